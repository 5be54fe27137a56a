"""Every change to a training job, one function each, used by the API, the CLI, tasks and workers.

Status changes lock the row (transaction.atomic() + select_for_update()) and ask the model
whether the move is allowed; the claim is a conditional UPDATE that exactly one worker wins.
Channel-layer messages go out only after the commit (kiln_web.jobs.events).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from datetime import timedelta

from django.conf import settings
from django.db import connection, transaction
from django.db.models.functions import Now
from django.utils import timezone

from kiln_web.adapters.models import Adapter, CheckpointRecord
from kiln_web.core import dispatch
from kiln_web.core.http import ActionRefused
from kiln_web.jobs import events, lineage, runtime, signals
from kiln_web.jobs.models import (ACTIVE_STATUSES, RUNNING_STATUSES, EventLevel, JobEvent, JobKind, JobMetric,
                                  JobStatus, TrainingJob, WorkerRecord)
from kiln_web.serving.promotion_request import split_promotion_fields
from kiln_web.teachers import actions as teachers

logger = logging.getLogger("kiln.jobs")
MAX_TOTAL_STEPS = 2**31 - 1  # TrainingJob.total_steps and committed_step are 32-bit integers on PostgreSQL


# -- helpers --


def _locked(job_id, bodies: bool = True) -> TrainingJob:
    """The job, its row locked; without its request and admission (TrainingJob.BODIES) unless BODIES."""
    jobs = TrainingJob.objects.select_for_update().select_related("adapter", "owner")
    return (jobs if bodies else jobs.defer(*TrainingJob.BODIES)).get(pk=job_id)


def _event(job: TrainingJob, level: str, message: str) -> None:
    row = JobEvent.objects.create(job=job, level=level, message=message)
    events.publish_after_commit(job.pk, job.owner_id, events.JOB_EVENT, row.to_dict())


def _status_changed(job: TrainingJob) -> None:
    events.publish_after_commit(job.pk, job.owner_id, events.JOB_STATUS, {
        "status": job.status, "progress": {"committed_step": job.committed_step, "total_steps": job.total_steps},
        "error": {"code": job.error_code, "message": job.error_message} if job.error_code else None})


def _name_taken(name: str) -> ActionRefused:
    """Someone else's adapter (shared with USER or not) has this name: said without saying whose."""
    return ActionRefused(409, "adapter_name_taken", f"the adapter name {name!r} is taken; choose another output_name",
                         field="config.output_name")


def _check_adapter_owner(name: str, user) -> None:
    adapter = Adapter.objects.filter(name=name).select_related("owner").first()
    if adapter is not None and not adapter.is_owner_or_staff(user):
        raise _name_taken(name)


def _check_resume_checkpoint_visible(reference, user) -> None:
    """A resume from another person's checkpoint (of an adapter USER may not change) is refused exactly as one the
    registry does not hold, before anything reads it: that it exists, its kind and what its manifest holds are
    theirs (a submission under their adapter's own name is refused adapter_name_taken first)."""
    name = runtime.checkpoint_adapter(reference)
    adapter = Adapter.objects.filter(name=name).select_related("owner").first() if name else None
    if adapter is not None and not adapter.is_owner_or_staff(user):
        raise runtime.checkpoint_not_found(reference)


def _hidden(user, path_text) -> bool:
    from kiln_web.serving.actions import registry_adapter_hidden

    return registry_adapter_hidden(user, path_text)


def check_reads_still_visible(job: TrainingJob) -> None:
    """At dequeue: the adapters JOB reads by path (a warm start's base_adapter, an OPD teacher's adapter) must still
    be ones its owner may see, so a share withdrawn since admission holds; refused as admission would refuse now."""
    config = job.effective_config if isinstance(job.effective_config, dict) else {}
    request = job.request if isinstance(job.request, dict) else {}
    asked = (request.get("config") or {}).get("base_adapter") if isinstance(request.get("config"), dict) else None
    _check_base_adapter_visible(asked, job.owner, config.get("base_adapter"))
    teacher = config.get("teacher")
    if isinstance(teacher, dict) and _hidden(job.owner, teacher.get("adapter")):
        raise ActionRefused(400, "teacher_unavailable", f"the teacher {teacher.get('alias')}'s adapter cannot be "
                                                        "read", field="config.teacher")


def _check_base_adapter_visible(path_text, user, resolved=None) -> None:
    """A warm start from someone else's adapter (one not shared with USER) reads it: refused exactly as the
    trainer refuses a base_adapter directory that does not exist. RESOLVED: the directory admission resolved
    PATH_TEXT to, checked too (a link may have been swapped between the two)."""
    if _hidden(user, path_text) or _hidden(user, resolved):
        raise ActionRefused(400, "base_adapter_not_found", f"{path_text} is not a directory")


def enqueue_job(job_id) -> None:
    """Hand a committed queued job to a worker: Celery with REDIS_URL, else wake the embedded worker."""
    try:
        dispatch.send(dispatch.TRAINING_TASK, job_id)
    except Exception as exc:  # the row is committed and stays queued; say so instead of a bare 500
        logger.exception("could not send job %s to the broker", job_id)
        JobEvent.objects.create(job_id=job_id, level=EventLevel.ERROR,
                                message=f"could not reach the broker ({exc}); the job stays queued, "
                                        "check REDIS_URL and that a `celery -A kiln_web worker -Q training` runs")


def do_redispatch_queued() -> list:
    """Send every queued job (and queued evaluation) to the broker again; returns the job ids. For when the
    broker may have lost them: a Redis restarted without persistence forgets its queue, and a submission
    while it was unreachable was never sent. A second delivery changes nothing: the claim is conditional."""
    job_ids = list(TrainingJob.objects.filter(status=JobStatus.QUEUED).order_by("created_at")
                   .values_list("pk", flat=True))
    for job_id in job_ids:
        enqueue_job(job_id)
    from kiln_web.evals.actions import enqueue_evaluation
    from kiln_web.evals.models import EvalRun, EvalStatus

    for run_id in EvalRun.objects.filter(status=EvalStatus.QUEUED).values_list("pk", flat=True):
        enqueue_evaluation(run_id)
    if job_ids:
        logger.warning("sent %d queued job(s) to the broker again: %s", len(job_ids), ", ".join(map(str, job_ids)))
    return job_ids


# -- submission --


def do_submit_job(user, body: dict, request: dict, kind: str = JobKind.SFT) -> TrainingJob:
    """Admit REQUEST (the validated body), then create the queued job; nothing exists if admission refuses.

    BODY is kept as submitted. Admission (which hashes the base, the data and any resume
    checkpoint) runs before the transaction; a trainer refusal is raised as the ActionRefused it
    means (runtime.refusal_for). OPD names its teacher by alias (config.teacher); admission gets
    the alias's resolved spec.
    """
    try:
        return _submit_job(user, body, request, kind)
    except Exception as exc:
        refusal = None if isinstance(exc, ActionRefused) else runtime.refusal_for(exc, kind)
        if refusal is None:
            raise
        raise ActionRefused(refusal.status, **refusal.as_error()) from exc


def _submit_job(user, body: dict, request: dict, kind: str) -> TrainingJob:
    if kind not in JobKind.values:
        raise ActionRefused(400, "invalid_request", f"training kind {kind!r} is not one of {', '.join(JobKind.values)}")
    name = request["config"]["output_name"]
    _check_adapter_owner(name, user)
    _check_resume_checkpoint_visible(request["config"].get("resume_checkpoint"), user)
    _check_base_adapter_visible(request["config"].get("base_adapter"), user)
    request = split_promotion_fields(user, request)  # auto_load and gate are decided after training, never admitted
    if kind == JobKind.OPD:
        teacher = teachers.resolve_teacher(request["config"].get("teacher"))
        if _hidden(user, teacher.get("adapter")):  # distilling from an adapter reads it
            raise ActionRefused(400, "teacher_unavailable", f"the teacher {teacher['alias']}'s adapter cannot be "
                                                            "read", field="config.teacher")
        request = {**request, "config": {**request["config"], "teacher": teacher}}
    runner = runtime.runner(kind)
    admission = runner.admit(request, runtime.run_settings(runner.module))
    _check_base_adapter_visible(request["config"].get("base_adapter"), user,
                                admission.effective_config.get("base_adapter"))
    if (admission.total_steps or 0) > MAX_TOTAL_STEPS:
        raise ActionRefused(400, "invalid_request", f"the run would take {admission.total_steps} optimizer steps; "
                                                    f"at most {MAX_TOTAL_STEPS} (ask for fewer epochs or steps)")
    resume = admission.resume or {}
    with transaction.atomic():
        adapter, _ = Adapter.objects.get_or_create(name=admission.adapter, defaults={"owner": user})
        adapter = Adapter.objects.select_for_update().get(pk=adapter.pk)  # one submission per adapter at a time
        if not adapter.is_owner_or_staff(user):
            raise _name_taken(adapter.name)
        active = TrainingJob.objects.filter(adapter=adapter, status__in=ACTIVE_STATUSES).first()
        if active is not None:
            if not active.is_owner_or_staff(user):  # staff's job on the owner's adapter is 404 to the owner
                raise ActionRefused(409, "adapter_busy", f"the adapter {adapter.name!r} already has a {active.status} "
                                                         "job of another person; wait for it to finish")
            raise ActionRefused(409, "adapter_busy",
                                f"the adapter {adapter.name!r} already has a {active.status} job ({active.pk}); "
                                "wait for it to finish or cancel it first", job_id=str(active.pk))
        if kind == JobKind.OPD:  # the alias, locked: unchanged since admission resolved it, else teacher_changed
            teachers.do_record_teacher_content(admission.identities["teacher"])
        job = TrainingJob.objects.create(
            owner=user, kind=kind, adapter=adapter, request=body, admission=admission.to_json(),
            effective_config=admission.effective_config, effective_seed=admission.effective_seed,
            data_source_kind=admission.data_source_kind, identities=admission.identities,
            resume_from=resume.get("checkpoint") or "", total_steps=admission.total_steps,
            committed_step=resume.get("step") or 0)
        lineage.record_admission(job)  # replay.jsonl and the adapter's lineage.json; refuses if unwritable
        resumed = f", resuming from {job.resume_from}" if job.resume_from else ""
        chosen = (job.identities or {}).get("backend") if isinstance(job.identities, dict) else None
        backend = f", backend {chosen['resolved']} ({chosen['reason']})" if isinstance(chosen, dict) else ""
        _event(job, EventLevel.INFO, f"queued: {job.total_steps} steps, seed {job.effective_seed}{resumed}{backend}")
        _status_changed(job)
        job_id = job.pk
        transaction.on_commit(lambda: enqueue_job(job_id))
    return job


# -- worker side --


def do_claim_job(job_id, worker_id: str, execution: dict | None = None) -> bool:
    """queued -> running for WORKER_ID, if no other worker got there first. True when this one won.
    EXECUTION, the claiming worker's execution identity, replaces the one admission recorded: it is the
    identity the run's checkpoints record and the one a resume is compared with at dequeue."""
    now = timezone.now()
    with transaction.atomic():
        changed = TrainingJob.objects.filter(pk=job_id, status=JobStatus.QUEUED).update(
            status=JobStatus.RUNNING, worker_id=worker_id, started_at=now, heartbeat_at=Now())
        if changed != 1:
            return False
        job = TrainingJob.objects.select_related("owner").get(pk=job_id)
        claimed = f"claimed by worker {worker_id}"
        if execution is not None:
            _bind_execution(job, execution)
            claimed += f" (execution identity {identity_sha256(execution)[:12]})"
        _event(job, EventLevel.INFO, claimed)
        _status_changed(job)
    return True


def _bind_execution(job: TrainingJob, execution: dict) -> None:
    """Record the claiming worker's execution identity on the job and in its admission record."""
    fields = []
    if isinstance(job.identities, dict):
        job.identities = {**job.identities, "execution": execution}
        fields.append("identities")
    if isinstance(job.admission, dict) and isinstance(job.admission.get("identities"), dict):
        job.admission = {**job.admission, "identities": {**job.admission["identities"], "execution": execution}}
        fields.append("admission")
    if fields:
        job.save(update_fields=fields)


def identity_sha256(identity: dict) -> str:
    return hashlib.sha256(json.dumps(identity, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def do_register_worker(worker_id: str, identity: dict) -> WorkerRecord:
    """A worker starting: record (or refresh) it and the execution identity it computed."""
    now = timezone.now()
    record, _ = WorkerRecord.objects.update_or_create(worker_id=worker_id, defaults={
        "identity": identity, "identity_sha256": identity_sha256(identity), "started_at": now,
        "heartbeat_at": now, "stopped_at": None})
    return record


def do_worker_heartbeat(worker_id: str) -> bool:
    """The worker is alive; False when it was never registered."""
    return WorkerRecord.objects.filter(worker_id=worker_id).update(heartbeat_at=Now(), stopped_at=None) == 1


def do_worker_stopped(worker_id: str) -> None:
    WorkerRecord.objects.filter(worker_id=worker_id).update(stopped_at=timezone.now())


def live_workers(now=None):
    """Workers that beat within KILN_LOST_AFTER_SECONDS and have not stopped."""
    cutoff = (now or database_now()) - timedelta(seconds=settings.KILN_LOST_AFTER_SECONDS)
    return WorkerRecord.objects.filter(stopped_at__isnull=True, heartbeat_at__gte=cutoff)


def do_heartbeat(job_id, worker_id: str) -> str | None:
    """Record that WORKER_ID still runs the job; returns the job's status (None if it is not this worker's)."""
    TrainingJob.objects.filter(pk=job_id, worker_id=worker_id, status__in=RUNNING_STATUSES).update(heartbeat_at=Now())
    WorkerRecord.objects.filter(worker_id=worker_id).update(heartbeat_at=Now())
    return TrainingJob.objects.filter(pk=job_id, worker_id=worker_id).values_list("status", flat=True).first()


def do_record_step(job_id, worker_id: str, metrics: dict) -> bool:
    """Store one committed step's metrics and move the job's progress; False if the job is no longer this worker's."""
    step = int(metrics["step"])
    metrics = {key: (None if isinstance(value, float) and not math.isfinite(value) else value)
               for key, value in metrics.items()}  # JSON (and PostgreSQL jsonb) has no NaN or infinity
    with transaction.atomic():
        changed = TrainingJob.objects.filter(pk=job_id, worker_id=worker_id, status__in=RUNNING_STATUSES).update(
            committed_step=step, heartbeat_at=Now())
        if changed != 1:
            return False
        JobMetric.objects.update_or_create(job_id=job_id, step=step, defaults={"metrics": metrics})
        owner_id = TrainingJob.objects.filter(pk=job_id).values_list("owner_id", flat=True).get()
        events.publish_after_commit(job_id, owner_id, events.JOB_STEP, {"metrics": metrics})
    return True


def do_record_checkpoint(job_id, worker_id: str, summary: dict, timing: dict | None = None,
                         manifest_digest: str = "") -> bool:
    """Index a published checkpoint and make it the job's latest; the directory itself is the authority.
    (The run reports the publication, with its timings, as an event of its own.)"""
    with transaction.atomic():
        job = _locked(job_id, bodies=False)  # at every checkpoint: not the inline data
        if job.worker_id != worker_id or job.status not in RUNNING_STATUSES:
            return False
        created = _index_checkpoint(job, summary, manifest_digest, timing)
        job.latest_checkpoint = summary
        job.save(update_fields=["latest_checkpoint"])
        TrainingJob.objects.filter(pk=job_id).update(heartbeat_at=Now())
        if created:
            _lineage_warning(job, lineage.record_checkpoint(job, summary, manifest_digest))
        events.publish_after_commit(job.pk, job.owner_id, events.JOB_CHECKPOINT, {"checkpoint": summary})
    return True


def _index_checkpoint(job: TrainingJob, summary: dict, manifest_digest: str, timing: dict | None = None) -> bool:
    """Index a checkpoint JOB published; whether its row is new. A row under the name that another publication
    left (the name was freed, by deleting the adapter or archiving the checkpoint, and this run published it again
    without replacing anything) now describes this publication: the directory in the registry is this one."""
    fields = {"job": job, "adapter": job.adapter, "step": int(summary.get("step") or 0),
              "checkpoint_id": str(summary.get("checkpoint_id") or ""), "manifest_digest": manifest_digest,
              "summary": summary, "timing": dict(timing or {})}
    record, created = CheckpointRecord.objects.select_for_update().get_or_create(
        basename=summary["resume_checkpoint"], defaults=fields)
    if created or (record.job_id, record.manifest_digest) == (job.pk, manifest_digest):
        return created
    for key, value in fields.items():
        setattr(record, key, value)
    record.save(update_fields=list(fields))
    return True


def _lineage_warning(job: TrainingJob, recorded: lineage.Recorded) -> None:
    """A lineage entry that could not be written is reported on the job (the run itself is unaffected)."""
    if recorded.warning is not None:
        _event(job, EventLevel.WARNING, recorded.warning)


def do_add_event(job_id, level: str, message: str) -> None:
    if level not in EventLevel.values:
        level = EventLevel.INFO
    with transaction.atomic():
        _event(TrainingJob.objects.only("pk", "owner_id").get(pk=job_id), level, message)


def do_finish_job(job_id, worker_id: str, status: str, *, result: dict | None = None,
                  error_code: str = "", error_message: str = "", error_details=None) -> bool:
    """running/cancelling -> succeeded, cancelled or failed. False when the job is no longer this worker's
    (it was marked lost meanwhile); a finished job is never reopened."""
    now = timezone.now()
    with transaction.atomic():
        job = _locked(job_id)
        if job.worker_id != worker_id or job.status not in RUNNING_STATUSES:
            logger.warning("job %s is %s (worker %r); not recording %s from %s",
                           job_id, job.status, job.worker_id, status, worker_id)
            return False
        job.check_transition(status)
        job.status = status
        job.finished_at = now
        job.heartbeat_at = now
        fields = ["status", "finished_at", "heartbeat_at"]
        if result is not None:
            job.result = {key: value for key, value in result.items() if key != "loss_history"}
            job.committed_step = int(result.get("steps_completed", job.committed_step) or job.committed_step)
            if result.get("latest_checkpoint"):
                job.latest_checkpoint = result["latest_checkpoint"]
            fields += ["result", "committed_step", "latest_checkpoint"]
        if error_code:
            job.error_code, job.error_message, job.error_details = error_code, error_message, error_details
            fields += ["error_code", "error_message", "error_details"]
        if status == JobStatus.FAILED:  # e.g. the database went away after a publication, before its record
            fields += _adopt_unrecorded_checkpoint(job, "before the run failed")
        job.save(update_fields=fields)
        if status == JobStatus.FAILED:
            _event(job, EventLevel.ERROR, f"failed: {error_code}: {error_message}")
        else:
            checkpoint = (job.latest_checkpoint or {}).get("resume_checkpoint")
            _event(job, EventLevel.INFO, f"{status} after step {job.committed_step}"
                   + (f"; latest checkpoint {checkpoint}" if checkpoint else ""))
        _status_changed(job)
        if status == JobStatus.SUCCEEDED and (result or {}).get("final_adapter"):
            _lineage_warning(job, lineage.record_final_adapter(job, result["final_adapter"]))
        if status == JobStatus.SUCCEEDED:  # promotion (kiln_web.serving) decides after the commit
            job_id = job.pk
            transaction.on_commit(lambda: signals.job_succeeded.send_robust(sender=TrainingJob, job_id=job_id))
    return True


# -- people --


def do_cancel_job(job_id, reason: str = "cancelled by request") -> TrainingJob:
    """queued -> cancelled at once; running -> cancelling (the run publishes at its next safe boundary
    and ends cancelled); cancelling stays. A finished job raises InvalidTransition."""
    with transaction.atomic():
        job = _locked(job_id)
        if job.status == JobStatus.CANCELLING:
            return job
        if job.status == JobStatus.QUEUED:
            job.check_transition(JobStatus.CANCELLED)
            job.status, job.finished_at = JobStatus.CANCELLED, timezone.now()
            job.save(update_fields=["status", "finished_at"])
            _event(job, EventLevel.INFO, f"{reason}; it never started")
        else:
            job.check_transition(JobStatus.CANCELLING)
            job.status = JobStatus.CANCELLING
            job.save(update_fields=["status"])
            _event(job, EventLevel.INFO, f"{reason}; the run stops at its next safe boundary")
        _status_changed(job)
    return job


def _unrecorded_checkpoint(job: TrainingJob) -> tuple[dict, str] | None:
    """(summary, manifest digest) of the adapter's newest checkpoint when it is newer than the one the job
    recorded, else None. A worker killed between publishing a checkpoint and recording it leaves the registry
    (the authority) one ahead of the row; resuming from the older one would stop at `name_exists`. Only one
    job trains an adapter at a time, so a newer checkpoint with the job's kind and seed that no other job recorded
    is the job's (a later resume of the same run shares its seed, and records what it publishes)."""
    try:
        module = runtime.checkpoint_module()
        recorded = (job.latest_checkpoint or {}).get("resume_checkpoint") or job.resume_from
        floor = module.parse_basename(recorded)[1] if recorded else 0
        others = dict(CheckpointRecord.objects.filter(adapter=job.adapter).exclude(job=job)
                      .values_list("basename", "manifest_digest"))
        for path in reversed(module.list_checkpoints(settings.KILN_ADAPTERS_DIR, job.adapter.name)):
            if module.parse_basename(path.name)[1] <= floor:
                return None
            try:
                loaded = module.load_checkpoint(path, full=False, expected_type=job.kind,
                                                expected_adapter=job.adapter.name)
            except (module.CheckpointError, OSError):
                continue  # damaged or unreadable: never offered
            if path.name in others and others[path.name] in ("", loaded.manifest_digest):
                continue  # another job's publication (a row of a deleted one holds another digest)
            if loaded.manifest.get("seed") == job.effective_seed:
                return module.checkpoint_summary(loaded), loaded.manifest_digest
    except Exception:  # noqa: BLE001 (a best effort: the job is marked lost with what it recorded)
        logger.warning("cannot look for unrecorded checkpoints of job %s", job.pk, exc_info=True)
    return None


def _adopt_unrecorded_checkpoint(job: TrainingJob, when: str) -> list:
    """Record the adapter's newest checkpoint as JOB's latest when the run published it but never recorded it
    (_unrecorded_checkpoint); returns the fields changed. Called inside the transaction that ends the job."""
    unrecorded = _unrecorded_checkpoint(job)
    if unrecorded is None:
        return []
    summary, digest = unrecorded
    _index_checkpoint(job, summary, digest)
    job.latest_checkpoint = summary
    _event(job, EventLevel.WARNING, f"{summary['resume_checkpoint']} was published but not recorded {when}; "
                                    "it is the latest checkpoint")
    return ["latest_checkpoint"]


def database_now():
    """The database server's clock. Every liveness stamp (heartbeat_at) is written with it (Now()) and the lost-job
    check compares with it, so a worker or web machine whose own clock is off by minutes (workers run on machines
    of their own) never makes a live run look silent. SQLite runs inside the process: its clock is this one."""
    if connection.vendor != "postgresql":
        return timezone.now()
    with connection.cursor() as cursor:
        cursor.execute("SELECT clock_timestamp()")
        return cursor.fetchone()[0]


def database_started_at():
    """When the database server last started (PostgreSQL's pg_postmaster_start_time), or None (SQLite, which
    runs inside the process and has no restarts a worker could outlive)."""
    if connection.vendor != "postgresql":
        return None
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_postmaster_start_time()")
        return cursor.fetchone()[0]


def do_mark_lost(now=None) -> list:
    """Mark running jobs whose worker sent no heartbeat for KILN_LOST_AFTER_SECONDS as lost; returns their ids.
    Running evaluations so silent are failed `worker_lost` (kiln_web.evals.actions.do_mark_lost_evaluations).

    No heartbeat can be written while the database is down, so silence is counted from the database server's
    last start too: for KILN_LOST_AFTER_SECONDS after a restart no job is lost for its silence before it, and a
    worker that rode the restart out beats again in that time."""
    now = now or database_now()
    cutoff = now - timedelta(seconds=settings.KILN_LOST_AFTER_SECONDS)
    started = database_started_at()
    if started is not None and started >= cutoff:
        return []
    from kiln_web.evals.actions import do_mark_lost_evaluations  # evals.actions imports nothing of jobs.actions

    do_mark_lost_evaluations(cutoff, now)  # a running evaluation beats too; the gate waiting on it then decides
    stale = list(TrainingJob.objects.filter(status__in=RUNNING_STATUSES, heartbeat_at__lt=cutoff)
                 .values_list("pk", flat=True))
    stale += list(TrainingJob.objects.filter(status__in=RUNNING_STATUSES, heartbeat_at__isnull=True)
                  .values_list("pk", flat=True))
    lost = []
    for job_id in stale:
        with transaction.atomic():
            job = _locked(job_id)
            if job.status not in RUNNING_STATUSES or (job.heartbeat_at is not None and job.heartbeat_at >= cutoff):
                continue  # it moved on, or beat, since the first look
            job.check_transition(JobStatus.LOST)
            fields = ["status", "finished_at", "error_code", "error_message"]
            fields += _adopt_unrecorded_checkpoint(job, "before the worker stopped")
            checkpoint = (job.latest_checkpoint or {}).get("resume_checkpoint") or job.resume_from
            last_beat = job.heartbeat_at.isoformat(timespec="seconds") if job.heartbeat_at else "never"
            job.status, job.finished_at = JobStatus.LOST, now
            job.error_code = "worker_lost"
            job.error_message = (f"worker {job.worker_id or '?'} sent no heartbeat since {last_beat}; "
                                 + (f"resume from {checkpoint} (it is intact)" if checkpoint else
                                    "no checkpoint was published; submit the run again"))
            job.save(update_fields=fields)
            _event(job, EventLevel.ERROR, f"lost: {job.error_message}")
            _status_changed(job)
            lost.append(job_id)
    if lost:
        logger.warning("marked %d job(s) lost: %s", len(lost), ", ".join(map(str, lost)))
    return lost
