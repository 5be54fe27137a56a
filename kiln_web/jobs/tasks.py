"""Celery tasks: thin shells around kiln_web.jobs.execution and kiln_web.jobs.actions.

A worker process computes its execution identity at start (worker_process_init; the main process at
worker_ready, which also registers it as a WorkerRecord and beats until shutdown): the jobs it claims
record that identity, and a resume whose checkpoint holds another is refused at dequeue."""

import logging
import threading

from celery import shared_task
from celery.signals import worker_process_init, worker_ready, worker_shutting_down

from kiln_web.core.dispatch import TRAINING_TASK, celery_worker_id
from kiln_web.jobs import actions, runtime
from kiln_web.jobs.execution import execute_training_job

# a run longer than this is stopped; the soft limit lets the task record "failed: time_limit"
SOFT_TIME_LIMIT = 7 * 24 * 3600
HARD_TIME_LIMIT = SOFT_TIME_LIMIT + 600
_SHUTDOWN = threading.Event()  # set by a warm shutdown: a run in this process stops at its next boundary
_STOPPED = threading.Event()  # set at any shutdown: the worker registry's heartbeat thread ends
logger = logging.getLogger("kiln.jobs")


@shared_task(name=TRAINING_TASK, bind=True, ignore_result=True,
             soft_time_limit=SOFT_TIME_LIMIT, time_limit=HARD_TIME_LIMIT)
def run_training_job(self, job_id: str) -> str:
    return execute_training_job(job_id, celery_worker_id(self.request.hostname), stop=_SHUTDOWN)


@shared_task(name="kiln.mark_lost_jobs", ignore_result=True)
def mark_lost_jobs() -> int:
    return len(actions.do_mark_lost())


@worker_ready.connect
def _check_lost_at_start(sender=None, **kwargs) -> None:
    actions.do_mark_lost()


@worker_process_init.connect
def _compute_identity(**kwargs) -> None:
    """A pool process computes its execution identity at start (cached for the jobs it claims)."""
    try:
        runtime.execution_identity()
    except Exception:  # a job it claims fails with the reason
        logger.warning("this worker process cannot compute its execution identity", exc_info=True)


@worker_ready.connect
def _register_worker(sender=None, **kwargs) -> None:
    """Record this worker and its execution identity, and keep its heartbeat fresh until it shuts down."""
    worker_id = celery_worker_id(getattr(sender, "hostname", None))
    try:
        identity = runtime.execution_identity()
        actions.do_register_worker(worker_id, identity)
    except Exception:
        logger.warning("worker %s cannot register its execution identity", worker_id, exc_info=True)
        return
    blas = identity.get("blas") or {}
    logger.info("worker %s: backend %s, BLAS %s %s (%s threads), float32 products on %s, kiln %s, code %s",
                worker_id, identity.get("backend"), blas.get("library"), blas.get("version"), blas.get("threads"),
                blas.get("float32_gemm", "openblas"),
                identity.get("kiln"), ((identity.get("code") or {}).get("sha256") or "")[:12])
    threading.Thread(target=_beat, args=(worker_id,), name="kiln-worker-heartbeat", daemon=True).start()


def _beat(worker_id: str) -> None:
    from django.conf import settings
    from django.db import connection

    try:
        while not _STOPPED.wait(settings.KILN_HEARTBEAT_SECONDS):
            try:
                actions.do_worker_heartbeat(worker_id)
            except Exception:
                logger.warning("worker %s heartbeat failed", worker_id, exc_info=True)
                connection.close()  # the next beat reconnects
        actions.do_worker_stopped(worker_id)
    except Exception:
        logger.warning("worker %s could not record that it stopped", worker_id, exc_info=True)
    finally:
        connection.close()


@worker_shutting_down.connect
def _cancel_this_workers_jobs(sender=None, sig=None, how=None, exitcode=None, **kwargs) -> None:
    """A warm shutdown (SIGTERM, or Ctrl-C once) cancels this worker's runs, so they publish a
    checkpoint at the next safe boundary and end cancelled while Celery waits for the task.

    This runs inside a signal handler, on the thread that may be running the task itself (the solo
    pool) and in the middle of its database work: so the stop flag is set for an in-process run, and
    the cancellation is written from a thread of its own, with its own connection."""
    _STOPPED.set()
    if how != "Warm" or not sender:  # sender: this worker's hostname, e.g. celery@host
        return
    _SHUTDOWN.set()
    prefix = celery_worker_id(sender).rsplit(":", 1)[0] + ":"
    threading.Thread(target=_cancel_jobs_of, args=(prefix,), name="kiln-shutdown-cancel", daemon=True).start()


def _cancel_jobs_of(worker_prefix: str) -> None:
    from django.db import connection

    from kiln_web.jobs.models import RUNNING_STATUSES, TrainingJob

    try:
        for job_id in TrainingJob.objects.filter(status__in=RUNNING_STATUSES, worker_id__startswith=worker_prefix
                                                 ).values_list("pk", flat=True):
            try:
                actions.do_cancel_job(job_id, reason="the Celery worker is shutting down")
            except Exception:
                pass  # it ended meanwhile
    finally:
        connection.close()
