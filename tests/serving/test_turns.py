"""TurnLock: one request computes at a time, requests hand over token by token, first come first served."""

import threading
import time

from trainer.serving import TurnLock


def test_requests_alternate_token_by_token_and_never_overlap():
    """a holds the turn until b is seen queued (an observed state, not a sleep), then they alternate."""
    turns, log, inside = TurnLock(), [], []
    a_holds = threading.Event()

    def request(name: str, steps: int, holding: threading.Event | None = None):
        with turns.turn() as pass_on:
            if holding is not None:
                holding.set()
                deadline = time.monotonic() + 60
                while turns.waiting < 1:  # b has asked for a turn
                    assert time.monotonic() < deadline, "b never queued"
                    time.sleep(0.001)
            for _ in range(steps):
                inside.append(name)
                assert len(inside) == 1, "two requests computed at once"
                log.append(name)
                inside.pop()
                pass_on()

    first = threading.Thread(target=request, args=("a", 5, a_holds))
    first.start()
    assert a_holds.wait(60)
    second = threading.Thread(target=request, args=("b", 5))
    second.start()
    for thread in (first, second):
        thread.join(60)
    assert log == ["a", "b"] * 5  # one token each, in turn, first come first served


def test_alone_a_request_keeps_its_turn_and_an_error_releases_it():
    turns = TurnLock()
    try:
        with turns.turn() as pass_on:
            pass_on()  # nobody waits: returns at once
            raise RuntimeError("the client went away")
    except RuntimeError:
        pass
    done = threading.Event()
    thread = threading.Thread(target=lambda: (turns.turn().__enter__(), done.set()))
    thread.start()
    assert done.wait(120)
