"""`kiln checkpoint prune` and do_prune_checkpoints: all but the newest N valid checkpoints go, safely."""

import os

import pytest

from kiln_web.adapters.actions import _confined, do_prune_checkpoints
from kiln_web.adapters.models import CheckpointRecord
from kiln_web.cli import main
from kiln_web.core.http import ActionRefused
from kiln_web.jobs.models import JobStatus, TrainingJob
from kiln_web.jobs.worker import EmbeddedWorker

from .conftest import sft_body

pytestmark = pytest.mark.django_db


def name(adapter: str, step: int) -> str:
    return f"{adapter}-checkpoint-step-{step:08d}.kiln-checkpoint"


@pytest.fixture
def trained(fake_runner, api, adapter_name, settings):
    """A finished run of ADAPTER_NAME with checkpoints at steps 1..6 (the last one complete)."""
    response = api.post("/v1/train/sft", sft_body(adapter_name, records=6, checkpoint_interval=1))
    assert response.status_code == 201 and EmbeddedWorker().run_once()
    assert TrainingJob.objects.get(pk=response.json()["id"]).status == JobStatus.SUCCEEDED
    registry = settings.KILN_ADAPTERS_DIR
    assert all((registry / name(adapter_name, step)).is_dir() for step in range(1, 7))
    return registry


def test_a_dry_run_lists_and_deletes_nothing_then_yes_deletes_with_the_index_rows(trained, adapter_name, capsys):
    assert main(["checkpoint", "prune", "--adapter", adapter_name, "--keep", "2"]) == 0
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert [line.split()[0] for line in lines] == ["keep", "keep", "would", "would", "would", "would"]
    assert name(adapter_name, 6) in lines[0] and "the newest valid checkpoint" in lines[0]
    assert name(adapter_name, 5) in lines[1] and "among the newest 2 valid" in lines[1]
    assert "dry run: 4 checkpoint(s) would be deleted, 2 kept; run again with --yes" in err
    assert all((trained / name(adapter_name, step)).is_dir() for step in range(1, 7))

    assert main(["checkpoint", "prune", "--adapter", adapter_name, "--keep", "2", "--yes"]) == 0
    out, err = capsys.readouterr()
    assert out.count("deleted ") == 4 and "4 checkpoint(s) deleted, 2 kept" in err
    assert sorted(p.name for p in trained.glob(f"{adapter_name}-checkpoint-*")) == [
        name(adapter_name, 5), name(adapter_name, 6)]
    assert sorted(CheckpointRecord.objects.filter(adapter__name=adapter_name).values_list("step", flat=True)) == [5, 6]


def test_never_the_newest_valid_nor_what_an_active_job_owns_or_resumes_from(trained, api, adapter_name):
    (trained / name(adapter_name, 6) / "state.json").write_text("changed size")  # the newest: invalid now
    resumed = api.post("/v1/train/sft", sft_body(adapter_name, records=6,
                                                 resume_checkpoint=name(adapter_name, 2)))
    assert resumed.status_code == 201, resumed.content  # queued, never run: it resumes from step 2

    plan = {item["basename"]: item for item in do_prune_checkpoints(None, adapter_name, keep=1, apply=True)}
    assert plan[name(adapter_name, 6)]["state"] == "invalid" and plan[name(adapter_name, 6)]["action"] == "delete"
    assert plan[name(adapter_name, 5)]["action"] == "keep"  # the newest valid one, whatever keep says
    assert plan[name(adapter_name, 2)]["action"] == "keep" and "resumes from it" in plan[name(adapter_name, 2)][
        "reason"]
    assert sorted(p.name for p in trained.glob(f"{adapter_name}-checkpoint-*")) == [
        name(adapter_name, 2), name(adapter_name, 5)]

    with pytest.raises(ActionRefused) as refused:
        do_prune_checkpoints(None, adapter_name, keep=0)
    assert refused.value.status == 400 and "newest valid checkpoint is never pruned" in refused.value.message

    TrainingJob.objects.filter(pk=resumed.json()["id"]).update(status=JobStatus.CANCELLED)
    first = TrainingJob.objects.filter(adapter__name=adapter_name).exclude(pk=resumed.json()["id"]).get()
    TrainingJob.objects.filter(pk=first.pk).update(status=JobStatus.RUNNING)  # its checkpoints are in use
    plan = do_prune_checkpoints(None, adapter_name, keep=1, apply=True)
    assert [item["action"] for item in plan] == ["keep", "keep"]
    assert f"published by the running job {first.pk}" in plan[1]["reason"]


def test_links_are_never_followed_and_others_adapters_are_refused(trained, adapter_name, bob, tmp_path):
    outside = tmp_path / "precious"
    outside.mkdir()
    (outside / "keep.txt").write_text("mine")
    link = trained / name(adapter_name, 9)
    os.symlink(outside, link)
    try:
        plan = do_prune_checkpoints(None, adapter_name, keep=1, apply=True)
        assert name(adapter_name, 9) not in {item["basename"] for item in plan}  # the registry lists real dirs
        with pytest.raises(ActionRefused) as refused:
            _confined(trained, adapter_name, name(adapter_name, 9))
        assert refused.value.code == "not_a_checkpoint"
        with pytest.raises(ActionRefused):
            _confined(trained, adapter_name + "-other", name(adapter_name, 6))
        assert (outside / "keep.txt").read_text() == "mine"
    finally:
        link.unlink()
    with pytest.raises(ActionRefused) as refused:
        do_prune_checkpoints(bob, adapter_name, keep=1)
    assert refused.value.status == 404 and refused.value.code == "adapter_not_found"  # someone else's
