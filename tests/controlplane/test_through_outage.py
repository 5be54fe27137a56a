"""jobs.execution.through_outage on a clock of the test's: a database call is retried while the database cannot be
reached, no attempt starts past KILN_LOST_AFTER_SECONDS, and giving up is printed before the error propagates
(the line tests/faults/test_postgres_restart.py waits for)."""

import logging
import types

import pytest
from django.db import OperationalError

from kiln_web.jobs import execution


class Clock:
    """time for through_outage: sleeping moves it on, nothing waits."""

    def __init__(self):
        self.now, self.slept = 1000.0, []

    def monotonic(self):
        return self.now

    def sleep(self, seconds):
        self.slept.append(seconds)
        self.now += seconds


@pytest.fixture
def clock(monkeypatch, settings):
    settings.KILN_LOST_AFTER_SECONDS = 9.0
    clock = Clock()
    monkeypatch.setattr(execution, "time", types.SimpleNamespace(monotonic=clock.monotonic, sleep=clock.sleep))
    monkeypatch.setattr(execution, "_drop_connection", lambda: None)
    return clock


def test_a_short_outage_is_ridden_out(clock, caplog):
    attempts = []

    def call(value):
        attempts.append(clock.now)
        if len(attempts) < 4:
            raise OperationalError("connection refused")
        return value

    with caplog.at_level(logging.WARNING, logger="kiln.jobs"):
        assert execution.through_outage(call, "done") == "done"
    assert clock.slept == [0.1, 0.2, 0.4]  # doubling from 0.1 s
    assert len(attempts) == 4 and "giving up" not in caplog.text
    assert caplog.text.count("the database cannot be reached") == 3


def give_up(clock, caplog) -> list:
    """The times through_outage called a database that stays down, once it raised."""
    attempts = []

    def call():
        attempts.append(clock.now)
        raise OperationalError("connection refused")

    with caplog.at_level(logging.WARNING, logger="kiln.jobs"), pytest.raises(OperationalError):
        execution.through_outage(call)
    return attempts


def test_an_outage_longer_than_the_window_is_given_up_with_a_line(clock, caplog):
    attempts = give_up(clock, caplog)
    assert clock.slept == [0.1, 0.2, 0.4, 0.8, 1.6, 2.0, 2.0]  # doubling, then every 2 s
    assert len(attempts) == 8 and attempts[-1] - attempts[0] <= 9.0  # no attempt starts past the window
    assert attempts[-1] - attempts[0] + 2.0 > 9.0  # the next would have
    errors = [record for record in caplog.records if record.levelno == logging.ERROR]
    assert len(errors) == 1
    assert errors[0].getMessage().startswith(f"the database could not be reached for {clock.now - 1000.0:.1f} s; "
                                             "giving up (connection refused)")


def test_inside_a_transaction_the_error_propagates_at_once(clock, caplog, monkeypatch):
    monkeypatch.setattr(execution, "connection", types.SimpleNamespace(in_atomic_block=True))
    attempts = give_up(clock, caplog)
    assert len(attempts) == 1 and clock.slept == [] and caplog.records == []
