"""Run one evaluation to a final state: the body of the Celery task and of the embedded worker.

claim (conditional update: queued -> running) -> parse the suite -> compare the candidate with
the baseline (kiln_web.evals.runtime) -> succeeded; any exception -> failed with a code and a
message, which a promotion gate reads as "unavailable".
"""

from __future__ import annotations

import logging

from kiln_web.evals import actions, runtime
from kiln_web.evals.models import EvalRun, EvalStatus

logger = logging.getLogger("kiln.evals")


def execute_evaluation(run_id, worker_id: str) -> str:
    """Claim and run RUN_ID; returns its final status, or "not_claimed" when another worker has it."""
    if not actions.do_claim_evaluation(run_id, worker_id):
        return "not_claimed"
    logger.info("evaluation %s claimed by %s", run_id, worker_id)
    try:
        run = EvalRun.objects.select_related("suite", "candidate").get(pk=run_id)
        suite = runtime.parse(run.suite.name, run.suite.content, run.suite.default_metric)
        if suite.digest != run.suite_digest:
            raise runtime.EvaluationError("suite_changed", f"suite {run.suite.name!r} no longer has the digest the "
                                                           "run was queued with")
        comparison = runtime.compare(
            suite, candidate=run.candidate.name, candidate_base=run.candidate_base, baseline_kind=run.baseline_kind,
            baseline=run.baseline, baseline_base=run.baseline_base, baseline_sha256=run.baseline_sha256,
            max_new_tokens=run.max_new_tokens)
    except Exception as exc:  # noqa: BLE001 (mapped to failed; the gate reads it as unavailable)
        code = getattr(exc, "code", None)
        if not isinstance(code, str) or not code:
            logger.exception("evaluation %s failed", run_id)
            code = "internal_error"
        actions.do_finish_evaluation(run_id, worker_id, error_code=code,
                                     error_message=str(getattr(exc, "message", None) or f"{type(exc).__name__}: {exc}"))
    else:
        actions.do_finish_evaluation(run_id, worker_id, comparison)
    final = EvalRun.objects.filter(pk=run_id).values_list("status", flat=True).first()
    logger.info("evaluation %s ended %s", run_id, final)
    return final


def run_next_queued(worker_id: str) -> bool:
    """For the embedded worker: run the oldest queued evaluation it can claim; False when there was none."""
    for run_id in EvalRun.objects.filter(status=EvalStatus.QUEUED).order_by("created_at").values_list("pk", flat=True)[:20]:
        if execute_evaluation(run_id, worker_id) != "not_claimed":
            return True
    return False
