"""Job events for browsers: sent to the channel layer only after the database commit.

Group names come from group_name() and nowhere else. Consumers (the dashboard) join
`group_name("job", job_id)` for one job or `group_name("user", user_id)` for a person's jobs;
the message `type` is one of the four below, which the dashboard consumers relay unchanged.
"""

import json
import logging
from functools import partial

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.core.serializers.json import DjangoJSONEncoder
from django.db import transaction

from kiln_web.core import fastpath

logger = logging.getLogger("kiln.jobs")

JOB_STATUS = "job.status"
JOB_STEP = "job.step"
JOB_CHECKPOINT = "job.checkpoint"
JOB_EVENT = "job.event"


def group_name(scope: str, key) -> str:
    """kiln.job.<uuid> or kiln.user.<id>: letters, digits, '.', '-' only, as channel layers require."""
    return f"kiln.{scope}.{key}"


def job_groups(job_id, owner_id) -> list[str]:
    return [group_name("job", job_id), group_name("user", owner_id)]


def publish_after_commit(job_id, owner_id, event_type: str, payload: dict) -> None:
    """Queue one message for the job's groups; it is sent when the current transaction commits."""
    message = json.loads(json.dumps({"type": event_type, "job_id": str(job_id), **payload}, cls=DjangoJSONEncoder))
    transaction.on_commit(partial(_send, job_groups(job_id, owner_id), message))


def _send(groups: list[str], message: dict) -> None:
    if message["type"] == JOB_STATUS:  # before any browser can hear of it, no status poll shows the old state
        fastpath.note_job_changed(message["job_id"])
    layer = get_channel_layer()
    if layer is None:
        return
    for group in groups:
        try:
            async_to_sync(layer.group_send)(group, message)
        except Exception:  # a dashboard update must never fail a run or a request
            logger.warning("could not send %s to %s", message["type"], group, exc_info=True)
