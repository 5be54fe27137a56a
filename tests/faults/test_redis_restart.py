"""Redis (the Celery broker and the channel layer) crashes and comes back while a run is in progress, with a
second job waiting in its queue (a Redis without persistence forgets it) and a third submitted while it is
down (never sent). The run goes on; `kiln up` notices the broker came back and sends the queued jobs again."""

import pytest

from controlplane.services import TERMINAL, sft_request

from .conftest import adapter, request
from .harness import assert_truthful, check_registry, final_bytes, finish_by_resuming

pytestmark = pytest.mark.slow


def test_redis_restarted_during_a_run(stack, services, reference):
    body = request(adapter())
    stack.hold(body["config"]["output_name"], step=10)
    job = stack.submit(body)
    stack.wait_held(body["config"]["output_name"], job["id"])
    waiting = stack.submit(sft_request(adapter(), epochs=2))  # in Redis's queue behind the run
    services["redis"].stop()
    during_outage = stack.submit(sft_request(adapter(), epochs=2))  # the broker cannot be reached
    assert during_outage["status"] == "queued"
    services["redis"].start()
    during = stack.wait(job["id"], lambda j: True)
    stack.release(body["config"]["output_name"])
    job = stack.wait(job["id"], lambda j: j["status"] in TERMINAL)
    assert during["status"] == "running" and during["progress"]["committed_step"] == 10  # held mid-run
    assert job["status"] == "succeeded", job["error"]  # the run never needed the broker
    assert_truthful(stack, job)
    assert final_bytes(stack, finish_by_resuming(stack, job, body)) == reference
    for other in (waiting, during_outage):  # neither stays queued forever
        other = stack.wait(other["id"], lambda j: j["status"] in TERMINAL)
        assert other["status"] == "succeeded", other["error"]
        assert_truthful(stack, other)
    check_registry(stack.registry)
