"""PostgreSQL crashes (an immediate stop: every connection drops at once) and comes back while a run is in
progress: briefly, which the run rides out, and until the worker gave up waiting for it (after
KILN_LOST_AFTER_SECONDS, as the worker prints), which ends the job failed or lost (never `running` for ever) with
its checkpoints intact."""

import pytest

from controlplane.services import TERMINAL

from .conftest import adapter, request
from .harness import assert_truthful, check_registry, final_bytes, finish_by_resuming

pytestmark = pytest.mark.slow


@pytest.fixture
def postgres(services):
    if services["postgres"] is None:
        pytest.skip(f"no throwaway PostgreSQL cluster: {services['postgres_missing']}")
    return services["postgres"]


def test_postgresql_restarted_during_a_run(stack, postgres, reference):
    body = request(adapter())
    stack.hold(body["config"]["output_name"], step=10)
    job = stack.submit(body)
    stack.wait_held(body["config"]["output_name"], job["id"])
    postgres.restart(down_seconds=1.0)
    stack.release(body["config"]["output_name"])
    job = stack.wait(job["id"], lambda j: j["status"] in TERMINAL)
    assert job["status"] == "succeeded", job["error"]  # the worker waited for the database and went on
    assert_truthful(stack, job)
    check_registry(stack.registry)
    assert final_bytes(stack, job) == reference


def test_postgresql_down_longer_than_the_worker_waits(stack, postgres, reference):
    body = request(adapter())
    stack.hold(body["config"]["output_name"], step=10)
    job = stack.submit(body)
    stack.wait_held(body["config"]["output_name"], job["id"])
    printed = len(stack.worker.lines)
    postgres.stop()
    try:  # down until the worker gave up on it, as it printed: however long its attempts took on this machine
        stack.worker.wait_for("; giving up", timeout=300, since=printed)
    finally:
        postgres.start()  # the cluster is every fault test's
    stack.release(body["config"]["output_name"])
    job = stack.wait(job["id"], lambda j: j["status"] in TERMINAL)
    assert job["status"] in ("failed", "lost"), job
    assert job["error"]["code"] in ("database_unavailable", "worker_lost"), job["error"]
    assert_truthful(stack, job)
    check_registry(stack.registry)
    assert final_bytes(stack, finish_by_resuming(stack, job, body)) == reference
