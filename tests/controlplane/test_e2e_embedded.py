"""End to end with the real trainer (trainer.runs.sft, the built-in kiln-tiny base) and the embedded
worker, in-process: submit through the API, run, and prove cancel-then-resume byte for byte."""

import pytest

from kiln_web.jobs import actions
from kiln_web.jobs.models import JobMetric, TrainingJob
from kiln_web.jobs.worker import EmbeddedWorker

from tests.engine.conftest import cuda_environment, emulated_library  # noqa: F401  (fixtures used here)

from .conftest import sft_body

pytestmark = [pytest.mark.slow, pytest.mark.django_db]

STATE_FILES = ("adapter.safetensors", "optimizer.safetensors", "state.json")


@pytest.fixture
def real_runner(settings):
    settings.KILN_SFT_RUNNER = "trainer.runs.sft"
    settings.KILN_HEARTBEAT_SECONDS = 3600
    settings.KILN_CANCEL_POLL_SECONDS = 0
    return settings


def request(adapter, **config):
    body = sft_body(adapter, records=4, epochs=2, checkpoint_interval=3, seed=17, **config)
    body["data"] = [{"messages": [{"role": "user", "content": f"Say {word}."},
                                  {"role": "assistant", "content": f"{word.upper()}!"}]}
                    for word in ("kiln", "clay", "glaze", "fire")]
    return body


def submit_and_run(api, body, cancel_at_step=None, monkeypatch=None):
    response = api.post("/v1/train/sft", body)
    assert response.status_code == 201, response.content
    job_id = response.json()["id"]
    if cancel_at_step is not None:
        record = actions.do_record_step

        def record_then_cancel(job, worker_id, metrics):
            recorded = record(job, worker_id, metrics)
            if metrics["step"] == cancel_at_step:
                actions.do_cancel_job(job, reason="test")
            return recorded

        monkeypatch.setattr(actions, "do_record_step", record_then_cancel)
    assert EmbeddedWorker().run_once()
    if monkeypatch is not None:
        monkeypatch.undo()
    return api.get(f"/v1/train/jobs/{job_id}").json()


def final_bytes(settings, job):
    path = settings.KILN_ADAPTERS_DIR / job["latest_checkpoint"]["resume_checkpoint"]
    return {name: (path / name).read_bytes() for name in STATE_FILES}


def test_submit_run_succeed_with_metrics(real_runner, api, adapter_name):
    job = submit_and_run(api, request(adapter_name))
    assert job["status"] == "succeeded", job["error"]
    assert job["progress"] == {"committed_step": 8, "total_steps": 8}
    assert job["effective_seed"] == 17 and job["effective_config"]["base_model"] == "kiln-tiny"
    assert job["identities"]["planning"]["schema"] == "kiln.training-checkpoint-planning.v5"
    assert job["latest_checkpoint"]["complete"] is True
    metrics = list(JobMetric.objects.filter(job_id=job["id"]).order_by("step"))
    assert [m.step for m in metrics] == list(range(1, 9))
    assert all(m.metrics["loss"] > 0 and m.metrics["grad_norm"] >= 0 for m in metrics)
    checkpoints = api.get(f"/v1/train/jobs/{job['id']}/checkpoints").json()["items"]
    assert [c["step"] for c in checkpoints] == [3, 6, 8] and all(c["present"] for c in checkpoints)


def test_cancel_then_resume_is_byte_identical_to_an_uninterrupted_run(real_runner, api, adapter_name, monkeypatch):
    whole = submit_and_run(api, request(adapter_name + "-whole"))
    assert whole["status"] == "succeeded", whole["error"]

    parted = request(adapter_name)
    cancelled = submit_and_run(api, parted, cancel_at_step=4, monkeypatch=monkeypatch)
    assert cancelled["status"] == "cancelled"
    basename = cancelled["latest_checkpoint"]["resume_checkpoint"]
    assert cancelled["latest_checkpoint"]["committed_step"] == 4
    assert cancelled["latest_checkpoint"]["complete"] is False

    parted["config"]["resume_checkpoint"] = basename
    resumed = submit_and_run(api, parted)
    assert resumed["status"] == "succeeded", resumed["error"]
    assert resumed["resume_from"] == basename and resumed["progress"]["committed_step"] == 8
    assert final_bytes(real_runner, resumed) == final_bytes(real_runner, whole)
    losses = [m.metrics["loss"] for m in JobMetric.objects.filter(job_id=whole["id"]).order_by("step")]
    resumed_losses = [m.metrics["loss"] for m in JobMetric.objects.filter(
        job_id__in=[cancelled["id"], resumed["id"]]).order_by("step")]
    assert resumed_losses == losses


def test_resume_drift_and_dequeue_revalidation(real_runner, api, adapter_name, monkeypatch):
    body = request(adapter_name)
    cancelled = submit_and_run(api, body, cancel_at_step=2, monkeypatch=monkeypatch)
    basename = cancelled["latest_checkpoint"]["resume_checkpoint"]

    drifted = request(adapter_name, resume_checkpoint=basename)
    drifted["config"]["learning_rate"] = 0.01
    response = api.post("/v1/train/sft", drifted)
    assert response.status_code == 409
    error = response.json()["error"]
    assert error["code"] == "resume_drift"
    assert {"field": "config.learning_rate", "checkpoint": 0.0002, "request": 0.01} in error["differences"]

    body["config"]["resume_checkpoint"] = basename
    response = api.post("/v1/train/sft", body)
    assert response.status_code == 201
    state = real_runner.KILN_ADAPTERS_DIR / basename / "state.json"
    raw = state.read_bytes()
    state.write_bytes(raw.replace(b'"step":2', b'"step":3', 1))  # same size, other bytes
    assert EmbeddedWorker().run_once()
    job = TrainingJob.objects.get(pk=response.json()["id"])
    assert job.status == "failed" and job.error_code == "checksum_mismatch", (job.error_code, job.error_message)
    assert not JobMetric.objects.filter(job=job).exists()


def test_cancel_then_resume_on_cuda_is_byte_identical(real_runner, api, adapter_name, monkeypatch,
                                                      cuda_environment):  # noqa: F811
    """The same proof on the cuda backend (a GPU, or the host emulation of the library as the loader's device):
    the jobs record cuda and its device, and the resumed run's state files equal the uninterrupted run's."""
    whole = submit_and_run(api, request(adapter_name + "-whole", backend="cuda"))
    assert whole["status"] == "succeeded", whole["error"]
    assert whole["effective_config"]["backend"] == "cuda"
    assert whole["identities"]["execution"]["backend"] == "cuda" and whole["identities"]["execution"]["gpu"]["name"]
    parted = request(adapter_name, backend="cuda")
    cancelled = submit_and_run(api, parted, cancel_at_step=4, monkeypatch=monkeypatch)
    assert cancelled["status"] == "cancelled" and cancelled["latest_checkpoint"]["committed_step"] == 4
    parted["config"]["resume_checkpoint"] = cancelled["latest_checkpoint"]["resume_checkpoint"]
    resumed = submit_and_run(api, parted)
    assert resumed["status"] == "succeeded", resumed["error"]
    assert final_bytes(real_runner, resumed) == final_bytes(real_runner, whole)
