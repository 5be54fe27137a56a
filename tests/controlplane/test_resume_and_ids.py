"""POST /v1/train/jobs/{job_id}/resume (kiln_web.jobs.resume) and job-id prefixes (kiln_web.jobs.ids)."""

import uuid

import pytest

from kiln_web.jobs.models import JobStatus, TrainingJob
from kiln_web.jobs.worker import EmbeddedWorker

from .conftest import ApiClient, sft_body

pytestmark = pytest.mark.django_db


def cancel_at_step(monkeypatch, step: int = 3) -> None:
    """Make the next fake SFT run cancelled (do_cancel_job, as `kiln train cancel` does) once it has committed
    STEP; the run then publishes a checkpoint at that boundary and ends cancelled."""
    from django.conf import settings

    from kiln_web.jobs import actions

    from . import fake_sft

    monkeypatch.setattr(settings, "KILN_CANCEL_POLL_SECONDS", 0)  # the run reads the status at every boundary
    real_run = fake_sft.run_sft

    def run(admission, run_settings, hooks):
        on_step = hooks.on_step

        def step_then_cancel(metrics):
            on_step(metrics)
            if metrics["step"] == step:
                actions.do_cancel_job(hooks.job_id, reason="cancelled by the test")

        hooks.on_step = step_then_cancel
        return real_run(admission, run_settings, hooks)

    monkeypatch.setattr(fake_sft, "run_sft", run)


def _cancelled_mid_run(api, adapter_name, monkeypatch, body=None, **config) -> TrainingJob:
    """A job submitted without checkpoint_interval (the server's is 50) and cancelled after its third step."""
    response = api.post("/v1/train/sft", body or sft_body(adapter_name, records=6, **config))
    assert response.status_code == 201, response.content
    with monkeypatch.context() as patch:
        cancel_at_step(patch)
        assert EmbeddedWorker().run_once()
    job = TrainingJob.objects.get(pk=response.json()["id"])
    assert job.status == JobStatus.CANCELLED and job.committed_step == 3
    return job


@pytest.fixture
def interval(fake_runner):
    fake_runner.KILN_CHECKPOINT_INTERVAL = 50  # the server default: no boundary before the cancellation
    return fake_runner


def test_a_cancelled_job_resumes_by_prefix_with_its_effective_config_and_seed(interval, api, adapter_name,
                                                                                monkeypatch):
    job = _cancelled_mid_run(api, adapter_name, monkeypatch, seed=77, learning_rate=0.001)
    basename = f"{adapter_name}-checkpoint-step-00000003.kiln-checkpoint"
    assert job.latest_checkpoint["resume_checkpoint"] == basename

    inline = api.post(f"/v1/train/jobs/{str(job.pk)[:8]}/resume", {})
    assert inline.status_code == 400, inline.content
    error = inline.json()["error"]
    assert error["code"] == "source_required" and error["field"] == "data" and "--file" in error["message"]

    data = sft_body(adapter_name, records=6)["data"]
    response = api.post(f"/v1/train/jobs/{str(job.pk)[:8]}/resume", {"data": data})
    assert response.status_code == 201, response.content
    new = TrainingJob.objects.get(pk=response.json()["id"])
    assert new.pk != job.pk and new.resume_from == basename and new.committed_step == 3
    assert new.effective_seed == 77 and new.effective_config["learning_rate"] == 0.001
    assert new.request["config"] == {"output_name": adapter_name, "epochs": 1, "checkpoint_interval": 50,
                                     "learning_rate": 0.001, "seed": 77, "resume_checkpoint": basename}
    assert new.request["data"] == data

    again = api.post(f"/v1/train/jobs/{new.pk}/resume", {"data": data})  # the new job is queued
    assert again.status_code == 409 and again.json()["error"]["code"] == "not_resumable"
    assert "queued" in again.json()["error"]["message"]
    assert EmbeddedWorker().run_once()
    new.refresh_from_db()
    assert new.status == JobStatus.SUCCEEDED and new.committed_step == 6
    done = api.post(f"/v1/train/jobs/{new.pk}/resume", {"data": data})
    assert done.status_code == 409 and "completed" in done.json()["error"]["message"]


def test_a_run_resumed_and_carried_on_is_not_resumed_from_behind(interval, api, adapter_name, monkeypatch):
    """Job A is cancelled at step 3; B resumes it and finishes at step 6. Resuming A again would redo steps 4-6
    and stop at the immutable name of B's checkpoint: it is refused, naming B. And A's failure or loss never
    takes B's checkpoint for an unrecorded one of its own (they share the seed)."""
    from kiln_web.jobs import actions

    job = _cancelled_mid_run(api, adapter_name, monkeypatch, seed=77)
    data = sft_body(adapter_name, records=6)["data"]
    response = api.post(f"/v1/train/jobs/{job.pk}/resume", {"data": data})
    assert response.status_code == 201, response.content
    assert EmbeddedWorker().run_once()
    carried_on = TrainingJob.objects.get(pk=response.json()["id"])
    assert carried_on.status == JobStatus.SUCCEEDED and carried_on.committed_step == 6
    newest = f"{adapter_name}-checkpoint-step-00000006.kiln-checkpoint"
    assert carried_on.latest_checkpoint["resume_checkpoint"] == newest

    again = api.post(f"/v1/train/jobs/{job.pk}/resume", {"data": data})
    assert again.status_code == 409, again.content
    error = again.json()["error"]
    assert error["code"] == "not_resumable" and error["job_id"] == str(carried_on.pk)
    assert error["newer_checkpoint"] == newest and str(carried_on.pk)[:8] in error["message"]
    assert TrainingJob.objects.filter(adapter__name=adapter_name).count() == 2  # nothing was queued

    assert actions._unrecorded_checkpoint(job) is None  # B recorded it: it is not A's


def test_a_file_source_is_kept_and_drift_is_refused_by_admission(interval, api, adapter_name, settings,
                                                                  monkeypatch):
    import json

    path = settings.KILN_DATASETS_DIR / f"{adapter_name}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in sft_body("x", records=6)["data"]))
    job = _cancelled_mid_run(api, adapter_name, monkeypatch,
                             {"dataset_path": str(path), "config": {"output_name": adapter_name}})
    response = api.post(f"/v1/train/jobs/{job.pk}/resume", {})
    assert response.status_code == 201, response.content
    new = TrainingJob.objects.get(pk=response.json()["id"])
    assert new.request["dataset_path"] == str(path) and new.resume_from == job.latest_checkpoint["resume_checkpoint"]
    new.status = JobStatus.CANCELLED
    new.save()

    # drift goes through do_submit_job's admission: the fake compares learning_rate with the checkpoint
    TrainingJob.objects.filter(pk=job.pk).update(effective_config={**job.effective_config, "learning_rate": 0.5})
    drifted = api.post(f"/v1/train/jobs/{job.pk}/resume", {"dataset_path": str(path)})
    assert drifted.status_code == 409, drifted.content
    assert drifted.json()["error"]["code"] == "resume_drift"
    assert drifted.json()["error"]["differences"][0]["field"] == "config.learning_rate"


def test_resume_refusals(interval, api, bob, adapter_name, monkeypatch):
    job = _cancelled_mid_run(api, adapter_name, monkeypatch)
    path = f"/v1/train/jobs/{job.pk}/resume"
    assert ApiClient(None).post(path, {}).status_code == 401
    hidden = ApiClient(bob.token).post(path, {"data": [{"prompt": "q", "completion": "a"}]})
    assert hidden.status_code == 404 and hidden.json()["error"]["code"] == "not_found"
    wrong = api.post(path, {"groups": [{"prompt": "q"}]})
    assert wrong.status_code == 400 and "give dataset_path or data" in wrong.json()["error"]["message"]
    unknown = api.post(path, {"config": {}})
    assert unknown.status_code == 400 and unknown.json()["error"]["code"] == "invalid_request"
    bodiless = api.client.post(path, content_type="application/json")
    assert bodiless.status_code == 400 and bodiless.json()["error"]["code"] == "source_required"  # no body: {}

    response = api.post("/v1/train/sft", sft_body(adapter_name + "-none", records=2))  # interval 50: none published
    assert EmbeddedWorker().run_once()
    TrainingJob.objects.filter(pk=response.json()["id"]).update(status=JobStatus.FAILED, latest_checkpoint=None)
    none = api.post(f"/v1/train/jobs/{response.json()['id']}/resume", {"data": [{"prompt": "q", "completion": "a"}]})
    assert none.status_code == 409 and "published no checkpoint" in none.json()["error"]["message"]

    import shutil

    from django.conf import settings

    shutil.rmtree(settings.KILN_ADAPTERS_DIR / job.latest_checkpoint["resume_checkpoint"])
    gone = api.post(path, {"data": [{"prompt": "q", "completion": "a"}]})
    assert gone.status_code == 409 and gone.json()["error"]["checkpoint_error"]["code"] == "not_found"


# -- prefixes --


def _job_with_id(api, adapter_name, job_id: str, monkeypatch) -> str:
    field = TrainingJob._meta.get_field("id")
    monkeypatch.setattr(field, "default", lambda: uuid.UUID(job_id))
    field.__dict__.pop("_get_default", None)  # Django caches the default's callable
    response = api.post("/v1/train/sft", sft_body(adapter_name))
    assert response.status_code == 201 and response.json()["id"] == job_id
    return job_id


def test_every_job_path_takes_a_unique_prefix(fake_runner, api, bob, adapter_name, monkeypatch):
    first = _job_with_id(api, adapter_name, "abcdef01-2345-4678-9abc-def012345678", monkeypatch)
    second = _job_with_id(api, adapter_name + "-2", "abcdef01-2399-4678-9abc-def012345678", monkeypatch)
    monkeypatch.undo()
    TrainingJob._meta.get_field("id").__dict__.pop("_get_default", None)
    for suffix in ("", "/checkpoints", "/metrics", "/events"):
        assert api.get(f"/v1/train/jobs/abcdef01-23{suffix}").status_code == 409
        response = api.get(f"/v1/train/jobs/ABCDEF01-2345{suffix}")
        assert response.status_code == 200, (suffix, response.content)
        assert api.get(f"/v1/train/jobs/abcdef012399{suffix}").status_code == 200  # hyphens optional
    assert api.get("/v1/train/jobs/abcdef01-2345").json()["id"] == first
    ambiguous = api.get("/v1/train/jobs/abcdef01").json()["error"]
    assert ambiguous["code"] == "ambiguous_job_id" and set(ambiguous["matches"]) == {first, second}
    assert first in ambiguous["message"] and second in ambiguous["message"]
    for bad in ("abcdef0", "abcdefgh", "zz", "abcdef01-2345-4678-9abc-def012345678-00"):
        response = api.get(f"/v1/train/jobs/{bad}")
        assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_job_id", bad
        assert "at least 8 hex digits" in response.json()["error"]["message"]
    assert api.get("/v1/train/jobs/0123abcd").json()["error"]["code"] == "not_found"
    assert ApiClient(bob.token).get("/v1/train/jobs/abcdef01-2345").status_code == 404  # not among bob's
    cancelled = api.post("/v1/train/jobs/abcdef012399/cancel")
    assert cancelled.status_code == 200 and cancelled.json()["id"] == second
    assert api.get(f"/v1/train/jobs/{first}").status_code == 200  # a full id still answers as before


# -- the request resume_request builds, for GRPO and OPD (rows and a checkpoint made by hand: nothing runs) --


def _ended_job(user, kind: str, adapter: str, request: dict, effective: dict, registry) -> TrainingJob:
    from trainer.runs import checkpoint_dir

    from kiln_web.adapters.models import Adapter

    manifest = {"config": effective, "seed": 9, "progress": {"committed_step": 2, "total_steps": 5,
                                                             "complete": False}}
    path = checkpoint_dir.publish_checkpoint(registry, adapter, 2, checkpoint_type=kind, files={"s.json": b"{}"},
                                             manifest=manifest)
    return TrainingJob.objects.create(
        owner=user, kind=kind, status=JobStatus.CANCELLED, adapter=Adapter.objects.create(name=adapter, owner=user),
        request=request, admission={}, effective_config=effective, effective_seed=9, committed_step=2,
        latest_checkpoint={"resume_checkpoint": path.name}, identities={"teacher": {"alias": "tutor@native"}})


def test_opd_resubmits_the_teacher_alias_and_grpo_its_groups(ada, adapter_name, settings):
    from kiln_web.jobs.resume import resume_request

    resolved = {"alias": "tutor@native", "route": "native", "base": "kiln-tiny", "identity_revision": "ab" * 32}
    opd = _ended_job(ada, "opd", adapter_name, {"dataset_path": "/data/prompts.jsonl", "config": {
        "output_name": adapter_name, "teacher": "tutor@native", "steps": 5}},
        {"output_name": adapter_name, "teacher": resolved, "steps": 5, "max_grad_norm": None, "top_k": None,
         "lora": {"rank": 8, "alpha": 16.0, "targets": ["q_proj"], "use_rslora": False, "dropout": 0.0},
         "checkpoint_interval": 1, "not_a_request_field": 3}, settings.KILN_ADAPTERS_DIR)
    body = resume_request(opd, {})
    assert body == {"dataset_path": "/data/prompts.jsonl", "config": {
        "output_name": adapter_name, "teacher": "tutor@native", "steps": 5, "max_grad_norm": None,
        "lora": {"rank": 8, "alpha": 16.0, "targets": ["q_proj"], "use_rslora": False}, "checkpoint_interval": 1,
        "seed": 9, "resume_checkpoint": f"{adapter_name}-checkpoint-step-00000002.kiln-checkpoint"}}

    grpo = _ended_job(ada, "grpo", adapter_name + "-g", {"groups": [{"prompt": "p"}], "config": {
        "output_name": adapter_name + "-g"}}, {"output_name": adapter_name + "-g", "loss_type": "dapo"},
        settings.KILN_ADAPTERS_DIR)
    from kiln_web.core.http import ActionRefused

    with pytest.raises(ActionRefused) as refused:
        resume_request(grpo, {})
    assert refused.value.code == "source_required" and "inline groups" in refused.value.message
    groups = [{"prompt": "p", "completions": [{"text": "a", "reward": 1.0}]}]
    assert resume_request(grpo, {"groups": groups})["groups"] == groups
    with pytest.raises(ActionRefused) as refused:
        resume_request(grpo, {"data": groups})
    assert refused.value.status == 400 and refused.value.extra["field"] == "data"


def test_a_new_run_beside_an_earlier_run_s_checkpoints_is_refused_409(api, adapter_name):
    """The real trainer's admission: a second new run of a finished adapter was admitted, trained to its first
    checkpoint and failed name_exists; it is refused before anything is queued, and the old run can be resumed
    or the adapter deleted and trained afresh."""
    first = api.post("/v1/train/sft", sft_body(adapter_name, checkpoint_interval=1))
    assert first.status_code == 201, first.content
    assert EmbeddedWorker().run_once()
    job = TrainingJob.objects.get(pk=first.json()["id"])
    assert job.status == JobStatus.SUCCEEDED, job.error_message
    again = api.post("/v1/train/sft", sft_body(adapter_name, checkpoint_interval=1))
    assert again.status_code == 409, again.content
    error = again.json()["error"]
    assert error["code"] == "checkpoints_exist", error
    assert job.latest_checkpoint["resume_checkpoint"] in error["message"]
    assert TrainingJob.objects.filter(adapter__name=adapter_name).count() == 1
    assert api.client.delete(f"/v1/adapters/{adapter_name}").status_code == 200
    assert api.post("/v1/train/sft", sft_body(adapter_name, checkpoint_interval=1)).status_code == 201


def _trained_deleted_and_submitted_again(api, adapter_name):
    """A run trained to its end under ADAPTER_NAME, the adapter deleted, and a fresh run submitted under the same
    name (not yet run): the two submissions' responses."""
    first = api.post("/v1/train/sft", sft_body(adapter_name, records=2, checkpoint_interval=1, seed=1))
    assert first.status_code == 201, first.content
    assert EmbeddedWorker().run_once()
    assert api.client.delete(f"/v1/adapters/{adapter_name}").status_code == 200
    second = api.post("/v1/train/sft", sft_body(adapter_name, records=2, checkpoint_interval=1, seed=2))
    assert second.status_code == 201, second.content
    return first, second


def test_a_fresh_run_after_its_adapter_was_deleted_reports_its_own_checkpoints(fake_runner, api, adapter_name):
    """Deleting an adapter frees its checkpoint names, and a fresh run under it publishes new checkpoints there.
    The index kept the deleted run's row for each name, so the fresh run's checkpoints were never indexed for it
    and, once it ended, its job reported latest_checkpoint null with checkpoint_changed (the digest of the deleted
    run's manifest); the old job must not report the new run's checkpoint as its own either."""
    from kiln_web.adapters.models import CheckpointRecord

    first, second = _trained_deleted_and_submitted_again(api, adapter_name)
    assert EmbeddedWorker().run_once()

    detail = api.get(f"/v1/train/jobs/{second.json()['id']}").json()
    assert detail["status"] == JobStatus.SUCCEEDED
    assert detail["latest_checkpoint_error"] is None, detail["latest_checkpoint_error"]
    latest = detail["latest_checkpoint"]
    record = CheckpointRecord.objects.get(basename=latest["resume_checkpoint"])
    assert (str(record.job_id), record.manifest_digest) == (second.json()["id"], latest["manifest_sha256"])
    assert record.checkpoint_id == record.summary["checkpoint_id"] == latest["checkpoint_id"]

    old = api.get(f"/v1/train/jobs/{first.json()['id']}").json()
    assert old["latest_checkpoint"] is None  # its checkpoint was deleted: the name holds the fresh run's now
    assert old["latest_checkpoint_error"]["code"] == "checkpoint_changed", old["latest_checkpoint_error"]


def test_a_fresh_run_after_its_adapter_was_deleted_adopts_its_unrecorded_checkpoint(fake_runner, api, adapter_name,
                                                                                     monkeypatch):
    """A worker lost between publishing a checkpoint and recording it: the job adopts the registry's newer
    checkpoint when it ends. A name the deleted run had indexed was taken for another job's and never adopted."""
    from kiln_web.adapters.models import CheckpointRecord
    from kiln_web.jobs import actions

    first, second = _trained_deleted_and_submitted_again(api, adapter_name)
    with monkeypatch.context() as patch:
        patch.setattr(actions, "do_record_checkpoint", lambda *args, **kwargs: True)  # published, never recorded
        assert EmbeddedWorker().run_once()
    job = TrainingJob.objects.get(pk=second.json()["id"])
    published = job.latest_checkpoint  # from the run's result
    job.latest_checkpoint = {}  # as a run lost before it returned would leave it
    unrecorded = actions._unrecorded_checkpoint(job)
    assert unrecorded is not None
    assert (unrecorded[0]["checkpoint_id"], unrecorded[1]) == (published["checkpoint_id"],
                                                              published["manifest_sha256"])
    assert actions._adopt_unrecorded_checkpoint(job, "in the test") == ["latest_checkpoint"]
    record = CheckpointRecord.objects.get(basename=published["resume_checkpoint"])  # the deleted run's row until now
    assert (record.job_id, record.manifest_digest) == (job.pk, published["manifest_sha256"])


def test_a_deleted_run_s_job_is_not_resumed_from_a_fresh_run_s_checkpoint(interval, api, adapter_name, monkeypatch):
    """After the adapter was deleted and trained afresh, the old job's latest checkpoint name holds the fresh run's
    checkpoint. Resuming the old job offered that one (and admission then refused it as drift, seed and data): it is
    not the checkpoint the old job published, so the old job is not resumable, and says why."""
    old = _cancelled_mid_run(api, adapter_name, monkeypatch, seed=1)
    assert api.client.delete(f"/v1/adapters/{adapter_name}").status_code == 200
    fresh = _cancelled_mid_run(api, adapter_name, monkeypatch, seed=2)
    basename = old.latest_checkpoint["resume_checkpoint"]
    assert fresh.latest_checkpoint["resume_checkpoint"] == basename  # the same name, another run's checkpoint

    response = api.post(f"/v1/train/jobs/{old.pk}/resume", {"data": sft_body(adapter_name, records=6)["data"]})
    assert response.status_code == 409, response.content
    error = response.json()["error"]
    assert error["code"] == "not_resumable" and error.get("checkpoint_error", {}).get("code") == "checkpoint_changed", \
        error
    assert TrainingJob.objects.filter(adapter__name=adapter_name).count() == 2  # nothing was queued
    again = api.post(f"/v1/train/jobs/{fresh.pk}/resume", {"data": sft_body(adapter_name, records=6)["data"]})
    assert again.status_code == 201, again.content  # the fresh run's job resumes from its own
