"""SFT runs at the trainer level: exact resume, drift refusals, dequeue revalidation."""

import json
import shutil
from pathlib import Path

import pytest

from run_worker import run_until_killed
from trainer.runs import checkpoint_dir, sft
from trainer.runs.sft import AdmissionError, RequestError, RunSettings, admit_sft, revalidate_sft, run_sft

RECORDS = [
    {"messages": [{"role": "user", "content": f"What is {a} plus {b}?"},
                  {"role": "assistant", "content": f"{a} plus {b} is {a + b}."}]}
    for a, b in [(1, 2), (3, 4), (5, 6), (7, 8), (2, 9), (4, 4), (6, 1)]
] + [{"prompt": "Say hello.", "completion": "Hello!"}]


def make_settings(home: Path, interval=None) -> RunSettings:
    (home / "datasets").mkdir(parents=True, exist_ok=True)
    (home / "adapters").mkdir(parents=True, exist_ok=True)
    return RunSettings(home=home, registry=home / "adapters", bases_root=home,
                       data_roots=(home / "datasets",), default_checkpoint_interval=interval)


def write_dataset(home: Path, records=RECORDS, name="train.jsonl") -> str:
    path = home / "datasets" / name
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def request(dataset_path, **config):
    base = {"output_name": "support-bot", "epochs": 2, "learning_rate": 5e-3, "batch_size": 2,
            "gradient_accumulation_steps": 1, "checkpoint_interval": 2, "seed": 7,
            "lora": {"rank": 4, "alpha": 8}, "max_sequence_length": 96,
            "lr_schedule": {"type": "cosine", "warmup_steps": 1}}
    base.update(config)
    return {"dataset_path": dataset_path, "config": base}


class StopAt:
    """Hooks that request cancellation after `step` committed steps."""

    def __init__(self, step):
        self.step, self.seen, self.checkpoints, self.metrics, self.events = step, 0, [], [], []

    def on_step(self, metrics):
        self.seen = metrics["step"]
        self.metrics.append(metrics)

    def should_cancel(self):
        return self.step is not None and self.seen >= self.step

    def on_checkpoint(self, summary, timing):
        self.checkpoints.append((summary, timing))

    def on_event(self, level, message):
        self.events.append((level, message))


def final_files(settings, adapter="support-bot"):
    path = checkpoint_dir.latest_checkpoint(settings.registry, adapter)
    files = {p.name: p.read_bytes() for p in sorted(path.iterdir())}
    snapshot = settings.registry / adapter
    files.update({"final/" + p.name: p.read_bytes() for p in sorted(snapshot.iterdir())})
    return files


def uninterrupted(home, **config):
    settings = make_settings(home)
    req = request(write_dataset(home), **config)
    result = run_sft(admit_sft(req, settings), settings, StopAt(None))
    assert result.status == "succeeded"
    return settings, result


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return uninterrupted(tmp_path_factory.mktemp("reference"))


def test_fresh_repeat_is_byte_identical(reference, tmp_path):
    settings, result = reference
    again_settings, again = uninterrupted(tmp_path)
    assert again.loss_history == result.loss_history
    assert final_files(again_settings) == final_files(settings)
    assert result.steps_completed == 8  # 8 examples, batch 2, 2 epochs
    assert result.latest_checkpoint["complete"] is True
    assert again.final_adapter["adapter_sha256"] == result.final_adapter["adapter_sha256"]
    assert (settings.registry / "support-bot" / "adapter_config.json").is_file()


def test_cancel_then_resume_is_byte_identical(reference, tmp_path):
    settings = make_settings(tmp_path)
    req = request(write_dataset(tmp_path))
    hooks = StopAt(3)
    first = run_sft(admit_sft(req, settings), settings, hooks)
    assert first.status == "cancelled" and first.steps_completed == 3
    basename = first.latest_checkpoint["resume_checkpoint"]
    assert basename == "support-bot-checkpoint-step-00000003.kiln-checkpoint"
    assert first.latest_checkpoint["complete"] is False
    assert first.latest_checkpoint["next_cursor"] == {"epoch": 0, "example": 6}
    resumed_request = request(req["dataset_path"], resume_checkpoint=basename)
    admission = admit_sft(resumed_request, settings)
    assert admission.resume["step"] == 3 and admission.effective_seed == 7
    second = run_sft(admission, settings, StopAt(None))
    assert second.status == "succeeded"
    assert second.loss_history == reference[1].loss_history
    assert final_files(settings) == final_files(reference[0])


def test_a_new_run_under_a_name_with_checkpoints_is_refused_at_admission(reference, tmp_path):
    """Was admitted, trained every step, then failed name_exists at its first publication: the earlier run's
    checkpoint names are immutable. Refused before any work now, naming the newest; a resume still admits."""
    settings, _ = reference
    newest = checkpoint_dir.latest_checkpoint(settings.registry, "support-bot")
    again = request(write_dataset(settings.home, name="again.jsonl"), epochs=1)
    with pytest.raises(AdmissionError) as info:
        admit_sft(again, settings)
    assert info.value.code == "checkpoints_exist" and newest.name in info.value.message
    other = request(write_dataset(settings.home, name="other.jsonl"), epochs=1, output_name="support-bot-2")
    assert admit_sft(other, settings).resume is None  # another name: a new run


def test_a_resume_from_behind_a_later_checkpoint_is_refused(cancelled):
    """A checkpoint with later ones of the same adapter beside it cannot be resumed: the run would reach their
    immutable names (name_exists) after doing the work again. The newest one can."""
    settings, req, basename = cancelled
    run_sft(admit_sft(request(req["dataset_path"], resume_checkpoint=basename), settings), settings, StopAt(4))
    newest = checkpoint_dir.latest_checkpoint(settings.registry, "support-bot").name
    assert newest == "support-bot-checkpoint-step-00000004.kiln-checkpoint"
    with pytest.raises(AdmissionError) as info:
        admit_sft(request(req["dataset_path"], resume_checkpoint=basename), settings)
    assert info.value.code == "later_checkpoints"
    assert newest in info.value.message and "step 2" in info.value.message
    assert admit_sft(request(req["dataset_path"], resume_checkpoint=newest), settings).resume["step"] == 4


def test_sigkill_then_resume_is_byte_identical(reference, tmp_path):
    settings = make_settings(tmp_path)
    req = request(write_dataset(tmp_path))
    run_until_killed(tmp_path, "sft", req, hold_after=4)
    latest = checkpoint_dir.latest_checkpoint(settings.registry, "support-bot")
    step = checkpoint_dir.parse_basename(latest.name)[1]
    assert 4 <= step < 8
    checkpoint_dir.load_checkpoint(latest, full=True, allowed_manifest_fields=sft.MANIFEST_FIELDS)
    admission = admit_sft(request(req["dataset_path"], resume_checkpoint=latest.name), settings)
    result = run_sft(admission, settings, StopAt(None))
    assert result.loss_history == reference[1].loss_history
    assert final_files(settings) == final_files(reference[0])


@pytest.fixture
def cancelled(tmp_path):
    settings = make_settings(tmp_path)
    req = request(write_dataset(tmp_path))
    result = run_sft(admit_sft(req, settings), settings, StopAt(2))
    return settings, req, result.latest_checkpoint["resume_checkpoint"]


@pytest.mark.parametrize("change,field", [
    ({"learning_rate": 1e-3}, "config.learning_rate"),
    ({"epochs": 3}, "config.epochs"),
    ({"lora": {"rank": 8, "alpha": 8}}, "config.lora.rank"),
    ({"lr_schedule": {"type": "linear", "warmup_steps": 1}}, "config.lr_schedule.type"),
    ({"batch_size": 1}, "config.batch_size"),
    ({"max_sequence_length": 64}, "config.max_sequence_length"),
    ({"seed": 8}, "seed"),
])
def test_config_drift_is_refused_field_by_field(cancelled, change, field):
    settings, req, basename = cancelled
    drifted = request(req["dataset_path"], resume_checkpoint=basename, **change)
    with pytest.raises(AdmissionError) as info:
        admit_sft(drifted, settings)
    assert info.value.code == "resume_drift"
    fields = {d["field"]: d for d in info.value.differences}
    assert field in fields, info.value.differences
    assert fields[field]["checkpoint"] != fields[field]["request"]


def test_dataset_drift_is_refused(cancelled):
    settings, req, basename = cancelled
    write_dataset(settings.home, RECORDS[::-1])  # same records, another order
    with pytest.raises(AdmissionError) as info:
        admit_sft(request(req["dataset_path"], resume_checkpoint=basename), settings)
    assert "dataset.sha256" in {d["field"] for d in info.value.differences}


def test_inline_data_route_drift_is_refused(cancelled):
    settings, req, basename = cancelled
    inline = {"data": RECORDS, "config": request(None, resume_checkpoint=basename)["config"]}
    with pytest.raises(AdmissionError) as info:
        admit_sft(inline, settings)
    assert "training.data_source_kind" in {d["field"] for d in info.value.differences}


def test_execution_drift_is_refused_at_dequeue(cancelled):
    """Admission leaves the execution identity to the process that trains: revalidate (at dequeue, with the
    worker's identity in the admission) refuses a checkpoint written under another, field by field."""
    settings, req, basename = cancelled
    admitted = admit_sft(request(req["dataset_path"], resume_checkpoint=basename), settings)
    revalidate_sft(admitted, settings)  # the same process: the same identity
    execution = admitted.identities["execution"]
    admitted.identities["execution"] = {**execution, "blas": {**execution["blas"], "threads": 99}}
    with pytest.raises(AdmissionError) as info:
        revalidate_sft(admitted, settings)
    assert info.value.code == "execution_drift"
    assert {"field": "execution.blas.threads", "checkpoint": execution["blas"]["threads"], "request": 99} \
        in info.value.differences


@pytest.mark.parametrize("reference_text", [
    "../support-bot-checkpoint-step-00000002.kiln-checkpoint",
    "nested/support-bot-checkpoint-step-00000002.kiln-checkpoint",
    "/etc/support-bot-checkpoint-step-00000002.kiln-checkpoint",
    "other-bot-checkpoint-step-00000002.kiln-checkpoint",
    "support-bot-checkpoint-step-2.kiln-checkpoint",
])
def test_resume_reference_refusals(cancelled, reference_text):
    settings, req, basename = cancelled
    with pytest.raises(AdmissionError) as info:
        admit_sft(request(req["dataset_path"], resume_checkpoint=reference_text), settings)
    print(info.value.code, info.value.message)
    assert info.value.code in {"outside_registry", "noncanonical_name", "not_found"}


def test_absolute_path_directly_beneath_the_registry_is_accepted(cancelled):
    settings, req, basename = cancelled
    admission = admit_sft(request(req["dataset_path"], resume_checkpoint=str(settings.registry / basename)),
                          settings)
    assert admission.resume["checkpoint"] == basename


def test_final_peft_snapshot_is_never_a_resume_checkpoint(reference):
    settings, result = reference
    with pytest.raises(AdmissionError) as info:
        admit_sft(request(str(settings.home / "datasets" / "train.jsonl"), resume_checkpoint="support-bot"),
                  settings)
    assert info.value.code in {"not_a_checkpoint", "noncanonical_name"}


def test_adapter_name_mismatch_and_peft_directory_are_refused(cancelled):
    settings, req, basename = cancelled
    with pytest.raises(AdmissionError) as info:
        admit_sft(request(req["dataset_path"], output_name="other-bot", resume_checkpoint=basename), settings)
    assert info.value.code == "wrong_adapter"
    peft_dir = settings.registry / "support-bot"
    peft_dir.mkdir()
    (peft_dir / "adapter_config.json").write_text("{}")
    (peft_dir / "adapter_model.safetensors").write_bytes(b"")
    with pytest.raises(AdmissionError) as info:
        admit_sft(request(req["dataset_path"], resume_checkpoint="support-bot"), settings)
    assert info.value.code in {"not_a_checkpoint", "noncanonical_name"}
    assert "PEFT" in info.value.message or "canonical" in info.value.message


def test_v3_planning_checkpoint_is_refused_for_sft(cancelled):
    settings, req, basename = cancelled
    source = checkpoint_dir.load_checkpoint(settings.registry / basename, full=True,
                                            allowed_manifest_fields=sft.MANIFEST_FIELDS)
    manifest = {k: v for k, v in source.manifest.items() if k in sft.MANIFEST_FIELDS}
    manifest["planning"] = {**manifest["planning"], "schema": "kiln.training-checkpoint-planning.v3"}
    manifest["progress"] = {**manifest["progress"], "committed_step": 1}
    files = {name: source.read(name) for name in source.manifest["files"]}
    checkpoint_dir.publish_checkpoint(settings.registry, "support-bot", 1, checkpoint_type="sft",
                                      files=files, manifest=manifest)
    with pytest.raises(AdmissionError) as info:
        admit_sft(request(req["dataset_path"],
                          resume_checkpoint="support-bot-checkpoint-step-00000001.kiln-checkpoint"), settings)
    assert info.value.code == "planning_schema"
    assert "v3" in info.value.message and "loss route" in info.value.message


def test_checkpoint_changed_between_admission_and_dequeue_is_refused(cancelled):
    settings, req, basename = cancelled
    admission = admit_sft(request(req["dataset_path"], resume_checkpoint=basename), settings)
    revalidate_sft(admission, settings)  # unchanged: fine
    target = settings.registry / basename / sft.STATE_FILE
    data = bytearray(target.read_bytes())
    data[10] ^= 1
    target.write_bytes(bytes(data))
    with pytest.raises(AdmissionError) as info:
        revalidate_sft(admission, settings)
    assert info.value.code == "checksum_mismatch"


def test_replaced_checkpoint_is_refused_at_dequeue(cancelled):
    settings, req, basename = cancelled
    admission = admit_sft(request(req["dataset_path"], resume_checkpoint=basename), settings)
    original = settings.registry / basename
    shutil.rmtree(original)
    # a different, fully valid checkpoint under the same name
    elsewhere = make_settings(settings.home / "elsewhere")
    other = run_sft(admit_sft(request(write_dataset(elsewhere.home), seed=99), elsewhere), elsewhere, StopAt(2))
    shutil.copytree(settings.home / "elsewhere" / "adapters" / other.latest_checkpoint["resume_checkpoint"],
                    original)
    with pytest.raises(AdmissionError) as info:
        revalidate_sft(admission, settings)
    assert info.value.code == "checkpoint_changed"
    assert {d["field"] for d in info.value.differences} >= {"checkpoint_id", "seed"}


def test_request_validation():
    settings = RunSettings(home=Path("/nonexistent"), registry=Path("/nonexistent/a"),
                           bases_root=Path("/nonexistent"))
    for config, field in (({"output_name": "x", "checkpoint_interval": 0}, "config.checkpoint_interval"),
                          ({"output_name": "x", "checkpoint_interval": -5}, "config.checkpoint_interval"),
                          ({}, "config.output_name"),
                          ({"output_name": "../x"}, "config.output_name"),
                          ({"output_name": "x", "bogus": 1}, "config.bogus"),
                          ({"output_name": "x", "epochs": 0}, "config.epochs"),
                          ({"output_name": "x", "lora": {"rank": 0}}, "config.lora")):
        with pytest.raises(RequestError) as info:
            sft.normalise_config(config, settings)
        assert info.value.field == field


def test_a_rank_beyond_what_a_targeted_projection_holds_is_refused(tmp_path):
    """kiln-tiny's k_proj and v_proj are [32, 64] (2 KV heads of 16): an update of them has rank at most 32, so
    rank 33 adds nothing but memory (and 2**40 was admitted, then failed the run with a MemoryError)."""
    settings = make_settings(tmp_path)
    path = write_dataset(tmp_path)
    for rank in (33, 2**40):
        with pytest.raises(RequestError) as info:
            admit_sft(request(path, lora={"rank": rank, "alpha": 8}), settings)
        assert info.value.field == "config.lora.rank"
        assert f"rank {rank} exceeds what k_proj of base kiln-tiny ([32, 64])" in str(info.value)
        assert "at most 32" in str(info.value)
    assert admit_sft(request(path, lora={"rank": 32, "alpha": 8}), settings).effective_config["lora"]["rank"] == 32
    wide = admit_sft(request(path, lora={"rank": 64, "alpha": 8, "targets": ["q_proj", "o_proj", "down_proj"]}),
                     settings)
    assert wide.effective_config["lora"]["rank"] == 64


def test_a_file_record_s_refusal_names_the_file_and_its_line(tmp_path):
    """A dataset file's bad record is named by its line (blank lines counted), not by data[i] of a list the
    person never wrote; inline records keep data[i]."""
    settings = make_settings(tmp_path)
    good = json.dumps(RECORDS[0])
    path = tmp_path / "datasets" / "lines.jsonl"
    for bad, words in (({"prompt": "q"}, "needs messages, or prompt and completion strings"),
                       ({"messages": [{"role": "user", "content": "q"}, {"role": "user", "content": "a"}]},
                        "the last message must be the assistant's")):
        path.write_text(f"{good}\n\n{good}\n{json.dumps(bad)}\n")
        with pytest.raises(RequestError) as info:
            admit_sft(request(str(path)), settings)
        assert info.value.field == "dataset_path" and info.value.message.startswith("line 4: " + words)
        with pytest.raises(RequestError) as info:
            admit_sft({"data": [RECORDS[0], RECORDS[1], bad], "config": request(None)["config"]}, settings)
        assert info.value.field == "data[2]" and info.value.message.startswith(words)
    path.write_text("\n\n")
    with pytest.raises(RequestError) as info:
        admit_sft(request(str(path)), settings)
    assert info.value.field == "dataset_path" and "no records" in info.value.message


def test_examples_cut_to_max_sequence_length_are_reported_once(tmp_path):
    """Truncation is TRL's (the end is cut), but said: the run's events carry one warning with the count and the
    longest example; a dataset that fits says nothing."""
    settings = make_settings(tmp_path)
    long = {"prompt": "Say hello.", "completion": " Hello" + " there" * 40 + "!"}
    path = write_dataset(tmp_path, RECORDS + [long, long])
    hooks = StopAt(None)
    admission = admit_sft(request(path, max_sequence_length=160, epochs=1), settings)  # kiln-tiny: a token a byte
    assert run_sft(admission, settings, hooks).status == "succeeded"
    warnings = [message for level, message in hooks.events if level == "warning" and "max_sequence_length" in message]
    assert len(warnings) == 1, hooks.events
    assert warnings[0].startswith("2 of 10 examples are longer than max_sequence_length 160 (the longest has ")
    fitting = StopAt(None)
    run_sft(admit_sft(request(write_dataset(tmp_path, name="fits.jsonl"), output_name="fits", epochs=1), settings),
            settings, fitting)
    assert not [message for _, message in fitting.events if "max_sequence_length" in message]


def test_server_checkpoint_interval_applies_when_request_has_none(tmp_path):
    settings = make_settings(tmp_path, interval=3)
    config = sft.normalise_config({"output_name": "x"}, settings)
    assert config["checkpoint_interval"] == 3
    assert sft.normalise_config({"output_name": "x", "checkpoint_interval": 5}, settings)["checkpoint_interval"] == 5


def test_dataset_paths_are_confined(tmp_path):
    settings = make_settings(tmp_path)
    outside = tmp_path / "outside.jsonl"
    outside.write_text(json.dumps(RECORDS[0]) + "\n")
    with pytest.raises(AdmissionError) as info:
        admit_sft(request(str(outside)), settings)
    assert info.value.code == "dataset_outside_roots"
    sneaky = str(tmp_path / "datasets" / ".." / "outside.jsonl")
    with pytest.raises(AdmissionError):
        admit_sft(request(sneaky), settings)


def test_metrics_and_diagnostics(reference, tmp_path):
    settings = make_settings(tmp_path)
    hooks = StopAt(None)
    run_sft(admit_sft(request(write_dataset(tmp_path), max_grad_norm=1e-3), settings), settings, hooks)
    assert all(m["clipped"] for m in hooks.metrics)
    assert [m["step"] for m in hooks.metrics] == list(range(1, 9))
    assert all(m["grad_norm"] > 0 and m["tokens"] > 0 for m in hooks.metrics)
    assert all({"lock_wait_seconds", "snapshot_seconds", "publish_seconds"} <= set(t) for _, t in hooks.checkpoints)


def test_a_checkpoint_name_that_appeared_after_admission_stops_the_run(cancelled, tmp_path):
    """Admission refuses a new run beside an earlier run's checkpoints (checkpoints_exist); one that appears after
    admission (copied back in, say) is still never overwritten: the run stops with name_exists reaching step 2."""
    settings, _, basename = cancelled
    fresh = make_settings(tmp_path / "fresh")
    admission = admit_sft(request(write_dataset(tmp_path / "fresh")), fresh)
    shutil.copytree(settings.registry / basename, fresh.registry / basename)
    with pytest.raises(checkpoint_dir.CheckpointError) as info:
        run_sft(admission, fresh, StopAt(None))
    assert info.value.code == "name_exists"


def refuse_weights(monkeypatch):
    """Admission must tokenize without loading a model: loading one fails the test."""
    import trainer.bases
    from trainer.model import DecoderOnlyTransformer

    def refuse(*args, **kwargs):
        raise AssertionError("admission loaded model weights")

    monkeypatch.setattr(trainer.bases, "load_base", refuse)
    monkeypatch.setattr(DecoderOnlyTransformer, "load_state_dict", refuse)


def test_admission_loads_no_weights(tmp_path, monkeypatch):
    settings = make_settings(tmp_path)
    path = write_dataset(tmp_path)
    before = admit_sft(request(path), settings)
    refuse_weights(monkeypatch)
    admitted = admit_sft(request(path), settings)
    assert admitted.to_json() == before.to_json()


@pytest.mark.parametrize("materialised", [False, True])
def test_load_tokenizer_is_the_tokenizer_load_base_gives(tmp_path, materialised):
    from trainer.bases import load_base, show_base
    from trainer.runs.tokenizers import load_tokenizer
    if materialised:
        model, _ = load_base("kiln-tiny", tmp_path)
        model.close()
    assert show_base("kiln-tiny", tmp_path).materialised == materialised
    tokenizer = load_tokenizer("kiln-tiny", tmp_path)
    model, loaded = load_base("kiln-tiny", tmp_path)
    model.close()
    assert tokenizer.identity() == loaded.identity() == show_base("kiln-tiny", tmp_path).tokenizer
    assert tokenizer.encode("What is 1 plus 2?") == loaded.encode("What is 1 plus 2?")


def test_each_kind_is_one_run_kind():
    from trainer.runs import RUN_KINDS, grpo, opd, run_kind
    from trainer.runs.kind import RunKind
    modules = {"sft": sft, "grpo": grpo, "opd": opd}
    assert set(RUN_KINDS) == set(modules)
    for name, module in modules.items():
        kind = run_kind(name)
        assert isinstance(kind, RunKind) and kind is module.RUN_KIND and kind.name == name
        assert kind.admit is getattr(module, f"admit_{name}") and kind.run is getattr(module, f"run_{name}")
        assert kind.defaults["base_model"] is None and "training" in kind.manifest_fields
    assert run_kind("sft", "trainer.runs.sft") is sft.RUN_KIND
    with pytest.raises(LookupError):
        run_kind("dpo")
    with pytest.raises(LookupError):
        run_kind("grpo", sft)  # a module of another kind


def test_a_module_without_run_kind_is_read_by_its_function_names():
    from types import SimpleNamespace

    from trainer.runs import run_kind
    stand_in = SimpleNamespace(__name__="stand_in", admit_sft=admit_sft, revalidate_sft=revalidate_sft,
                               run_sft=run_sft, SFTAdmission=sft.SFTAdmission)
    kind = run_kind("sft", stand_in)
    assert (kind.admit, kind.revalidate, kind.run) == (admit_sft, revalidate_sft, run_sft)
    with pytest.raises(LookupError):
        run_kind("sft", SimpleNamespace(__name__="empty"))


def test_a_non_finite_loss_fails_the_run_before_its_checkpoint(tmp_path, monkeypatch):
    """state.json refuses NaN (allow_nan=False): the step check must stop the run first."""
    from trainer.model import DecoderOnlyTransformer
    from trainer.runs.admission import RunFailed
    settings = make_settings(tmp_path)
    real, calls = DecoderOnlyTransformer.forward_backward, []

    def poisoned(self, *args, **kwargs):
        calls.append(1)
        loss = real(self, *args, **kwargs)
        return float("nan") if len(calls) == 3 else loss

    monkeypatch.setattr(DecoderOnlyTransformer, "forward_backward", poisoned)
    with pytest.raises(RunFailed) as info:
        run_sft(admit_sft(request(write_dataset(tmp_path), checkpoint_interval=1), settings), settings,
                StopAt(None))
    assert info.value.code == "non_finite" and info.value.message.startswith("step 3:")
    latest = checkpoint_dir.latest_checkpoint(settings.registry, "support-bot")
    assert checkpoint_dir.parse_basename(latest.name)[1] == 2


def test_sequences_beyond_64_positions_train_tiled_and_resume_byte_identical(reference, tmp_path, monkeypatch):
    """A run whose max_sequence_length exceeds 64 computes the tiled attention (admission.attention_options: from
    128 positions on it is faster and never keeps [heads, T, T] probabilities); up to 64 the engine's dense one.
    Cancelled and resumed, the tiled run ends byte-identical to its uninterrupted twin."""
    import trainer.bases

    loaded = []
    load_base = trainer.bases.load_base

    def recording(*args, **options):
        model, tokenizer = load_base(*args, **options)
        loaded.append((model.config.attention_algorithm, model.config.attention_block_size))
        return model, tokenizer

    monkeypatch.setattr(trainer.bases, "load_base", recording)  # run_sft imports it when it starts
    whole_settings, whole = uninterrupted(tmp_path / "whole", max_sequence_length=600)
    assert loaded == [("tiled", 128)]

    settings = make_settings(tmp_path / "parts")
    req = request(write_dataset(tmp_path / "parts"), max_sequence_length=600)
    first = run_sft(admit_sft(req, settings), settings, StopAt(3))
    assert first.status == "cancelled"
    resumed = request(req["dataset_path"], max_sequence_length=600,
                      resume_checkpoint=first.latest_checkpoint["resume_checkpoint"])
    second = run_sft(admit_sft(resumed, settings), settings, StopAt(None))
    assert second.status == "succeeded" and loaded == [("tiled", 128)] * 3
    assert second.loss_history == whole.loss_history
    assert final_files(settings) == final_files(whole_settings)

    loaded.clear()
    uninterrupted(tmp_path / "short", max_sequence_length=64)
    assert [algorithm for algorithm, _ in loaded] == ["dense"]
