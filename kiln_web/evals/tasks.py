"""Celery task: a thin shell around kiln_web.evals.execution, routed to the training workers' queue
(KILN_TRAINING_QUEUE, by CELERY_TASK_ROUTES)."""

from celery import shared_task

from kiln_web.evals.execution import execute_evaluation
from kiln_web.core.dispatch import EVALUATION_TASK, celery_worker_id

# an evaluation longer than this is stopped; the soft limit lets the run record "failed"
SOFT_TIME_LIMIT = 6 * 3600
HARD_TIME_LIMIT = SOFT_TIME_LIMIT + 300


@shared_task(name=EVALUATION_TASK, bind=True, ignore_result=True,
             soft_time_limit=SOFT_TIME_LIMIT, time_limit=HARD_TIME_LIMIT)
def run_evaluation(self, run_id: str) -> str:
    return execute_evaluation(run_id, celery_worker_id(self.request.hostname))
