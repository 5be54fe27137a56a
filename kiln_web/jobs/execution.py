"""Run one training job to a final state: the body of the Celery task and of the embedded worker.

claim (conditional update: queued -> running; the worker's own execution identity replaces the one
admission recorded) -> revalidate the admission at dequeue (a resume's checkpoint must carry this
worker's execution identity, else `execution_drift` with a field-by-field table; and an OPD job's
teacher alias) -> the kind's run (run_sft, run_grpo, run_opd) with hooks that record
steps, checkpoints and events -> succeeded or cancelled; any exception -> failed with a code
and a message. A heartbeat thread keeps heartbeat_at fresh so a dead worker's job is detected
as lost.
"""

from __future__ import annotations

import errno
import logging
import threading
import time
import traceback

from django.conf import settings
from django.db import InterfaceError, OperationalError, connection

from kiln_web.jobs import actions, runtime
from kiln_web.jobs.pacing import Pace
from kiln_web.jobs.models import EventLevel, InvalidTransition, JobKind, JobStatus, TrainingJob
from kiln_web.teachers import actions as teachers

logger = logging.getLogger("kiln.jobs")
# errno of a write the registry's storage refused -> the job's error code
STORAGE_ERRORS = {errno.ENOSPC: "disk_full", errno.EDQUOT: "disk_full", errno.EROFS: "storage_error",
                  errno.EIO: "storage_error", errno.EFBIG: "storage_error"}
# what to do about it, where "free space" is not the answer
STORAGE_ADVICE = {errno.EFBIG: "raise the file-size limit (ulimit -f) or move the registry to a filesystem that "
                               "holds files this large", errno.EROFS: "make the registry writable",
                  errno.EIO: "repair the storage"}


def through_outage(call, *args, **kwargs):
    """CALL (a database write or read), retried on a fresh connection while the database cannot be reached
    (a restart, a failover), starting no attempt (as far as its sleeps keep time) past KILN_LOST_AFTER_SECONDS;
    one that began before may wait for a pooled connection up to the pool's timeout more. Then it logs that it
    gives up and the error propagates (at once inside a transaction, which a new connection cannot continue).
    A run survives a short outage, and a job is never left `running` because the database was down when it
    finished."""
    start = time.monotonic()
    deadline = start + settings.KILN_LOST_AFTER_SECONDS
    delay = 0.1
    while True:
        try:
            return call(*args, **kwargs)
        except (OperationalError, InterfaceError) as exc:
            if connection.in_atomic_block:
                raise  # inside a transaction a new connection cannot continue it
            if time.monotonic() + delay > deadline:
                logger.error("the database could not be reached for %.1f s; giving up (%s)",
                             time.monotonic() - start, exc)
                raise
            logger.warning("the database cannot be reached (%s); retrying in %.1f s", exc, delay)
            _drop_connection()
            time.sleep(delay)
            delay = min(delay * 2, 2.0)


def _drop_connection() -> None:
    """Forget this thread's broken connection, so that the next query opens a new one."""
    try:
        connection.close()
    except Exception:  # noqa: BLE001 (closing a dead connection may itself fail)
        connection.connection = None


class JobHooks:
    """What a run (run_sft, run_grpo, run_opd) calls back into: every call writes through one action."""

    def __init__(self, job_id, worker_id: str, stop: threading.Event | None = None,
                 poll_seconds: float | None = None, clock=time.monotonic):
        self.job_id, self.worker_id, self.stop = job_id, worker_id, stop
        self.poll_seconds = settings.KILN_CANCEL_POLL_SECONDS if poll_seconds is None else poll_seconds
        self._clock = clock
        self._last_poll: float | None = None
        self._cancel = False
        self._pace = None  # tests only (KILN_TEST_PACE_DIR): hold the run where a fault test asks
        if settings.KILN_TEST_PACE_DIR:
            adapter = TrainingJob.objects.filter(pk=job_id).values_list("adapter__name", flat=True).first()
            self._pace = Pace(settings.KILN_TEST_PACE_DIR, adapter, self.should_cancel)

    def on_step(self, metrics: dict) -> None:
        if self._pace is not None:
            self._pace.before_step(metrics["step"])
        through_outage(actions.do_record_step, self.job_id, self.worker_id, metrics)

    def on_publish_stage(self, stage: str) -> None:
        if self._pace is not None:
            self._pace.at_stage(stage)

    def should_cancel(self) -> bool:
        """True once the job is no longer plainly running (cancelling, lost) or the worker is stopping;
        asks the database at most once every poll_seconds."""
        if self._cancel:
            return True
        if self.stop is not None and self.stop.is_set():
            self._cancel = True
            try:  # so the job reads "cancelling" until the run has published and ended
                actions.do_cancel_job(self.job_id, reason="the worker is stopping")
            except InvalidTransition:
                pass
            return True
        now = self._clock()
        if self._last_poll is None or now - self._last_poll >= self.poll_seconds:
            self._last_poll = now
            status = through_outage(
                lambda: TrainingJob.objects.filter(pk=self.job_id).values_list("status", flat=True).first())
            self._cancel = status != JobStatus.RUNNING
        return self._cancel

    def on_checkpoint(self, summary: dict, timing: dict) -> None:
        # the summary the run read back after publishing carries the digest: no second read of the manifest
        digest = summary.get("manifest_sha256") or runtime.manifest_digest(summary["resume_checkpoint"])
        through_outage(actions.do_record_checkpoint, self.job_id, self.worker_id, summary, timing,
                       manifest_digest=digest)

    def on_event(self, level: str, message: str) -> None:
        through_outage(actions.do_add_event, self.job_id, level, message)


class Heartbeat:
    """A thread that marks the job alive every KILN_HEARTBEAT_SECONDS while the run computes (BEAT(id, worker_id):
    actions.do_heartbeat for a training job, the evaluation's own for an evaluation)."""

    def __init__(self, job_id, worker_id: str, interval: float | None = None, beat=None):
        self.job_id, self.worker_id = job_id, worker_id
        self.interval = settings.KILN_HEARTBEAT_SECONDS if interval is None else interval
        self._beat = actions.do_heartbeat if beat is None else beat
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"kiln-heartbeat-{job_id}", daemon=True)

    def __enter__(self) -> "Heartbeat":
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        try:
            while not self._stop.wait(self.interval):
                try:
                    self._beat(self.job_id, self.worker_id)
                except Exception:
                    logger.warning("heartbeat for %s failed", self.job_id, exc_info=True)
                    _drop_connection()  # the next beat reconnects (the database may have restarted)
        finally:
            connection.close()  # this thread's own connection


def execute_training_job(job_id, worker_id: str, stop: threading.Event | None = None) -> str:
    """Claim and run JOB_ID; returns the job's final status, or "not_claimed" when another worker has it."""
    if stop is not None and stop.is_set():
        return "not_claimed"
    identity, identity_error = None, None
    try:
        identity = _identity_for(*_job_backend(job_id))
    except Exception as exc:  # noqa: BLE001 (the claimed job fails with it below)
        identity_error = exc
    if not through_outage(actions.do_claim_job, job_id, worker_id, execution=identity):
        logger.info("job %s was not claimed by %s (gone, cancelled or claimed by another worker)", job_id, worker_id)
        return "not_claimed"
    logger.info("job %s claimed by %s", job_id, worker_id)
    if identity_error is not None:
        status, error = JobStatus.FAILED, failure_fields(identity_error)
    else:
        status, error = _run_claimed(job_id, worker_id, stop, identity)
    if status == JobStatus.FAILED:
        through_outage(actions.do_finish_job, job_id, worker_id, JobStatus.FAILED, **error)
    else:
        through_outage(actions.do_finish_job, job_id, worker_id, status, result=error)
    final = through_outage(lambda: TrainingJob.objects.filter(pk=job_id).values_list("status", flat=True).first())
    logger.info("job %s ended %s", job_id, final)
    return final


def _job_backend(job_id) -> tuple[str, str | None, dict]:
    """(backend, precision, identities) admission resolved for JOB_ID: its effective configuration's backend (a job
    admitted before config.backend existed: its recorded execution identity's, which was cpu), precision (None:
    float32) and identities (where its device plan is recorded)."""
    row = TrainingJob.objects.filter(pk=job_id).values_list("effective_config", "identities").first()
    config, identities = row or ({}, {})
    backend = (config or {}).get("backend") if isinstance(config, dict) else None
    if backend is None and isinstance(identities, dict):
        backend = (identities.get("execution") or {}).get("backend")
    precision = (config or {}).get("precision") if isinstance(config, dict) else None
    backend = backend if backend in ("cpu", "cuda") else "cpu"  # a stand-in's record may hold the setting
    return backend, precision, identities if isinstance(identities, dict) else {}


def _identity_for(backend: str, precision: str | None = None, identities=None) -> dict:
    """The execution identity this worker trains a job of BACKEND under: its own (computed at start) when that is
    for BACKEND, else one computed for it. A cuda job on a worker whose CUDA loader finds no device, or a device
    with less free memory than the job's recorded device plan (IDENTITIES' device_plan), is refused here, at
    dequeue (backend_unavailable with the reason), before anything is loaded."""
    try:
        runtime.require_backend(backend, identities)
    except runtime.BackendRefused as error:
        raise runtime.BackendRefused(f"this worker cannot run the job's backend: {error.message}; run it on a "
                                     "worker whose CUDA device the loader finds with the free memory the job plans, or "
                                     "submit it again with backend cpu") from None
    if precision not in (None, "float32"):
        return runtime.execution_identity(backend, precision)
    own = runtime.execution_identity()  # cached: the one this worker computed at start
    return own if own.get("backend") == backend else runtime.execution_identity(backend)


def _run_claimed(job_id, worker_id: str, stop: threading.Event | None, identity: dict) -> tuple[str, dict]:
    """(status, result) on a normal end, (FAILED, error fields) on an exception. IDENTITY, this worker's
    execution identity, is the one the run binds: revalidation compares a resume's checkpoint with it and
    the checkpoints the run publishes record it."""
    kind = None
    try:
        kind, admitted = TrainingJob.objects.values_list("kind", "admission").get(pk=job_id)
        runner = runtime.runner(kind)
        run_settings = runtime.run_settings(runner.module)
        admission = runner.admission_from_json(admitted)
        if isinstance(getattr(admission, "identities", None), dict):
            admission.identities["execution"] = identity  # as do_claim_job recorded it on the row
        hooks = JobHooks(job_id, worker_id, stop=stop)
        with Heartbeat(job_id, worker_id):
            actions.check_reads_still_visible(TrainingJob.objects.select_related("owner").get(pk=job_id))
            if kind == JobKind.OPD:
                teachers.check_teacher_unchanged(admission.effective_config["teacher"])
            runner.revalidate(admission, run_settings)  # before any memory is reserved
            actions.do_add_event(job_id, EventLevel.INFO, "dequeue revalidation passed; starting the run")
            result = runner.run(admission, run_settings, hooks)
    except BaseException as exc:  # noqa: BLE001 (mapped to a state; KeyboardInterrupt/SystemExit re-raised below)
        error = failure_fields(exc, kind)
        if not isinstance(exc, Exception):
            actions.do_finish_job(job_id, worker_id, JobStatus.FAILED, **error)
            raise
        return JobStatus.FAILED, error
    status = JobStatus.CANCELLED if result.status == "cancelled" else JobStatus.SUCCEEDED
    return status, {"status": result.status, "steps_completed": result.steps_completed,
                    "latest_checkpoint": result.latest_checkpoint,
                    "final_loss": result.loss_history[-1] if result.loss_history else None,
                    "final_adapter": getattr(result, "final_adapter", None)}  # the PEFT snapshot, for lineage


def failure_fields(exc: BaseException, kind: str | None = None) -> dict:
    """error_code, error_message, error_details for an exception that ended a run of KIND."""
    if isinstance(exc, actions.ActionRefused):
        return {"error_code": exc.code, "error_message": exc.message, "error_details": exc.extra or None}
    try:
        refusal = runtime.refusal_for(exc, kind) if isinstance(exc, Exception) else None
    except runtime.RunnerUnavailable:
        refusal = None
    if refusal is not None:
        details = {"differences": refusal.differences} if refusal.differences else None
        if refusal.field:
            details = (details or {}) | {"field": refusal.field}
        return {"error_code": refusal.code, "error_message": refusal.message, "error_details": details}
    name = type(exc).__name__
    if name == "SoftTimeLimitExceeded":
        return {"error_code": "time_limit", "error_message": "the run exceeded the worker's time limit"}
    if isinstance(exc, runtime.RunnerUnavailable):
        return {"error_code": exc.code, "error_message": str(exc)}
    if isinstance(exc, (KeyboardInterrupt, SystemExit)):
        return {"error_code": "worker_stopped", "error_message": f"the worker stopped ({name}) during the run"}
    if isinstance(exc, OSError) and exc.errno in STORAGE_ERRORS:
        where = f" ({exc.filename})" if exc.filename else ""
        return {"error_code": STORAGE_ERRORS[exc.errno],
                "error_message": f"{exc.strerror}{where} while the run wrote its files; the checkpoints it published "
                                 f"are intact: {STORAGE_ADVICE.get(exc.errno, 'free space')} and resume from the "
                                 "latest"}
    if isinstance(exc, (OperationalError, InterfaceError)):
        return {"error_code": "database_unavailable",
                "error_message": f"the database could not be reached during the run ({exc}); the worker waited up "
                                 f"to {settings.KILN_LOST_AFTER_SECONDS:g} s for it; resume from the latest "
                                 "checkpoint"}
    code = getattr(exc, "code", None)
    if isinstance(code, str) and code:  # e.g. CheckpointError raised inside the run
        return {"error_code": code, "error_message": str(getattr(exc, "message", None) or exc)}
    logger.error("job failed with an unexpected error", exc_info=exc)
    return {"error_code": "internal_error", "error_message": f"{name}: {exc}",
            "error_details": {"traceback": traceback.format_exception(exc)[-12:]}}
