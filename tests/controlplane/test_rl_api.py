"""GRPO and OPD end to end as deployed: `kiln up` and a SEPARATE Celery worker process on a real Redis
broker, a temporary KILN_HOME, the real trainer on kiln-tiny, everything through the HTTP API.

For inline GRPO, streamed GRPO and OPD with a native teacher: a fresh repeat, and a cancelled run
resumed from its checkpoint, end byte-identical to an uninterrupted run (every file of the final
checkpoint, the final adapter's bytes, the metric history). Refusals specific to each: changed source
bytes for a streamed resume, a teacher alias whose identity or content revision changed, a checkpoint
of the wrong training kind."""

import json
import shutil

import pytest

from kiln_web.client import ApiError
from trainer.runs.checkpoint_dir import MANIFEST

from .rl_data import grpo_inline, grpo_streamed, opd_request, write_groups, write_teacher_adapter
from .services import TERMINAL, celery_stack, sft_request

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with celery_stack(tmp_path_factory.mktemp("kiln-rl-home")) as running:
        yield running


@pytest.fixture(scope="module")
def tutor(stack):
    """tutor@native: kiln-tiny with a random PEFT adapter in the server's data root."""
    adapter = write_teacher_adapter(stack.home, stack.home / "datasets" / "tutor-adapter", seed=5)
    stack.client.create_teacher({"name": "tutor@native", "base": "kiln-tiny", "adapter": str(adapter)})
    return "tutor@native"


@pytest.fixture(scope="module")
def groups_file(stack):
    return write_groups(stack.home / "datasets" / "groups.jsonl")


# -- helpers --


def finish(stack, kind, body) -> dict:
    job = stack.client.submit(kind, body)
    job = stack.wait(job["id"], lambda j: j["status"] in TERMINAL)
    assert job["status"] == "succeeded", (job["error"], stack.worker.output[-3000:])
    return job


def cancel_midway(stack, kind, body) -> dict:
    adapter = body["config"]["output_name"]
    stack.hold(adapter, step=2)  # these runs take well under a second: held after step 2, then cancelled
    job = stack.client.submit(kind, body)
    stack.wait_held(adapter, job["id"])
    stack.client.cancel(job["id"])
    job = stack.wait(job["id"], lambda j: j["status"] in TERMINAL)
    stack.release(adapter)
    assert job["status"] == "cancelled", (job["error"], stack.worker.output[-3000:])
    checkpoint = job["latest_checkpoint"]
    assert checkpoint["complete"] is False and checkpoint["committed_step"] == job["progress"]["committed_step"]
    return job


def metric_history(stack, job) -> list:
    """Every recorded step's metrics except the wall-clock ones."""
    items = stack.client.metrics(job["id"])["items"]
    return [{key: value for key, value in item.items() if key != "elapsed_seconds"} for item in items]


def final_state(stack, job) -> dict:
    """The final checkpoint's files (all but the manifest, which names the adapter) and the final adapter."""
    checkpoint = stack.home / "adapters" / job["latest_checkpoint"]["resume_checkpoint"]
    files = {path.name: path.read_bytes() for path in sorted(checkpoint.iterdir()) if path.name != MANIFEST}
    final = stack.home / "adapters" / job["adapter"]
    files["final adapter_model.safetensors"] = (final / "adapter_model.safetensors").read_bytes()
    return files


def resume(body: dict, basename: str) -> dict:
    return {**body, "config": {**body["config"], "resume_checkpoint": basename}}


def refused(stack, kind, body, status) -> dict:
    """The error object of a submission the API refuses with STATUS."""
    with pytest.raises(ApiError) as info:
        stack.client.submit(kind, body)
    assert info.value.status == status, info.value.error
    return info.value.error


# -- exactness --


# kind, request, steps: enough steps (a few milliseconds each on kiln-tiny) that a cancellation sent
# after step 2 lands well before the end
MODES = {
    "grpo-inline": ("grpo", lambda adapter, context: grpo_inline(adapter, epochs=15, checkpoint_interval=10), 60),
    "grpo-streamed": ("grpo", lambda adapter, context: grpo_streamed(adapter, context["groups"], epochs=15,
                                                                     checkpoint_interval=10), 60),
    "opd-native": ("opd", lambda adapter, context: opd_request(adapter, context["tutor"], steps=60,
                                                              checkpoint_interval=10), 60),
}


@pytest.mark.parametrize("mode", MODES)
def test_fresh_repeat_and_cancel_then_resume_are_byte_identical(stack, tutor, groups_file, mode):
    kind, build, steps = MODES[mode]
    context = {"groups": groups_file, "tutor": tutor}
    whole = finish(stack, kind, build(f"{mode}-whole", context))
    assert whole["kind"] == kind and whole["progress"] == {"committed_step": steps, "total_steps": steps}
    assert whole["worker_id"].startswith("celery:kiln-test-")
    history = metric_history(stack, whole)
    assert [m["step"] for m in history] == list(range(1, steps + 1))
    checkpoints = stack.client.request("GET", f"/train/jobs/{whole['id']}/checkpoints")["items"]
    assert [c["step"] for c in checkpoints] == list(range(10, steps + 1, 10))
    assert {c["summary"]["training_kind"] for c in checkpoints} == {kind}

    again = finish(stack, kind, build(f"{mode}-again", context))
    assert metric_history(stack, again) == history
    assert final_state(stack, again) == final_state(stack, whole)

    body = build(f"{mode}-cut", context)
    cancelled = cancel_midway(stack, kind, body)
    basename = cancelled["latest_checkpoint"]["resume_checkpoint"]
    resumed = stack.client.submit(kind, resume(body, basename))
    assert resumed["resume_from"] == basename
    resumed = stack.wait(resumed["id"], lambda j: j["status"] in TERMINAL)
    assert resumed["status"] == "succeeded", resumed["error"]
    assert metric_history(stack, cancelled) + metric_history(stack, resumed) == history
    assert json.dumps(metric_history(stack, resumed)) == json.dumps(history[cancelled["progress"]["committed_step"]:])
    assert final_state(stack, resumed) == final_state(stack, whole)
    if kind == "opd":
        assert resumed["teacher"] == whole["teacher"] and resumed["teacher"]["alias"] == tutor
        assert resumed["latest_checkpoint"]["teacher"]["identity_revision"] == whole["teacher"]["identity_revision"]
    else:
        assert "clip_region_fraction" in history[0] and "kl_mean" in history[0]


# -- refusals --


def test_streamed_resume_refuses_changed_source_bytes(stack):
    path = write_groups(stack.home / "datasets" / "changing-groups.jsonl")
    body = grpo_streamed("stream-refusal", path, epochs=1, checkpoint_interval=1)
    finish(stack, "grpo", body)
    original = open(path, "rb").read()
    with open(path, "wb") as handle:  # one byte of the first (consumed) group's line
        handle.write(original.replace(b"Q: 0 times", b"Q: 9 times", 1))
    error = refused(stack, "grpo", resume(body, "stream-refusal-checkpoint-step-00000002.kiln-checkpoint"), 409)
    assert error["code"] == "source_changed", error
    fields = [difference["field"] for difference in error["differences"]]
    assert fields == ["dataset.consumed_lines", "dataset.line[1]"], error


def test_opd_resume_refuses_a_teacher_whose_identity_or_content_changed(stack):
    home = stack.home / "datasets"
    adapter = write_teacher_adapter(stack.home, home / "critic-adapter", seed=7)
    stack.client.create_teacher({"name": "critic@native", "base": "kiln-tiny", "adapter": str(adapter)})
    body = opd_request("opd-refusal", "critic@native", steps=2, checkpoint_interval=1)
    first = finish(stack, "opd", body)
    basename = "opd-refusal-checkpoint-step-00000001.kiln-checkpoint"

    moved = shutil.copytree(adapter, home / "critic-adapter-copy")  # same bytes, another configuration
    changed = stack.client.update_teacher("critic@native", {"base": "kiln-tiny", "adapter": str(moved)})
    assert changed["identity_revision"] != first["teacher"]["identity_revision"]
    error = refused(stack, "opd", resume(body, basename), 409)
    assert error["code"] == "teacher_changed", error
    assert [d["field"] for d in error["differences"]] == ["teacher.identity_revision"]
    assert error["differences"][0]["checkpoint"] == first["teacher"]["identity_revision"]

    restored = stack.client.update_teacher("critic@native", {"base": "kiln-tiny", "adapter": str(adapter)})
    assert restored["identity_revision"] == first["teacher"]["identity_revision"]
    write_teacher_adapter(stack.home, home / "other-weights", seed=8)
    shutil.copy(home / "other-weights" / "adapter_model.safetensors", adapter / "adapter_model.safetensors")
    error = refused(stack, "opd", resume(body, basename), 409)
    assert error["code"] == "teacher_changed", error
    fields = [d["field"] for d in error["differences"]]
    assert fields[0] == "teacher.content_revision" and "teacher.content_evidence.adapter_files" in fields
    assert error["differences"][0]["checkpoint"] == first["teacher"]["content_revision"]


def test_a_checkpoint_of_another_training_kind_is_refused(stack, groups_file, tutor):
    sft = finish(stack, "sft", sft_request("mixed-kinds", epochs=1, checkpoint_interval=2))
    sft_basename = sft["latest_checkpoint"]["resume_checkpoint"]
    error = refused(stack, "grpo", resume(grpo_inline("mixed-kinds"), sft_basename), 400)
    assert error["code"] == "wrong_kind" and "sft" in error["message"], error
    grpo = finish(stack, "grpo", grpo_inline("grpo-kind", epochs=1))
    error = refused(stack, "opd", resume(opd_request("grpo-kind", tutor),
                                         grpo["latest_checkpoint"]["resume_checkpoint"]), 400)
    assert error["code"] == "wrong_kind" and "grpo" in error["message"], error
