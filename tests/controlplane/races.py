"""Races between real PostgreSQL transactions, run the same way on any machine however busy it is.

Each side runs in a thread of its own with its own connection. A patched hook at the racy point (`Rendezvous.hold`)
keeps each side there until every other side has reached it too, has finished, or is waiting on a database lock
(PostgreSQL's pg_locks, asked again until one of those is observed): a check-then-act race therefore always
interleaves its two checks before either act, and a correct lock makes the other side wait visibly instead.
No sleep decides the outcome; GIVE_UP only ends a test whose sides stopped moving (a bug in the test or a deadlock).
"""

from __future__ import annotations

import threading
import time

from django.db import connection

GIVE_UP = 120.0  # seconds without any side moving on: a failure, never an outcome
POLL = 0.02


class Rendezvous:
    def __init__(self):
        self._cond = threading.Condition()
        self._pids: dict[str, int] = {}
        self._arrived: set[str] = set()
        self._finished: set[str] = set()
        self.errors: dict[str, BaseException] = {}
        self.results: dict = {}

    def _name(self) -> str:
        return threading.current_thread().name

    def hold(self) -> None:
        """At the racy point: wait until every other side has arrived, finished, or waits on a database lock."""
        me = self._name()
        with self._cond:
            if me in self._arrived or me not in self._pids:
                return  # once per side (the first time it passes), and only on the sides of the race
            self._arrived.add(me)
            self._cond.notify_all()
        deadline = time.monotonic() + GIVE_UP
        while True:
            with self._cond:
                pending = [name for name in self._pids if name not in self._arrived | self._finished]
            if not pending or all(self._waiting_on_lock(self._pids[name]) for name in pending):
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"{me}: the other sides {pending} neither arrived nor waited on a lock")
            with self._cond:
                self._cond.wait(POLL)

    def wait_arrived(self, name: str) -> None:
        """For a side that must start its part only once side NAME is held at the racy point."""
        with self._cond:
            if not self._cond.wait_for(lambda: name in self._arrived | self._finished, GIVE_UP):
                raise AssertionError(f"{name} never reached the racy point")

    @staticmethod
    def _waiting_on_lock(pid: int) -> bool:
        with connection.cursor() as cursor:  # pg_locks is read live, never from a per-transaction snapshot
            cursor.execute("SELECT EXISTS (SELECT 1 FROM pg_locks WHERE pid = %s AND NOT granted)", [pid])
            return bool(cursor.fetchone()[0])

    def run(self, **sides) -> None:
        """Run each side (name=callable) in its own thread and connection; results and errors by name."""
        def side(name, call):
            try:
                connection.ensure_connection()
                with self._cond:
                    self._pids[name] = connection.connection.info.backend_pid
                started.wait()
                self.results[name] = call()
            except BaseException as exc:  # noqa: BLE001 (reported to the test)
                self.errors[name] = exc
            finally:
                with self._cond:
                    self._finished.add(name)
                    self._cond.notify_all()
                connection.close()

        started = threading.Event()
        threads = [threading.Thread(target=side, args=(name, call), name=name) for name, call in sides.items()]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + GIVE_UP
        while True:  # every side has its connection (and so its pid) before any starts
            with self._cond:
                if len(self._pids) + len(self._finished) >= len(threads):
                    break
            assert time.monotonic() < deadline, "the sides did not connect"
            time.sleep(POLL)
        started.set()
        for thread in threads:
            thread.join(GIVE_UP * 2)
            assert not thread.is_alive(), f"{thread.name} did not end"
