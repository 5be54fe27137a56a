"""Bearer-token authentications this process trusts for a few seconds, keyed by the token's SHA-256.

Every /v1/ request authenticates its token (kiln_web.accounts.actions.authenticate_token); without this
each one costs a database query. An authentication is remembered for KILN_AUTH_CACHE_SECONDS (0: never).
Any save or delete of a token or a user in this process forgets every authentication at once, and again when
its transaction commits (kiln_web.accounts.apps connects the signals), and one the database was asked for while
such a change happened is not kept, so a token revoked here is refused on the very next request after the
commit. A change another process announces on Redis ends them too, once this process hears it (the caller
passes its count of those as the epoch: the job-status fast path's listener, kiln_web.core.fastpath, while it
runs). Otherwise other processes
are not heard: a token revoked, or a user deactivated, by another process (`kiln token`, the admin of another
web process) is still accepted here for up to KILN_AUTH_CACHE_SECONDS.
"""

from __future__ import annotations

import copy
import threading
import time
from dataclasses import dataclass

from django.db import transaction

MAX_ENTRIES = 10_000  # tokens remembered; beyond this the expired ones, then the oldest half, are dropped


@dataclass(frozen=True)
class _Entry:
    user: object
    expires: float
    epoch: int  # the caller's count of changes heard from elsewhere when it was put


class TokenCache:
    """token hash -> the user Django authenticated it for, until it expires or any token or user changes."""

    def __init__(self, max_entries: int = MAX_ENTRIES, clock=time.monotonic):
        self.max_entries = max_entries
        self._clock = clock
        self._entries: dict[str, _Entry] = {}
        self._generation = 0  # token and user changes seen
        self._lock = threading.Lock()  # requests run on several threads

    def generation(self) -> int:
        """Read before asking the database; put() keeps the answer only if nothing changed since."""
        return self._generation

    def get(self, token_hash: str, epoch: int = 0):
        """A copy of the remembered user (each request gets its own instance), or None. EPOCH: changes the
        caller heard of from other processes; an entry put under another epoch is not used."""
        with self._lock:
            entry = self._entries.get(token_hash)
            if entry is not None and (entry.expires <= self._clock() or entry.epoch != epoch):
                del self._entries[token_hash]
                entry = None
        return None if entry is None else copy.copy(entry.user)

    def put(self, token_hash: str, user, seconds: float, generation: int, epoch: int = 0) -> None:
        if seconds <= 0:
            return
        with self._lock:
            if generation != self._generation:
                return  # a token or user changed while the database was being asked
            now = self._clock()
            if len(self._entries) >= self.max_entries:
                self._entries = {key: entry for key, entry in self._entries.items() if entry.expires > now}
                if len(self._entries) >= self.max_entries:
                    self._entries = dict(list(self._entries.items())[len(self._entries) // 2:])
            self._entries[token_hash] = _Entry(copy.copy(user), now + seconds, epoch)

    def clear(self) -> None:
        """A token or user changed: forget every authentication."""
        with self._lock:
            self._generation += 1
            self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)


tokens = TokenCache()  # the process's one cache


def note_auth_changed(**_) -> None:
    """Signal receiver for any save or delete of a token or a user (kiln_web.accounts.apps): forget now, and again
    when the change commits, since until then a request on another connection still reads the old row from the
    database and may remember it."""
    tokens.clear()
    transaction.on_commit(tokens.clear)
