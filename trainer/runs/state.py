"""What every training kind writes and reads back at a checkpoint boundary: the adapter and optimizer
files, the state document, the `.kiln-checkpoint` publication and the final PEFT snapshot.

The bytes written here are what exact resume compares with `==`: change them only with a new
checkpoint schema.
"""

import json
import time
from dataclasses import dataclass

import numpy as np
from safetensors.numpy import save as safetensors_save

from trainer.peft import publish_final_adapter
from trainer.runs import checkpoint_dir
from trainer.runs.admission import (MANIFEST_FIELDS, Admission, AdmissionError, RunSettings, comparable_config,
                                    training_view)
from trainer.tensorfiles import tensors_from_buffer

STATE_FILE = "state.json"
ADAPTER_FILE = "adapter.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"


@dataclass
class RunResult:
    status: str
    steps_completed: int
    latest_checkpoint: dict | None
    loss_history: list
    final_adapter: dict | None = None  # {"path", "adapter_sha256", "config_sha256"} on success


def tensors_bytes(tensors: dict) -> bytes:
    return safetensors_save({k: np.ascontiguousarray(v) for k, v in tensors.items()})


def tensors_from(data) -> dict:
    """{name: array} from a safetensors file's bytes, or the memoryview a checkpoint load returns."""
    return tensors_from_buffer(data)


def optimizer_files(model, optimizer) -> tuple[dict, dict]:
    """({file: bytes} of adapter and optimizer moments, the optimizer's scalar state)."""
    state = optimizer.state_dict()
    moments = {f"first_moment/{k}": v for k, v in state["first_moment"].items()}
    moments.update({f"second_moment/{k}": v for k, v in state["second_moment"].items()})
    files = {ADAPTER_FILE: tensors_bytes(model.adapter_state_dict()), OPTIMIZER_FILE: tensors_bytes(moments)}
    scalars = {"step": state["step"], "beta1_power": state["beta1_power"],
               "beta2_power": state["beta2_power"], "hyperparameters": state["hyperparameters"]}
    return files, scalars


def restore_optimizer(loaded, model, optimizer, scalars: dict):
    model.load_adapter_state_dict(tensors_from(loaded.read(ADAPTER_FILE)))
    moments = tensors_from(loaded.read(OPTIMIZER_FILE))
    first = {k.split("/", 1)[1]: v for k, v in moments.items() if k.startswith("first_moment/")}
    second = {k.split("/", 1)[1]: v for k, v in moments.items() if k.startswith("second_moment/")}
    optimizer.load_state_dict({"step": scalars["step"], "beta1_power": scalars["beta1_power"],
                               "beta2_power": scalars["beta2_power"], "first_moment": first,
                               "second_moment": second})


def check_restored_step(step: int, optimizer, loaded) -> None:
    """AdmissionError unless the restored loop, optimizer and manifest agree on the committed step."""
    if step != optimizer.step_count or step != loaded.manifest["progress"]["committed_step"]:
        raise AdmissionError("checkpoint_invalid", "checkpoint loop, optimizer and progress steps disagree")


def state_bytes(document: dict) -> bytes:
    """state.json: sorted keys, compact, ASCII; a non-finite number is refused (runs fail before it)."""
    return json.dumps(document, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def snapshot(model, optimizer, document_of, tensors=None) -> tuple[dict, float]:
    """({file: bytes}, seconds taken) of one boundary: adapter, optimizer moments, the named tensor files
    in `tensors` (None values skipped) and state.json, whose document `document_of(optimizer scalars)` gives."""
    started = time.perf_counter()
    files, scalars = optimizer_files(model, optimizer)
    files.update({name: tensors_bytes(values) for name, values in (tensors or {}).items() if values is not None})
    files[STATE_FILE] = state_bytes(document_of(scalars))
    return files, time.perf_counter() - started


def publish(admission: Admission, settings: RunSettings, step: int, files: dict, progress: dict, hooks,
            snapshot_seconds: float, training_extra=None) -> dict:
    """Publish one `.kiln-checkpoint` for a committed step; returns its summary."""
    started = time.perf_counter()
    manifest = {
        "training": training_view(admission.kind, admission.adapter, admission.data_source_kind,
                                  admission.identities, **(training_extra or {})),
        "config": comparable_config(admission.effective_config),
        "seed": admission.effective_seed,
        "base": admission.identities["base"],
        "tokenizer": admission.identities["tokenizer"],
        "dataset": admission.identities["dataset"],
        "execution": admission.identities["execution"],
        "planning": admission.identities["planning"],
        "progress": {"data_source_kind": admission.data_source_kind, "committed_step": step,
                     "total_steps": admission.total_steps, **progress},
    }
    timing = {"lock_wait_seconds": 0.0, "snapshot_seconds": snapshot_seconds}
    path = checkpoint_dir.publish_checkpoint(settings.registry, admission.adapter, step,
                                             checkpoint_type=admission.kind, files=files, manifest=manifest,
                                             on_timing=timing.update,
                                             on_stage=getattr(hooks, "on_publish_stage", None))
    timing["publish_seconds"] = time.perf_counter() - started
    loaded = checkpoint_dir.load_checkpoint(path, full=False, allowed_manifest_fields=MANIFEST_FIELDS)
    summary = checkpoint_dir.checkpoint_summary(loaded)
    hooks.on_checkpoint(summary, timing)
    hooks.on_event("info", f"published {path.name} (snapshot {snapshot_seconds:.3f}s, "
                           f"publish {timing['publish_seconds']:.3f}s, lock wait 0.000s)")
    return summary


def publish_final(result: RunResult, model, settings: RunSettings, adapter: str, base_model: str,
                  hooks) -> RunResult:
    """On success, publish the PEFT snapshot of the trained adapter beside its checkpoints."""
    if result.status == "succeeded":
        result.final_adapter = publish_final_adapter(model, settings.registry, adapter, base_model)
        hooks.on_event("info", f"published the final adapter {adapter} "
                               f"(sha256 {result.final_adapter['adapter_sha256'][:12]})")
    return result
