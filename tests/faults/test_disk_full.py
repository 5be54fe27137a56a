"""The adapter registry's filesystem fills up in the middle of a checkpoint publication: a tmpfs whose free
space is set to two and a half checkpoints, so that the third publication runs out of space part-way."""

import pytest

from controlplane.services import TERMINAL
from trainer.runs import checkpoint_dir

from .conftest import adapter, request
from .harness import assert_truthful, check_registry, final_bytes, finish_by_resuming

pytestmark = pytest.mark.slow

PAGE = 4096


def footprint(path) -> int:
    """Bytes a checkpoint directory takes on a tmpfs (its files, page by page)."""
    return sum(-(-item.stat().st_size // PAGE) * PAGE for item in path.rglob("*") if item.is_file())


def test_disk_fills_up_during_a_checkpoint_publication(stack, services, reference):
    volume = services["volume"]
    if volume is None:
        pytest.skip(f"no size-limited filesystem for the registry: {services['volume_missing']}")
    one = max(footprint(path) for path in checkpoint_dir.list_checkpoints(stack.registry))
    body = request(adapter())
    volume.fill(leave=int(2.5 * one))
    job = stack.submit(body)
    job = stack.wait(job["id"], lambda j: j["status"] in TERMINAL)
    assert_truthful(stack, job)
    assert job["status"] == "failed" and job["error"]["code"] == "disk_full", job["error"]
    assert "No space left on device" in job["error"]["message"]
    assert job["latest_checkpoint"]["committed_step"] == 10  # the two that fitted
    assert checkpoint_dir.list_staging_orphans(stack.registry, body["config"]["output_name"]) == []
    check_registry(stack.registry)
    volume.unfill()
    assert final_bytes(stack, finish_by_resuming(stack, job, body)) == reference
