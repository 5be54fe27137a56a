"""Compatibility names for the run helpers, which now live by concern in trainer.runs.admission
(errors, settings, request checks, identities, drift, the admission record), trainer.runs.state
(checkpoint files, publication, the run result) and trainer.runs.step (schedule, clipping, hooks).
New code imports from those modules."""

from trainer.runs.admission import (  # noqa: F401
    BACKEND_LOSS_ROUTES, IDENTITY_FIELDS, KERNEL_CONTRACT, LORA_DEFAULT, MANIFEST_FIELDS, NULLABLE,
    PLANNING_SCHEMA_V3, SCHEDULE_DEFAULT, Admission, AdmissionError, RequestError, RunFailed, RunSettings,
    admit_resume, canonical, check_lora, check_planning_schema, check_request, check_shared, comparable_config,
    compare, confined, difference, execution_identity, file_sha256, find_base, int_field, load_resume,
    lora_config, merge_config, number_field, planning_identity, refuse_drift, reopen_resume, require_loss_route,
    resume_record, revalidate, run_identities, select_loss_route, settle_seed, sha256_hex)
from trainer.runs.state import (  # noqa: F401
    ADAPTER_FILE, OPTIMIZER_FILE, STATE_FILE, RunResult, check_restored_step, optimizer_files, publish,
    publish_final, restore_optimizer, state_bytes, tensors_bytes, tensors_from)
from trainer.runs.step import NullHooks, adapter_values, clip_and_step, learning_rate_at  # noqa: F401
