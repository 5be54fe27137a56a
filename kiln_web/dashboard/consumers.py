"""WebSocket consumers: authenticate, join the job groups a person may see, relay; nothing else.

Messages come from kiln_web.jobs.events after the database commit; the four job event types
(RELAYED) are sent on unchanged by `dispatch` itself. Group names come from
events.group_name. An anonymous socket, or one for a job the person may not see, is refused.
"""

from __future__ import annotations

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer
from django.contrib.auth import get_user_model

from kiln_web.dashboard.readers import visible_jobs
from kiln_web.jobs import events

RELAYED = frozenset({events.JOB_STATUS, events.JOB_STEP, events.JOB_CHECKPOINT, events.JOB_EVENT})
UNAUTHENTICATED = 4401  # close codes a page can tell apart from a network failure
NOT_FOUND = 4404


class RelayConsumer(AsyncJsonWebsocketConsumer):
    """Joins `group_names(user)` (None refuses the socket) and relays the job events."""

    joined: list[str] = []

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
        self.joined = names
        for name in names:
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
