"""WebSocket consumers: authenticate, join the job groups a person may see, relay; nothing else.

Messages come from kiln_web.jobs.events after the database commit; the four job event types
(RELAYED) are sent on unchanged by `dispatch` itself. Group names come from
events.group_name. An anonymous socket, or one for a job the person may not see, is refused.
An open socket is judged again when its person's account changes (events.ACCOUNT_CHANGED: deactivated,
deleted, a changed password, no longer or newly staff) or its session signs out, and closes when it would be
refused now (4401 signed out, 4404 a job they may no longer see) or let into other groups (4409: the page
reconnects and is judged afresh).
"""

from __future__ import annotations

from importlib import import_module

from channels.auth import get_user
from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer
from django.conf import settings
from django.contrib.auth import get_user_model

from kiln_web.dashboard.readers import visible_jobs
from kiln_web.jobs import events

RELAYED = frozenset({events.JOB_STATUS, events.JOB_STEP, events.JOB_CHECKPOINT, events.JOB_EVENT})
UNAUTHENTICATED = 4401  # close codes a page can tell apart from a network failure
NOT_FOUND = 4404
RECONNECT = 4409  # still signed in, but what the person may hear changed (staff no more, or newly): reconnect


class RelayConsumer(AsyncJsonWebsocketConsumer):
    """Joins `group_names(user)` (None refuses the socket) and relays the job events."""

    joined: list[str] = []
    user_id = None  # whom the socket was accepted for, and whether they were staff then
    was_staff = False

    async def group_names(self, user) -> list[str] | None:
        """The groups this user may join here; the base joins none and refuses the socket."""
        return None

    async def connect(self) -> None:
        user = self.scope.get("user")
        if user is None or not user.is_authenticated:
            await self.close(code=UNAUTHENTICATED)
            return
        names = await self.group_names(user)
        if names is None:
            await self.close(code=NOT_FOUND)
            return
        self.user_id, self.was_staff = user.pk, user.is_staff
        self.joined = [*names, events.group_name("account", user.pk)]
        for name in self.joined:
            await self.channel_layer.group_add(name, self.channel_name)
        await self.accept()

    async def disconnect(self, code) -> None:
        for name in self.joined:
            await self.channel_layer.group_discard(name, self.channel_name)

    async def dispatch(self, message):
        """Relayed events go straight to the socket. Channels' own dispatch first closes stale database
        connections in a worker thread, for every message: a thread hop per event and per open
        dashboard, for handlers that never touch the database. Connect and disconnect keep it."""
        if message["type"] in RELAYED:
            await self.send_json(message)
        else:
            await super().dispatch(message)

    async def account_changed(self, message) -> None:
        """events.ACCOUNT_CHANGED: close when this socket's session signed out, or when its person would not be let
        in (or not into the same groups) now."""
        session = self.scope.get("session")
        key = getattr(session, "session_key", None)
        if message.get("session") is not None:  # a sign-out: only that session's sockets are affected
            if key is not None and message["session"] == events.session_digest(key):
                await self.close(code=UNAUTHENTICATED)
            return
        code = await self._refusal_now(session, key)
        if code is not None:
            await self.close(code=code)

    async def _refusal_now(self, session, key) -> int | None:
        """The close code this socket would be refused with now (RECONNECT: it would be let into other groups),
        or None."""
        if session is None or key is None:
            return UNAUTHENTICATED
        stored = import_module(settings.SESSION_ENGINE).SessionStore(key)  # as stored now, not as connected
        user = await get_user({"session": stored})
        if not user.is_authenticated or user.pk != self.user_id:
            return UNAUTHENTICATED
        if await self.group_names(user) is None:
            return NOT_FOUND
        return RECONNECT if user.is_staff != self.was_staff else None

    async def receive(self, text_data=None, bytes_data=None, **kwargs) -> None:
        pass  # the page only listens; it asks the HTTP views for anything else. Any frame (JSON or not) is ignored


class NoRoute(RelayConsumer):
    """A socket path no route has (a job id that is not a UUID, say): refused as not found, like someone else's
    job, where the router would raise."""


class JobListConsumer(RelayConsumer):
    """The jobs list: the person's own jobs; staff hear every user's."""

    @database_sync_to_async
    def group_names(self, user) -> list[str]:
        if user.is_staff:
            # every user's group, as the channel layer has no all-jobs group; someone who signs up
            # later is heard after the next reconnect
            owners = get_user_model().objects.values_list("pk", flat=True)
            return [events.group_name("user", owner) for owner in owners]
        return [events.group_name("user", user.pk)]


class JobConsumer(RelayConsumer):
    """One job's page: its group, when the person may see the job."""

    @database_sync_to_async
    def group_names(self, user) -> list[str] | None:
        job_id = self.scope["url_route"]["kwargs"]["job_id"]
        if not visible_jobs(user).filter(pk=job_id).exists():
            return None
        return [events.group_name("job", job_id)]
