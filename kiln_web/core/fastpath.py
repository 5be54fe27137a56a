"""Job status polling answered from memory: `GET /v1/train/jobs/{id}` with a bearer token.

Scripts, `kiln train ... --follow` and dashboards poll one job's status about once a second
each. Through Django every poll costs a thread, a database connection, the token query,
the job queries and a read of the latest checkpoint's directory: several milliseconds of
the web process's one interpreter, so a few hundred pollers saturate it and everything
else (WebSocket events included) waits behind them.

This ASGI wrapper keeps, per web process, the last 200 answer Django gave for each job
(status line, headers and body, byte for byte) for KILN_STATUS_CACHE_SECONDS (off by default; the load bench uses 1 s),
and the tokens Django authenticated for KILN_TOKEN_CACHE_SECONDS (default 10 s). A poll
is answered from memory only when both are fresh and the token's user may see the job
(its owner, or staff: the rule of `kiln_web.jobs.api`); anything else goes to Django, which
stays the only authority: it authenticates, authorizes and builds every answer that is
replayed. Once an answer is half its allowed age, the next poll goes to Django for a new
one while the others are still given the old one; when there is no answer yet, one poll goes
and the rest wait for it. So once a job is watched, no poll waits behind another's trip
through Django.

So a poll can be up to KILN_STATUS_CACHE_SECONDS older than the database, and a token
revoked (or a user deactivated or demoted) in another process keeps reading job status for
up to KILN_TOKEN_CACHE_SECONDS there; changes made in this process take effect at once
(model signals drop what they affect). That lag is why it is off unless KILN_STATUS_CACHE_SECONDS is set:
a script that waits for a worker to finish and then reads the status once expects the new status.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from dataclasses import dataclass

from django.conf import settings

JOB_PATH = re.compile(r"/v1/train/jobs/([0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12})(/|\Z)")
FILL_WAIT_SECONDS = 5.0  # a poll waiting for another's trip through Django gives up after this and goes itself
MAX_ENTRIES = 10_000  # jobs or tokens remembered; beyond this the oldest half is dropped
REPLAYED_HEADERS = {b"content-type", b"content-length", b"x-content-type-options", b"referrer-policy",
                    b"x-frame-options", b"cross-origin-opener-policy", b"vary", b"cache-control"}


@dataclass(frozen=True)
class _Token:
    username: str
    is_staff: bool
    expires: float


@dataclass(frozen=True)
class _Answer:
    owner: str
    headers: list
    body: bytes
    refresh_after: float  # from here one poll goes to Django for a new answer while the others get this one
    expires: float  # from here it is never given


_tokens: dict[bytes, _Token] = {}
_answers: dict[str, _Answer] = {}
_lock = threading.Lock()  # Django fills from its threads; the event loop reads


def _bounded(table: dict) -> None:
    if len(table) > MAX_ENTRIES:
        for key in list(table)[: len(table) // 2]:
            table.pop(key, None)


def remember_token(token_hash: str, user) -> None:
    """Django authenticated this token for `user` (kiln_web.accounts.actions.authenticate_token)."""
    seconds = settings.KILN_TOKEN_CACHE_SECONDS
    if seconds <= 0 or settings.KILN_STATUS_CACHE_SECONDS <= 0:
        return
    with _lock:
        _tokens[token_hash.encode()] = _Token(user.get_username(), bool(user.is_staff), time.monotonic() + seconds)
        _bounded(_tokens)


def forget_tokens(**_) -> None:
    """A token, user or permission changed here: every cached authentication goes."""
    with _lock:
        _tokens.clear()


def forget_job(job_id) -> None:
    """The job changed here: its next poll goes to Django."""
    with _lock:
        _answers.pop(str(job_id), None)


def forget_everything() -> None:
    with _lock:
        _tokens.clear()
        _answers.clear()


def _bearer_hash(scope) -> str | None:
    from kiln_web.accounts.models import TOKEN_PREFIX, hash_token

    values = [value for name, value in scope.get("headers") or () if name == b"authorization"]
    if len(values) != 1:
        return None  # none, or several that Django would join into one it refuses
    scheme, _, token = values[0].decode("latin-1").partition(" ")  # as django-ninja's HttpBearer splits it
    if scheme.lower() != "bearer" or not token.startswith(TOKEN_PREFIX):
        return None
    return hash_token(token)


def _lookup(token_hash: str, job_id: str) -> tuple[_Answer | None, bool]:
    """(the answer this token may be given, whether it should be refreshed), or (None, True)."""
    now = time.monotonic()
    who = _tokens.get(token_hash.encode())
    answer = _answers.get(job_id)
    if who is None or answer is None or who.expires <= now or answer.expires <= now:
        return None, True
    if not (who.is_staff or who.username == answer.owner):
        return None, True  # Django answers: 404, as for a job that does not exist
    return answer, now >= answer.refresh_after


def _remember_answer(job_id: str, status: int, headers: list, body: bytes) -> None:
    if status != 200 or any(name.lower() == b"set-cookie" for name, _ in headers):
        return
    try:
        document = json.loads(body)
        owner = document["owner"]
        if document["id"] != job_id or not isinstance(owner, str):
            return
    except (ValueError, KeyError, TypeError):
        return
    kept = [(name, value) for name, value in headers if name.lower() in REPLAYED_HEADERS]
    now, seconds = time.monotonic(), settings.KILN_STATUS_CACHE_SECONDS
    with _lock:
        _answers[job_id] = _Answer(owner, kept, body, now + seconds / 2, now + seconds)
        _bounded(_answers)


class JobStatusFastPath:
    """ASGI wrapper: fresh, authorized job-status polls from memory; everything else to `app`."""

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
        answer, stale = _lookup(token_hash, job_id)
        if answer is None and job_id in self._filling:
            try:
                await asyncio.wait_for(self._filling[job_id].wait(), FILL_WAIT_SECONDS)
            except TimeoutError:
                pass
            answer, stale = _lookup(token_hash, job_id)
        if answer is not None and (not stale or job_id in self._filling):
            await send({"type": "http.response.start", "status": 200, "headers": answer.headers})
            await send({"type": "http.response.body", "body": answer.body})
            return
        await self._through_django(job_id, scope, receive, send)

    async def _through_django(self, job_id: str, scope, receive, send):
        filling = job_id not in self._filling
        if filling:
            self._filling[job_id] = asyncio.Event()
        start, chunks = {}, []

        async def keep(message):
            if message["type"] == "http.response.start":
                start.update(message)
            elif message["type"] == "http.response.body":
                chunks.append(message.get("body", b""))
                if not message.get("more_body", False) and start:
                    _remember_answer(job_id, start["status"], list(start.get("headers") or ()), b"".join(chunks))
            await send(message)

        try:
            await self.app(scope, receive, keep)
        finally:
            if filling:
                self._filling.pop(job_id).set()
