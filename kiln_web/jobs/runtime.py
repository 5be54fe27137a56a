"""The one place the web side reaches the trainer: the run module, its RunSettings, error mapping.

`trainer.runs.sft` (settings.KILN_SFT_RUNNER) and `trainer.runs.checkpoint_dir`
(settings.KILN_CHECKPOINT_MODULE) are imported here and nowhere else in kiln_web, so
tests can swap in a fake runner by overriding those two settings.
"""

from __future__ import annotations

import importlib
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


def sft_runner() -> ModuleType:
    """The module with RunSettings, admit_sft, revalidate_sft, run_sft, RequestError, AdmissionError."""
    return _module(settings.KILN_SFT_RUNNER, "the SFT run")


def checkpoint_module() -> ModuleType:
    """The module with load_checkpoint, checkpoint_summary, CheckpointError."""
    return _module(settings.KILN_CHECKPOINT_MODULE, "the checkpoint")


def run_settings(runner: ModuleType | None = None):
    """RunSettings built from the Django settings: the single source of paths and defaults for runs."""
    runner = runner or sft_runner()
    return runner.RunSettings(
        home=settings.KILN_HOME,
        registry=settings.KILN_ADAPTERS_DIR,
        bases_root=settings.KILN_BASES_DIR,
        data_roots=tuple(settings.KILN_DATA_ROOTS),
        default_checkpoint_interval=settings.KILN_CHECKPOINT_INTERVAL,
        backend=settings.KILN_TRAINING_BACKEND,
    )


def checkpoint_path(basename: str):
    return settings.KILN_ADAPTERS_DIR / basename


def read_checkpoint_summary(basename: str, kind: str, adapter: str) -> tuple[dict | None, dict | None]:
    """(summary, None) for a checkpoint that passes the light validation (bounded metadata, sizes by
    stat, nothing hashed), else (None, {code, message}). For status reads, never for resume."""
    module = checkpoint_module()
    try:
        loaded = module.load_checkpoint(checkpoint_path(basename), full=False, expected_type=kind,
                                        expected_adapter=adapter)
        return module.checkpoint_summary(loaded), None
    except module.CheckpointError as exc:
        return None, {"code": getattr(exc, "code", "checkpoint_invalid"), "message": _text(exc)}
    except OSError as exc:
        return None, {"code": "checkpoint_unreadable", "message": f"{basename}: {exc.strerror or exc}"}


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
CONFLICT_CODES = {"resume_drift"}


def refusal_for(exc: BaseException) -> Refusal | None:
    """Map a trainer exception to a Refusal, or None when it is not one the trainer raises on bad input."""
    runner = sft_runner()
    if isinstance(exc, runner.RequestError):
        return Refusal(400, "invalid_request", _text(exc), field=getattr(exc, "field", None))
    if isinstance(exc, runner.AdmissionError):
        code = getattr(exc, "code", None) or "admission_refused"
        differences = list(getattr(exc, "differences", None) or [])
        status = 409 if code in CONFLICT_CODES or differences else 400
        return Refusal(status, code, _text(exc), differences=differences or None)
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
