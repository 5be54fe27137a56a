"""A job-status poll is answered from the database: no checkpoint directory is read while the job is active;
once it has ended its latest checkpoint is checked against the directory and the digest recorded at
publication (docs/api.md, "Job status")."""

import pytest

from kiln_web.adapters.models import CheckpointRecord
from kiln_web.jobs import actions, runtime
from kiln_web.jobs.models import JobStatus

from .conftest import sft_body
from .test_jobs import cancel_at, run_queued, submit

pytestmark = pytest.mark.django_db


def no_directory_reads(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a status poll read a checkpoint directory")

    monkeypatch.setattr(runtime, "read_checkpoint_summary", refuse)
    monkeypatch.setattr(runtime, "checkpoint_module", refuse)


def cancelled_with_checkpoint(api, adapter_name, monkeypatch, fake_runner) -> tuple[dict, dict]:
    """A job cancelled after publishing step 2, and the request that made it."""
    fake_runner.KILN_CANCEL_POLL_SECONDS = 0
    body = sft_body(adapter_name, records=5, checkpoint_interval=10, seed=3)
    job_id = submit(api, body)
    cancel_at(monkeypatch, 2)
    run_queued()
    monkeypatch.undo()
    fake_runner.KILN_CANCEL_POLL_SECONDS = 0
    return api.get(f"/v1/train/jobs/{job_id}").json(), body


def test_polls_of_an_active_job_read_no_checkpoint_directory(fake_runner, api, adapter_name, monkeypatch):
    cancelled, body = cancelled_with_checkpoint(api, adapter_name, monkeypatch, fake_runner)
    basename = cancelled["latest_checkpoint"]["resume_checkpoint"]
    body["config"]["resume_checkpoint"] = basename
    resumed = submit(api, body)

    no_directory_reads(monkeypatch)
    job = api.get(f"/v1/train/jobs/{resumed}").json()  # queued: the checkpoint it resumes from, as indexed
    assert job["status"] == "queued" and job["latest_checkpoint_error"] is None
    assert job["latest_checkpoint"] == cancelled["latest_checkpoint"]

    assert actions.do_claim_job(resumed, "w")
    summary = {**cancelled["latest_checkpoint"], "step": 3, "committed_step": 3,
               "resume_checkpoint": f"{adapter_name}-checkpoint-step-00000003.kiln-checkpoint"}
    assert actions.do_record_checkpoint(resumed, "w", summary, manifest_digest="f" * 64)
    for _ in range(3):  # running: what the worker recorded (that directory does not even exist)
        job = api.get(f"/v1/train/jobs/{resumed}").json()
        assert job["status"] == "running" and job["latest_checkpoint"] == summary
        assert job["latest_checkpoint_error"] is None
    assert api.post(f"/v1/train/jobs/{resumed}/cancel").json()["latest_checkpoint"] == summary  # cancelling

    monkeypatch.undo()
    assert actions.do_finish_job(resumed, "w", JobStatus.CANCELLED)
    job = api.get(f"/v1/train/jobs/{resumed}").json()  # ended: the directory is checked, and it is not there
    assert job["latest_checkpoint"] is None
    assert job["latest_checkpoint_error"]["code"] not in (None, "checkpoint_changed")
    assert summary["resume_checkpoint"] in job["latest_checkpoint_error"]["message"]


def test_an_ended_job_checks_its_checkpoint_against_the_recorded_digest(fake_runner, api, adapter_name,
                                                                        monkeypatch, settings):
    cancelled, _ = cancelled_with_checkpoint(api, adapter_name, monkeypatch, fake_runner)
    basename = cancelled["latest_checkpoint"]["resume_checkpoint"]
    assert cancelled["latest_checkpoint_error"] is None and cancelled["latest_checkpoint"]["step"] == 2

    record = CheckpointRecord.objects.get(basename=basename)
    recorded = record.manifest_digest
    record.manifest_digest = "0" * 64  # as if the manifest had been rewritten since its publication
    record.save(update_fields=["manifest_digest"])
    job = api.get(f"/v1/train/jobs/{cancelled['id']}").json()
    assert job["latest_checkpoint"] is None and job["latest_checkpoint_error"]["code"] == "checkpoint_changed"

    record.manifest_digest = recorded
    record.save(update_fields=["manifest_digest"])
    path = settings.KILN_ADAPTERS_DIR / basename
    path.rename(path.with_name(basename + ".moved"))
    try:
        job = api.get(f"/v1/train/jobs/{cancelled['id']}").json()
        assert job["latest_checkpoint"] is None and job["latest_checkpoint_error"] is not None
        checkpoints = api.get(f"/v1/train/jobs/{cancelled['id']}/checkpoints").json()["items"]
        assert [c["present"] for c in checkpoints] == [False]
    finally:
        path.with_name(basename + ".moved").rename(path)
    assert api.get(f"/v1/train/jobs/{cancelled['id']}").json()["latest_checkpoint"] == cancelled["latest_checkpoint"]


def test_a_poll_of_a_running_job_is_three_queries(fake_runner, api, adapter_name, settings,
                                                   django_assert_max_num_queries, monkeypatch):
    """With the fast path off (KILN_STATUS_CACHE_SECONDS=0) and the token remembered: the job with its owner
    and adapter, its promotion, its evaluations. No token query, no directory read."""
    settings.KILN_STATUS_CACHE_SECONDS, settings.KILN_AUTH_CACHE_SECONDS = 0, 5
    job_id = submit(api, sft_body(adapter_name))
    assert actions.do_claim_job(job_id, "w")
    summary = {"resume_checkpoint": f"{adapter_name}-checkpoint-step-00000001.kiln-checkpoint",
               "training_kind": "sft", "adapter": adapter_name, "step": 1, "checkpoint_id": "c" * 64}
    assert actions.do_record_checkpoint(job_id, "w", summary, manifest_digest="f" * 64)
    api.get(f"/v1/train/jobs/{job_id}")  # the token is remembered from here on
    no_directory_reads(monkeypatch)
    with django_assert_max_num_queries(3):
        job = api.get(f"/v1/train/jobs/{job_id}").json()
    assert job["status"] == "running" and job["latest_checkpoint"]["resume_checkpoint"] == summary["resume_checkpoint"]
