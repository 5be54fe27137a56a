"""The one place kiln_web.evals reaches the trainer: suite parsing, scoring and the gate decision.

Models are loaded in a scratch serving pool (kiln_web.serving.runtime), one at a time, so
an evaluation holds at most one model beside the pool's bookkeeping.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainer.evals import SuiteError, evaluate, gate_decision, parse_suite  # noqa: F401 (SuiteError, gate_decision: for the app)

from kiln_web.serving import runtime as serving_runtime
from kiln_web.serving.runtime import ServingError


class EvaluationError(Exception):
    """The evaluation cannot run; `code` is machine-readable."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code, self.message = code, message


def planned_bytes(candidate: str, base: str, max_new_tokens: int):
    """The device plan of evaluating CANDIDATE's PEFT snapshot over BASE (trainer.runs.device_plan.evaluation_bytes:
    greedy generation of up to MAX_NEW_TOKENS by the candidate or by the base alone, whichever holds more, the
    prompts at their bound, plus the CUDA context): an Unplannable need when the base does not describe its
    architecture or the snapshot's LoRA cannot be read; None when BASE is not registered (loading it fails)."""
    from django.conf import settings

    from trainer.bases import show_base
    from trainer.peft import read_adapter_config
    from trainer.runs import device_plan

    try:
        info = show_base(base, settings.KILN_HOME)
    except (LookupError, ValueError):
        return None
    try:
        lora = read_adapter_config(serving_runtime.snapshot_path(candidate))
    except (OSError, ValueError) as error:
        return device_plan.Unplannable(f"the LoRA of adapter {candidate!r} cannot be read ({error})")
    return device_plan.evaluation_bytes(info, lora, max_new_tokens)


def resolve_backend(requested: str | None, need_bytes: int | None = None) -> tuple[str, str]:
    """(resolved backend, why) of REQUESTED (auto, cpu, cuda; None: KILN_TRAINING_BACKEND), as training admission
    resolves it, for an evaluation that plans NEED_BYTES on the device (planned_bytes); EvaluationError
    backend_unavailable (the reason) when cuda is asked for without a device, or one with less free memory."""
    from django.conf import settings

    from trainer.runs.admission import choose_backend
    from trainer.runs.backend import BackendUnavailable

    try:
        choice = choose_backend(requested, settings.KILN_TRAINING_BACKEND, settings.KILN_HOME, need_bytes=need_bytes)
    except BackendUnavailable as error:
        raise EvaluationError("backend_unavailable", f"{error.message}; ask for backend cpu or auto") from None
    return choice.resolved, choice.reason


def require_backend(backend: str, need_bytes: int | None = None) -> None:
    """Dequeue-time check: EvaluationError backend_unavailable unless BACKEND can run in this worker now (cuda: the
    device, with free memory for NEED_BYTES, the evaluation's plan, when given)."""
    from trainer.runs.backend import BackendUnavailable, require_cuda

    if backend == "cuda":
        try:
            require_cuda(need_bytes)
        except BackendUnavailable as error:
            raise EvaluationError("backend_unavailable", f"this worker cannot run the evaluation's backend: "
                                                         f"{error.message}") from None


@dataclass
class Comparison:
    candidate: object  # trainer.evals.EvalResult
    baseline: object
    candidate_sha256: str


def parse(name: str, content: str, default_metric: str):
    """The parsed Suite; SuiteError names the line at fault."""
    return parse_suite(name, content, default_metric=default_metric)


def compare(suite, *, candidate: str, candidate_base: str, baseline_kind: str, baseline: str, baseline_base: str,
            baseline_sha256: str = "", max_new_tokens: int = 64, progress=None, backend: str = "cpu") -> Comparison:
    """Greedy completions of every example by the candidate adapter, then by the baseline, on BACKEND."""
    total = 2 * len(suite.examples)
    try:
        with serving_runtime.scratch_pool(backend) as pool:
            sha = serving_runtime.snapshot_sha256(candidate)
            served = pool.load_adapter(candidate, candidate_base)
            if serving_runtime.snapshot_sha256(candidate) != sha:
                raise EvaluationError("adapter_changed", f"the snapshot of {candidate!r} changed while loading")
            report = (lambda done, _: progress(done, total)) if progress else None
            ours = evaluate(served.model, served.tokenizer, suite, max_new_tokens=max_new_tokens, progress=report)
            pool.unload(candidate)
            if baseline_kind == "adapter":
                if serving_runtime.snapshot_sha256(baseline) != baseline_sha256:
                    raise EvaluationError("baseline_changed", f"the snapshot of the baseline {baseline!r} is no longer "
                                                              "the one that was serving when the evaluation was queued")
                served = pool.load_adapter(baseline, baseline_base)
            else:
                served = pool.base(baseline)
            report = (lambda done, _: progress(len(suite.examples) + done, total)) if progress else None
            theirs = evaluate(served.model, served.tokenizer, suite, max_new_tokens=max_new_tokens, progress=report)
    except ServingError as error:
        raise EvaluationError(error.code, error.message) from None
    return Comparison(candidate=ours, baseline=theirs, candidate_sha256=sha)
