"""TurnLock: one request computes at a time, requests hand over token by token, first come first served."""

import threading
import time

from trainer.serving import TurnLock


def test_requests_alternate_token_by_token_and_never_overlap():
    turns, log, inside = TurnLock(), [], []
    started = threading.Barrier(2)

    def request(name: str, steps: int):
        started.wait()
        with turns.turn() as pass_on:
            for _ in range(steps):
                inside.append(name)
                assert len(inside) == 1, "two requests computed at once"
                log.append(name)
                time.sleep(0.002)
                inside.pop()
                pass_on()

    threads = [threading.Thread(target=request, args=(name, 5)) for name in ("a", "b")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert sorted(log) == ["a"] * 5 + ["b"] * 5
    switches = sum(1 for x, y in zip(log, log[1:]) if x != y)
    assert switches >= 8  # they took turns, rather than one finishing before the other began


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
    assert done.wait(5)
