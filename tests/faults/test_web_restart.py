"""The web server (`kiln up`) is SIGKILLed and started again while a run is in progress: with Celery the run
goes on in its worker; with the embedded worker the run dies with the process and the new one finds it lost."""

import pytest

from controlplane.services import TERMINAL

from .conftest import adapter, request
from .harness import FaultStack, assert_truthful, check_registry, final_bytes, finish_by_resuming

pytestmark = pytest.mark.slow


def test_web_restarted_during_a_celery_run(stack, reference):
    body = request(adapter())
    stack.hold(body["config"]["output_name"], step=10)
    job = stack.submit(body)
    stack.wait_held(body["config"]["output_name"], job["id"])
    stack.restart_web()
    stack.release(body["config"]["output_name"])
    job = stack.wait(job["id"], lambda j: j["status"] in TERMINAL)
    assert job["status"] == "succeeded", job["error"]
    assert_truthful(stack, job)
    check_registry(stack.registry)
    assert final_bytes(stack, job) == reference


def test_web_restarted_during_an_embedded_run(tmp_path, reference):
    embedded = FaultStack(tmp_path, redis_url=None)
    try:
        body = request(adapter())
        embedded.hold(body["config"]["output_name"], step=10)
        job = embedded.submit(body)
        embedded.wait_held(body["config"]["output_name"], job["id"])
        embedded.restart_web()  # SIGKILL: the run in the embedded worker dies with the process
        embedded.release(body["config"]["output_name"])
        job = embedded.wait(job["id"], lambda j: j["status"] in TERMINAL)
        assert job["status"] == "lost" and job["error"]["code"] == "worker_lost", job
        assert_truthful(embedded, job)
        check_registry(embedded.registry)
        assert final_bytes(embedded, finish_by_resuming(embedded, job, body)) == reference
    finally:
        embedded.stop()
