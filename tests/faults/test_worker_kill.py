"""The Celery worker is SIGKILLed in the middle of a checkpoint publication: the run is held right after the
step-15 checkpoint's files and manifest were written into its staging directory, before the rename."""

import signal

import pytest

from controlplane.services import TERMINAL
from trainer.runs import checkpoint_dir

from .conftest import adapter, request
from .harness import assert_truthful, check_registry, final_bytes, finish_by_resuming

pytestmark = pytest.mark.slow


def test_worker_killed_during_a_checkpoint_publication(stack, reference):
    body = request(adapter())
    name = body["config"]["output_name"]
    stack.hold(name, step=15, stage="manifest")
    job = stack.submit(body)
    assert stack.wait_held(name, job["id"]) == {"step": 15, "stage": "manifest"}
    (orphan,) = checkpoint_dir.list_staging_orphans(stack.registry, name)  # the publication in progress
    stack.worker.popen.send_signal(signal.SIGKILL)
    stack.worker.popen.wait(60)
    job = stack.wait(job["id"], lambda j: j["status"] in TERMINAL)
    assert job["status"] == "lost" and job["error"]["code"] == "worker_lost", job
    assert job["latest_checkpoint"]["committed_step"] == 10  # the last one published before the kill
    assert job["latest_checkpoint"]["resume_checkpoint"] in job["error"]["message"]
    assert_truthful(stack, job)
    counts = check_registry(stack.registry)  # the half-published staging directory is refused by the loader
    assert orphan in checkpoint_dir.list_staging_orphans(stack.registry, name) and counts["orphans"] >= 1
    canonical = stack.registry / orphan.name.split(".staging-")[0][1:]
    assert not canonical.exists()  # never renamed into place
    stack.release(name)
    stack.start_worker()
    assert final_bytes(stack, finish_by_resuming(stack, job, body)) == reference
