"""End to end as deployed: `kiln up` (web) and a SEPARATE `celery -A kiln_web worker -Q training` process,
a real Redis broker, a temporary KILN_HOME, the real trainer on kiln-tiny. Cancel-then-resume and
SIGKILL-then-resume, both ending byte-identical to an uninterrupted run; a warm worker shutdown cancels
with a checkpoint. Each fault lands while the run is held at a step (Stack.hold), so it is mid-run however
fast or loaded the machine is."""

import signal

import pytest

from .services import TERMINAL, celery_stack
from .services import sft_request as body

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with celery_stack(tmp_path_factory.mktemp("kiln-e2e-home")) as running:
        yield running


@pytest.fixture(autouse=True)
def settled(stack):
    stack.settle()


@pytest.fixture(scope="module")
def uninterrupted(stack):
    job = stack.submit(body("whole"))
    job = stack.wait(job["id"], lambda j: j["status"] in TERMINAL)
    assert job["status"] == "succeeded", (job["error"], stack.worker.output[-3000:])
    assert job["progress"] == {"committed_step": 100, "total_steps": 100}
    assert job["worker_id"].startswith("celery:kiln-test-")
    return job


def test_cancel_mid_run_then_resume(stack, uninterrupted):
    request = body("cancelled")
    stack.hold("cancelled", step=6)
    job = stack.submit(request)
    assert stack.wait_held("cancelled", job["id"]) == {"step": 6, "stage": None}
    assert stack.client.cancel(job["id"])["status"] in ("cancelling", "cancelled")
    job = stack.wait(job["id"], lambda j: j["status"] in TERMINAL)  # the cancel releases the hold
    stack.release("cancelled")
    assert job["status"] == "cancelled", job["error"]
    checkpoint = job["latest_checkpoint"]
    assert checkpoint["committed_step"] in (6, 7) and checkpoint["complete"] is False
    assert checkpoint["committed_step"] == job["progress"]["committed_step"]  # published at the boundary

    request["config"]["resume_checkpoint"] = checkpoint["resume_checkpoint"]
    resumed = stack.submit(request)
    assert resumed["resume_from"] == checkpoint["resume_checkpoint"]
    resumed = stack.wait(resumed["id"], lambda j: j["status"] in TERMINAL)
    assert resumed["status"] == "succeeded", resumed["error"]
    assert stack.final_bytes(resumed) == stack.final_bytes(uninterrupted)


def test_sigkill_worker_then_lost_then_resume(stack, uninterrupted):
    request = body("killed")
    stack.hold("killed", step=12)
    job = stack.submit(request)
    stack.wait_held("killed", job["id"])
    stack.worker.stop(signal.SIGKILL)
    job = stack.wait(job["id"], lambda j: j["status"] in TERMINAL)
    assert job["status"] == "lost", job
    assert job["error"]["code"] == "worker_lost"
    basename = job["latest_checkpoint"]["resume_checkpoint"]
    assert basename in job["error"]["message"]  # the message names the checkpoint to resume from
    assert job["latest_checkpoint"]["committed_step"] == 10  # the last published checkpoint survived

    stack.release("killed")
    stack.start_worker()
    request["config"]["resume_checkpoint"] = basename
    resumed = stack.submit(request)
    resumed = stack.wait(resumed["id"], lambda j: j["status"] in TERMINAL)
    assert resumed["status"] == "succeeded", resumed["error"]
    assert stack.final_bytes(resumed) == stack.final_bytes(uninterrupted)


def test_warm_shutdown_of_the_worker_cancels_its_run_with_a_checkpoint(stack):
    stack.hold("stopped", step=3)
    job = stack.submit(body("stopped", epochs=250))
    stack.wait_held("stopped", job["id"])
    stack.worker.popen.send_signal(signal.SIGTERM)  # what `docker stop` sends; the stopping worker is not held
    assert stack.worker.popen.wait(300) == 0, stack.worker.output[-3000:]
    job = stack.client.job(job["id"])
    assert job["status"] == "cancelled", (job, stack.worker.output[-3000:])
    assert job["latest_checkpoint"]["committed_step"] == job["progress"]["committed_step"] in (3, 4)
    stack.start_worker()
