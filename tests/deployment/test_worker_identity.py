"""A heterogeneous worker pool: two Celery worker processes on one queue and one database, started with
different BLAS thread counts (OPENBLAS_NUM_THREADS=2 and 1), so their execution identities differ. A
checkpoint made on worker A records A's identity; worker B refuses to resume it (the job ends failed,
`execution_drift`, with the field-by-field table naming execution.blas.threads); the same resume on a
worker with A's identity is admitted and continues to the end. Only one worker runs at a time, so which
worker dequeues is never a race."""

import os
import signal
import sys

import pytest

from controlplane.services import TERMINAL, Process, Stack, sft_request
from trainer.runs import checkpoint_dir, sft

pytestmark = pytest.mark.slow

REDIS_URL = os.environ.get("KILN_TEST_REDIS_URL")


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """`kiln up` (web only: REDIS_URL is set, so no embedded worker) on SQLite; workers start per test."""
    if REDIS_URL is None:
        pytest.skip("KILN_TEST_REDIS_URL is unset (./dev test sets it when Redis answers)")
    stack = Stack(tmp_path_factory.mktemp("kiln-identity"), redis_url=None, REDIS_URL=REDIS_URL)
    try:
        yield stack
    finally:
        stack.stop()


def start_worker(stack: Stack, name: str, threads: int) -> Process:
    env = stack.env | {"OPENBLAS_NUM_THREADS": str(threads)}
    worker = Process([sys.executable, "-m", "celery", "-A", "kiln_web", "worker", "-Q", env["KILN_TRAINING_QUEUE"],
                      "--pool", "solo", "-l", "info", "-n", f"{name}-{stack.port}@%h"], env)
    worker.wait_for("ready.", 300)
    return worker


def stop_worker(worker: Process) -> None:
    worker.stop(signal.SIGTERM)
    assert worker.popen.returncode is not None


def test_a_checkpoint_resumes_only_on_a_worker_of_its_identity(stack):
    adapter = "identity-bot"
    request = sft_request(adapter, epochs=5)  # 20 steps, a checkpoint every 5
    alpha = start_worker(stack, "alpha", threads=2)
    try:
        stack.hold(adapter, 10)
        job = stack.submit(request)
        stack.wait_held(adapter, job["id"])
        stack.client.cancel(job["id"])
        first = stack.wait(job["id"], lambda j: j["status"] in TERMINAL)  # the cancel releases the hold
        stack.release(adapter)
        assert first["status"] == "cancelled", first["error"]
        execution = first["identities"]["execution"]
        assert execution["blas"]["threads"] == 2 and execution["kiln"] not in ("0", None)
        basename = first["latest_checkpoint"]["resume_checkpoint"]
        manifest = checkpoint_dir.load_checkpoint(stack.home / "adapters" / basename, full=False,
                                                  allowed_manifest_fields=sft.MANIFEST_FIELDS).manifest
        assert manifest["execution"] == execution  # the worker's identity, not the web's
    finally:
        stop_worker(alpha)

    resume = {**request, "config": {**request["config"], "resume_checkpoint": basename}}
    beta = start_worker(stack, "beta", threads=1)
    try:
        refused = stack.wait(stack.submit(resume)["id"], lambda j: j["status"] in TERMINAL)
    finally:
        stop_worker(beta)
    assert refused["status"] == "failed" and refused["error"]["code"] == "execution_drift", refused["error"]
    differences = refused["error"]["details"]["differences"]
    assert {"field": "execution.blas.threads", "checkpoint": 2, "request": 1} in differences, differences
    assert {d["field"] for d in differences} <= {"execution.blas.threads"}, differences
    assert refused["identities"]["execution"]["blas"]["threads"] == 1
    assert refused["worker_id"].startswith("celery:beta-")

    alpha_again = start_worker(stack, "alpha2", threads=2)
    try:
        resumed = stack.wait(stack.submit(resume)["id"], lambda j: j["status"] in TERMINAL)
    finally:
        stop_worker(alpha_again)
    assert resumed["status"] == "succeeded", resumed["error"]
    assert resumed["progress"]["committed_step"] == 20 and resumed["resume_from"] == basename
