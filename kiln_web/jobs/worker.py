"""The embedded worker: polls the database for queued jobs and runs them with the task's own code.

`kiln up` runs one in a thread when REDIS_URL is unset; `kiln worker` runs one alone. Any
number may poll the same database: the conditional claim gives each job to exactly one.
Stopping cancels the running job cooperatively (it publishes a checkpoint at its next safe
boundary and ends cancelled) and waits for it.

At start a worker computes its execution identity (trainer.runs.execution, through
kiln_web.jobs.runtime) and registers it (WorkerRecord), then beats with its housekeeping; the jobs
it claims carry that identity and a resume whose checkpoint holds another is refused at dequeue.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid

from django.conf import settings
from django.db import close_old_connections, connection

from kiln_web.core import dispatch
from kiln_web.jobs import actions, runtime
from kiln_web.jobs.execution import execute_training_job
from kiln_web.jobs.models import JobStatus, TrainingJob

logger = logging.getLogger("kiln.jobs")


class EmbeddedWorker:
    def __init__(self, poll_seconds: float | None = None, housekeeping_seconds: float | None = None):
        self.worker_id = f"embedded:{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
        self.poll_seconds = settings.KILN_WORKER_POLL_SECONDS if poll_seconds is None else poll_seconds
        self.housekeeping_seconds = (max(settings.KILN_LOST_AFTER_SECONDS / 4, 1.0)
                                     if housekeeping_seconds is None else housekeeping_seconds)
        self.current_job = None
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self.identity: dict | None = None  # this process's execution identity, once computed (at start)

    # -- running --

    def compute_identity(self) -> dict:
        """This process's execution identity (computed once per process; RunnerUnavailable when the trainer
        cannot be imported)."""
        if self.identity is None:
            self.identity = runtime.execution_identity()
        return self.identity

    def _register(self) -> None:
        try:
            actions.do_register_worker(self.worker_id, self.compute_identity())
        except Exception:  # the jobs it claims still carry the identity (or fail with why it cannot be had)
            logger.warning("worker %s could not register its execution identity", self.worker_id, exc_info=True)

    def start(self) -> "EmbeddedWorker":
        self._thread = threading.Thread(target=self.run, name="kiln-embedded-worker", daemon=True)
        self._thread.start()
        return self

    def run(self) -> None:
        dispatch.EMBEDDED_WORKERS.register(self._wake)  # a submission in this process wakes it at once
        logger.info("embedded worker %s started", self.worker_id)
        self._register()
        last_housekeeping = None
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                if last_housekeeping is None or now - last_housekeeping >= self.housekeeping_seconds:
                    last_housekeeping = now
                    self._housekeeping()
                close_old_connections()  # a broken or stale connection is replaced, as between requests
                if self.run_once():
                    continue
                self._wake.wait(self.poll_seconds)
                self._wake.clear()
        finally:
            dispatch.EMBEDDED_WORKERS.unregister(self._wake)
            try:
                actions.do_worker_stopped(self.worker_id)
            except Exception:
                logger.warning("worker %s could not record that it stopped", self.worker_id, exc_info=True)
            connection.close()
            logger.info("embedded worker %s stopped", self.worker_id)

    def run_once(self) -> bool:
        """Run the oldest queued job this worker can claim, else the oldest queued evaluation; False when
        there was none."""
        try:
            queued = list(TrainingJob.objects.filter(status=JobStatus.QUEUED).order_by("created_at")
                          .values_list("pk", flat=True)[:20])
        except Exception:
            logger.warning("embedded worker cannot read the job queue", exc_info=True)
            return False
        for job_id in queued:
            if self._stop.is_set():
                return False
            self.current_job = job_id
            try:
                outcome = execute_training_job(job_id, self.worker_id, stop=self._stop)
            except Exception:
                logger.exception("job %s: the worker failed outside the run", job_id)
                outcome = "error"
            finally:
                self.current_job = None
            if outcome != "not_claimed":
                return True
        return self._run_queued_evaluation()

    def _run_queued_evaluation(self) -> bool:
        """Evaluations (kiln_web.evals) run here too, after the training jobs, with the Celery task's code."""
        from kiln_web.evals.execution import run_next_queued

        if self._stop.is_set():
            return False
        try:
            return run_next_queued(self.worker_id)
        except Exception:
            logger.exception("the worker failed outside an evaluation")
            return False

    def _housekeeping(self) -> None:
        try:
            if not actions.do_worker_heartbeat(self.worker_id):
                self._register()  # its row was lost (a database restored from before it started)
        except Exception:
            logger.warning("worker %s heartbeat failed", self.worker_id, exc_info=True)
        try:
            actions.do_mark_lost()
        except Exception:
            logger.warning("the lost-job check failed", exc_info=True)

    # -- stopping --

    def stop(self, timeout: float | None = None) -> bool:
        """Stop polling; the running job sees the stop at its next step boundary, becomes cancelling,
        publishes a checkpoint and ends cancelled. Waits for that; True when the worker thread has ended."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
            return not self._thread.is_alive()
        return True

    @property
    def running_job(self):
        return self.current_job

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)


class BrokerWatch:
    """Tells when the broker (Redis) has restarted, or answers again after not answering, since the last
    look: its queue may then have lost messages, or never got them."""

    def __init__(self, url: str):
        self.url = url
        self.run_id = None  # Redis's own id of its current process; None: not known (never seen, or unreachable)

    def came_back(self) -> bool:
        import redis

        try:
            client = redis.Redis.from_url(self.url, socket_timeout=2, socket_connect_timeout=2)
            try:
                run_id = client.info("server")["run_id"]
            finally:
                client.close()
        except (redis.RedisError, OSError, KeyError):
            self.run_id = None
            return False
        came_back, self.run_id = run_id != self.run_id, run_id
        return came_back


class Housekeeper:
    """The lost-job check alone, for `kiln up` when Celery workers run the jobs (no beat needed); with a
    broker, also sends queued jobs again whenever the broker may have lost them (BrokerWatch)."""

    running_job = None

    def __init__(self, interval: float | None = None):
        self.interval = max(settings.KILN_LOST_AFTER_SECONDS / 4, 1.0) if interval is None else interval
        self.broker = None if settings.KILN_EMBEDDED_WORKER else BrokerWatch(settings.CELERY_BROKER_URL)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kiln-housekeeper", daemon=True)

    def start(self) -> "Housekeeper":
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            while True:
                try:
                    close_old_connections()  # a connection broken by a database restart is replaced
                    actions.do_mark_lost()
                    if self.broker is not None and self.broker.came_back():
                        actions.do_redispatch_queued()
                except Exception:
                    logger.warning("the lost-job check failed", exc_info=True)
                    if self.broker is not None:
                        self.broker.run_id = None  # look again, and send again, next time
                if self._stop.wait(self.interval):
                    return
        finally:
            connection.close()

    def stop(self, timeout: float | None = None) -> bool:
        self._stop.set()
        self._thread.join(timeout)
        return not self._thread.is_alive()
