"""What every training kind shares: errors, settings, request checks, execution identity,
drift comparison, the learning-rate schedule, the run result and final publication; and what
GRPO and OPD share besides (their admission record, the v3 planning identity, resume loading,
adapter/optimizer state files and publication).

One set of exceptions for every kind, so the control plane maps them once.
"""

import copy
import hashlib
import json
import math
import os
import platform
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from safetensors.numpy import save as safetensors_save

import trainer
from trainer import LoraConfig
from trainer.lora import PROJECTIONS
from trainer.peft import publish_final_adapter
from trainer.tensorfiles import tensors_from_buffer
from trainer.runs import checkpoint_dir
from trainer.runs.checkpoint_dir import CheckpointError
PLANNING_SCHEMA_V3 = "kiln.training-checkpoint-planning.v3"
LORA_DEFAULT = {"rank": 8, "alpha": 16.0, "targets": list(PROJECTIONS), "use_rslora": False}
SCHEDULE_DEFAULT = {"type": "constant", "warmup_steps": 0}
NULLABLE = ("seed", "checkpoint_interval", "resume_checkpoint", "max_grad_norm")


KERNEL_CONTRACT = "kiln-cpu-kernels-v1"
STATE_FILE = "state.json"
ADAPTER_FILE = "adapter.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"
MANIFEST_FIELDS = {"training", "planning", "execution", "base", "tokenizer", "dataset", "config",
                   "seed", "progress"}
# capability-derived loss routes of each backend, in order of preference
BACKEND_LOSS_ROUTES = {"cpu": ("kt_tape_flce", "full_logits")}


class RequestError(ValueError):
    """The request itself is malformed; `field` names the offending field."""

    def __init__(self, field_name: str, message: str):
        super().__init__(f"{field_name}: {message}")
        self.field = field_name
        self.message = message


class AdmissionError(Exception):
    """The request is well formed but cannot run (drift, an invalid checkpoint, ...)."""

    def __init__(self, code: str, message: str, differences=None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.differences = list(differences or [])


class RunFailed(Exception):
    """Training stopped on a condition a person must look at (non-finite loss, ...)."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True)
class RunSettings:
    home: Path
    registry: Path  # the adapter registry: checkpoints are its direct children
    bases_root: Path  # the data root that holds bases/ (trainer.bases' `root`)
    data_roots: tuple = ()
    default_checkpoint_interval: int | None = None  # server-level training.checkpoint_interval
    backend: str = "cpu"


def int_field(value, name, minimum=None, allow_none=False):
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(name, f"must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise RequestError(name, f"must be at least {minimum}, got {value}")
    return value


def number_field(value, name, minimum_exclusive=None, allow_none=False):
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RequestError(name, f"must be a finite number, got {value!r}")
    if minimum_exclusive is not None and not value > minimum_exclusive:
        raise RequestError(name, f"must be greater than {minimum_exclusive}, got {value}")
    return float(value)


def confined(path_text, roots) -> Path:
    if not isinstance(path_text, str) or not path_text or "\x00" in path_text:
        raise RequestError("dataset_path", "must be a path")
    path = Path(path_text)
    if not path.is_absolute():
        raise RequestError("dataset_path", "must be an absolute path inside a data root")
    resolved = path.resolve()
    for root in roots:
        root = Path(root).resolve()
        if resolved.is_relative_to(root) and resolved != root:
            if not resolved.is_file():
                raise AdmissionError("dataset_not_found", f"{path_text} is not a file")
            return resolved
    raise AdmissionError("dataset_outside_roots",
                         f"{path_text} is outside the configured data roots "
                         f"({', '.join(str(r) for r in roots) or 'none'})")




def execution_identity(backend: str) -> dict:
    """What must be the same for bit-for-bit continuation on this backend."""
    from threadpoolctl import threadpool_info

    import native_ext
    from native_ext import blas as engine_blas
    native = Path(native_ext.__file__).parent
    builds = {p.name: file_sha256(p) for p in sorted(native.glob("_*.so"))}
    # only the BLAS the engine computes with (numpy's): other libraries loaded in the same
    # process (torch's, scipy's) do not touch training arithmetic
    blas = sorted((i.get("internal_api"), str(i.get("version")), str(i.get("architecture")),
                   i.get("num_threads")) for i in threadpool_info()
                  if i.get("user_api") == "blas" and str(engine_blas.LIBRARY_PATH) == i.get("filepath"))
    return {
        "backend": backend,
        "device": platform.machine(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "blas": [list(b) for b in blas],
        "native_builds": builds,
        "kiln": trainer.__version__ if hasattr(trainer, "__version__") else "0",
        "precision": "float32",
        "kernel_contract": KERNEL_CONTRACT,
        "threads": os.cpu_count(),
    }




def difference(field_name, checkpoint_value, request_value):
    return {"field": field_name, "checkpoint": checkpoint_value, "request": request_value}


def compare(prefix, checkpoint_value, request_value, out):
    """Field-by-field differences between two JSON values."""
    if isinstance(checkpoint_value, dict) and isinstance(request_value, dict):
        for key in sorted(set(checkpoint_value) | set(request_value)):
            compare(f"{prefix}.{key}" if prefix else key, checkpoint_value.get(key),
                     request_value.get(key), out)
    elif checkpoint_value != request_value:
        out.append(difference(prefix, checkpoint_value, request_value))


def learning_rate_at(step: int, config: dict, total_steps: int) -> float:
    """Learning rate of optimizer step `step` (0-based)."""
    base = config["learning_rate"]
    schedule = config["lr_schedule"]
    warmup = schedule["warmup_steps"]
    if step < warmup:
        return base * (step + 1) / warmup
    if schedule["type"] == "constant":
        return base
    span = max(1, total_steps - warmup)
    progress = min(1.0, (step - warmup) / span)
    if schedule["type"] == "linear":
        return base * (1.0 - progress)
    return base * 0.5 * (1.0 + math.cos(math.pi * progress))


@dataclass
class RunResult:
    status: str
    steps_completed: int
    latest_checkpoint: dict | None
    loss_history: list
    final_adapter: dict | None = None  # {"path", "adapter_sha256", "config_sha256"} on success


def publish_final(result: RunResult, model, settings: RunSettings, adapter: str, base_model: str,
                  hooks) -> RunResult:
    """On success, publish the PEFT snapshot of the trained adapter beside its checkpoints."""
    if result.status == "succeeded":
        result.final_adapter = publish_final_adapter(model, settings.registry, adapter, base_model)
        hooks.on_event("info", f"published the final adapter {adapter} "
                               f"(sha256 {result.final_adapter['adapter_sha256'][:12]})")
    return result




def canonical(obj) -> bytes:
    """Sorted-key, compact, ASCII JSON: the bytes every identity digest is taken over."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                      allow_nan=False).encode("ascii")


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def file_sha256(path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


# -- configuration --------------------------------------------------------------------------


def merge_config(config: dict, defaults: dict, kind: str) -> dict:
    """defaults updated by the request's fields; unknown fields refused."""
    if not isinstance(config, dict):
        raise RequestError("config", "must be an object")
    unknown = sorted(set(config) - set(defaults))
    if unknown:
        raise RequestError(f"config.{unknown[0]}", f"is not a known {kind.upper()} configuration field")
    merged = copy.deepcopy(defaults)
    merged.update({k: copy.deepcopy(v) for k, v in config.items() if v is not None or k in NULLABLE})
    return merged


def check_shared(c: dict, settings: RunSettings) -> dict:
    """Validate the fields every training kind has; fills in the server checkpoint interval."""
    name = c["output_name"]
    if not isinstance(name, str) or not name:
        raise RequestError("config.output_name", "is required: the adapter name to train")
    try:
        checkpoint_dir.check_adapter_name(name)
    except CheckpointError as error:
        raise RequestError("config.output_name", str(error)) from None
    if not isinstance(c["base_model"], str) or not c["base_model"]:
        raise RequestError("config.base_model", "must name a registered base")
    c["learning_rate"] = number_field(c["learning_rate"], "config.learning_rate", 0.0)
    schedule = c["lr_schedule"]
    if not isinstance(schedule, dict) or set(schedule) - {"type", "warmup_steps"}:
        raise RequestError("config.lr_schedule", "must be {type, warmup_steps}")
    schedule = {"type": schedule.get("type", "constant"), "warmup_steps": schedule.get("warmup_steps", 0)}
    if schedule["type"] not in ("constant", "linear", "cosine"):
        raise RequestError("config.lr_schedule.type", "must be constant, linear or cosine")
    schedule["warmup_steps"] = int_field(schedule["warmup_steps"], "config.lr_schedule.warmup_steps", 0)
    c["lr_schedule"] = schedule
    c["max_grad_norm"] = number_field(c["max_grad_norm"], "config.max_grad_norm", 0.0, allow_none=True)
    c["lora"] = check_lora(c["lora"])
    c["seed"] = int_field(c["seed"], "config.seed", 0, allow_none=True)
    interval = c["checkpoint_interval"]
    if interval is None:
        interval = settings.default_checkpoint_interval
    c["checkpoint_interval"] = int_field(interval, "config.checkpoint_interval", 1, allow_none=True)
    if c["resume_checkpoint"] is not None and not isinstance(c["resume_checkpoint"], str):
        raise RequestError("config.resume_checkpoint", "must be a checkpoint basename")
    if c["activation_checkpointing"] not in ("none", "blocks"):
        raise RequestError("config.activation_checkpointing", "must be none or blocks")
    return c


def check_request(request, inline_field: str) -> None:
    """A request is an object with config and either dataset_path or its inline field."""
    if not isinstance(request, dict):
        raise RequestError("request", "must be an object")
    unknown = sorted(set(request) - {"dataset_path", inline_field, "config"})
    if unknown:
        raise RequestError(unknown[0], "is not a known request field")


def find_base(config: dict, settings: RunSettings):
    """The registered base the configuration names (BaseInfo), or AdmissionError base_not_found."""
    from trainer.bases import show_base
    try:
        return show_base(config["base_model"], settings.bases_root)
    except (LookupError, ValueError) as error:
        raise AdmissionError("base_not_found", str(error)) from None


def check_lora(lora) -> dict:
    if not isinstance(lora, dict) or set(lora) - {"rank", "alpha", "targets", "use_rslora"}:
        raise RequestError("config.lora", "must be {rank, alpha, targets, use_rslora}")
    lora = {**LORA_DEFAULT, **lora}
    try:
        shaped = LoraConfig(rank=lora["rank"], alpha=lora["alpha"], targets=tuple(lora["targets"]),
                            use_rslora=lora["use_rslora"])
    except (ValueError, TypeError) as error:
        raise RequestError("config.lora", str(error)) from None
    return shaped.shape_identity()


def lora_config(config: dict, seed: int) -> LoraConfig:
    lora = config["lora"]
    return LoraConfig(rank=lora["rank"], alpha=lora["alpha"], targets=tuple(lora["targets"]),
                      use_rslora=lora["use_rslora"], initializer_seed=seed)


def comparable_config(config: dict) -> dict:
    """The effective configuration as bound into a checkpoint (no resume pointer, no seed)."""
    return {k: v for k, v in config.items() if k not in ("resume_checkpoint", "seed")}


def select_loss_route(backend: str) -> str:
    routes = BACKEND_LOSS_ROUTES.get(backend)
    if not routes:
        raise AdmissionError("backend_unavailable", f"backend {backend!r} has no loss route here")
    return routes[0]


def planning_identity(objective: str, config: dict, loss_route: str) -> dict:
    """The v3 planning identity GRPO and OPD bind (all planned boundaries retained)."""
    return {
        "schema": PLANNING_SCHEMA_V3,
        "objective": objective,
        "loss_route": loss_route,
        "policy_gradient": "weighted_cross_entropy",
        "checkpoint_boundary_replay": {"policy": "retain_all"},
        "activation_checkpointing": config["activation_checkpointing"],
        "streaming_prefill": "none",
    }


# -- admission record ----------------------------------------------------------------------


@dataclass
class Admission:
    """What admission resolved; stored on the job row as JSON and handed to the run."""

    kind: str
    adapter: str
    request: dict
    effective_config: dict
    effective_seed: int
    data_source_kind: str
    total_steps: int
    identities: dict
    resume: dict | None = None
    steps_per_epoch: int | None = None

    def to_json(self) -> dict:
        return json.loads(json.dumps(asdict(self)))

    @classmethod
    def from_json(cls, data: dict) -> "Admission":
        return cls(**data)


def load_resume(reference: str, adapter: str, kind: str, settings: RunSettings):
    try:
        path = checkpoint_dir.resolve_checkpoint(settings.registry, reference)
        return checkpoint_dir.load_checkpoint(path, full=True, expected_type=kind, expected_adapter=adapter,
                                              allowed_manifest_fields=MANIFEST_FIELDS)
    except CheckpointError as error:
        raise AdmissionError(error.code, str(error)) from None


def check_planning_schema(manifest: dict):
    schema = (manifest.get("planning") or {}).get("schema")
    if schema != PLANNING_SCHEMA_V3:
        raise AdmissionError(
            "planning_schema", f"checkpoint planning identity {schema!r} cannot resume under "
            f"{PLANNING_SCHEMA_V3}: any change to the planning identity fails closed; start a new run "
            "or use base_adapter", [difference("planning.schema", schema, PLANNING_SCHEMA_V3)])


def refuse_drift(manifest: dict, request_view: dict, seed):
    """AdmissionError("resume_drift") listing every field where the request differs."""
    checkpoint_view = {key: manifest.get(key) for key in request_view}
    differences = []
    compare("", checkpoint_view, request_view, differences)
    if seed is not None and seed != manifest["seed"]:
        differences.append(difference("seed", manifest["seed"], seed))
    if differences:
        raise AdmissionError("resume_drift", "the request differs from the checkpoint in "
                             f"{len(differences)} field(s); exact resume continues the same run, "
                             "so restore the original request or start a new run", differences)


def resume_record(loaded) -> dict:
    manifest = loaded.manifest
    return {"checkpoint": loaded.path.name, "checkpoint_id": loaded.checkpoint_id,
            "manifest_digest": loaded.manifest_digest, "seed": manifest["seed"],
            "step": manifest["progress"]["committed_step"]}


def revalidate(admission: Admission, settings: RunSettings) -> None:
    """Dequeue-time proof: the checkpoint is still the one admission validated."""
    if admission.resume is None:
        return
    loaded = load_resume(admission.resume["checkpoint"], admission.adapter, admission.kind, settings)
    checks = (("checkpoint_id", loaded.checkpoint_id), ("manifest_digest", loaded.manifest_digest),
              ("seed", loaded.manifest.get("seed")))
    differences = [difference(name, value, admission.resume[name])
                   for name, value in checks if value != admission.resume[name]]
    if differences:
        raise AdmissionError("checkpoint_changed", "the resume checkpoint changed after admission; "
                             "checkpoints must stay immutable", differences)
    route = admission.identities["planning"]["loss_route"]
    if route not in BACKEND_LOSS_ROUTES.get(settings.backend, ()):
        raise AdmissionError("loss_route_unavailable", f"this worker cannot run the admitted loss route {route!r}")


def reopen_resume(admission: Admission, settings: RunSettings):
    """The admitted resume checkpoint, loaded again by the worker and checked to be the same."""
    loaded = load_resume(admission.resume["checkpoint"], admission.adapter, admission.kind, settings)
    if loaded.checkpoint_id != admission.resume["checkpoint_id"]:
        raise AdmissionError("checkpoint_changed", "the resume checkpoint changed after admission")
    return loaded


# -- state files ---------------------------------------------------------------------------


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


def state_bytes(document: dict) -> bytes:
    return json.dumps(document, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def publish(admission: Admission, settings: RunSettings, step: int, files: dict, progress: dict, hooks,
            snapshot_seconds: float, training_extra=None) -> dict:
    """Publish one `.kiln-checkpoint` for a committed step; returns its summary."""
    started = time.perf_counter()
    manifest = {
        "training": {"kind": admission.kind, "adapter": admission.adapter,
                     "data_source_kind": admission.data_source_kind, **(training_extra or {})},
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


# -- the step ------------------------------------------------------------------------------


def clip_and_step(config, optimizer, adapters, step: int, total_steps: int, loss: float):
    """Gradient norm, optional clipping, learning rate and one Adam step; returns (norm, clipped, lr)."""
    total = 0.0
    for p in adapters:
        flat = p.grad.reshape(-1)
        total += float(np.dot(flat.astype(np.float64), flat))
    grad_norm = math.sqrt(total)
    if not math.isfinite(loss) or not math.isfinite(grad_norm):
        raise RunFailed("non_finite", f"step {step + 1}: loss {loss} / gradient norm {grad_norm} is not "
                                      "finite; lower the learning rate or check the data")
    clipped = config["max_grad_norm"] is not None and grad_norm > config["max_grad_norm"]
    if clipped:
        factor = np.float32(config["max_grad_norm"] / (grad_norm + 1e-6))
        for p in adapters:
            p.grad *= factor
    optimizer.learning_rate = learning_rate_at(step, config, total_steps)
    optimizer.step()
    return grad_norm, clipped, optimizer.learning_rate


@contextmanager
def adapter_values(model, values: dict):
    """Run the model with other adapter values (a reference), then restore the live ones exactly."""
    live = model.adapter_state_dict()
    model.load_adapter_state_dict(values)
    try:
        yield
    finally:
        model.load_adapter_state_dict(live)


class NullHooks:
    """What a run calls back into (the control plane's JobHooks); `on_publish_stage(name)` is optional."""

    def on_step(self, metrics):
        pass

    def should_cancel(self):
        return False

    def on_checkpoint(self, summary, timing):
        pass

    def on_event(self, level, message):
        pass
