"""Promotion is a separate decision from training.

A training request may carry `auto_load` and a `gate` {suite, min_accuracy, min_improvement}.
They are control-plane decisions, not training configuration: they are split off before
admission (so the trainer never sees them and they cannot cause resume drift) and read
back from the job's request when it succeeds:

- no auto_load: nothing happens (outcome not_requested);
- auto_load, no gate: the serving canary runs (load, generate, finite log-probabilities)
  and the adapter is activated in the job owner's scope when it passes (promoted), else
  canary_failed; nobody else's active adapter changes;
- auto_load and a gate: an evaluation is queued; the owner's active adapter stays active
  until it passes. The gate compares with the job owner's active adapter when it is over the
  candidate's base, else with that base itself (kiln_web.evals.actions), never across bases
  and never with an adapter the owner may not see. A failed
  threshold is gate_failed, too few examples or no comparable baseline inconclusive, an
  evaluation that cannot be queued or does not finish unavailable.

The training job stays succeeded whatever the outcome. Each decision is a PromotionRecord.
"""

from __future__ import annotations

import logging

from django.dispatch import receiver

from kiln_web.core.http import ActionRefused
from kiln_web.evals.signals import evaluation_finished
from kiln_web.jobs.signals import job_succeeded
from kiln_web.serving import actions, runtime
from kiln_web.serving.models import AUTO_LOAD, GATE, PromotionOutcome, PromotionRecord
from kiln_web.serving.promotion_request import PromotionRequest, requested_promotion

logger = logging.getLogger("kiln.serving")

PENDING = "pending"


# -- deciding --


def _log(job, outcome: str, reason: str) -> None:
    from kiln_web.jobs import actions as jobs_actions  # jobs.actions imports nothing of serving

    level = "info" if outcome == PromotionOutcome.PROMOTED else "warning"
    try:
        jobs_actions.do_add_event(job.pk, level, f"promotion: {outcome}: {reason}")
    except Exception:  # noqa: BLE001 (the log line must never undo a decision)
        logger.warning("could not log the promotion of job %s", job.pk, exc_info=True)


def _record(job, outcome: str, reason: str, decided_by: str, evaluation=None, sha: str = "") -> PromotionRecord:
    record = actions.do_record_promotion(job.adapter, outcome, reason, decided_by=decided_by, job=job,
                                         evaluation=evaluation, sha=sha)
    _log(job, outcome, reason)
    return record


def _canary_then_activate(job, decided_by: str, passed_because: str, evaluation=None) -> PromotionRecord:
    adapter = job.adapter
    base = actions.job_base(job)
    if base is None:
        return _record(job, PromotionOutcome.CANARY_FAILED, "the adapter's base is unknown", decided_by, evaluation)
    passed, reason, sha = runtime.canary(adapter.name, base)
    if not passed:
        return _record(job, PromotionOutcome.CANARY_FAILED, f"the serving canary failed: {reason}", decided_by,
                       evaluation, sha)
    if evaluation is not None and evaluation.candidate_sha256 and evaluation.candidate_sha256 != sha:
        return _record(job, PromotionOutcome.INCONCLUSIVE, "the adapter's snapshot changed after it was evaluated",
                       decided_by, evaluation, sha)
    try:
        record = actions.do_promote(adapter, base, sha, decided_by=decided_by, job=job, evaluation=evaluation,
                                    reason=f"{passed_because}; the serving canary passed ({reason})")
    except runtime.ServingError as error:
        return _record(job, PromotionOutcome.CANARY_FAILED, error.message, decided_by, evaluation, sha)
    _log(job, record.outcome, record.reason)
    return record


def decide_after_training(job_id) -> PromotionRecord | None:
    """What a succeeded job's auto_load and gate ask for: the canary and activation, or the gate's evaluation."""
    from kiln_web.jobs.models import TrainingJob

    job = TrainingJob.objects.select_related("adapter", "owner").get(pk=job_id)
    try:
        wanted = requested_promotion(job.request)
    except ActionRefused as refused:  # admitted before this check existed, or written by hand
        return _record(job, PromotionOutcome.UNAVAILABLE, refused.message, GATE)
    if not wanted.auto_load:
        return None
    if wanted.gate is None:
        return _canary_then_activate(job, AUTO_LOAD, "auto_load without a gate")
    from kiln_web.evals import actions as evals_actions
    from kiln_web.evals.models import EvalPurpose

    try:
        run = evals_actions.do_enqueue_evaluation(job.owner, job.adapter.name, wanted.suite, base=actions.job_base(job),
                                                  training_job=job, purpose=EvalPurpose.GATE)
    except Exception as exc:  # noqa: BLE001 (whatever stops the evaluation leaves the candidate unpromoted)
        message = exc.message if isinstance(exc, ActionRefused) else f"{type(exc).__name__}: {exc}"
        return _record(job, PromotionOutcome.UNAVAILABLE, f"the gate's evaluation could not be queued: {message}",
                       GATE)
    _log(job, PENDING, f"the gate's evaluation {run.pk} is queued on suite {wanted.suite!r}; "
                       "your active adapter stays active until it passes")
    return None


def decide_after_evaluation(run_id) -> PromotionRecord | None:
    """A gate's evaluation ended: promote (after the canary) or record why not."""
    from kiln_web.evals import runtime as evals_runtime
    from kiln_web.evals.models import EvalPurpose, EvalRun, EvalStatus

    run = EvalRun.objects.select_related("training_job__adapter", "training_job__owner").get(pk=run_id)
    job = run.training_job
    if run.purpose != EvalPurpose.GATE or job is None or PromotionRecord.objects.filter(job=job).exists():
        return None
    wanted = requested_promotion(job.request)
    if run.status == EvalStatus.FAILED:
        return _record(job, PromotionOutcome.UNAVAILABLE,
                       f"the gate's evaluation {run.pk} did not finish: {run.error_code}: {run.error_message}", GATE,
                       run)
    outcome, reason = evals_runtime.gate_decision(run.candidate_summary, run.baseline_summary,
                                                  min_accuracy=wanted.min_accuracy,
                                                  min_improvement=wanted.min_improvement,
                                                  min_examples=minimum_examples(wanted))
    if outcome != PromotionOutcome.PROMOTED:
        return _record(job, outcome, reason, GATE, run, run.candidate_sha256)
    accuracy = run.candidate_summary["accuracy"]
    gain = accuracy - run.baseline_summary["accuracy"]
    return _canary_then_activate(job, GATE, f"the gate passed on {run.suite.name!r}: accuracy {accuracy:.4f}, "
                                            f"{gain:+.4f} over {baseline_label(run)}", evaluation=run)


def minimum_examples(wanted) -> int:
    """The fewest suite examples the gate decides on: the request's gate.min_examples, else the server's."""
    from django.conf import settings

    return wanted.min_examples or settings.KILN_GATE_MIN_EXAMPLES


def baseline_label(run) -> str:
    """What a gate compared with, in words: always something over the candidate's own base."""
    if run.baseline_kind == "base":
        return f"the base {run.baseline!r}"
    return f"the adapter {run.baseline!r} (over {run.baseline_base!r})"


def _guarded(decide, key, gate: bool):
    """Run a decision; an unexpected error is recorded (unpromoted), never raised into a worker."""
    try:
        return decide(key)
    except Exception as exc:  # noqa: BLE001
        logger.exception("promotion after %s failed", key)
        try:
            from kiln_web.jobs.models import TrainingJob

            job = (TrainingJob.objects.select_related("adapter").filter(pk=key).first() if not gate else
                   TrainingJob.objects.select_related("adapter").filter(evaluations__pk=key).first())
            if job is not None and not PromotionRecord.objects.filter(job=job).exists():
                _record(job, PromotionOutcome.UNAVAILABLE, f"the promotion failed: {type(exc).__name__}: {exc}",
                        GATE if gate else AUTO_LOAD)
        except Exception:  # noqa: BLE001
            logger.exception("could not record the failed promotion after %s", key)
        return None


@receiver(job_succeeded, dispatch_uid="kiln.serving.promotion.job_succeeded")
def _on_job_succeeded(sender, job_id, **kwargs) -> None:
    _guarded(decide_after_training, job_id, gate=False)


@receiver(evaluation_finished, dispatch_uid="kiln.serving.promotion.evaluation_finished")
def _on_evaluation_finished(sender, run_id, **kwargs) -> None:
    _guarded(decide_after_evaluation, run_id, gate=True)


# -- reading --


def job_promotion(job) -> dict:
    """The job's promotion as its detail shows it: what was asked, the outcome, and its evaluations."""
    try:
        wanted = requested_promotion(job.request)
    except ActionRefused:  # unreadable: shown as not requested
        wanted = PromotionRequest()
    record = job.promotions.order_by("-decided_at", "-id").first() if job.pk else None
    out = {"auto_load": wanted.auto_load, "gate": wanted.gate, "outcome": None, "reason": None,
           "decided_by": None, "decided_at": None, "evaluation": None}
    if record is not None:
        out |= {"outcome": record.outcome, "reason": record.reason, "decided_by": record.decided_by,
                "decided_at": record.decided_at, "evaluation": str(record.evaluation_id) if record.evaluation_id
                else None}
    elif not wanted.auto_load:
        out |= {"outcome": PromotionOutcome.NOT_REQUESTED, "reason": "auto_load was not requested"}
    elif job.status == "succeeded":
        out |= {"outcome": PENDING, "reason": "the gate's evaluation has not finished" if wanted.gate else
                "the serving canary has not finished"}
    else:
        out["reason"] = "decided when the training job succeeds"
    return out


def job_evaluation_ids(job) -> list[str]:
    if not job.pk:
        return []
    return [str(pk) for pk in job.evaluations.order_by("created_at").values_list("pk", flat=True)]
