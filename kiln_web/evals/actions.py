"""Every change to suites and evaluation runs, one function each, used by the API, the CLI, promotion
and the workers.

A run's claim is a conditional UPDATE (queued -> running) that exactly one worker wins; its end
is written on a locked row, and kiln_web.evals.signals.evaluation_finished goes out after the
commit. A run that cannot be handed to a worker fails at once (broker_unavailable), so a gate
waiting on it decides "unavailable" instead of waiting forever.
"""

from __future__ import annotations

import logging
import re

from django.db import IntegrityError, transaction
from django.db.models import Q
from django.db.models.functions import Now
from django.utils import timezone

from kiln_web.core import dispatch
from kiln_web.core.http import ActionRefused
from kiln_web.evals import runtime, signals
from kiln_web.evals.models import (BaselineKind, EvalExampleResult, EvalPurpose, EvalRun, EvalStatus, EvalSuite,
                                   Metric)

logger = logging.getLogger("kiln.evals")

SUITE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,99}$")
MAX_NEW_TOKENS = 64  # per example: evaluation answers are short


# -- suites --


def do_create_suite(user, name: str, content: str, default_metric: str = Metric.EXACT) -> EvalSuite:
    """Parse CONTENT (held-out JSONL) and store it; a suite never changes afterwards, so a digest names it."""
    if not isinstance(name, str) or not SUITE_NAME.match(name):
        raise ActionRefused(400, "invalid_request", f"{name!r} is not a suite name (letters, digits, '.', '_', '-'; "
                                                    "at most 100)", field="name")
    if default_metric not in Metric.values:
        raise ActionRefused(400, "invalid_request", f"default_metric must be one of {', '.join(Metric.values)}",
                            field="default_metric")
    if isinstance(content, str) and "\x00" in content:
        raise ActionRefused(400, "invalid_suite", "the suite holds a NUL character (U+0000), which no database "
                                                  "text field keeps; remove it", field="content")
    try:
        suite = runtime.parse(name, content, default_metric)
    except runtime.SuiteError as error:
        raise ActionRefused(400, "invalid_suite", str(error), field="content") from None
    exists = ActionRefused(409, "suite_exists", f"a suite named {name!r} exists; suites do not change, so create "
                                                "one under a new name")
    if EvalSuite.objects.filter(name=name).exists():
        raise exists
    try:  # a create beside this one may take the name after the look above: the unique name refuses the second
        with transaction.atomic():
            return EvalSuite.objects.create(name=name, owner=user, content=content, digest=suite.digest,
                                            default_metric=default_metric, example_count=len(suite.examples))
    except IntegrityError:
        raise exists from None


def visible_suites(user):
    return EvalSuite.objects.visible_to(user).select_related("owner")


def suite_for(user, name: str) -> EvalSuite:
    suite = visible_suites(user).filter(name=name).first()
    if suite is None:
        raise ActionRefused(404, "suite_not_found", f"no evaluation suite named {name!r} (or it belongs to someone "
                                                    "else); GET /v1/evals/suites lists yours")
    return suite


# -- runs --


def _cross_base(candidate: str, candidate_base: str, baseline: str, baseline_base: str) -> ActionRefused:
    other = f"the base {baseline!r}" if baseline == baseline_base else f"{baseline!r} (over base {baseline_base!r})"
    return ActionRefused(409, "cross_base_comparison",
                         f"cannot compare {candidate!r} (over base {candidate_base!r}) with {other}: an evaluation "
                         f"compares answers over one base; name an adapter trained over {candidate_base!r}, or leave "
                         f"baseline out to compare with your active adapter when it is over {candidate_base!r}, else "
                         "with that base", field="baseline", candidate_base=candidate_base, baseline_base=baseline_base)


def _adapter_baseline(name: str, base: str, sha: str, note: str = "") -> dict:
    return {"baseline_kind": BaselineKind.ADAPTER, "baseline": name, "baseline_base": base, "baseline_sha256": sha,
            "baseline_note": note}


def _base_baseline(base: str, note: str) -> dict:
    return {"baseline_kind": BaselineKind.BASE, "baseline": base, "baseline_base": base, "baseline_note": note}


def _baseline(user, candidate: str, candidate_base: str) -> dict:
    """USER's active adapter (the run's owner's: never someone else's, and only one they may still see) when it is
    over the candidate's base (and is not the candidate itself), else that base: a comparison is only meaningful
    between answers over the same base."""
    from kiln_web.adapters.models import Adapter
    from kiln_web.serving.models import ServedAdapter

    active = (ServedAdapter.objects.filter(active=True, active_for=user, adapter__in=Adapter.objects.visible_to(user))
              .select_related("adapter").first())
    if active is None:
        note = "no adapter is active for you"
    elif active.adapter.name == candidate:
        note = f"your active adapter is {candidate!r} itself, which is not compared with itself"
    elif active.base != candidate_base:
        note = f"your active adapter {active.adapter.name!r} is over another base ({active.base!r})"
    else:
        return _adapter_baseline(active.adapter.name, active.base, active.adapter_sha256)
    return _base_baseline(candidate_base, f"{note}: compared with the base {candidate_base!r}")


def _named_baseline(user, candidate: str, candidate_base: str, baseline: str) -> dict:
    """The baseline a person named: the candidate's base, or an adapter over that base that they may use (their
    own or one shared with them; any other is refused exactly like a name that does not exist, 404
    adapter_not_found); refused (cross_base_comparison) when it is over another base."""
    from kiln_web.serving import actions as serving_actions
    from kiln_web.serving import runtime as serving_runtime
    from kiln_web.serving.models import ServedAdapter

    if baseline == candidate_base:
        return _base_baseline(candidate_base, f"asked for: compared with the base {candidate_base!r}")
    if baseline == candidate:
        raise ActionRefused(400, "invalid_request", f"{candidate!r} cannot be its own baseline; name another adapter "
                                                    f"over {candidate_base!r}, or the base itself", field="baseline")
    if serving_runtime.is_base(baseline) and not serving_runtime.has_snapshot(baseline):
        raise _cross_base(candidate, candidate_base, baseline, baseline)
    adapter = serving_actions.adapter_for(user, baseline, manage=False, field="baseline")
    served = ServedAdapter.objects.filter(adapter=adapter).first()
    if served is not None:
        baseline_base, sha = served.base, served.adapter_sha256
    else:
        if not serving_runtime.has_snapshot(baseline):
            raise ActionRefused(409, "adapter_not_found", f"the baseline {baseline!r} has no PEFT snapshot: a "
                                                          "training run publishes one when it succeeds, and deleting "
                                                          "the adapter removes it",
                                field="baseline")
        baseline_base = serving_actions.adapter_base(adapter)
        if baseline_base is None:
            raise ActionRefused(400, "base_required", f"cannot tell which base the baseline {baseline!r} was "
                                                      "trained over", field="baseline")
        sha = serving_runtime.snapshot_sha256(baseline)
    if baseline_base != candidate_base:
        raise _cross_base(candidate, candidate_base, baseline, baseline_base)
    return _adapter_baseline(baseline, baseline_base, sha, "asked for")


def _planned_bytes(user, candidate, base: str | None, max_new_tokens: int):
    """The device plan of evaluating CANDIDATE over BASE (None: the candidate's own) for USER (runtime.planned_bytes),
    read before anything is checked so that the backend is resolved first, as it always was; None where the request
    is refused further on (no snapshot, an adapter USER may not see, no registered base): nothing of it runs."""
    from kiln_web.adapters.models import Adapter
    from kiln_web.serving import actions as serving_actions
    from kiln_web.serving import runtime as serving_runtime

    if not isinstance(candidate, str) or not serving_actions.ADAPTER_NAME.match(candidate) \
            or not serving_runtime.has_snapshot(candidate):
        return None
    adapter = Adapter.objects.visible_to(user).filter(name=candidate).first()
    if adapter is None and Adapter.objects.filter(name=candidate).exists():
        return None  # someone else's, refused below exactly like a name that does not exist
    if base is None and adapter is not None:
        base = serving_actions.adapter_base(adapter)
    elif base is None:
        base = serving_runtime.snapshot_base(candidate)  # an unclaimed snapshot: it becomes USER's below
    if not isinstance(base, str) or not serving_runtime.is_base(base):
        return None
    return runtime.planned_bytes(candidate, base, max_new_tokens)


def do_enqueue_evaluation(user, candidate: str, suite: str, *, base: str | None = None, baseline: str | None = None,
                          training_job=None, purpose: str = EvalPurpose.MANUAL,
                          max_new_tokens: int = MAX_NEW_TOKENS, backend: str | None = None) -> EvalRun:
    """Queue an evaluation of CANDIDATE (an adapter with a PEFT snapshot that USER may use) on SUITE against
    BASELINE (an adapter over the same base that USER may use, or that base), else against USER's active adapter
    when it is over the candidate's base, else against the base itself; a worker runs it (Celery with REDIS_URL,
    else the embedded worker). A baseline over another base is refused (409 cross_base_comparison). BACKEND (auto,
    cpu, cuda; None: KILN_TRAINING_BACKEND) is resolved now; cuda without a device is refused (400
    backend_unavailable, with the loader's reason)."""
    from kiln_web.adapters.models import Adapter
    from kiln_web.serving import actions as serving_actions
    from kiln_web.serving import runtime as serving_runtime

    try:
        resolved, why = runtime.resolve_backend(backend, _planned_bytes(user, candidate, base, max_new_tokens))
    except runtime.EvaluationError as error:
        raise ActionRefused(400, error.code, error.message, field="backend") from None
    adapter = serving_actions.adapter_for(user, candidate, manage=False, field="adapter")  # theirs, or shared
    no_snapshot = ActionRefused(409, "adapter_not_found", f"the adapter {candidate!r} has no PEFT snapshot: a "
                                                          "training run publishes one when it succeeds, and deleting "
                                                          "the adapter removes it")
    if not serving_runtime.has_snapshot(candidate):
        raise no_snapshot
    suite_row = suite_for(user, suite)
    candidate_base = base or serving_actions.adapter_base(adapter)
    if candidate_base is None or not serving_runtime.is_base(candidate_base):
        raise ActionRefused(400, "base_not_found", f"cannot evaluate {candidate!r}: base {candidate_base!r} is not "
                                                   "registered; name one (base)")
    with transaction.atomic():
        # the candidate's row, locked as do_delete_adapter locks it: a delete either ran before (its snapshot is
        # gone: refused here) or waits for this run's row (and is refused adapter_busy)
        adapter = Adapter.objects.select_for_update().get(pk=adapter.pk)
        if not serving_runtime.has_snapshot(candidate):
            raise no_snapshot
        chosen = (_baseline(user, candidate, candidate_base) if baseline is None else
                  _named_baseline(user, candidate, candidate_base, baseline))
        run = EvalRun.objects.create(owner=user, suite=suite_row, suite_digest=suite_row.digest, candidate=adapter,
                                     candidate_base=candidate_base, training_job=training_job, purpose=purpose,
                                     max_new_tokens=max_new_tokens, backend=resolved, backend_reason=why[:500],
                                     **chosen)
        run_id = run.pk
        transaction.on_commit(lambda: enqueue_evaluation(run_id))
    return run


def enqueue_evaluation(run_id) -> None:
    """Hand a committed queued run to a worker; a broker that cannot be reached fails the run at once."""
    try:
        dispatch.send(dispatch.EVALUATION_TASK, run_id)
    except Exception as exc:  # noqa: BLE001 (any broker failure)
        logger.exception("could not send evaluation %s to the broker", run_id)
        do_fail_unclaimed(run_id, "broker_unavailable", f"could not reach the broker ({exc}); check REDIS_URL and "
                                                        "that a `celery -A kiln_web worker -Q training` runs")


def require_adapters_usable(run: EvalRun) -> None:
    """When a worker starts RUN: its owner must still be allowed to use its candidate and an adapter baseline (an
    adapter no longer shared with them since the run was queued is not used), else EvaluationError
    adapter_not_found, as queueing it now would answer."""
    from kiln_web.adapters.models import Adapter

    usable = Adapter.objects.visible_to(run.owner)
    names = [run.candidate.name] + ([run.baseline] if run.baseline_kind == BaselineKind.ADAPTER else [])
    for name in names:
        if not usable.filter(name=name).exists():
            raise runtime.EvaluationError("adapter_not_found", f"no adapter named {name!r} that the run's owner may "
                                                               "use (it is no longer shared with them); GET "
                                                               "/v1/adapters lists theirs and those shared with them")


def do_claim_evaluation(run_id, worker_id: str) -> bool:
    now = timezone.now()
    changed = EvalRun.objects.filter(pk=run_id, status=EvalStatus.QUEUED).update(
        status=EvalStatus.RUNNING, worker_id=worker_id, started_at=now, heartbeat_at=Now())
    return changed == 1


def do_evaluation_heartbeat(run_id, worker_id: str) -> bool:
    """Record that WORKER_ID still runs the evaluation; False when it is no longer this worker's running run."""
    return EvalRun.objects.filter(pk=run_id, worker_id=worker_id, status=EvalStatus.RUNNING).update(
        heartbeat_at=Now()) == 1  # the database's clock, as a job's (kiln_web.jobs.actions.database_now)


def do_mark_lost_evaluations(cutoff, now) -> list:
    """running -> failed (`worker_lost`) for each evaluation whose worker sent no heartbeat since CUTOFF (it was
    killed, or its machine lost): nothing else would ever finish it, and a promotion gate waiting on it then
    decides (unavailable). An evaluation is not resumable; it is run again. Returns their ids. The caller
    (kiln_web.jobs.actions.do_mark_lost) has checked that the database did not restart since CUTOFF."""
    # a run claimed before evaluations beat (no heartbeat_at) counts from its start
    silent = Q(heartbeat_at__lt=cutoff) | Q(heartbeat_at__isnull=True, started_at__lt=cutoff)
    stale = list(EvalRun.objects.filter(silent, status=EvalStatus.RUNNING).values_list("pk", flat=True))
    lost = []
    for run_id in stale:
        with transaction.atomic():
            run = EvalRun.objects.select_for_update().get(pk=run_id)
            last = run.heartbeat_at or run.started_at
            if run.status != EvalStatus.RUNNING or last is None or last >= cutoff:
                continue  # it ended, or beat, since the first look
            last_beat = last.isoformat(timespec="seconds")
            run.status, run.finished_at, run.error_code = EvalStatus.FAILED, now, "worker_lost"
            run.error_message = (f"worker {run.worker_id or '?'} sent no heartbeat since {last_beat}; the "
                                 "evaluation did not finish: run the evaluation again")
            run.save(update_fields=["status", "finished_at", "error_code", "error_message"])
            _finished(run.pk)
            lost.append(run_id)
    if lost:
        logger.warning("marked %d evaluation(s) failed (worker lost): %s", len(lost), ", ".join(map(str, lost)))
    return lost


def _finished(run_id) -> None:
    transaction.on_commit(lambda: signals.evaluation_finished.send_robust(sender=EvalRun, run_id=run_id))


def do_fail_unclaimed(run_id, code: str, message: str) -> bool:
    """queued -> failed for a run no worker can get."""
    with transaction.atomic():
        changed = EvalRun.objects.filter(pk=run_id, status=EvalStatus.QUEUED).update(
            status=EvalStatus.FAILED, error_code=code, error_message=message, finished_at=timezone.now())
        if changed == 1:
            _finished(run_id)
    return changed == 1


def storable(output: str) -> str:
    """A model's output (or an expected answer) as a text column keeps it: PostgreSQL refuses NUL characters (a
    byte-level model such as kiln-tiny can generate one), so each is stored, and shown, as the six characters
    \\u0000. Scoring saw the real text."""
    return output.replace("\x00", "\\u0000")


def do_finish_evaluation(run_id, worker_id: str, comparison=None, *, error_code: str = "",
                         error_message: str = "") -> bool:
    """running -> succeeded (with the comparison's summaries and per-example results) or failed."""
    with transaction.atomic():
        run = EvalRun.objects.select_for_update().get(pk=run_id)
        if run.worker_id != worker_id or run.status != EvalStatus.RUNNING:
            return False
        run.finished_at = timezone.now()
        if comparison is None:
            run.status, run.error_code, run.error_message = EvalStatus.FAILED, error_code, error_message
            run.save(update_fields=["status", "error_code", "error_message", "finished_at"])
        else:
            run.status = EvalStatus.SUCCEEDED
            run.candidate_summary = comparison.candidate.summary()
            run.baseline_summary = comparison.baseline.summary()
            run.candidate_sha256 = comparison.candidate_sha256
            run.save(update_fields=["status", "candidate_summary", "baseline_summary", "candidate_sha256",
                                    "finished_at"])
            EvalExampleResult.objects.bulk_create(
                EvalExampleResult(run=run, index=ours["index"], expected=storable(ours["expected"]),
                                  metric=ours["metric"],
                                  candidate_output=storable(ours["output"]), candidate_correct=ours["correct"],
                                  baseline_output=storable(theirs["output"]), baseline_correct=theirs["correct"])
                for ours, theirs in zip(comparison.candidate.examples, comparison.baseline.examples))
        _finished(run.pk)
    return True


def visible_runs(user):
    # a run shows its suite's name, never its content (every example: up to KILN_UPLOAD_MAX_BYTES)
    return EvalRun.objects.visible_to(user).select_related("owner", "suite", "candidate").defer("suite__content")
