"""The Celery worker is SIGKILLed while a run is in progress, aimed at the middle of a checkpoint publication."""

import signal
import time

import pytest

from controlplane.services import TERMINAL
from trainer.runs import checkpoint_dir
from trainer.runs.sft import MANIFEST_FIELDS

from .conftest import adapter, request
from .harness import assert_truthful, check_registry, final_bytes, finish_by_resuming

pytestmark = pytest.mark.slow


def kill_during_publication(stack, adapter_name: str, timeout: float) -> bool:
    """SIGKILL the worker as soon as a staging directory of ADAPTER_NAME exists (True), else after TIMEOUT."""
    deadline = time.monotonic() + timeout
    caught = False
    while time.monotonic() < deadline and not caught:
        caught = bool(checkpoint_dir.list_staging_orphans(stack.registry, adapter_name))
    stack.worker.popen.send_signal(signal.SIGKILL)
    stack.worker.popen.wait(10)
    return caught


def test_worker_killed_during_a_run(stack, reference):
    body = request(adapter())
    name = body["config"]["output_name"]
    job = stack.submit(body)
    stack.wait(job["id"], lambda j: j["progress"]["committed_step"] >= 10)
    caught = kill_during_publication(stack, name, timeout=3.0)
    job = stack.wait(job["id"], lambda j: j["status"] in TERMINAL, timeout=30)
    assert job["status"] == "lost" and job["error"]["code"] == "worker_lost", job
    assert job["latest_checkpoint"]["resume_checkpoint"] in job["error"]["message"]
    assert_truthful(stack, job)
    counts = check_registry(stack.registry)  # a half-written staging directory, if caught, is refused
    if caught:
        orphans = checkpoint_dir.list_staging_orphans(stack.registry, name)
        assert counts["orphans"] >= len(orphans) >= 1
        for orphan in orphans:  # its canonical name is absent, or a complete checkpoint
            canonical = stack.registry / orphan.name.split(".staging-")[0][1:]
            if canonical.exists():
                checkpoint_dir.load_checkpoint(canonical, full=True, allowed_manifest_fields=MANIFEST_FIELDS)
    stack.start_worker()
    assert final_bytes(stack, finish_by_resuming(stack, job, body)) == reference
