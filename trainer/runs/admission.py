"""What every training kind's admission shares: the errors, RunSettings, request and configuration
checks, the identities a checkpoint binds, drift refusal, the admission record and the resume proof
repeated at dequeue.

One set of exceptions for every kind, so the control plane maps them once.
"""

import copy
import hashlib
import json
import math
import os
import secrets
from dataclasses import asdict, dataclass
from pathlib import Path

from native_ext import onednn
from trainer import LoraConfig
from trainer.runs import checkpoint_dir
from trainer.runs.loss_chunks import LOSS_CHUNK_BYTES, loss_options  # noqa: F401  (re-exported)
from trainer.bases_identity import BUILTIN_TINY
from trainer.bases import is_registered
from trainer.fsio import file_sha256
from trainer.jsonio import MAX_INT
from trainer.runs.backend import BACKENDS, BackendChoice, BackendUnavailable, cuda_unavailable, probe_cuda, resolve_backend
from trainer.runs.checkpoint_dir import CheckpointError
from trainer.runs.defaults import LORA_DEFAULT, OPTIMIZER_DEFAULT, SCHEDULE_DEFAULT  # noqa: F401  (re-exported)
from trainer.runs.execution import KERNEL_CONTRACT, execution_identity  # noqa: F401  (re-exported)
from trainer.runs.tokenizers import TEMPLATE_CLOCK, load_tokenizer, pin_template_clock, run_tokenizer_identity

PLANNING_SCHEMA_V3 = "kiln.training-checkpoint-planning.v3"
NULLABLE = ("seed", "checkpoint_interval", "resume_checkpoint", "max_grad_norm")
MANIFEST_FIELDS = {"training", "planning", "execution", "base", "tokenizer", "dataset", "config",
                   "seed", "progress"}
IDENTITY_FIELDS = ("base", "tokenizer", "dataset", "execution", "planning")  # bound into every checkpoint
# compared at admission; "execution" is compared at dequeue by the worker that will train (revalidate)
ADMISSION_FIELDS = ("base", "tokenizer", "dataset", "planning")
# capability-derived loss routes of each backend, in order of preference (cuda: the chunked fused route only;
# the full [tokens, vocabulary] logits are what the fused route exists to avoid on a device)
BACKEND_LOSS_ROUTES = {"cpu": ("kt_tape_flce", "full_logits"), "cuda": ("kt_tape_flce",)}


class RequestError(ValueError):
    """The request itself is malformed; `field` names the offending field."""

    def __init__(self, field_name: str, message: str):
        super().__init__(f"{field_name}: {message}")
        self.field = field_name
        self.message = message


class AdmissionError(Exception):
    """The request is well formed but cannot run (drift, an invalid checkpoint, ...)."""

    def __init__(self, code: str, message: str, differences=None, field=None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.differences = list(differences or [])
        self.field = field  # the request field the refusal is about ("config.precision"), when it is one


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
    default_base: str = BUILTIN_TINY  # the base a request without base_model trains (trainer.bases.default_base)
    backend: str = "cpu"  # the server default a request without config.backend takes: auto, cpu or cuda


# -- fields ----------------------------------------------------------------------------------


def int_field(value, name, minimum=None, allow_none=False):
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(name, f"must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise RequestError(name, f"must be at least {minimum}, got {value}")
    if value > MAX_INT:  # the checkpoint manifest binds it, and holds signed 64-bit integers only
        raise RequestError(name, f"must be at most {MAX_INT}, got {value}")
    return value


def number_field(value, name, minimum_exclusive=None, allow_none=False):
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RequestError(name, f"must be a finite number, got {value!r}")
    if minimum_exclusive is not None and not value > minimum_exclusive:
        raise RequestError(name, f"must be greater than {minimum_exclusive}, got {value}")
    return float(value)


def within_roots(path: Path, roots) -> Path | None:
    """PATH resolved, when it lies strictly inside one of ROOTS (resolved too); else None."""
    resolved = path.resolve()
    for root in roots:
        root = Path(root).resolve()
        if resolved.is_relative_to(root) and resolved != root:
            return resolved
    return None


def confined(path_text, roots) -> Path:
    if not isinstance(path_text, str) or not path_text or "\x00" in path_text:
        raise RequestError("dataset_path", "must be a path")
    path = Path(path_text)
    if not path.is_absolute():
        raise RequestError("dataset_path", "must be an absolute path inside a data root")
    resolved = within_roots(path, roots)
    if resolved is None:
        raise AdmissionError("dataset_outside_roots",
                             f"{path_text} is outside the configured data roots "
                             f"({', '.join(dict.fromkeys(str(Path(r).resolve()) for r in roots)) or 'none'})")
    if not resolved.is_file():
        raise AdmissionError("dataset_not_found", f"{path_text} is not a file")
    return resolved


def has_dataset_path(request: dict, inline_field: str) -> bool:
    """True when the request names a dataset_path, False when it carries its data in `inline_field`."""
    has_path, has_inline = request.get("dataset_path") is not None, request.get(inline_field) is not None
    if has_path == has_inline:
        raise RequestError("dataset_path", f"give exactly one of dataset_path or {inline_field}")
    return has_path


def dataset_file(request: dict, settings: RunSettings) -> Path:
    """The request's dataset_path, confined to the datasets folder and the data roots."""
    return confined(request["dataset_path"], (settings.home / "datasets",) + tuple(settings.data_roots))


# -- digests -----------------------------------------------------------------------------------


def canonical(obj) -> bytes:
    """Sorted-key, compact, ASCII JSON: the bytes every identity digest is taken over."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                      allow_nan=False).encode("ascii")


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()




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
    """Validate the fields every training kind has; fills in the server's default base and checkpoint interval."""
    name = c["output_name"]
    if not isinstance(name, str) or not name:
        raise RequestError("config.output_name", "is required: the adapter name to train")
    try:
        checkpoint_dir.check_adapter_name(name)
    except CheckpointError as error:
        raise RequestError("config.output_name", str(error)) from None
    if is_registered(name, settings.bases_root):
        raise RequestError("config.output_name", f"{name!r} is the name of a registered base; requests name bases "
                                                 "and adapters alike, so an adapter cannot take a base's name")
    if c["base_model"] is None:
        c["base_model"] = settings.default_base
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
    c["optimizer"] = check_optimizer(c["optimizer"])
    c["seed"] = int_field(c["seed"], "config.seed", 0, allow_none=True)
    interval = c["checkpoint_interval"]
    if interval is None:
        interval = settings.default_checkpoint_interval
    c["checkpoint_interval"] = int_field(interval, "config.checkpoint_interval", 1, allow_none=True)
    if c["resume_checkpoint"] is not None and not isinstance(c["resume_checkpoint"], str):
        raise RequestError("config.resume_checkpoint", "must be a checkpoint basename")
    if c["activation_checkpointing"] not in ("none", "blocks"):
        raise RequestError("config.activation_checkpointing", "must be none or blocks")
    if c.get("backend") is not None and c["backend"] not in BACKENDS:
        raise RequestError("config.backend", f"must be one of {', '.join(BACKENDS)} (absent: the server's default)")
    check_precision(c)
    return c


# how a LoRA run's frozen base computes (config.precision): float32; bfloat16 (products from bfloat16-rounded
# operands, FP32 accumulation: oneDNN on the CPU, BF16 tensor cores on cuda); tfloat32 (TF32 tensor cores, cuda)
PRECISIONS = ("float32", "bfloat16", "tfloat32")
CUDA_ONLY_PRECISIONS = ("tfloat32",)


def check_precision(c: dict) -> None:
    """config.precision: absent or float32 (then dropped, so a float32 run's effective configuration is what it
    was before the field existed), or bfloat16 / tfloat32 for a dense LoRA base."""
    precision = c.pop("precision", None)
    if precision in (None, "float32"):
        return
    if precision not in PRECISIONS:
        raise RequestError("config.precision", f"must be one of {', '.join(PRECISIONS)} (absent: float32)")
    if c.get("quantization") is not None:
        raise RequestError("config.precision", f"{precision} computes a dense LoRA base; a quantized (NF4) base "
                                               "computes in float32")
    c["precision"] = precision


def precision_options(config: dict) -> dict:
    """load_base's execution option for the effective configuration's precision: the CPU model computes it on
    cpu; on cuda the CPU model stays float32 and the device model computes it (device_precision)."""
    if config.get("backend") == "cuda":
        return {"base_precision": "float32"}
    return {"base_precision": config.get("precision", "float32")}


def device_precision(config: dict) -> str:
    """The precision a cuda run's device model computes its frozen base at (trainer.cuda_model.CudaModel)."""
    return config.get("precision") or "float32"


def check_request(request, inline_field: str) -> None:
    """A request is an object with config and either dataset_path or its inline field."""
    if not isinstance(request, dict):
        raise RequestError("request", "must be an object")
    unknown = sorted(set(request) - {"dataset_path", inline_field, "config"})
    if unknown:
        raise RequestError(unknown[0], "is not a known request field")


class FileRecords(list):
    """The records of a dataset file, with where each came from: its line (1-based) in a JSONL file, its item
    (0-based) in a JSON list. A refusal of one names the file (`dataset_path`) and that place, where an inline
    record's names its field and index (`data[i]`, `prompts[i]`)."""

    def __init__(self, records, lines=None):
        super().__init__(records)
        self.lines = lines  # None: a JSON list's items


def record_place(records, index: int, inline_field: str) -> tuple[str, str]:
    """(the field a refusal of record INDEX of RECORDS names, the words its message starts with)."""
    if not isinstance(records, FileRecords):
        return f"{inline_field}[{index}]", ""
    return line_place(records.lines[index]) if records.lines is not None else ("dataset_path", f"item {index}: ")


def line_place(number: int) -> tuple[str, str]:
    """record_place's answer for the record on line NUMBER (1-based) of the request's dataset_path file."""
    return "dataset_path", f"line {number}: "


def within(place, part: str):
    """The place of PART (e.g. "completions[1]") inside the record at PLACE."""
    if isinstance(place, str):
        return f"{place}.{part}"
    field, prefix = place
    return (field, f"{prefix}{part}: ") if prefix else (f"{field}.{part}", "")


def refuse_record(place, message: str) -> RequestError:
    """The RequestError for a record at PLACE (record_place's (field, prefix), or a field name)."""
    field, prefix = (place, "") if isinstance(place, str) else place
    return RequestError(field, prefix + message)


def message_problem(messages) -> str | None:
    """What is wrong with a record's MESSAGES (a list of {role: string, content: string}), naming the message, or
    None when nothing is."""
    if not isinstance(messages, list):
        return f"messages must be a list of {{role, content}} objects, got {json_kind(messages)}"
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            return f"messages[{index}] must be an object {{role, content}}, got {json_kind(message)}"
        if not isinstance(message.get("role"), str):
            return f"messages[{index}] needs a role string (user, assistant, system ...)"
        if not isinstance(message.get("content"), str):
            return (f"messages[{index}].content must be a string, got {json_kind(message.get('content'))} (tool "
                    "calls and content parts are not read: give the text)")
    return None


def json_kind(value) -> str:
    """How JSON spells VALUE's type, for a refusal: null, a list, an object, a number ..."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    return "a list" if isinstance(value, list) else "an object" if isinstance(value, dict) else "a string"


def render_chat(tokenizer, messages, place, add_generation_prompt: bool = True) -> str:
    """The base's chat template rendered for a record's MESSAGES; the record's refusal (at PLACE, record_place's)
    when the base has no chat template or its template refuses them (raise_exception: roles out of turn, say)."""
    if tokenizer.chat_template is None:
        raise refuse_record(place, "the base has no chat template to render messages with; give prompt and "
                                   "completion text instead (prompt text for GRPO and OPD)")
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    except Exception as error:  # noqa: BLE001 (jinja2's TemplateError from raise_exception, or the template's own fault)
        raise refuse_record(place, f"the base's chat template refused the messages: {error}") from None


def find_base(config: dict, settings: RunSettings):
    """The registered base the configuration names (BaseInfo), or AdmissionError base_not_found; the adapter's
    rank is checked against it (check_rank_fits), unless a base_adapter's own files give the rank (PEFT bounds
    none, and the run imports each of their tensors with its shape)."""
    from trainer.bases import show_base
    try:
        base = show_base(config["base_model"], settings.bases_root)
    except (LookupError, ValueError) as error:
        raise AdmissionError("base_not_found", str(error)) from None
    if config.get("base_adapter") is None:
        check_rank_fits(config.get("lora"), base)
    return base


def check_rank_fits(lora: dict | None, base) -> None:
    """RequestError config.lora.rank when the rank exceeds the smaller side of a projection it targets in BASE: the
    update B @ A of an [out, in] projection has rank at most min(out, in), so a larger rank adds no capacity, only
    memory (a huge one would fail the run after admission). A base that does not describe its architecture is
    left to the run."""
    from trainer.runs.device_plan import architecture

    model = architecture(base, None) if lora else None
    if model is None:
        return
    shapes = model.projection_shapes()
    name, (rows, cols) = min(((n, shapes[n]) for n in lora["targets"] if n in shapes), key=lambda item: min(item[1]),
                             default=(None, (0, 0)))
    if name is not None and lora["rank"] > min(rows, cols):
        raise RequestError("config.lora.rank", f"rank {lora['rank']} exceeds what {name} of base "
                                               f"{getattr(base, 'name', '?')} ([{rows}, {cols}]) can hold: an "
                                               f"update of it has rank at most {min(rows, cols)}; ask for at most "
                                               f"that, or target only wider projections")


def prepare(request, settings: RunSettings, inline_field: str, normalise, read):
    """(config, records, raw bytes, data_source_kind, base): what admission and the worker both derive
    from a request, given the kind's `normalise(config, settings)` and `read(request, settings)`."""
    check_request(request, inline_field)
    config = normalise(request.get("config", {}), settings)
    records, raw, kind = read(request, settings)
    return config, records, raw, kind, find_base(config, settings)


def check_optimizer(optimizer) -> dict:
    """Adam's {beta1, beta2, epsilon, weight_decay}: the request's fields over OPTIMIZER_DEFAULT, checked."""
    if optimizer is None:
        optimizer = {}
    if not isinstance(optimizer, dict) or set(optimizer) - set(OPTIMIZER_DEFAULT):
        raise RequestError("config.optimizer", f"must be {{{', '.join(OPTIMIZER_DEFAULT)}}}")
    optimizer = {**OPTIMIZER_DEFAULT, **optimizer}
    for name in ("beta1", "beta2"):
        optimizer[name] = number_field(optimizer[name], f"config.optimizer.{name}")
        if not 0.0 <= optimizer[name] < 1.0:
            raise RequestError(f"config.optimizer.{name}", f"must lie in [0, 1), got {optimizer[name]}")
    optimizer["epsilon"] = number_field(optimizer["epsilon"], "config.optimizer.epsilon", 0.0)
    optimizer["weight_decay"] = number_field(optimizer["weight_decay"], "config.optimizer.weight_decay")
    if optimizer["weight_decay"] < 0.0:
        raise RequestError("config.optimizer.weight_decay", f"must be at least 0, got {optimizer['weight_decay']}")
    return optimizer


def adam_options(config: dict) -> dict:
    """The keyword arguments of trainer.Adam that the effective configuration fixes (besides the learning rate)."""
    return dict(config["optimizer"])


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
    """The effective configuration as bound into a checkpoint (no resume pointer, no seed, no backend: the
    execution identity binds the backend, and checkpoints written before config.backend existed must still
    compare equal)."""
    return {k: v for k, v in config.items() if k not in ("resume_checkpoint", "seed", "backend")}


# -- identities ------------------------------------------------------------------------------


def choose_backend(requested: str | None, default: str, home, need_bytes: int | None = None,
                   precision: str | None = None) -> BackendChoice:
    """trainer.runs.backend.resolve_backend with this process's cuda execution identity at PRECISION (None:
    float32), which a receipt must hold for: auto computes a precision on cuda only where that precision was
    qualified there. A tensor-core precision (CUDA_ONLY_PRECISIONS) under auto is refused rather than sent to
    cpu. ValueError or BackendUnavailable as it raises them."""
    cuda_only = f"precision {precision}" if precision in CUDA_ONLY_PRECISIONS else None
    return resolve_backend(requested, default, home, lambda: execution_identity("cuda", precision), need_bytes,
                           cuda_only)


def planned_device_bytes(config: dict, base) -> int:
    """The device memory a run over BASE plans (trainer.runs.device_plan, on trainer.cuda_model.planned_device_bytes:
    weights as they reside, adapters, gradients, Adam's moments, the activations of one micro-batch and the loss's
    chunk, plus device_plan.CUDA_CONTEXT_BYTES for the CUDA context and cuBLAS's own memory): SFT's micro-batch of
    config.batch_size sequences of config.max_sequence_length tokens; GRPO's and OPD's at their bounds (their
    admissions plan from the data: device_plan.grpo_bytes, opd_bytes, handed to admit_backend as need_bytes).
    Never None: a run whose plan cannot be computed (a base that does not describe its architecture, a GRPO
    configuration without its groups) plans a device_plan.Unplannable need, larger than any device, which
    backend.cuda_unavailable refuses with its reason (explicit cuda: backend_unavailable; auto: cpu)."""
    from trainer.runs import device_plan

    return device_plan.run_bytes(config, base)


def admit_backend(config: dict, settings: RunSettings, base=None, need_bytes: int | None = None) -> BackendChoice:
    """Resolve config.backend (None: the server's settings.backend) for a run from capabilities
    (trainer.runs.backend; the device must have free at least NEED_BYTES, the run's plan, by default what
    planned_device_bytes gives from the configuration over BASE) and record the resolved one in the effective
    configuration; AdmissionError backend_unavailable, with the loader's reason, when cuda is asked for and cannot
    run here."""
    if need_bytes is None and base is not None:
        need_bytes = planned_device_bytes(config, base)
    requested = config.get("backend")
    precision = config.get("precision")
    if precision in CUDA_ONLY_PRECISIONS:
        if (requested or settings.backend) == "cpu":
            raise AdmissionError("backend_unavailable", f"precision {precision} is a CUDA tensor-core precision; the "
                                                        "cpu backend computes float32 or bfloat16: ask for backend "
                                                        "cuda or auto, or another precision", field="config.precision")
    try:
        choice = choose_backend(requested, settings.backend, settings.home, need_bytes, precision)
    except BackendUnavailable as error:
        hint = (f"precision {precision} needs a CUDA device; ask for precision float32 or bfloat16"
                if precision in CUDA_ONLY_PRECISIONS else
                "ask for backend cpu or auto, or run on a machine whose CUDA device the loader finds")
        raise AdmissionError("backend_unavailable", f"{error.message}; {hint}",
                             field="config.precision" if precision in CUDA_ONLY_PRECISIONS else None) from None
    except ValueError as error:
        raise RequestError("config.backend", str(error)) from None
    if precision == "bfloat16" and choice.resolved == "cpu":
        reason = onednn.unavailable_reason()
        if reason is not None:
            raise AdmissionError("backend_unavailable", f"precision bfloat16 is unavailable here: {reason}; ask "
                                                        "for precision float32, or backend cuda on a machine with "
                                                        "a CUDA device", field="config.precision")
    config["backend"] = choice.resolved
    return choice


def run_backend(admission) -> str:
    """The backend an admitted run computes on: its effective configuration's (runs admitted before
    config.backend existed: the backend of the execution identity admission recorded, which was cpu)."""
    backend = (admission.effective_config or {}).get("backend")
    if backend is None:
        backend = ((admission.identities or {}).get("execution") or {}).get("backend") or "cpu"
    return backend


def select_loss_route(backend: str, capabilities: dict | None = None) -> str:
    """The loss route admission budgets for a run, derived from the backend and its capabilities (the CUDA
    loader's probe; None: probed here): cpu as it always was, cuda the chunked fused route, once the probe finds a
    device."""
    routes = BACKEND_LOSS_ROUTES.get(backend)
    if not routes:
        raise AdmissionError("backend_unavailable", f"backend {backend!r} has no loss route here")
    if backend == "cuda":
        reason = cuda_unavailable(probe_cuda() if capabilities is None else capabilities)
        if reason is not None:
            raise AdmissionError("backend_unavailable", f"backend cuda is unavailable here: {reason}")
    return routes[0]


# a run's loss execution options: trainer.runs.loss_chunks (device_plan plans with them too)


# a run whose sequences may be longer than this computes the tiled attention (online softmax over 128-position
# blocks, one C kernel per direction: native_ext/attention.h). Measured on the SmolLM2 shape (2-core AMX Xeon,
# forward and backward of one layer): dense 0.28, 1.02, 3.20, 11.7 and 58 ms at 64, 128, 256, 512 and 1024
# positions, tiled 0.29, 0.75, 1.97, 6.65 and 23.8 ms; and dense keeps [heads, T, T] probabilities per block
DENSE_ATTENTION_POSITIONS = 64
TILED_ATTENTION_BLOCK = 128


def attention_options(max_positions: int) -> dict:
    """load_base's attention execution options for a run whose sequences hold at most MAX_POSITIONS tokens: the
    engine's dense default up to DENSE_ATTENTION_POSITIONS, the tiled algorithm beyond. They follow from the
    request's config alone, so a resume computes with the same ones (its checkpoint's policies record them)."""
    if int(max_positions) <= DENSE_ATTENTION_POSITIONS:
        return {}
    return {"attention_algorithm": "tiled", "attention_block_size": TILED_ATTENTION_BLOCK}


def require_loss_route(route: str, backend: str) -> None:
    """AdmissionError unless this process can run the admitted loss route of a run on the run's BACKEND
    (rechecked before allocation: a cuda run needs the device now)."""
    if route not in BACKEND_LOSS_ROUTES.get(backend, ()):
        raise AdmissionError("loss_route_unavailable", f"loss route {route!r} is not available on backend "
                                                       f"{backend!r}")
    select_loss_route(backend)


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


def run_identities(config: dict, base, tokenizer, dataset: dict, settings: RunSettings, planning: dict,
                   backend: BackendChoice | None = None) -> dict:
    """The identities every kind binds into its checkpoints (kinds may add their own), and BACKEND, how the
    run's backend was chosen ({requested, resolved, reason}; shown on the job, bound into no checkpoint)."""
    identities = {
        "base": {"name": config["base_model"], "identity": base.identity, "config": base.config},
        "tokenizer": run_tokenizer_identity(tokenizer),
        "dataset": dataset,
        # this process's identity; a worker replaces it with its own at claim (revalidate compares that one)
        "execution": execution_identity(config.get("backend") or settings.backend, config.get("precision")),
        "planning": planning,
    }
    if backend is not None:
        identities["backend"] = backend.to_dict()
    return identities


# -- tokenizer -------------------------------------------------------------------------------


def admission_tokenizer(config: dict, settings: RunSettings):
    """The tokenizer of the configuration's base, to admit it with: a chat template that reads the clock renders at
    the instant the resume checkpoint's tokenizer identity records (read from its manifest, unhashed: the full
    load that follows proves the checkpoint), else at this moment (trainer.runs.tokenizers)."""
    tokenizer = load_tokenizer(config["base_model"], settings.bases_root)
    held = None
    if tokenizer.reads_clock and config.get("resume_checkpoint") is not None:
        try:
            path = checkpoint_dir.resolve_checkpoint(settings.registry, config["resume_checkpoint"])
            loaded = checkpoint_dir.load_checkpoint(path, full=False, allowed_manifest_fields=MANIFEST_FIELDS)
            held = (loaded.manifest.get("tokenizer") or {}).get(TEMPLATE_CLOCK)
            pin_template_clock(tokenizer, held)
        except (CheckpointError, ValueError):
            held = None  # the full load refuses such a checkpoint; one without a clock is refused as drift
    if held is None:
        pin_template_clock(tokenizer)
    return tokenizer


def check_run_tokenizer(tokenizer, admission) -> None:
    """Pin the admitted template clock on the tokenizer a run loaded; AdmissionError("tokenizer_changed") unless
    it is the tokenizer admission tokenized with (its files changed since: the run would train other tokens)."""
    admitted = admission.identities["tokenizer"]
    pin_template_clock(tokenizer, admitted.get(TEMPLATE_CLOCK))
    differences = []
    compare("tokenizer", admitted, run_tokenizer_identity(tokenizer), differences)
    if differences:
        raise AdmissionError("tokenizer_changed", f"the tokenizer of base {admission.effective_config['base_model']} "
                             "changed after admission (tokenizer.json or tokenizer_config.json); restore its files "
                             "or submit the run again", differences)


# -- drift -----------------------------------------------------------------------------------


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


def refuse_later_checkpoints(loaded) -> None:
    """AdmissionError("later_checkpoints") when the adapter has checkpoints after LOADED's step beside it: the
    resumed run would reach their names, which are immutable, and stop with name_exists after doing the work up to
    them again; and two branches of one adapter in the registry would make "its latest checkpoint" ambiguous."""
    registry, basename = loaded.path.parent, loaded.path.name
    adapter, step = checkpoint_dir.parse_basename(basename)
    later = [path.name for path in checkpoint_dir.later_checkpoints(registry, adapter, step)]
    if later:
        raise AdmissionError("later_checkpoints", f"{adapter} already has {len(later)} checkpoint(s) after step "
                             f"{step}, the newest {later[-1]}: a run resumed from {basename} would reach their "
                             "names, which are immutable. Resume from the newest (the job that published it); if it "
                             "is damaged (kiln checkpoint verify), move it and the others after step "
                             f"{step} out of the registry first")


def refuse_existing_checkpoints(registry, adapter: str) -> None:
    """AdmissionError("checkpoints_exist") for a new run (no resume_checkpoint) of an adapter that already has
    checkpoints in the registry, from an earlier run: the new run's checkpoints would take their names, which are
    immutable, so it would stop with name_exists at its first publication after doing the work up to it; and two
    runs' checkpoints under one name would make "its latest checkpoint" ambiguous."""
    existing = checkpoint_dir.later_checkpoints(registry, adapter, 0)
    if existing:
        raise AdmissionError("checkpoints_exist", f"{adapter} already has {len(existing)} checkpoint(s) from an "
                             f"earlier run, the newest {existing[-1].name}: a new run's checkpoints would take "
                             "their names, which are immutable. Continue that run instead (resume_checkpoint, or "
                             "POST /v1/train/jobs/{id}/resume); train the next version under another output_name "
                             f"(warm-started from this one's snapshot with base_adapter: {Path(registry) / adapter}); "
                             f"or delete the adapter's files first (DELETE /v1/adapters/{adapter}, kiln adapter "
                             "delete)")


def check_planning_schema(manifest: dict, expected: str = PLANNING_SCHEMA_V3,
                          reason: str = "any change to the planning identity fails closed"):
    schema = (manifest.get("planning") or {}).get("schema")
    if schema != expected:
        raise AdmissionError(
            "planning_schema", f"checkpoint planning identity {schema!r} cannot resume under "
            f"{expected}: {reason}; start a new run",
            [difference("planning.schema", schema, expected)])


def refuse_drift(manifest: dict, request_view: dict, seed, backend: str | None = None):
    """AdmissionError("resume_drift") listing every field where the request differs; BACKEND, the request's
    resolved backend, is compared with the one the checkpoint's execution identity records."""
    checkpoint_view = {key: manifest.get(key) for key in request_view}
    differences = []
    hint = ""
    execution = manifest.get("execution")
    held = execution.get("backend") if isinstance(execution, dict) else None
    if backend is not None and held != backend:
        differences.append(difference("execution.backend", held, backend))
        hint = (f"; the checkpoint was trained on backend {held}: ask for config.backend {held} to continue it, or "
                "start a new run warm-started from its adapter with base_adapter (weights only)")
    compare("", checkpoint_view, request_view, differences)
    if seed is not None and seed != manifest["seed"]:
        differences.append(difference("seed", manifest["seed"], seed))
    if differences:
        raise AdmissionError("resume_drift", "the request differs from the checkpoint in "
                             f"{len(differences)} field(s); exact resume continues the same run, "
                             f"so restore the original request or start a new run{hint}", differences)


def resume_record(loaded) -> dict:
    manifest = loaded.manifest
    return {"checkpoint": loaded.path.name, "checkpoint_id": loaded.checkpoint_id,
            "manifest_digest": loaded.manifest_digest, "seed": manifest["seed"],
            "step": manifest["progress"]["committed_step"]}


def admit_resume(loaded, training: dict, config: dict, identities: dict) -> dict:
    """Refuse any drift between the request and the checkpoint, then a checkpoint with later ones beside it; the
    resume record of the job row. The execution identity is not compared here: the process that trains compares
    its own at dequeue."""
    view = {"training": training, "config": comparable_config(config),
            **{key: identities[key] for key in ADMISSION_FIELDS}}
    refuse_drift(loaded.manifest, view, config["seed"], backend=identities["execution"]["backend"])
    refuse_later_checkpoints(loaded)
    return resume_record(loaded)


def settle_seed(config: dict, resume: dict | None) -> int:
    """The effective seed: the checkpoint's on resume, else the request's, else a fresh one."""
    seed = resume["seed"] if resume is not None else config["seed"]
    if seed is None:
        seed = secrets.randbelow(2**31)
    config["seed"] = seed
    return seed


def revalidate(admission: Admission, settings: RunSettings, route_field: str = "loss_route") -> None:
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
    refuse_execution_drift(loaded.manifest.get("execution"), admission.identities["execution"])
    route = admission.identities["planning"][route_field]
    if route not in BACKEND_LOSS_ROUTES.get(run_backend(admission), ()):
        raise AdmissionError("loss_route_unavailable", f"this worker cannot run the admitted loss route {route!r}")


def refuse_execution_drift(checkpoint_identity, worker_identity: dict) -> None:
    """AdmissionError("execution_drift") listing every field where the checkpoint's execution identity
    differs from the training process's ("request" holds the worker's value, as in every drift table)."""
    differences = []
    if isinstance(checkpoint_identity, dict):
        compare("execution", checkpoint_identity, worker_identity, differences)
    else:
        differences.append(difference("execution", checkpoint_identity, worker_identity))
    if differences:
        fields = ", ".join(d["field"] for d in differences[:4]) + (", ..." if len(differences) > 4 else "")
        raise AdmissionError(
            "execution_drift", f"this worker's execution identity differs from the checkpoint's in "
            f"{len(differences)} field(s) ({fields}); exact resume needs the same backend, device, BLAS and "
            "thread count, builds and code: run it on a worker that matches (or set its environment, e.g. "
            "OPENBLAS_NUM_THREADS, to match), or start a new run", differences)


def reopen_resume(admission: Admission, settings: RunSettings):
    """The admitted resume checkpoint, loaded again by the worker and checked to be the same."""
    loaded = load_resume(admission.resume["checkpoint"], admission.adapter, admission.kind, settings)
    if loaded.checkpoint_id != admission.resume["checkpoint_id"]:
        raise AdmissionError("checkpoint_changed", "the resume checkpoint changed after admission")
    return loaded


# -- a weights-only warm start (config.base_adapter, every kind) -----------------------------


def _confined_directory(path_text, roots) -> Path:
    path = Path(path_text)
    if not path.is_absolute():
        raise RequestError("config.base_adapter", "must be an absolute path inside the adapter registry or a data root")
    resolved = within_roots(path, roots)
    if resolved is None:
        raise AdmissionError("base_adapter_outside_roots",
                             f"{path_text} is outside the adapter registry and data roots")
    if not resolved.is_dir():
        raise AdmissionError("base_adapter_not_found", f"{path_text} is not a directory")
    outside = adapter_files_outside(resolved, roots)
    if outside:
        raise AdmissionError("base_adapter_outside_roots",
                             f"{path_text}: {', '.join(outside)} resolves outside the adapter registry and data roots")
    return resolved


def adapter_files_outside(directory: Path, roots) -> list:
    """The names of DIRECTORY's PEFT files that are links resolving outside ROOTS: a directory inside them whose
    files point elsewhere is read from elsewhere."""
    from trainer.peft import ADAPTER_FILES
    return [name for name in ADAPTER_FILES
            if os.path.lexists(directory / name) and within_roots(directory / name, roots) is None]


def training_view(kind: str, adapter: str, data_source_kind: str, identities: dict, **extra) -> dict:
    """The manifest's `training` object (what resume compares it with too): the kind, the adapter, the data
    source kind, the warm start when the run had one, and what the kind adds (OPD: teacher, base_adapter)."""
    view = {"kind": kind, "adapter": adapter, "data_source_kind": data_source_kind}
    if identities.get("base_adapter") is not None:
        view["base_adapter"] = identities["base_adapter"]
    return view | extra


def check_base_adapter(c: dict, settings: RunSettings, given_lora: bool) -> None:
    """config.base_adapter: None, or an absolute PEFT adapter directory inside the adapter registry or a data root
    whose weights start the run (a new run only; a resume restores its own); the LoRA shape becomes the adapter's,
    and a request's different `lora` is refused."""
    if c.get("base_adapter") is None:
        return
    if not isinstance(c["base_adapter"], str):
        raise RequestError("config.base_adapter", "must be the path of a PEFT adapter directory")
    roots = (settings.registry, settings.home / "adapters") + tuple(settings.data_roots)
    directory = _confined_directory(c["base_adapter"], roots)
    from trainer.peft import check_rank_in_weights, read_adapter_config
    try:
        lora = read_adapter_config(directory)
        check_rank_in_weights(directory, lora)
        shape = lora.shape_identity()
    except (OSError, ValueError) as error:
        raise RequestError("config.base_adapter", str(error)) from None
    if given_lora and c["lora"] != shape:
        raise RequestError("config.lora", f"differs from base_adapter's LoRA {shape}; omit lora to use the "
                                          "adapter's shape")
    c["lora"] = shape
    c["base_adapter"] = str(directory)


def base_adapter_identity(config: dict):
    """{path, lora, files: {name: SHA-256}} of config.base_adapter, or None; bound into the checkpoint."""
    if config.get("base_adapter") is None:
        return None
    from trainer.peft import CONFIG_FILE, WEIGHTS_FILE
    directory = Path(config["base_adapter"])
    return {"path": str(directory), "lora": config["lora"],
            "files": {name: file_sha256(directory / name) for name in (CONFIG_FILE, WEIGHTS_FILE)
                      if (directory / name).is_file()}}


def check_base_adapter_unchanged(admission: Admission) -> None:
    """Dequeue-time proof that the warm-start files are still the ones admission hashed."""
    if base_adapter_identity(admission.effective_config) != admission.identities.get("base_adapter"):
        raise AdmissionError("base_adapter_changed", "the base_adapter files changed after admission")


def warm_start(model, admission: Admission) -> None:
    """Load config.base_adapter's weights into MODEL's freshly attached LoRA (a new run only)."""
    path = admission.effective_config.get("base_adapter")
    if path is None or admission.resume is not None:
        return
    from trainer.peft import import_adapter
    try:
        import_adapter(model, path)
    except (OSError, ValueError) as error:
        raise AdmissionError("base_adapter_mismatch", str(error)) from None
