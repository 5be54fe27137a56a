"""The job lifecycle through the API and the worker code, with the fake runner: ownership, claims,
progress, checkpoints, cancellation, failures, revalidation at dequeue, lost workers, events."""

import asyncio
import threading
from datetime import timedelta

import pytest
from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.db import connection
from django.utils import timezone

from kiln_web.adapters.models import CheckpointRecord
from kiln_web.jobs import actions
from kiln_web.jobs.events import group_name
from kiln_web.jobs.execution import JobHooks, execute_training_job
from kiln_web.jobs.models import JobMetric, JobStatus, TrainingJob
from kiln_web.jobs.worker import EmbeddedWorker

from .conftest import ApiClient, sft_body

pytestmark = pytest.mark.django_db


def submit(api, body):
    response = api.post("/v1/train/sft", body)
    assert response.status_code == 201, response.content
    return response.json()["id"]


def run_queued():
    assert EmbeddedWorker().run_once()


def cancel_at(monkeypatch, step):
    """Cancel the job (as a person would) right after STEP is recorded."""
    record = actions.do_record_step

    def record_then_cancel(job_id, worker_id, metrics):
        recorded = record(job_id, worker_id, metrics)
        if metrics["step"] == step:
            actions.do_cancel_job(job_id, reason="test")
        return recorded

    monkeypatch.setattr(actions, "do_record_step", record_then_cancel)


# -- ownership --


def test_people_see_only_their_own_jobs(fake_runner, api, ada, bob, make_user, adapter_name):
    mine = submit(api, sft_body(adapter_name))
    theirs = submit(ApiClient(bob.token), sft_body(adapter_name + "-bob"))
    listing = api.get("/v1/train/jobs").json()
    assert [job["id"] for job in listing["items"]] == [mine] and listing["count"] == 1
    for path in ("", "/checkpoints", "/metrics", "/events"):
        response = api.get(f"/v1/train/jobs/{theirs}{path}")
        assert response.status_code == 404, path
        assert response.json()["error"]["code"] == "not_found"
        assert api.get(f"/v1/train/jobs/{mine}{path}").status_code == 200
    assert api.post(f"/v1/train/jobs/{theirs}/cancel").status_code == 404
    assert TrainingJob.objects.get(pk=theirs).status == JobStatus.QUEUED
    staff = ApiClient(make_user("root", staff=True).token)
    assert {job["id"] for job in staff.get("/v1/train/jobs").json()["items"]} == {mine, theirs}
    assert staff.get(f"/v1/train/jobs/{theirs}").status_code == 200


def test_list_filters_and_pages(fake_runner, api, adapter_name):
    first = submit(api, sft_body(adapter_name))
    api.post(f"/v1/train/jobs/{first}/cancel")
    second = submit(api, sft_body(adapter_name + "-2"))
    assert [j["id"] for j in api.get("/v1/train/jobs", status="queued").json()["items"]] == [second]
    assert [j["id"] for j in api.get("/v1/train/jobs", adapter=adapter_name).json()["items"]] == [first]
    page = api.get("/v1/train/jobs", limit=1, offset=1).json()
    assert page["count"] == 2 and [j["id"] for j in page["items"]] == [first]
    assert api.get("/v1/train/jobs", status="paused").status_code == 400


def test_unknown_job_is_404_and_a_bad_id_400(fake_runner, api):
    assert api.get("/v1/train/jobs/00000000-0000-0000-0000-000000000000").status_code == 404
    response = api.get("/v1/train/jobs/not-a-uuid")
    assert response.status_code in (400, 404)


# -- claims --


def test_a_job_is_claimed_exactly_once(fake_runner, api, adapter_name):
    job_id = submit(api, sft_body(adapter_name))
    assert actions.do_claim_job(job_id, "worker-a") is True
    assert actions.do_claim_job(job_id, "worker-b") is False
    job = TrainingJob.objects.get(pk=job_id)
    assert job.status == JobStatus.RUNNING and job.worker_id == "worker-a" and job.started_at and job.heartbeat_at
    assert execute_training_job(job_id, "worker-c") == "not_claimed"
    assert TrainingJob.objects.get(pk=job_id).worker_id == "worker-a"


@pytest.mark.django_db(transaction=True)
def test_racing_workers_claim_once(fake_runner, ada, adapter_name):
    """Real concurrent transactions; SQLite's shared in-memory test database serialises them differently,
    so the race itself runs in the PostgreSQL pass of `./dev test` (tests/run_suite.py)."""
    if connection.vendor != "postgresql":
        pytest.skip("the concurrent claim race runs on PostgreSQL (the PostgreSQL pass of ./dev test)")
    job_id = actions.do_submit_job(ada, {}, sft_body(adapter_name)).pk
    barrier, results = threading.Barrier(8), []

    def claim(index):
        barrier.wait()
        try:
            results.append(actions.do_claim_job(job_id, f"worker-{index}"))
        finally:
            connection.close()

    threads = [threading.Thread(target=claim, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(results) == [False] * 7 + [True]


def test_cancelled_queued_job_is_never_claimed(fake_runner, api, adapter_name):
    job_id = submit(api, sft_body(adapter_name))
    job = api.post(f"/v1/train/jobs/{job_id}/cancel").json()
    assert job["status"] == "cancelled" and job["finished_at"]
    assert actions.do_claim_job(job_id, "worker") is False
    response = api.post(f"/v1/train/jobs/{job_id}/cancel")
    assert response.status_code == 409
    assert response.json()["error"]["code"] == "job_not_active"


# -- runs --


def test_run_records_metrics_checkpoints_and_events(fake_runner, api, adapter_name):
    job_id = submit(api, sft_body(adapter_name, records=3, epochs=2, checkpoint_interval=2))
    run_queued()
    job = api.get(f"/v1/train/jobs/{job_id}").json()
    assert job["status"] == "succeeded" and job["error"] is None
    assert job["progress"] == {"committed_step": 6, "total_steps": 6}
    latest = job["latest_checkpoint"]
    assert latest["resume_checkpoint"] == f"{adapter_name}-checkpoint-step-00000006.kiln-checkpoint"
    assert latest["complete"] is True and latest["training_kind"] == "sft" and latest["committed_step"] == 6
    metrics = api.get(f"/v1/train/jobs/{job_id}/metrics").json()
    assert [m["step"] for m in metrics["items"]] == [1, 2, 3, 4, 5, 6] and metrics["next_after_step"] is None
    assert set(metrics["items"][0]) >= {"loss", "learning_rate", "grad_norm", "clipped", "loss_spike", "tokens"}
    page = api.get(f"/v1/train/jobs/{job_id}/metrics", after_step=2, limit=2).json()
    assert [m["step"] for m in page["items"]] == [3, 4] and page["next_after_step"] == 4
    checkpoints = api.get(f"/v1/train/jobs/{job_id}/checkpoints").json()["items"]
    assert [c["step"] for c in checkpoints] == [2, 4, 6]
    assert all(c["present"] and len(c["manifest_digest"]) == 64 for c in checkpoints)
    assert "snapshot_seconds" in checkpoints[0]["timing"]
    messages = [e["message"] for e in api.get(f"/v1/train/jobs/{job_id}/events").json()["items"]]
    assert messages[0].startswith("queued") and messages[-1].startswith("succeeded after step 6")
    assert any("dequeue revalidation passed" in m for m in messages)


def test_cancel_mid_run_publishes_then_resume_continues(fake_runner, api, adapter_name, monkeypatch):
    fake_runner.KILN_CANCEL_POLL_SECONDS = 0
    body = sft_body(adapter_name, records=5, checkpoint_interval=10, seed=3)
    job_id = submit(api, body)
    cancel_at(monkeypatch, 2)
    run_queued()
    job = api.get(f"/v1/train/jobs/{job_id}").json()
    assert job["status"] == "cancelled"
    basename = job["latest_checkpoint"]["resume_checkpoint"]
    assert basename == f"{adapter_name}-checkpoint-step-00000002.kiln-checkpoint"  # the next safe boundary
    assert job["latest_checkpoint"]["complete"] is False

    monkeypatch.undo()
    fake_runner.KILN_CANCEL_POLL_SECONDS = 0
    body["config"]["resume_checkpoint"] = basename
    resumed = api.post("/v1/train/sft", body).json()
    assert resumed["resume_from"] == basename and resumed["effective_seed"] == 3
    assert resumed["progress"]["committed_step"] == 2  # the run continues from there
    assert resumed["latest_checkpoint"]["resume_checkpoint"] == basename  # until it publishes its own
    run_queued()
    job = api.get(f"/v1/train/jobs/{resumed['id']}").json()
    assert job["status"] == "succeeded" and job["progress"]["committed_step"] == 5
    assert list(JobMetric.objects.filter(job_id=resumed["id"]).values_list("step", flat=True)) == [3, 4, 5]


def test_resume_drift_is_refused_field_by_field(fake_runner, api, adapter_name, monkeypatch):
    fake_runner.KILN_CANCEL_POLL_SECONDS = 0
    body = sft_body(adapter_name, records=4, checkpoint_interval=2, learning_rate=0.001)
    job_id = submit(api, body)
    cancel_at(monkeypatch, 2)
    run_queued()
    basename = api.get(f"/v1/train/jobs/{job_id}").json()["latest_checkpoint"]["resume_checkpoint"]
    body["config"].update(resume_checkpoint=basename, learning_rate=0.002, seed=99)
    response = api.post("/v1/train/sft", body)
    assert response.status_code == 409
    error = response.json()["error"]
    assert error["code"] == "resume_drift"
    assert error["differences"] == [
        {"field": "config.learning_rate", "checkpoint": 0.001, "request": 0.002},
        {"field": "seed", "checkpoint": 1234, "request": 99}]
    assert TrainingJob.objects.count() == 1


def test_checkpoint_changed_after_admission_fails_at_dequeue(fake_runner, api, adapter_name, monkeypatch, settings):
    fake_runner.KILN_CANCEL_POLL_SECONDS = 0
    body = sft_body(adapter_name, records=4, checkpoint_interval=2)
    job_id = submit(api, body)
    cancel_at(monkeypatch, 2)
    run_queued()
    monkeypatch.undo()
    basename = api.get(f"/v1/train/jobs/{job_id}").json()["latest_checkpoint"]["resume_checkpoint"]
    body["config"]["resume_checkpoint"] = basename
    resumed = submit(api, body)
    (settings.KILN_ADAPTERS_DIR / basename / "state.json").write_text('{"step": 9}')  # same size, other bytes
    run_queued()
    job = api.get(f"/v1/train/jobs/{resumed}").json()
    assert job["status"] == "failed"
    assert job["error"]["code"] == "checksum_mismatch"
    assert job["progress"]["committed_step"] == 2  # where the resumed run would have continued
    assert job["resume_from"] == basename
    assert not JobMetric.objects.filter(job_id=resumed).exists()


def test_an_exception_in_the_run_fails_the_job_with_a_message(fake_runner, api, adapter_name):
    body = sft_body(adapter_name, records=3)
    body["data"][1] = {"fail": "the data source went away"}
    job_id = submit(api, body)
    run_queued()
    job = api.get(f"/v1/train/jobs/{job_id}").json()
    assert job["status"] == "failed"
    assert job["error"]["code"] == "internal_error"
    assert job["error"]["message"] == "RuntimeError: the data source went away"
    assert job["progress"]["committed_step"] == 1 and job["finished_at"]


def test_admission_errors_at_run_time_keep_their_code(fake_runner, api, adapter_name, monkeypatch):
    from controlplane import fake_sft

    def refuse(admission, settings):
        raise fake_sft.AdmissionError("loss_route_unavailable", "this worker cannot run the admitted loss route")

    monkeypatch.setattr(fake_sft, "revalidate_sft", refuse)
    job_id = submit(api, sft_body(adapter_name))
    run_queued()
    job = TrainingJob.objects.get(pk=job_id)
    assert (job.status, job.error_code) == (JobStatus.FAILED, "loss_route_unavailable")


# -- lost workers --


def test_a_job_without_heartbeats_is_marked_lost(fake_runner, api, adapter_name, settings):
    job_id = submit(api, sft_body(adapter_name))
    actions.do_claim_job(job_id, "worker-dead")
    assert actions.do_mark_lost() == []
    # the check runs LOST_AFTER + 2 seconds from now (and so after the database server's start)
    later = timezone.now() + timedelta(seconds=settings.KILN_LOST_AFTER_SECONDS + 2)
    TrainingJob.objects.filter(pk=job_id).update(heartbeat_at=timezone.now() - timedelta(seconds=1))
    assert actions.do_mark_lost(now=later) == [TrainingJob.objects.get(pk=job_id).pk]
    job = api.get(f"/v1/train/jobs/{job_id}").json()
    assert job["status"] == "lost" and job["error"]["code"] == "worker_lost"
    assert "worker-dead" in job["error"]["message"]
    # the worker coming back cannot reopen it, and its run is told to stop
    assert actions.do_finish_job(job_id, "worker-dead", JobStatus.SUCCEEDED) is False
    assert actions.do_record_step(job_id, "worker-dead", {"step": 1, "loss": 1.0}) is False
    assert JobHooks(job_id, "worker-dead", poll_seconds=0).should_cancel() is True
    assert TrainingJob.objects.get(pk=job_id).status == JobStatus.LOST


def test_a_run_that_fails_after_publishing_a_checkpoint_it_could_not_record_names_it(fake_runner, api,
                                                                                        adapter_name, settings):
    """The database went away between a checkpoint's publication and its record, and the run failed with
    database_unavailable (tests/faults/test_postgres_restart.py): the failed job names the checkpoint on disk
    (the registry is the authority), so a resume starts from it and not from the older one."""
    import json as _json

    from trainer.runs import checkpoint_dir

    job_id = submit(api, sft_body(adapter_name))
    actions.do_claim_job(job_id, "worker-1")
    job = TrainingJob.objects.get(pk=job_id)
    manifest = {"training": {"kind": "sft"}, "config": job.effective_config, "seed": job.effective_seed,
                "progress": {"data_source_kind": "inline", "committed_step": 4, "total_steps": 8,
                             "next_cursor": {"epoch": 2, "example": 0}, "complete": False}}
    other = {**manifest, "seed": job.effective_seed + 1}
    path = checkpoint_dir.publish_checkpoint(settings.KILN_ADAPTERS_DIR, adapter_name, 4, checkpoint_type="sft",
                                             files={"state.json": _json.dumps({"step": 4}).encode()},
                                             manifest=manifest)
    assert actions.do_finish_job(job_id, "worker-1", JobStatus.FAILED, error_code="database_unavailable",
                                 error_message="the database could not be reached")
    detail = api.get(f"/v1/train/jobs/{job_id}").json()
    assert detail["status"] == "failed" and detail["latest_checkpoint"]["resume_checkpoint"] == path.name
    assert CheckpointRecord.objects.filter(basename=path.name, job_id=job_id).exists()
    # a checkpoint of another run (another seed) is never taken for the job's
    second = submit(api, sft_body(adapter_name + "-b"))
    actions.do_claim_job(second, "worker-2")
    checkpoint_dir.publish_checkpoint(settings.KILN_ADAPTERS_DIR, adapter_name + "-b", 4, checkpoint_type="sft",
                                      files={"state.json": b"{}"}, manifest={**other, "seed": other["seed"] + 99})
    assert actions.do_finish_job(second, "worker-2", JobStatus.FAILED, error_code="database_unavailable",
                                 error_message="the database could not be reached")
    assert api.get(f"/v1/train/jobs/{second}").json()["latest_checkpoint"] is None


def test_silence_is_counted_from_the_database_servers_start(fake_runner, api, adapter_name, settings):
    """A worker cannot beat while the database is down: for LOST_AFTER after PostgreSQL (re)started, no job is lost
    for a silence that began before (tests/faults/test_postgres_restart.py restarts a real server mid-run)."""
    if connection.vendor != "postgresql":
        pytest.skip("SQLite has no server start to count from (the PostgreSQL pass of ./dev test runs this)")
    job_id = submit(api, sft_body(adapter_name))
    actions.do_claim_job(job_id, "worker-quiet")
    started = actions.database_started_at()
    lost_after = timedelta(seconds=settings.KILN_LOST_AFTER_SECONDS)
    TrainingJob.objects.filter(pk=job_id).update(heartbeat_at=started - timedelta(days=1))
    assert actions.do_mark_lost(now=started + lost_after / 2) == []  # the server restarted since it last beat
    assert TrainingJob.objects.get(pk=job_id).status == JobStatus.RUNNING
    assert actions.do_mark_lost(now=started + lost_after + timedelta(seconds=1)) == [
        TrainingJob.objects.get(pk=job_id).pk]


def test_a_worker_whose_clock_is_off_is_not_taken_for_a_dead_one(fake_runner, api, adapter_name, settings,
                                                                   monkeypatch):
    """Workers run on machines of their own (docker-compose.yml): one whose clock runs minutes behind the web
    machine's still beats, so its job is never marked lost, and its run never told to stop, for that. Every
    liveness stamp is the database's clock, which the lost-job check reads too."""
    job_id = submit(api, sft_body(adapter_name))
    real_now = timezone.now
    skew = timedelta(seconds=5 * settings.KILN_LOST_AFTER_SECONDS)
    monkeypatch.setattr(timezone, "now", lambda: real_now() - skew)  # the worker's machine
    assert actions.do_claim_job(job_id, "worker-behind")
    assert actions.do_record_step(job_id, "worker-behind", {"step": 1, "loss": 1.0})
    assert actions.do_heartbeat(job_id, "worker-behind") == JobStatus.RUNNING
    monkeypatch.setattr(timezone, "now", real_now)  # the web machine's lost-job check
    assert actions.do_mark_lost() == []
    assert TrainingJob.objects.get(pk=job_id).status == JobStatus.RUNNING
    # one that stopped beating is still lost, by the database's clock
    later = actions.database_now() + timedelta(seconds=settings.KILN_LOST_AFTER_SECONDS + 2)
    assert actions.do_mark_lost(now=later) == [TrainingJob.objects.get(pk=job_id).pk]


def test_heartbeat_keeps_a_job_alive(fake_runner, api, adapter_name, settings):
    job_id = submit(api, sft_body(adapter_name))
    actions.do_claim_job(job_id, "worker-a")
    TrainingJob.objects.filter(pk=job_id).update(heartbeat_at=timezone.now() - timedelta(days=1))
    assert actions.do_heartbeat(job_id, "worker-a") == JobStatus.RUNNING
    assert actions.do_heartbeat(job_id, "worker-b") is None
    assert actions.do_mark_lost() == []


def test_should_cancel_polls_at_most_every_interval(fake_runner, api, adapter_name, django_assert_num_queries):
    job_id = submit(api, sft_body(adapter_name))
    actions.do_claim_job(job_id, "worker-a")
    now = [100.0]
    hooks = JobHooks(job_id, "worker-a", poll_seconds=5, clock=lambda: now[0])
    with django_assert_num_queries(1):
        assert [hooks.should_cancel() for _ in range(10)] == [False] * 10
    actions.do_cancel_job(job_id)
    assert hooks.should_cancel() is False  # not asked again yet
    now[0] += 5
    assert hooks.should_cancel() is True


# -- channel-layer events --


def _receive(layer, channel, timeout=0.2):
    async def receive():
        return await asyncio.wait_for(layer.receive(channel), timeout)

    try:
        return async_to_sync(receive)()
    except asyncio.TimeoutError:
        return None


def test_events_reach_the_channel_layer_only_after_commit(fake_runner, api, ada, bob, adapter_name,
                                                          django_capture_on_commit_callbacks):
    job_id = submit(api, sft_body(adapter_name))
    layer = get_channel_layer()
    watcher, stranger = async_to_sync(layer.new_channel)(), async_to_sync(layer.new_channel)()
    async_to_sync(layer.group_add)(group_name("job", job_id), watcher)
    async_to_sync(layer.group_add)(group_name("user", bob.pk), stranger)
    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        actions.do_cancel_job(job_id, reason="test")
    assert _receive(layer, watcher) is None  # nothing before the commit
    for callback in callbacks:
        callback()
    received = [_receive(layer, watcher), _receive(layer, watcher)]
    assert {m["type"] for m in received} == {"job.event", "job.status"}
    status = next(m for m in received if m["type"] == "job.status")
    assert status["job_id"] == job_id and status["status"] == "cancelled"
    assert _receive(layer, stranger) is None  # another person's group hears nothing


# -- the embedded worker stops cleanly --


def test_stopping_the_worker_cancels_its_running_job(fake_runner, api, adapter_name, monkeypatch):
    """Stop requested while a run is in progress: the run publishes at the next boundary and ends cancelled."""
    fake_runner.KILN_CANCEL_POLL_SECONDS = 0
    job_id = submit(api, sft_body(adapter_name, records=6, checkpoint_interval=100))
    worker = EmbeddedWorker()
    record = actions.do_record_step

    def stop_at_step_two(job, worker_id, metrics):
        recorded = record(job, worker_id, metrics)
        if metrics["step"] == 2:
            worker._stop.set()  # what stop() does from another thread, minus the join
        return recorded

    monkeypatch.setattr(actions, "do_record_step", stop_at_step_two)
    assert worker.run_once()
    job = TrainingJob.objects.get(pk=job_id)
    assert job.status == JobStatus.CANCELLED
    assert job.latest_checkpoint["resume_checkpoint"].endswith("step-00000002.kiln-checkpoint")
    assert job.events.filter(message__startswith="the worker is stopping").exists()
    assert CheckpointRecord.objects.filter(job=job).count() == 1
    assert worker.run_once() is False  # stopping: claims nothing more


# -- admin --


def test_admin_pages_render(fake_runner, api, adapter_name, admin_client):
    job_id = submit(api, sft_body(adapter_name, records=2, checkpoint_interval=1))
    run_queued()
    record = CheckpointRecord.objects.first()
    for url in ("/admin/jobs/trainingjob/", f"/admin/jobs/trainingjob/{job_id}/change/",
                "/admin/jobs/trainingjob/?status__exact=succeeded", f"/admin/jobs/trainingjob/?q={adapter_name}",
                "/admin/jobs/jobmetric/", "/admin/jobs/jobevent/", "/admin/adapters/adapter/",
                "/admin/adapters/checkpointrecord/", f"/admin/adapters/checkpointrecord/{record.pk}/change/",
                "/admin/accounts/apitoken/"):
        assert admin_client.get(url).status_code == 200, url


@pytest.mark.django_db
def test_a_recorded_checkpoint_takes_its_digest_from_the_run_without_reading_the_manifest_again(
        fake_runner, ada, adapter_name, monkeypatch):
    from kiln_web.jobs import runtime

    job_id = actions.do_submit_job(ada, {}, sft_body(adapter_name)).pk
    assert actions.do_claim_job(job_id, "worker-a")

    def read_again(basename):
        raise AssertionError(f"{basename}'s manifest was read again after publication")

    monkeypatch.setattr(runtime, "manifest_digest", read_again)
    summary = {"resume_checkpoint": f"{adapter_name}-step-2.kiln-checkpoint", "step": 2, "checkpoint_id": "c" * 64,
               "manifest_sha256": "ab" * 32}
    JobHooks(job_id, "worker-a").on_checkpoint(summary, {})
    assert CheckpointRecord.objects.get(basename=summary["resume_checkpoint"]).manifest_digest == "ab" * 32
