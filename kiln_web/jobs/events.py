"""Job events for browsers: sent to the channel layer only after the database commit.

Group names come from group_name() and nowhere else. Consumers (the dashboard) join
`group_name("job", job_id)` for one job or `group_name("user", user_id)` for a person's jobs;
the message `type` is one of the four below, which the dashboard consumers relay unchanged.
Every socket also joins `group_name("account", user_id)`, where ACCOUNT_CHANGED tells it that its
person's account changed or one of their sessions signed out (the socket then judges itself again).
"""

import asyncio
import atexit
import hashlib
import json
import logging
import os
import threading
from functools import partial

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from channels_redis.core import RedisChannelLayer
from django.core.serializers.json import DjangoJSONEncoder
from django.db import transaction

from kiln_web.core import fastpath

logger = logging.getLogger("kiln.jobs")

JOB_STATUS = "job.status"
JOB_STEP = "job.step"
JOB_CHECKPOINT = "job.checkpoint"
JOB_EVENT = "job.event"
ACCOUNT_CHANGED = "account.changed"  # never relayed: the consumer re-authenticates (kiln_web.dashboard.consumers)


def group_name(scope: str, key) -> str:
    """kiln.job.<uuid> or kiln.user.<id>: letters, digits, '.', '-' only, as channel layers require."""
    return f"kiln.{scope}.{key}"


def job_groups(job_id, owner_id) -> list[str]:
    return [group_name("job", job_id), group_name("user", owner_id)]


def publish_after_commit(job_id, owner_id, event_type: str, payload: dict) -> None:
    """Queue one message for the job's groups; it is sent when the current transaction commits."""
    message = json.loads(json.dumps({"type": event_type, "job_id": str(job_id), **payload}, cls=DjangoJSONEncoder))
    transaction.on_commit(partial(_send, job_groups(job_id, owner_id), message))


def session_digest(session_key: str) -> str:
    """What an ACCOUNT_CHANGED message names a session by: the key itself never travels through the layer."""
    return hashlib.sha256(session_key.encode()).hexdigest()


def publish_account_changed(user_id, session_key: str | None = None) -> None:
    """After the commit, tell USER_ID's open sockets that their account changed (SESSION_KEY: that session
    signed out), so a socket its person may no longer have closes at once."""
    message = {"type": ACCOUNT_CHANGED, "session": session_digest(session_key) if session_key else None}
    transaction.on_commit(partial(_send, [group_name("account", user_id)], message))


def note_user_changed(sender, instance, update_fields=None, created=False, **_) -> None:
    """post_save / post_delete of a user. A new user has no socket yet, and a sign-in's own save (last_login only)
    takes nothing away."""
    if created or (update_fields is not None and set(update_fields) <= {"last_login"}):
        return
    publish_account_changed(instance.pk)


def note_signed_out(sender, request, user, **_) -> None:
    """user_logged_out: the session the request carried ends (Django flushes it right after this signal)."""
    if user is not None and request is not None and getattr(request, "session", None) is not None:
        publish_account_changed(user.pk, request.session.session_key)


def _send(groups: list[str], message: dict) -> None:
    if message["type"] == JOB_STATUS:  # before any browser can hear of it, no status poll shows the old state
        fastpath.note_job_changed(message["job_id"])
    layer = get_channel_layer()
    if layer is None:
        return
    if isinstance(layer, RedisChannelLayer):
        _Sender.for_layer(layer).send(groups, message)
        return
    for group in groups:
        try:
            async_to_sync(layer.group_send)(group, message)
        except Exception:  # a dashboard update must never fail a run or a request
            logger.warning("could not send %s to %s", message["type"], group, exc_info=True)


class _Sender:
    """Sends a process's job events to a Redis channel layer from one thread and one event loop, in order.

    `async_to_sync(group_send)` from a worker would start an event loop and open a Redis connection
    for every event (several milliseconds of a training process that runs at low priority); here
    the loop and its connections live as long as the process, and the run only queues the message.
    Messages still queued when the process exits are sent first, for up to FLUSH_SECONDS.
    """

    FLUSH_SECONDS = 5.0
    _instances: dict = {}
    _guard = threading.Lock()

    @classmethod
    def for_layer(cls, layer) -> "_Sender":
        with cls._guard:
            key = (os.getpid(), id(layer))
            sender = cls._instances.get(key)
            if sender is None:
                sender = cls._instances[key] = cls(layer)
            return sender

    def __init__(self, layer):
        self.layer = layer
        self.loop = asyncio.new_event_loop()
        self.pending = 0
        self.idle = threading.Condition()
        self.order = None  # an asyncio.Lock, made in the loop: sends go out in the order they were queued
        threading.Thread(target=self.loop.run_forever, name="kiln-events", daemon=True).start()
        atexit.register(self.flush)

    def send(self, groups: list[str], message: dict) -> None:
        with self.idle:
            self.pending += 1
        asyncio.run_coroutine_threadsafe(self._send(groups, message), self.loop)

    async def _send(self, groups, message) -> None:
        if self.order is None:
            self.order = asyncio.Lock()
        try:
            async with self.order:
                for group in groups:
                    try:
                        await self.layer.group_send(group, message)
                    except Exception:  # a dashboard update must never fail a run or a request
                        logger.warning("could not send %s to %s", message["type"], group, exc_info=True)
        finally:
            with self.idle:
                self.pending -= 1
                self.idle.notify_all()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued message has been sent (or TIMEOUT); True when none is left."""
        with self.idle:
            return self.idle.wait_for(lambda: self.pending == 0, self.FLUSH_SECONDS if timeout is None else timeout)
