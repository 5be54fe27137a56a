"""config.precision through the HTTP API, the CLI and the dashboard form (the real SFT admission): bfloat16 is
recorded in the effective configuration and the execution identity, and refused with the reason where the CPU or
the library cannot run it (tests/runs/test_precision.py runs it; tests/engine/test_bf16_base.py checks its
numbers)."""

import pytest

from kiln_web.jobs.models import TrainingJob
from native_ext import onednn

from .conftest import cli_runner, sft_body

UNAVAILABLE = onednn.unavailable_reason()
NO_FLAGS = "this CPU has no BF16 dot-product instructions"


@pytest.fixture
def real_sft(settings):
    settings.KILN_SFT_RUNNER = "trainer.runs.sft"
    settings.KILN_HEARTBEAT_SECONDS = 3600
    settings.KILN_CANCEL_POLL_SECONDS = 0
    settings.KILN_TRAINING_BACKEND = "cpu"
    return settings


@pytest.fixture
def no_bf16(monkeypatch):
    monkeypatch.setattr(onednn, "cpu_bf16_flags", lambda: ())


@pytest.mark.django_db
@pytest.mark.skipif(UNAVAILABLE is not None, reason=f"no bfloat16 route here: {UNAVAILABLE}")
def test_the_api_records_a_bf16_precision(real_sft, api, adapter_name):
    response = api.post("/v1/train/sft", sft_body(adapter_name, records=2, seed=1, precision="bfloat16"))
    assert response.status_code == 201, response.content
    job = response.json()
    assert job["effective_config"]["precision"] == "bfloat16"
    execution = job["identities"]["execution"]
    assert execution["precision"] == "bfloat16" and execution["onednn"]["threads"] >= 1
    plain = api.post("/v1/train/sft", sft_body(adapter_name + "-f", records=2, seed=1)).json()
    assert "precision" not in plain["effective_config"] and plain["identities"]["execution"]["precision"] == "float32"


@pytest.mark.django_db
def test_the_api_refuses_bf16_where_it_cannot_run(real_sft, api, adapter_name, no_bf16):
    response = api.post("/v1/train/sft", sft_body(adapter_name, records=2, precision="bfloat16"))
    assert response.status_code == 400, response.content
    error = response.json()["error"]
    assert error["code"] == "backend_unavailable" and NO_FLAGS in error["message"]
    assert error["field"] == "config.precision"  # the precision, not the backend, cannot run here
    bad = api.post("/v1/train/sft", sft_body(adapter_name, records=2, precision="float16"))
    assert bad.status_code in (400, 422) and "precision" in bad.content.decode()
    assert not TrainingJob.objects.exists()


@pytest.mark.django_db
def test_the_api_refuses_tfloat32_off_cuda_with_the_loaders_reason(real_sft, api, adapter_name):
    """tfloat32 is a CUDA tensor-core precision: refused on this server's cpu default, and with backend auto or cuda
    on a machine without a usable device, with the real loader's reason; both on config.precision."""
    from trainer.runs.backend import cuda_unavailable, probe_cuda

    reason = cuda_unavailable(probe_cuda())
    if reason is None:
        pytest.skip("a usable CUDA device is here: tfloat32 runs")
    refused = api.post("/v1/train/sft", sft_body(adapter_name, records=2, precision="tfloat32"))
    assert refused.status_code == 400, refused.content
    error = refused.json()["error"]
    assert error["code"] == "backend_unavailable" and "the cpu backend computes float32 or bfloat16" in error["message"]
    assert error["field"] == "config.precision"
    for backend in ("auto", "cuda"):
        refused = api.post("/v1/train/sft", sft_body(adapter_name, records=2, precision="tfloat32", backend=backend))
        assert refused.status_code == 400, refused.content
        error = refused.json()["error"]
        assert error["code"] == "backend_unavailable" and error["field"] == "config.precision"
        assert reason in error["message"] and "precision tfloat32 needs a CUDA device" in error["message"]
    assert not TrainingJob.objects.exists()


@pytest.fixture
def cli(live_server, real_sft, monkeypatch, capsys, ada, tmp_path):
    return cli_runner(live_server.url, ada.token, monkeypatch, capsys, tmp_path)


@pytest.mark.django_db(transaction=True)
def test_the_cli_sends_precision_and_shows_the_refusal(cli, tmp_path, adapter_name, no_bf16):
    import json

    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in sft_body("x", records=2)["data"]))
    code, out, err = cli("train", "sft", "--file", str(data), "--adapter", adapter_name, "--precision", "bfloat16")
    assert code == 1 and "backend_unavailable" in err and NO_FLAGS in err, (out, err)
    assert not TrainingJob.objects.exists()


@pytest.mark.django_db
def test_the_dashboard_form_offers_precision_and_shows_its_refusal_there(real_sft, ada, adapter_name, no_bf16):
    from django.test import Client

    from dashboard.conftest import csrf_post, field_errors, upload

    client = Client()
    client.force_login(ada)
    form = client.get("/jobs/new/sft/").content.decode()
    assert 'name="precision"' in form and all(f'value="{p}"' in form for p in ("float32", "bfloat16"))
    response = csrf_post(client, "/jobs/new/sft/", {"output_name": adapter_name, "data": upload(),
                                                    "precision": "bfloat16"})
    assert response.status_code == 400
    errors = field_errors(response.content.decode(), "precision")
    assert errors and NO_FLAGS in " ".join(errors), errors
    assert not TrainingJob.objects.exists()
