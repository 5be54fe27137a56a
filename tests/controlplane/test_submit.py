"""POST /v1/train/sft: shapes checked by the schema, meaning by admission; a refusal creates nothing."""

import pytest

from kiln_web.adapters.models import Adapter
from kiln_web.jobs.models import JobEvent, TrainingJob

from .conftest import ApiClient, sft_body

pytestmark = pytest.mark.django_db


def assert_nothing_created():
    assert not TrainingJob.objects.exists()
    assert not Adapter.objects.exists()
    assert not JobEvent.objects.exists()


def refused(api, body, status=400):
    response = api.post("/v1/train/sft", body)
    assert response.status_code == status, response.content
    assert_nothing_created()
    return response.json()["error"]


def test_submit_queues_a_job_with_the_admitted_values(fake_runner, api, adapter_name, django_capture_on_commit_callbacks):
    body = sft_body(adapter_name, records=3, epochs=2, seed=11, checkpoint_interval=2)
    with django_capture_on_commit_callbacks() as callbacks:
        response = api.post("/v1/train/sft", body)
    assert response.status_code == 201, response.content
    job = response.json()
    assert job["status"] == "queued" and job["kind"] == "sft" and job["owner"] == "ada"
    assert job["adapter"] == adapter_name and job["data_source_kind"] == "inline"
    assert job["effective_seed"] == 11
    assert job["effective_config"]["checkpoint_interval"] == 2
    assert job["progress"] == {"committed_step": 0, "total_steps": 6}
    assert job["latest_checkpoint"] is None and job["error"] is None
    row = TrainingJob.objects.get(pk=job["id"])
    assert row.request == body  # as submitted
    assert row.admission["adapter"] == adapter_name
    assert len(callbacks) >= 1  # the enqueue waits for the commit


def test_server_checkpoint_interval_applies_when_the_request_has_none(fake_runner, api, adapter_name):
    fake_runner.KILN_CHECKPOINT_INTERVAL = 7
    job = api.post("/v1/train/sft", sft_body(adapter_name)).json()
    assert job["effective_config"]["checkpoint_interval"] == 7
    job = api.post("/v1/train/sft", sft_body(adapter_name + "-b", checkpoint_interval=3)).json()
    assert job["effective_config"]["checkpoint_interval"] == 3


@pytest.mark.parametrize("interval", [0, -1])
def test_checkpoint_interval_must_be_positive(fake_runner, api, adapter_name, interval):
    error = refused(api, sft_body(adapter_name, checkpoint_interval=interval))
    assert error["code"] == "invalid_request"
    assert error["field"] == "config.checkpoint_interval"
    assert "greater than 0" in error["message"]


@pytest.mark.parametrize("body, field, words", [
    (lambda n: {"data": [{"prompt": "a", "completion": "b"}], "config": {}}, "config.output_name", "required"),
    (lambda n: {"data": [{"prompt": "a", "completion": "b"}]}, "config", "required"),
    (lambda n: sft_body(n, warmup=3), "config.warmup", "unknown field"),
    (lambda n: {**sft_body(n), "priority": 1}, "priority", "unknown field"),
    (lambda n: sft_body(n, lora={"rank": 4, "dropout": 0.1}), "config.lora.dropout", "unknown field"),
    (lambda n: sft_body(n, epochs="3"), "config.epochs", "integer"),
    (lambda n: sft_body(n, epochs=True), "config.epochs", "integer"),
    (lambda n: sft_body(n, learning_rate=0), "config.learning_rate", "greater than 0"),
    (lambda n: sft_body(n, lr_schedule={"type": "step"}), "config.lr_schedule.type", "constant"),
    (lambda n: sft_body(n, quantization={"type": "int8"}), "config.quantization.type", "nf4"),
    (lambda n: sft_body(n, seed=-5), "config.seed", "greater than or equal to 0"),
    (lambda n: sft_body(n, seed=2**64), "config.seed", "less than or equal"),
    (lambda n: sft_body("../escape"), "config.output_name", "pattern"),
    (lambda n: {**sft_body(n), "dataset_path": "/tmp/x.jsonl"}, "dataset_path", "exactly one of dataset_path and data"),
    (lambda n: {"config": {"output_name": n}}, "dataset_path", "exactly one of dataset_path and data"),
    (lambda n: {**sft_body(n), "data": []}, "data", "at least 1"),
])
def test_schema_refusals_name_the_field(fake_runner, api, adapter_name, body, field, words):
    error = refused(api, body(adapter_name))
    assert error["code"] == "invalid_request"
    assert error.get("field") == field
    assert words in error["message"]


@pytest.mark.parametrize("body", [lambda n: {**sft_body(n), "dataset_path": "/tmp/x.jsonl"},
                                  lambda n: {"config": {"output_name": n}}])
def test_both_or_neither_source_is_a_clean_refusal_of_dataset_path(fake_runner, api, adapter_name, body):
    """A model validator's refusal names its field and says nothing of pydantic ("Value error", "the request")."""
    assert refused(api, body(adapter_name)) == {
        "code": "invalid_request", "field": "dataset_path",
        "message": "dataset_path: give exactly one of dataset_path and data"}


def test_malformed_json_is_refused(fake_runner, api):
    response = api.client.post("/v1/train/sft", "{not json", content_type="application/json")
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "invalid_request"
    assert_nothing_created()


def test_trainer_request_error_maps_to_400_with_its_field(fake_runner, api, adapter_name):
    error = refused(api, sft_body(adapter_name, base_model="bad-request"))
    assert error == {"code": "invalid_request", "field": "config.base_model",
                     "message": "is not acceptable to the fake"}


def test_admission_error_maps_to_400_with_its_code(fake_runner, api, adapter_name):
    error = refused(api, sft_body(adapter_name, base_model="missing"))
    assert error["code"] == "base_not_found"
    assert "kiln base list" in error["message"]


def test_dataset_outside_the_data_roots(fake_runner, api, adapter_name, tmp_path):
    outside = tmp_path / "data.jsonl"
    outside.write_text('{"prompt": "a", "completion": "b"}\n')
    error = refused(api, {"dataset_path": str(outside), "config": {"output_name": adapter_name}})
    assert error["code"] == "dataset_outside_roots"


def test_dataset_inside_a_configured_root(fake_runner, api, adapter_name, tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text('{"prompt": "a", "completion": "b"}\n{"prompt": "c", "completion": "d"}\n')
    fake_runner.KILN_DATA_ROOTS = (fake_runner.KILN_DATASETS_DIR, tmp_path)
    response = api.post("/v1/train/sft", {"dataset_path": str(data), "config": {"output_name": adapter_name}})
    assert response.status_code == 201, response.content
    job = response.json()
    assert job["data_source_kind"] == "file" and job["dataset_path"] == str(data)


@pytest.mark.parametrize("reference, code", [
    ("../elsewhere-checkpoint-step-00000001.kiln-checkpoint", "outside_registry"),
    ("nested/bot-checkpoint-step-00000001.kiln-checkpoint", "outside_registry"),
    ("/tmp/bot-checkpoint-step-00000001.kiln-checkpoint", "outside_registry"),
    ("not-a-checkpoint-name", "noncanonical_name"),
    ("{adapter}-checkpoint-step-00000099.kiln-checkpoint", "not_found"),
])
def test_resume_references_refused_before_any_work(fake_runner, api, adapter_name, reference, code):
    error = refused(api, sft_body(adapter_name, resume_checkpoint=reference.format(adapter=adapter_name)))
    assert error["code"] == code, error
    assert error["message"]


def test_request_too_large(fake_runner, api, adapter_name):
    fake_runner.KILN_UPLOAD_MAX_BYTES = fake_runner.DATA_UPLOAD_MAX_MEMORY_SIZE = 2048
    error = refused(api, sft_body(adapter_name, records=200), status=413)
    assert error["code"] == "request_too_large"
    assert "dataset_path" in error["message"]


def test_adapter_of_another_user_is_refused(fake_runner, api, bob, adapter_name):
    assert ApiClient(bob.token).post("/v1/train/sft", sft_body(adapter_name)).status_code == 201
    response = api.post("/v1/train/sft", sft_body(adapter_name))
    assert response.status_code == 409
    error = response.json()["error"]
    assert error["code"] == "adapter_name_taken" and "bob" not in error["message"]  # taken, never whose
    assert TrainingJob.objects.count() == 1


def test_one_active_job_per_adapter(fake_runner, api, adapter_name):
    first = api.post("/v1/train/sft", sft_body(adapter_name)).json()
    response = api.post("/v1/train/sft", sft_body(adapter_name))
    assert response.status_code == 409
    error = response.json()["error"]
    assert error["code"] == "adapter_busy" and error["job_id"] == first["id"]
    assert TrainingJob.objects.count() == 1
    assert api.post(f"/v1/train/jobs/{first['id']}/cancel").json()["status"] == "cancelled"
    assert api.post("/v1/train/sft", sft_body(adapter_name)).status_code == 201


def test_an_unimportable_runner_is_a_503_that_says_so(fake_runner, api, adapter_name):
    fake_runner.KILN_SFT_RUNNER = "trainer.runs.no_such_module"
    error = refused(api, sft_body(adapter_name), status=503)
    assert error["code"] == "runner_unavailable" and "pip install -e ." in error["message"]
