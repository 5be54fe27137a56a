"""POST /v1/train/grpo and /v1/train/opd with the real trainer's admission: schema and trainer refusals,
and one short GRPO run by the worker code whose metrics and checkpoints carry the policy audit."""

import pytest

from kiln_web.jobs.models import TrainingJob
from kiln_web.jobs.worker import EmbeddedWorker

from .rl_data import GROUPS, grpo_inline, opd_request, write_groups

pytestmark = pytest.mark.django_db


def refused(api, kind, body, status=400):
    response = api.post(f"/v1/train/{kind}", body)
    assert response.status_code == status, response.content
    assert not TrainingJob.objects.exists()
    return response.json()["error"]


@pytest.mark.parametrize("kind, body, field, words", [
    ("grpo", lambda n: {**grpo_inline(n), "dataset_path": "/x.jsonl"}, "dataset_path",
     "exactly one of dataset_path and groups"),
    ("grpo", lambda n: grpo_inline(n, loss_type="ppo"), "config.loss_type", "grpo"),
    ("grpo", lambda n: grpo_inline(n, epsilon=1.5), "config.epsilon", "less than 1"),
    ("grpo", lambda n: grpo_inline(n, reference={"type": "ema", "mixup_alpha": 2}), "config.reference.mixup_alpha",
     "less than or equal to 1"),
    ("grpo", lambda n: grpo_inline(n, quantization={"type": "nf4"}), "config.quantization", "unknown field"),
    ("grpo", lambda n: grpo_inline(n, streaming=True), "config.streaming", "dataset_path"),  # the trainer's
    ("grpo", lambda n: {**grpo_inline(n), "groups": [{"prompt": "a", "completions": [{"text": "b", "reward": 1}]}]},
     "groups[0]", "at least two"),
    ("opd", lambda n: {**opd_request(n, "tutor@native"), "prompts": []}, "prompts", "at least 1"),
    ("opd", lambda n: opd_request(n, "tutor"), "config.teacher", "pattern"),
    ("opd", lambda n: opd_request(n, "tutor@native", guardrails={"max_empty_rate": 2}),
     "config.guardrails.max_empty_rate", "less than or equal to 1"),
    ("opd", lambda n: {"prompts": ["a"], "config": {"output_name": n}}, "config.teacher", "required"),
])
def test_refusals_name_the_field(api, adapter_name, kind, body, field, words):
    error = refused(api, kind, body(adapter_name))
    assert error["code"] == "invalid_request" and error.get("field") == field, error
    assert words in error["message"], error


def test_a_streamed_file_outside_the_data_roots_is_refused(api, adapter_name, tmp_path):
    path = write_groups(tmp_path / "groups.jsonl")
    error = refused(api, "grpo", {"dataset_path": path, "config": {"output_name": adapter_name, "streaming": True}})
    assert error["code"] == "dataset_outside_roots", error


def test_a_short_grpo_run_reports_the_policy_audit(api, adapter_name, settings):
    settings.KILN_HEARTBEAT_SECONDS = 3600
    path = write_groups(settings.KILN_DATASETS_DIR / f"{adapter_name}.jsonl")
    response = api.post("/v1/train/grpo", {"dataset_path": path, "config": {
        "output_name": adapter_name, "seed": 3, "streaming": True, "checkpoint_interval": 2,
        "lora": {"rank": 4, "alpha": 8}, "max_completion_length": 8, "beta": 0.1}})
    assert response.status_code == 201, response.content
    job = response.json()
    assert job["kind"] == "grpo" and job["data_source_kind"] == "streamed_jsonl" and job["teacher"] is None
    assert job["progress"]["total_steps"] == len(GROUPS) and job["effective_config"]["loss_type"] == "dapo"
    assert job["identities"]["planning"]["schema"] == "kiln.training-checkpoint-planning.v3"
    assert EmbeddedWorker().run_once()
    job = api.get(f"/v1/train/jobs/{job['id']}").json()
    assert job["status"] == "succeeded", job["error"]
    cursor = job["latest_checkpoint"]["next_cursor"]
    assert job["latest_checkpoint"]["training_kind"] == "grpo" and job["latest_checkpoint"]["complete"] is True
    assert {"group_sha256", "line", "byte", "consumed_lines", "consumed_lines_sha256"} <= set(cursor)
    metrics = api.get(f"/v1/train/jobs/{job['id']}/metrics").json()["items"]
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    for key in ("clip_low_fraction", "clip_high_fraction", "clip_region_fraction", "kl_mean", "ratio_mean",
                "ratio_min", "ratio_max", "reward_mean", "reward_std", "advantage_mean", "advantage_std"):
        assert all(isinstance(m.get(key), float) for m in metrics), (key, sorted(metrics[0]))
    checkpoints = api.get(f"/v1/train/jobs/{job['id']}/checkpoints").json()["items"]
    assert [c["step"] for c in checkpoints] == [2, 4]
    assert all(c["present"] and c["summary"]["training_kind"] == "grpo" for c in checkpoints)
