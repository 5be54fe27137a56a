"""The control-plane fake SFT runner (controlplane.fake_sft) that also publishes a final PEFT snapshot
on success, as trainer.runs.sft does: kiln-tiny with LoRA weights seeded by the run's effective seed
(seed 666 gives weights that overflow, for a canary that must fail). Selected with
KILN_SFT_RUNNER=serving.publishing_sft."""

from controlplane import fake_sft
from controlplane.fake_sft import (MANIFEST_FIELDS, AdmissionError, RequestError, RunResult,  # noqa: F401
                                   RunSettings, SFTAdmission, admit_sft, revalidate_sft)

from .helpers import publish_adapter


def run_sft(admission, settings, hooks):
    result = fake_sft.run_sft(admission, settings, hooks)
    if result.status == "succeeded":
        publish_adapter(settings.home, settings.registry, admission.adapter, seed=admission.effective_seed)
        hooks.on_event("info", f"published the final adapter {admission.adapter}")
    return result
