"""Job status polling answered from memory: `GET /v1/train/jobs/{id}` with a bearer token.

Scripts, `kiln train ... --follow` and dashboards poll one job's status about once a second
each. Through Django every poll costs a thread, a database connection, the token query,
the job queries and a read of the latest checkpoint's directory: several milliseconds of
the web process's one interpreter, so a few hundred pollers saturate it and everything
else (WebSocket events included) waits behind them.

This ASGI wrapper keeps, per web process, the last 200 answer Django gave for each job
(status line, headers and body, byte for byte) and the tokens Django authenticated. A poll
is answered from memory only when

- the token's user may see the job (its owner, or staff: the rule of `kiln_web.jobs.api`), judged by user
  id: an answer Django gave its owner is kept for that user id (a rename, and someone new taking the old
  name, change nothing), one it gave staff for staff only;
- the job's state and the token did not change since: each state change of a job (its
  `job.status` event, kiln_web.jobs.events) and each change to a token or user is announced:
  with REDIS_URL on a Redis channel every web process listens to (while it is not subscribed,
  every poll goes to Django), without Redis in the one process where the worker runs too. A
  change drops what it affects, and an answer Django was building while a change arrived is not
  kept;
- the answer is younger than KILN_STATUS_CACHE_SECONDS (default 1 s) and the token's
  authentication younger than KILN_TOKEN_CACHE_SECONDS (default 10 s). These bound what no
  announcement covers: a running job's progress (committed step, latest checkpoint, heartbeat),
  which changes several times a second and would otherwise send every poll to Django, a
  promotion or evaluation added to the job, and a token revoked by another process when
  there is no Redis.

Anything else goes to Django, which stays the only authority: it authenticates, authorizes
and builds every answer that is replayed. Once an answer is half its allowed age, the next
poll goes to Django for a new one while the others still get the old one; when there is no
usable answer, one poll goes and the rest wait for it. KILN_STATUS_CACHE_SECONDS=0 turns
the fast path off.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import logging
import os
import re
import threading
import time
import weakref
from dataclasses import dataclass

import redis
import redis.asyncio
from django.conf import settings
from django.db import transaction

logger = logging.getLogger("kiln.web")

JOB_PATH = re.compile(r"/v1/train/jobs/([0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12})(/|\Z)")
CHANGES = "kiln:status:changes"  # Redis channel: "job:<id>" or "auth"
REDIS_TIMEOUT_SECONDS = 2.0
RESUBSCRIBE_SECONDS = 1.0
FILL_WAIT_SECONDS = 5.0  # a poll waiting for another's trip through Django gives up after this and goes itself
MAX_ENTRIES = 10_000  # jobs or tokens remembered; beyond this the oldest half is dropped
REPLAYED_HEADERS = {b"content-type", b"content-length", b"x-content-type-options", b"referrer-policy",
                    b"x-frame-options", b"cross-origin-opener-policy", b"vary", b"cache-control"}


@dataclass(frozen=True)
class _Token:
    user_id: int
    is_staff: bool
    auth_generation: int  # token and user changes heard of before Django authenticated it
    expires: float


@dataclass(frozen=True)
class _Answer:
    owner_id: int | None  # the user Django answered, its owner; None: Django answered staff, kept for staff
    headers: list
    body: bytes
    job_generation: int
    refresh_after: float  # from here one poll goes to Django for a new answer while the others get this one
    expires: float  # from here it is never given


@dataclass
class _Poll:
    """A status poll on its way through Django: the changes heard of before Django ran, and whom Django
    authenticated (remember_token, in Django's thread, writes it)."""

    generations: tuple[int, int]  # (job, auth)
    user_id: int | None = None
    is_staff: bool = False


_tokens: dict[str, _Token] = {}
_answers: dict[str, _Answer] = {}
_lock = threading.Lock()  # Django fills from its threads; the event loop reads
_job_generations: dict[str, int] = {}  # changes heard of, per job
_auth_generation = 0  # token and user changes heard of
_observed = contextvars.ContextVar("kiln_status_poll", default=None)  # the _Poll Django is answering
_sync_client = None  # (url, client)
_listeners: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # event loop -> _Listener


def auth_changes_heard() -> int:
    """How many token or user changes this process has heard of (made here, or announced on Redis by another
    web process while the listener runs); a cache of authentications is stale once this has moved."""
    return _auth_generation


def _bounded(table: dict) -> None:
    if len(table) > MAX_ENTRIES:
        for key in list(table)[: len(table) // 2]:
            table.pop(key, None)


# -- what changes tell it (any process) --


def _announce(change: str) -> None:
    global _sync_client
    if settings.REDIS_URL is None:
        return
    try:
        if _sync_client is None or _sync_client[0] != settings.REDIS_URL:
            _sync_client = settings.REDIS_URL, redis.Redis.from_url(
                settings.REDIS_URL, socket_timeout=REDIS_TIMEOUT_SECONDS, socket_connect_timeout=REDIS_TIMEOUT_SECONDS)
        _sync_client[1].publish(CHANGES, change)
    except redis.RedisError as exc:  # never fails a run or a request; the ages still bound what is served
        logger.warning("could not announce %s to the web processes: %s", change, exc)


def _reset_after_fork() -> None:
    global _sync_client
    _sync_client = None
    _listeners.clear()


os.register_at_fork(after_in_child=_reset_after_fork)


def _job_changed_here(job_id: str) -> None:
    with _lock:
        _job_generations[job_id] = _job_generations.get(job_id, 0) + 1
        _answers.pop(job_id, None)
        if len(_job_generations) > MAX_ENTRIES:
            for key in list(_job_generations)[: len(_job_generations) // 2]:
                del _job_generations[key]
                _answers.pop(key, None)  # its answer must not meet generation 0 again


def _auth_changed_here() -> None:
    global _auth_generation
    with _lock:
        _auth_generation += 1
        _tokens.clear()


def forget_job(job_id) -> None:
    _job_changed_here(str(job_id))


def note_job_changed(job_id) -> None:
    """The job changed (after the commit): no web process replays an answer from before."""
    _job_changed_here(str(job_id))
    _announce(f"job:{job_id}")


def note_auth_changed(**_) -> None:
    """A token or user changed: no web process uses an authentication from before. Until the change commits,
    Django (on another connection, here or in another process) still reads the old row, so what it authenticates
    meanwhile is forgotten again, and the change announced, once it commits."""
    _auth_changed_here()
    transaction.on_commit(_auth_committed)


def _auth_committed() -> None:
    _auth_changed_here()
    _announce("auth")


def forget_everything() -> None:
    global _auth_generation
    with _lock:
        _tokens.clear()
        _answers.clear()
        _auth_generation += 1


def remember_token(token_hash: str, user) -> None:
    """Django authenticated this token for `user` (kiln_web.accounts.actions.authenticate_token)."""
    seconds = settings.KILN_TOKEN_CACHE_SECONDS
    if seconds <= 0 or settings.KILN_STATUS_CACHE_SECONDS <= 0:
        return
    poll = _observed.get()
    if poll is None:
        return  # not a status poll: what changed since is not known here, and nothing needs it
    poll.user_id, poll.is_staff = user.pk, bool(user.is_staff)
    with _lock:
        _tokens[token_hash] = _Token(user.pk, poll.is_staff, poll.generations[1], time.monotonic() + seconds)
        _bounded(_tokens)


# -- the web process --


class _Listener:
    """Hears the changes other processes announce, in one event loop; `live` while subscribed."""

    def __init__(self):
        self.live = False
        self.task = asyncio.get_running_loop().create_task(self._run(), name="kiln-status-changes")

    async def _run(self):
        while True:
            client = redis.asyncio.Redis.from_url(settings.REDIS_URL, socket_connect_timeout=REDIS_TIMEOUT_SECONDS)
            try:
                async with client.pubsub() as pubsub:
                    await pubsub.subscribe(CHANGES)
                    async for message in pubsub.listen():
                        if message["type"] == "subscribe":
                            forget_everything()  # what changed before the subscription is unknown
                            self.live = True
                        elif message["type"] == "message":
                            change = message["data"].decode()
                            if change == "auth":
                                _auth_changed_here()
                            elif change.startswith("job:"):
                                _job_changed_here(change[4:])
            except (redis.RedisError, OSError) as exc:
                if self.live:
                    logger.warning("job-status fast path off until Redis answers again: %s", exc)
            finally:
                self.live = False
                await client.aclose()
            await asyncio.sleep(RESUBSCRIBE_SECONDS)


def _generations(job_id: str) -> tuple[int, int] | None:
    """(job, auth) changes heard of; None while changes could go unheard (then Django answers)."""
    if settings.REDIS_URL is not None:
        loop = asyncio.get_running_loop()
        listener = _listeners.get(loop)
        if listener is None:
            listener = _listeners[loop] = _Listener()
        if not listener.live:
            return None
    return _job_generations.get(job_id, 0), _auth_generation


def _bearer_hash(scope) -> str | None:
    from kiln_web.accounts.models import TOKEN_PREFIX, hash_token

    values = [value for name, value in scope.get("headers") or () if name == b"authorization"]
    if len(values) != 1:
        return None  # none, or several that Django would join into one it refuses
    scheme, _, token = values[0].decode("latin-1").partition(" ")  # as django-ninja's HttpBearer splits it
    if scheme.lower() != "bearer" or not token.startswith(TOKEN_PREFIX):
        return None
    return hash_token(token)


def _lookup(token_hash: str, job_id: str, generations) -> tuple[_Answer | None, bool]:
    """(the answer this token may be given, whether it should be refreshed), or (None, True)."""
    now = time.monotonic()
    who = _tokens.get(token_hash)
    answer = _answers.get(job_id)
    if (generations is None or who is None or answer is None or who.expires <= now or answer.expires <= now
            or (answer.job_generation, who.auth_generation) != generations):
        return None, True
    if not (who.is_staff or (answer.owner_id is not None and who.user_id == answer.owner_id)):
        return None, True  # Django answers: 404, as for a job that does not exist
    return answer, now >= answer.refresh_after


def _remember_answer(job_id: str, poll: _Poll, status: int, headers: list, body: bytes) -> None:
    if status != 200 or poll.user_id is None or any(name.lower() == b"set-cookie" for name, _ in headers):
        return
    try:
        if json.loads(body)["id"] != job_id:
            return
    except (ValueError, KeyError, TypeError):
        return
    generations = poll.generations
    kept = [(name, value) for name, value in headers if name.lower() in REPLAYED_HEADERS]
    now, seconds = time.monotonic(), settings.KILN_STATUS_CACHE_SECONDS
    with _lock:
        if (_job_generations.get(job_id, 0), _auth_generation) != generations:
            return  # something changed (or went unheard) while Django was building this answer
        # a 200 went to the job's owner or to staff (kiln_web.jobs.api): an owner's answer is for that user id
        owner_id = None if poll.is_staff else poll.user_id
        _answers[job_id] = _Answer(owner_id, kept, body, generations[0], now + seconds / 2, now + seconds)
        _bounded(_answers)


class JobStatusFastPath:
    """ASGI wrapper: current, authorized job-status polls from memory; everything else to `app`."""

    def __init__(self, app):
        self.app = app
        self._filling: dict[str, asyncio.Event] = {}

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or settings.KILN_STATUS_CACHE_SECONDS <= 0:
            return await self.app(scope, receive, send)
        match = JOB_PATH.match(scope.get("path", ""))
        if match is None:
            return await self.app(scope, receive, send)
        job_id = match.group(1)
        if scope.get("method") not in ("GET", "HEAD"):  # cancel, resume and the like: the next poll asks Django
            try:
                return await self.app(scope, receive, send)
            finally:
                forget_job(job_id)
        token_hash = _bearer_hash(scope)
        if match.group(2) or scope.get("method") != "GET" or scope.get("query_string") or token_hash is None:
            return await self.app(scope, receive, send)
        generations = _generations(job_id)
        answer, stale = _lookup(token_hash, job_id, generations)
        if answer is None and job_id in self._filling and generations is not None:
            try:
                await asyncio.wait_for(self._filling[job_id].wait(), FILL_WAIT_SECONDS)
            except TimeoutError:
                pass
            answer, stale = _lookup(token_hash, job_id, generations)
        if answer is not None and (not stale or job_id in self._filling):
            await send({"type": "http.response.start", "status": 200, "headers": answer.headers})
            await send({"type": "http.response.body", "body": answer.body})
            return
        await self._through_django(job_id, generations, scope, receive, send)

    async def _through_django(self, job_id: str, generations, scope, receive, send):
        filling = job_id not in self._filling and generations is not None
        if filling:
            self._filling[job_id] = asyncio.Event()
        start, chunks = {}, []
        poll = None if generations is None else _Poll(generations)

        async def keep(message):
            if message["type"] == "http.response.start":
                start.update(message)
            elif message["type"] == "http.response.body":
                chunks.append(message.get("body", b""))
                if not message.get("more_body", False) and start and poll is not None:
                    _remember_answer(job_id, poll, start["status"], list(start.get("headers") or ()),
                                     b"".join(chunks))
            await send(message)

        token = _observed.set(poll)  # Django's threads inherit it: remember_token records whom it authenticated
        try:
            await self.app(scope, receive, keep)
        finally:
            _observed.reset(token)
            if filling:
                self._filling.pop(job_id).set()
