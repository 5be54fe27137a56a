"""Hand committed work to whoever runs it: Celery by task name when a broker is configured, else this
process's embedded workers, woken at once. The floor under every actions module: it imports no task, worker
or action, so enqueuing never needs an import upward."""

from __future__ import annotations

import os
import threading

from django.conf import settings

TRAINING_TASK = "kiln.run_training_job"  # kiln_web.jobs.tasks.run_training_job
EVALUATION_TASK = "kiln.run_evaluation"  # kiln_web.evals.tasks.run_evaluation


class WakeSignals:
    """The wake events of the embedded workers running in this process."""

    def __init__(self):
        self._lock = threading.Lock()
        self._events: list[threading.Event] = []

    def register(self, event: threading.Event) -> None:
        with self._lock:
            self._events.append(event)

    def unregister(self, event: threading.Event) -> None:
        with self._lock:
            self._events.remove(event)

    def wake(self) -> None:
        with self._lock:
            for event in self._events:
                event.set()


EMBEDDED_WORKERS = WakeSignals()


def send(task_name: str, object_id) -> None:
    """Enqueue TASK_NAME for OBJECT_ID on Celery (routed to KILN_TRAINING_QUEUE by CELERY_TASK_ROUTES; raises
    whatever the broker raises), or wake the embedded workers when there is no broker."""
    if settings.KILN_EMBEDDED_WORKER:
        EMBEDDED_WORKERS.wake()
        return
    from kiln_web.celery import app  # the Celery app configures itself from settings on first import

    app.send_task(task_name, args=[str(object_id)])


def celery_worker_id(hostname: str | None) -> str:
    """The worker id a Celery worker process records on the rows it claims."""
    return f"celery:{hostname or 'unknown'}:{os.getpid()}"
