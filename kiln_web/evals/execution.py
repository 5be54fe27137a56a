"""Run one evaluation to a final state: the body of the Celery task and of the embedded worker.

claim (conditional update: queued -> running) -> parse the suite -> compare the candidate with
the baseline (kiln_web.evals.runtime) -> succeeded; any exception -> failed with a code and a
message, which a promotion gate reads as "unavailable".

A run linked to a training job (a promotion gate) also writes a job event when it starts and when it
ends, so the job's page, which redraws its panels on every job event, follows the evaluation's status.
"""

from __future__ import annotations

import logging

from django.db import transaction

from kiln_web.evals import actions, runtime
from kiln_web.evals.models import EvalRun, EvalStatus
from kiln_web.jobs.execution import Heartbeat

logger = logging.getLogger("kiln.evals")


def _job_event(run_id, level: str, describe) -> None:
    """A job event for the training job RUN_ID is linked to (none when it is linked to none); DESCRIBE(run)
    gives its message. Written in a savepoint: an event that cannot be written never undoes the evaluation."""
    from kiln_web.jobs import actions as jobs_actions  # jobs.actions imports nothing of evals.execution

    run = EvalRun.objects.select_related("suite").filter(pk=run_id).first()
    if run is None or run.training_job_id is None:
        return
    try:
        with transaction.atomic():
            jobs_actions.do_add_event(run.training_job_id, level, describe(run))
    except Exception:  # noqa: BLE001 (a log line of the job page)
        logger.warning("could not add the event of evaluation %s to job %s", run_id, run.training_job_id,
                       exc_info=True)


def _started(run) -> str:
    return f"evaluation {run.pk} ({run.purpose}, suite {run.suite.name!r}): running on {run.worker_id}"


def _ended(comparison, error: dict):
    def describe(run) -> str:
        head = f"evaluation {run.pk} ({run.purpose}, suite {run.suite.name!r})"
        if comparison is None:
            return f"{head}: failed: {error['error_code']}: {error['error_message']}"
        ours, theirs = comparison.candidate.summary(), comparison.baseline.summary()
        if isinstance(ours.get("accuracy"), (int, float)) and isinstance(theirs.get("accuracy"), (int, float)):
            return f"{head}: succeeded: accuracy {ours['accuracy']:.4f} vs {run.baseline} {theirs['accuracy']:.4f}"
        return f"{head}: succeeded"

    return describe


def _finish(run_id, worker_id: str, comparison=None, **error) -> None:
    """do_finish_evaluation and its job event in one transaction, the event first: it is sent before what
    the end sets off after the commit (the promotion decision and its own events); when the run is no
    longer this worker's, neither is kept."""
    with transaction.atomic():
        _job_event(run_id, "info" if comparison is not None else "warning", _ended(comparison, error))
        if not actions.do_finish_evaluation(run_id, worker_id, comparison, **error):
            transaction.set_rollback(True)


def execute_evaluation(run_id, worker_id: str) -> str:
    """Claim and run RUN_ID; returns its final status, or "not_claimed" when another worker has it."""
    if not actions.do_claim_evaluation(run_id, worker_id):
        return "not_claimed"
    logger.info("evaluation %s claimed by %s", run_id, worker_id)
    _job_event(run_id, "info", _started)
    with Heartbeat(run_id, worker_id, beat=lambda run, worker: actions.do_evaluation_heartbeat(run, worker)):
        _run_claimed(run_id, worker_id)
    final = EvalRun.objects.filter(pk=run_id).values_list("status", flat=True).first()
    logger.info("evaluation %s ended %s", run_id, final)
    return final


def _run_claimed(run_id, worker_id: str) -> None:
    """Compare the claimed run's candidate with its baseline and finish it (succeeded, or failed with a code)."""
    try:
        run = EvalRun.objects.select_related("suite", "candidate", "owner").get(pk=run_id)
        actions.require_adapters_usable(run)  # a share withdrawn since the run was queued holds now
        need = runtime.planned_bytes(run.candidate.name, run.candidate_base, run.max_new_tokens) \
            if run.backend == "cuda" else None
        runtime.require_backend(run.backend, need)  # a cuda run needs this worker's device, and its memory, now
        suite = runtime.parse(run.suite.name, run.suite.content, run.suite.default_metric)
        if suite.digest != run.suite_digest:
            raise runtime.EvaluationError("suite_changed", f"suite {run.suite.name!r} no longer has the digest the "
                                                           "run was queued with")
        comparison = runtime.compare(
            suite, candidate=run.candidate.name, candidate_base=run.candidate_base, baseline_kind=run.baseline_kind,
            baseline=run.baseline, baseline_base=run.baseline_base, baseline_sha256=run.baseline_sha256,
            max_new_tokens=run.max_new_tokens, backend=run.backend)
    except Exception as exc:  # noqa: BLE001 (mapped to failed; the gate reads it as unavailable)
        code = getattr(exc, "code", None)
        if not isinstance(code, str) or not code:
            logger.exception("evaluation %s failed", run_id)
            code = "internal_error"
        _finish(run_id, worker_id, error_code=code,
                error_message=str(getattr(exc, "message", None) or f"{type(exc).__name__}: {exc}"))
    else:
        _finish(run_id, worker_id, comparison)


def run_next_queued(worker_id: str) -> bool:
    """For the embedded worker: run the oldest queued evaluation it can claim; False when there was none."""
    queued = EvalRun.objects.filter(status=EvalStatus.QUEUED).order_by("created_at").values_list("pk", flat=True)
    for run_id in queued[:20]:
        if execute_evaluation(run_id, worker_id) != "not_claimed":
            return True
    return False
