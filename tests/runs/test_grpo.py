"""GRPO runs at the trainer level: exact resume (inline and streamed JSONL), refusals, the policy audit."""

import json
from pathlib import Path

import numpy as np
import pytest

from run_worker import StopAt, run_until_killed
from trainer.runs import checkpoint_dir, grpo, sft
from trainer.runs.admission import MANIFEST_FIELDS, AdmissionError, RequestError, RunSettings


def make_group(i):
    prompt = ({"messages": [{"role": "user", "content": f"What is {i} times 3?"}]} if i % 2
              else {"prompt": f"Q: {i} times 3 =" })
    return {**prompt, "completions": [
        {"text": f" {3 * i}.", "reward": 1.0},
        {"text": f" {3 * i + 1}, I think", "reward": 0.0},
        {"text": " I cannot say", "rewards": {"correct": 0.0, "polite": 1.0, "brief": None}},
    ], "reward_weights": {"polite": 0.3}}


GROUPS = [make_group(i) for i in range(5)]


def make_settings(home: Path) -> RunSettings:
    (home / "datasets").mkdir(parents=True, exist_ok=True)
    (home / "adapters").mkdir(parents=True, exist_ok=True)
    return RunSettings(home=home, registry=home / "adapters", bases_root=home, data_roots=(home / "datasets",))


def write_jsonl(home: Path, groups=GROUPS, name="groups.jsonl") -> str:
    path = home / "datasets" / name
    lines = [json.dumps(g) for g in groups]
    lines.insert(2, "")  # a blank line is consumed (and hashed) but is no group
    path.write_text("\n".join(lines) + "\n\n")
    return str(path)


INLINE = {"output_name": "reward-bot", "seed": 11, "learning_rate": 2e-2, "groups_per_step": 2, "epochs": 2,
          "num_iterations": 2, "beta": 0.05, "loss_type": "dapo", "checkpoint_interval": 2,
          "reference": {"type": "ema", "refresh_steps": 2, "mixup_alpha": 0.5},
          "lora": {"rank": 4, "alpha": 8}, "max_completion_length": 12}
STREAMED = {"output_name": "stream-bot", "seed": 5, "learning_rate": 2e-2, "groups_per_step": 2, "epochs": 2,
            "beta": 0.1, "loss_type": "grpo", "scale_rewards": "batch", "checkpoint_interval": 2,
            "streaming": True, "lora": {"rank": 4, "alpha": 8}, "epsilon_high": 0.28}


def inline_request(**config):
    return {"groups": GROUPS, "config": {**INLINE, **config}}


def streamed_request(path, **config):
    return {"dataset_path": path, "config": {**STREAMED, **config}}


def final_files(settings, adapter):
    path = checkpoint_dir.latest_checkpoint(settings.registry, adapter)
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def run(settings, request, stop=None):
    hooks = StopAt(stop)
    result = grpo.run_grpo(grpo.admit_grpo(request, settings), settings, hooks)
    return result, hooks


@pytest.fixture(scope="module")
def inline_reference(tmp_path_factory):
    settings = make_settings(tmp_path_factory.mktemp("inline"))
    result, hooks = run(settings, inline_request())
    assert result.status == "succeeded"
    return settings, result, hooks


@pytest.fixture(scope="module")
def streamed_reference(tmp_path_factory):
    home = tmp_path_factory.mktemp("streamed")
    settings = make_settings(home)
    result, hooks = run(settings, streamed_request(write_jsonl(home)))
    assert result.status == "succeeded"
    return settings, result, hooks


def test_inline_fresh_repeat_is_byte_identical(inline_reference, tmp_path):
    settings, result, hooks = inline_reference
    assert result.steps_completed == 12  # 5 groups, 2 per step: 3 batches x 2 epochs x 2 iterations
    again_settings = make_settings(tmp_path)
    again, again_hooks = run(again_settings, inline_request())
    assert again.loss_history == result.loss_history
    assert again_hooks.metrics == hooks.metrics
    assert final_files(again_settings, "reward-bot") == final_files(settings, "reward-bot")


def test_inline_cancel_then_resume_is_byte_identical(inline_reference, tmp_path):
    settings = make_settings(tmp_path)
    first, first_hooks = run(settings, inline_request(), stop=3)
    assert first.status == "cancelled" and first.steps_completed == 3
    summary = first.latest_checkpoint
    assert summary["next_cursor"]["iteration"] == 1  # mid-batch: old/reference log p are checkpointed
    assert summary["next_cursor"]["group"] == 4
    assert summary["next_cursor"]["group_sha256"] == grpo.group_sha256(GROUPS[4])
    loaded = checkpoint_dir.load_checkpoint(settings.registry / summary["resume_checkpoint"],
                                            allowed_manifest_fields=MANIFEST_FIELDS)
    assert {grpo.ROLLOUT_FILE, grpo.REFERENCE_FILE} <= set(loaded.manifest["files"])
    admission = grpo.admit_grpo(inline_request(resume_checkpoint=summary["resume_checkpoint"]), settings)
    assert admission.resume["step"] == 3 and admission.effective_seed == 11
    second, second_hooks = run(settings, inline_request(resume_checkpoint=summary["resume_checkpoint"]))
    assert second.status == "succeeded"
    assert second.loss_history == inline_reference[1].loss_history
    assert first_hooks.metrics + second_hooks.metrics == inline_reference[2].metrics
    assert final_files(settings, "reward-bot") == final_files(inline_reference[0], "reward-bot")


def test_streamed_fresh_repeat_and_cancel_then_resume(streamed_reference, tmp_path):
    settings, result, hooks = streamed_reference
    assert result.steps_completed == 6
    home = tmp_path / "repeat"
    again_settings = make_settings(home)
    again, _ = run(again_settings, streamed_request(write_jsonl(home)))
    assert final_files(again_settings, "stream-bot") == final_files(settings, "stream-bot")
    home = tmp_path / "resume"
    resume_settings = make_settings(home)
    path = write_jsonl(home)
    metrics = []
    for stop in (2, 4):  # the second interruption is in the second epoch
        latest = checkpoint_dir.latest_checkpoint(resume_settings.registry, "stream-bot")
        extra = {} if latest is None else {"resume_checkpoint": latest.name}
        part, part_hooks = run(resume_settings, streamed_request(path, **extra), stop=stop)
        assert part.status == "cancelled"
        metrics += part_hooks.metrics
    cursor = part.latest_checkpoint["next_cursor"]
    assert cursor["epoch"] == 1 and cursor["group"] == 2 and cursor["line"] == 2  # the blank line is next
    last, last_hooks = run(resume_settings, streamed_request(path, resume_checkpoint=part.latest_checkpoint[
        "resume_checkpoint"]))
    assert last.loss_history == result.loss_history
    assert metrics + last_hooks.metrics == hooks.metrics
    assert final_files(resume_settings, "stream-bot") == final_files(settings, "stream-bot")


def test_streamed_resume_mid_batch_rereads_the_pending_lines(tmp_path):
    """num_iterations 2, stopped after the first iteration: the batch is re-read by byte offset."""
    config = {"num_iterations": 2, "epochs": 1, "reference": {"type": "ema", "refresh_steps": 1}}
    whole_settings = make_settings(tmp_path / "whole")
    whole, _ = run(whole_settings, streamed_request(write_jsonl(tmp_path / "whole"), **config))
    settings = make_settings(tmp_path / "parts")
    path = write_jsonl(tmp_path / "parts")
    first, _ = run(settings, streamed_request(path, **config), stop=3)
    assert first.latest_checkpoint["next_cursor"]["iteration"] == 1
    second, _ = run(settings, streamed_request(path, resume_checkpoint=first.latest_checkpoint["resume_checkpoint"],
                                               **config))
    assert second.loss_history == whole.loss_history
    assert final_files(settings, "stream-bot") == final_files(whole_settings, "stream-bot")


def test_sigkill_then_resume_is_byte_identical(streamed_reference, tmp_path):
    settings = make_settings(tmp_path)
    request = streamed_request(write_jsonl(tmp_path), checkpoint_interval=1)
    run_until_killed(tmp_path, "grpo", request, hold_after=3)
    latest = checkpoint_dir.latest_checkpoint(settings.registry, "stream-bot")
    step = checkpoint_dir.parse_basename(latest.name)[1]
    assert 3 <= step < 6
    resumed = {**request, "config": {**request["config"], "resume_checkpoint": latest.name}}
    result, _ = run(settings, resumed)
    assert result.loss_history == streamed_reference[1].loss_history
    reference = final_files(streamed_reference[0], "stream-bot")
    ours = final_files(settings, "stream-bot")
    # the interval differs (1 vs 2), which the manifest binds; every state file is identical
    assert {k: v for k, v in ours.items() if k != "checkpoint_manifest.json"} == \
           {k: v for k, v in reference.items() if k != "checkpoint_manifest.json"}


@pytest.fixture
def streamed_checkpoint(tmp_path):
    settings = make_settings(tmp_path)
    path = write_jsonl(tmp_path)
    result, _ = run(settings, streamed_request(path), stop=2)
    return settings, path, result.latest_checkpoint["resume_checkpoint"]


def test_changed_consumed_line_is_refused(streamed_checkpoint):
    settings, path, basename = streamed_checkpoint
    text = Path(path).read_text()
    Path(path).write_text(text.replace("Q: 0 times 3", "Q: 0 times 4", 1))  # same length, a consumed line
    with pytest.raises(AdmissionError) as info:
        grpo.admit_grpo(streamed_request(path, resume_checkpoint=basename), settings)
    assert info.value.code == "source_changed"
    fields = [d["field"] for d in info.value.differences]
    assert fields[0] == "dataset.consumed_lines" and "dataset.line[1]" in fields


def test_changed_bytes_after_the_cursor_are_refused(streamed_checkpoint):
    settings, path, basename = streamed_checkpoint
    with open(path, "a") as handle:
        handle.write(json.dumps(make_group(9)) + "\n")
    with pytest.raises(AdmissionError) as info:
        grpo.admit_grpo(streamed_request(path, resume_checkpoint=basename), settings)
    assert info.value.code == "source_changed"
    assert {"dataset.sha256", "dataset.groups"} <= {d["field"] for d in info.value.differences}


def test_file_changed_between_admission_and_run_is_refused(streamed_checkpoint):
    settings, path, basename = streamed_checkpoint
    admission = grpo.admit_grpo(streamed_request(path, resume_checkpoint=basename), settings)
    Path(path).write_text(Path(path).read_text().replace("I think", "I guess"))
    with pytest.raises(AdmissionError) as info:
        grpo.run_grpo(admission, settings, StopAt(None))
    assert info.value.code == "source_changed"


def test_wrong_training_kind_is_refused(streamed_checkpoint, tmp_path):
    settings, path, basename = streamed_checkpoint
    sft_request = {"data": [{"prompt": "Say hi.", "completion": "Hi!"}] * 2,
                   "config": {"output_name": "stream-bot", "seed": 1, "lora": {"rank": 4, "alpha": 8},
                              "checkpoint_interval": 1, "resume_checkpoint": basename}}
    with pytest.raises(AdmissionError) as info:
        sft.admit_sft(sft_request, settings)
    assert info.value.code == "wrong_kind" and "grpo checkpoint" in info.value.message
    other = make_settings(tmp_path / "sft")
    done = sft.run_sft(sft.admit_sft({**sft_request, "config": {**sft_request["config"], "resume_checkpoint": None,
                                                                  "output_name": "sft-bot"}}, other), other)
    with pytest.raises(AdmissionError) as info:
        grpo.admit_grpo(inline_request(output_name="sft-bot",
                                       resume_checkpoint=done.latest_checkpoint["resume_checkpoint"]), other)
    assert info.value.code == "wrong_kind" and "sft checkpoint" in info.value.message


def test_another_planning_schema_is_refused(streamed_checkpoint):
    settings, path, basename = streamed_checkpoint
    source = checkpoint_dir.load_checkpoint(settings.registry / basename, allowed_manifest_fields=MANIFEST_FIELDS)
    manifest = {k: v for k, v in source.manifest.items() if k in MANIFEST_FIELDS}
    manifest["planning"] = {**manifest["planning"], "schema": "kiln.training-checkpoint-planning.v4"}
    manifest["progress"] = {**manifest["progress"], "committed_step": 1}
    checkpoint_dir.publish_checkpoint(settings.registry, "stream-bot", 1, checkpoint_type="grpo",
                                      files={n: source.read(n) for n in source.manifest["files"]}, manifest=manifest)
    with pytest.raises(AdmissionError) as info:
        grpo.admit_grpo(streamed_request(path, resume_checkpoint="stream-bot-checkpoint-step-00000001.kiln-checkpoint"),
                        settings)
    assert info.value.code == "planning_schema"


@pytest.mark.parametrize("change,field", [
    ({"beta": 0.2}, "config.beta"),
    ({"loss_type": "bnpo"}, "config.loss_type"),
    ({"epsilon": 0.1}, "config.epsilon"),
    ({"scale_rewards": "none"}, "config.scale_rewards"),
    ({"reference": {"type": "ema"}}, "config.reference.type"),
    ({"seed": 6}, "seed"),
])
def test_config_drift_is_refused_field_by_field(streamed_checkpoint, change, field):
    settings, path, basename = streamed_checkpoint
    with pytest.raises(AdmissionError) as info:
        grpo.admit_grpo(streamed_request(path, resume_checkpoint=basename, **change), settings)
    assert info.value.code == "resume_drift"
    assert field in {d["field"] for d in info.value.differences}


def test_route_drift_is_refused(streamed_checkpoint):
    settings, path, basename = streamed_checkpoint
    with pytest.raises(AdmissionError) as info:
        grpo.admit_grpo(streamed_request(path, resume_checkpoint=basename, streaming=False), settings)
    assert "training.data_source_kind" in {d["field"] for d in info.value.differences}


def test_checkpoint_changed_at_dequeue_is_refused(streamed_checkpoint):
    settings, path, basename = streamed_checkpoint
    admission = grpo.admit_grpo(streamed_request(path, resume_checkpoint=basename), settings)
    grpo.revalidate_grpo(grpo.Admission.from_json(admission.to_json()), settings)
    state = settings.registry / basename / sft.STATE_FILE
    data = bytearray(state.read_bytes())
    data[5] ^= 1
    state.write_bytes(bytes(data))
    with pytest.raises(AdmissionError) as info:
        grpo.revalidate_grpo(admission, settings)
    assert info.value.code == "checksum_mismatch"


def test_audit_is_reported_and_checkpointed(inline_reference):
    settings, result, hooks = inline_reference
    loaded = checkpoint_dir.load_checkpoint(checkpoint_dir.latest_checkpoint(settings.registry, "reward-bot"),
                                            allowed_manifest_fields=MANIFEST_FIELDS)
    state = json.loads(loaded.read(sft.STATE_FILE))
    assert len(state["audit_history"]) == len(state["plans"]) == 12
    first, second = hooks.metrics[0], hooks.metrics[1]
    assert first["ratio_min"] == first["ratio_max"] == 1.0 and first["kl_mean"] == 0.0  # EMA starts at the base
    assert second["ratio_min"] != 1.0 and second["kl_mean"] > 0  # the second iteration reuses old log p
    assert any(m["clip_low_fraction"] + m["clip_high_fraction"] > 0 for m in hooks.metrics)
    for metrics, audit in zip(hooks.metrics, state["audit_history"]):
        assert {k: metrics[k] for k in audit} == audit
    assert state["accumulators"]["steps"] == 12
    assert state["accumulators"]["tokens"] == sum(m["tokens"] for m in hooks.metrics)
    assert state["reference"] == {"type": "ema", "refresh_steps": 2, "mixup_alpha": 0.5,
                                  "refreshes": [2, 4, 6, 8, 10, 12]}
    plan = state["plans"][0]
    assert plan["groups"][0]["sha256"] == grpo.group_sha256(GROUPS[0]) and plan["accumulation"] == 2


def test_streamed_plans_hold_line_cursor_and_token_counts(streamed_reference):
    settings = streamed_reference[0]
    loaded = checkpoint_dir.load_checkpoint(checkpoint_dir.latest_checkpoint(settings.registry, "stream-bot"),
                                            allowed_manifest_fields=MANIFEST_FIELDS)
    plans = json.loads(loaded.read(sft.STATE_FILE))["plans"]
    refs = [g for plan in plans[:3] for g in plan["groups"]]
    assert [r["line"] for r in refs] == [0, 1, 3, 4, 5]  # line 2 is blank
    assert all(r["completion_tokens"] and r["prompt_tokens"] > 0 and len(r["line_sha256"]) == 64 for r in refs)
    assert loaded.manifest["dataset"]["route"] == "streamed_jsonl"
    assert loaded.manifest["progress"]["complete"] is True


def test_frozen_reference_is_the_adapter_switched_off(tmp_path):
    """With beta > 0 and a frozen reference, step one's KL is exactly zero (a fresh LoRA is the base)."""
    settings = make_settings(tmp_path)
    result, hooks = run(settings, inline_request(reference={"type": "frozen"}, num_iterations=1, epochs=1,
                                                 checkpoint_interval=None))
    assert hooks.metrics[0]["kl_mean"] == 0.0 and hooks.metrics[1]["kl_mean"] > 0.0


def test_request_validation(tmp_path):
    settings = make_settings(tmp_path)
    cases = [
        ({"groups": GROUPS, "config": {**INLINE, "loss_type": "sum"}}, "config.loss_type"),
        ({"groups": GROUPS, "config": {**INLINE, "scale_rewards": True}}, "config.scale_rewards"),
        ({"groups": GROUPS, "config": {**INLINE, "reference": {"type": "frozen", "refresh_steps": 3}}},
         "config.reference"),
        ({"groups": GROUPS, "config": {**INLINE, "reference": {"type": "ema", "mixup_alpha": 2}}},
         "config.reference.mixup_alpha"),
        ({"groups": GROUPS, "config": {**INLINE, "streaming": True}}, "config.streaming"),
        ({"groups": GROUPS, "config": {**INLINE, "checkpoint_interval": 0}}, "config.checkpoint_interval"),
        ({"groups": [{"prompt": "x", "completions": [{"text": "a", "reward": 1}]}], "config": INLINE}, "groups[0]"),
        ({"groups": [{"prompt": "x", "completions": [{"text": "a", "reward": 1}, {"text": "b"}]}],
          "config": INLINE}, "groups[0].completions[1]"),
        ({"groups": [{"prompt": "x", "completions": [{"text": "", "reward": 1}, {"text": "", "reward": 0}]}],
          "config": INLINE}, "groups[0]"),
        ({"groups": GROUPS, "dataset_path": "/x", "config": INLINE}, "dataset_path"),
        ({"groups": [{"prompt": "x", "completions": [{"text": "a", "rewards": {"r": None}},
                                                      {"text": "b", "rewards": {"r": None, "s": None}}]}],
          "config": INLINE}, "groups[0]"),  # no completion scored
    ]
    for request, field in cases:
        with pytest.raises(RequestError) as info:
            grpo.admit_grpo(request, settings)
        assert info.value.field == field, (field, info.value)
    outside = tmp_path / "outside.jsonl"
    outside.write_text(json.dumps(GROUPS[0]) + "\n")
    with pytest.raises(AdmissionError) as info:
        grpo.admit_grpo(streamed_request(str(outside)), settings)
    assert info.value.code == "dataset_outside_roots"


def test_admission_loads_no_weights(tmp_path, monkeypatch):
    from test_sft import refuse_weights
    settings = make_settings(tmp_path)
    path = write_jsonl(tmp_path)
    before = [grpo.admit_grpo(inline_request(), settings), grpo.admit_grpo(streamed_request(path), settings)]
    refuse_weights(monkeypatch)
    after = [grpo.admit_grpo(inline_request(), settings), grpo.admit_grpo(streamed_request(path), settings)]
    assert [a.to_json() for a in after] == [b.to_json() for b in before]


def test_an_unscorable_completion_is_left_out_of_its_group_baseline(tmp_path):
    """TRL (>= 1.6): a completion every reward function returned None for has no reward, not reward 0: it is left out
    of the group's mean and std and gets advantage 0; the reported reward statistics leave it out too."""
    settings = make_settings(tmp_path)
    group = {"prompt": "Q: 2 times 3 =", "completions": [
        {"text": " 6.", "rewards": {"correct": 1.0}}, {"text": " 7.", "rewards": {"correct": 0.0}},
        {"text": " dunno", "rewards": {"correct": None}}]}
    config = {**INLINE, "groups_per_step": 1, "epochs": 1, "num_iterations": 1, "beta": 0.0,
              "reference": {"type": "frozen"}}
    result, hooks = run(settings, {"groups": [group], "config": config})
    assert result.status == "succeeded"
    metrics = hooks.metrics[0]
    assert metrics["reward_mean"] == 0.5 and metrics["completions"] == 3
    advantage = 0.5 / (np.std([1.0, 0.0], ddof=1) + 1e-4)  # the two scored ones: +-advantage, the third 0
    assert metrics["advantage_mean"] == pytest.approx(0.0, abs=1e-15)
    assert metrics["advantage_std"] == pytest.approx(np.std([advantage, -advantage, 0.0]), rel=1e-12)


@pytest.mark.parametrize("streaming", [False, True], ids=["file", "streamed"])
def test_a_file_group_s_refusal_names_dataset_path_and_its_line(tmp_path, streaming):
    """Was field "dataset_path line 4" (no field of the request), and, for a file read whole, "groups[2]" when the
    group failed to tokenize (the request has no groups). Now the field is dataset_path and the message starts
    with the line (blank lines counted), then the completion where it is one."""
    settings = make_settings(tmp_path)
    empty_prompt = {"prompt": "", "completions": [{"text": "a", "reward": 1}, {"text": "b", "reward": 0}]}
    unrewarded = {"prompt": "x", "completions": [{"text": "a", "reward": 1}, {"text": "b"}]}
    config = {**(STREAMED if streaming else INLINE), "streaming": streaming}
    for bad, message in ((unrewarded, "line 4: completions[1]: needs exactly one of reward"),
                         (empty_prompt, "line 4: the prompt has no tokens")):
        path = write_jsonl(tmp_path, GROUPS[:2] + [bad], name=f"bad-{streaming}.jsonl")  # a blank third line
        with pytest.raises(RequestError) as info:
            grpo.admit_grpo({"dataset_path": path, "config": config}, settings)
        assert info.value.field == "dataset_path" and info.value.message.startswith(message), info.value
