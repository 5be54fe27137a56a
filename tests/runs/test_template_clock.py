"""A chat template that reads the clock (`strftime_now`, as Llama 3's "Today Date: ..." does) renders the training
data a run learns from, so the run pins the instant it renders at: chosen once for a new run, recorded in its
tokenizer identity and checkpoints, and taken from the checkpoint on resume. A run interrupted on one day and
resumed on the next then ends with the bytes of the uninterrupted run; and the tokenizer a worker loads is checked
against the one admission tokenized with."""

import json
import shutil
from datetime import datetime

import pytest
from safetensors.numpy import save_file

import test_grpo
from test_sft import RECORDS, StopAt, final_files
from trainer import tokenizer as tokenizer_module
from trainer.bases import import_base, load_base
from trainer.runs.admission import AdmissionError, RunSettings
from trainer.runs.sft import admit_sft, run_sft

DATED = "kiln-dated"
# Llama 3's shape: a system line with today's date before the conversation
CLOCK_TEMPLATE = "{{ '<|im_start|>system\\nToday Date: ' + strftime_now('%d %b %Y') + '<|im_end|>\\n' }}"
DAY_ONE, DAY_TWO = datetime(2026, 3, 1, 23, 59, 58), datetime(2026, 3, 2, 9, 0, 0)


class Clock:
    """Stands in for trainer.tokenizer's datetime: now() is whatever the test set."""

    instant = DAY_ONE

    @classmethod
    def now(cls):
        return cls.instant


@pytest.fixture
def clock(monkeypatch):
    monkeypatch.setattr(tokenizer_module, "datetime", Clock)
    monkeypatch.setattr(Clock, "instant", DAY_ONE)
    return Clock


@pytest.fixture(scope="module")
def bases_root(tmp_path_factory):
    """kiln-tiny's weights and tokenizer registered as kiln-dated, whose chat template reads the clock."""
    root = tmp_path_factory.mktemp("bases")
    model, _ = load_base("kiln-tiny", root)
    state = model.state_dict()
    model.close()
    source = root / "hf-dated"
    source.mkdir()
    save_file(state, str(source / "model.safetensors"))
    shutil.copy(root / "bases" / "kiln-tiny" / "tokenizer.json", source)
    config = json.loads((root / "bases" / "kiln-tiny" / "tokenizer_config.json").read_text())
    config["chat_template"] = CLOCK_TEMPLATE + config["chat_template"]
    (source / "tokenizer_config.json").write_text(json.dumps(config))
    (source / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": 260, "max_position_embeddings": 512, "hidden_size": 64,
        "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2, "intermediate_size": 128,
        "head_dim": 16, "rope_theta": 10000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": True}))
    import_base(source, DATED, root)
    return root


def settings_in(home, bases_root) -> RunSettings:
    (home / "datasets").mkdir(parents=True, exist_ok=True)
    (home / "adapters").mkdir(parents=True, exist_ok=True)
    return RunSettings(home=home, registry=home / "adapters", bases_root=bases_root, data_roots=(home / "datasets",))


def sft_request(home, **config):
    path = home / "datasets" / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in RECORDS[:6]))
    return {"dataset_path": str(path), "config": {
        "output_name": "dated-bot", "base_model": DATED, "epochs": 1, "learning_rate": 5e-3, "batch_size": 2,
        "checkpoint_interval": 1, "seed": 7, "lora": {"rank": 4, "alpha": 8}, "max_sequence_length": 96, **config}}


def test_an_sft_run_resumed_on_another_day_is_byte_identical(bases_root, tmp_path, clock):
    reference = settings_in(tmp_path / "reference", bases_root)
    whole = run_sft(admit_sft(sft_request(reference.home), reference), reference, StopAt(None))
    assert whole.status == "succeeded" and whole.steps_completed == 3

    settings = settings_in(tmp_path / "resumed", bases_root)
    first = run_sft(admit_sft(sft_request(settings.home), settings), settings, StopAt(1))
    assert first.status == "cancelled"
    clock.instant = DAY_TWO  # the next morning
    resumed = sft_request(settings.home, resume_checkpoint=first.latest_checkpoint["resume_checkpoint"])
    second = run_sft(admit_sft(resumed, settings), settings, StopAt(None))
    assert second.loss_history == whole.loss_history
    assert final_files(settings, "dated-bot") == final_files(reference, "dated-bot")


def test_the_run_renders_at_the_admitted_instant_and_records_it(bases_root, tmp_path, clock):
    """Admission and the run (and a clock that ticks between an example's prompt and its full rendering) render at
    one instant; the checkpoint's tokenizer identity records it."""
    settings = settings_in(tmp_path, bases_root)
    admission = admit_sft(sft_request(settings.home), settings)
    assert admission.identities["tokenizer"]["template_clock"] == DAY_ONE.isoformat()
    clock.instant = DAY_TWO
    result = run_sft(admission, settings, StopAt(None))
    assert result.status == "succeeded"
    manifest = json.loads((settings.registry / result.latest_checkpoint["resume_checkpoint"]
                           / "checkpoint_manifest.json").read_text())
    assert manifest["tokenizer"]["template_clock"] == DAY_ONE.isoformat()


def test_a_template_without_the_clock_keeps_its_identity(tmp_path):
    """Every existing checkpoint's tokenizer identity stays what it was: only a clock-reading template adds one."""
    settings = test_grpo.make_settings(tmp_path)
    admission = admit_sft(sft_request(settings.home, base_model="kiln-tiny"), settings)
    assert "template_clock" not in admission.identities["tokenizer"]


def test_a_grpo_run_resumed_on_another_day_is_byte_identical(bases_root, tmp_path, clock):
    """GRPO renders each batch's chat prompts as it reads them, during the run."""
    config = {**test_grpo.INLINE, "base_model": DATED, "epochs": 1, "num_iterations": 1}
    reference = settings_in(tmp_path / "reference", bases_root)
    whole, _ = test_grpo.run(reference, {"groups": test_grpo.GROUPS, "config": config})
    assert whole.status == "succeeded" and whole.steps_completed == 3

    settings = settings_in(tmp_path / "resumed", bases_root)
    first, _ = test_grpo.run(settings, {"groups": test_grpo.GROUPS, "config": config}, stop=1)
    clock.instant = DAY_TWO
    resumed = {"groups": test_grpo.GROUPS,
               "config": {**config, "resume_checkpoint": first.latest_checkpoint["resume_checkpoint"]}}
    second, _ = test_grpo.run(settings, resumed)
    assert second.loss_history == whole.loss_history
    assert test_grpo.final_files(settings, "reward-bot") == test_grpo.final_files(reference, "reward-bot")


def test_a_tokenizer_changed_after_admission_is_refused_by_the_run(tmp_path):
    """The run tokenizes again with the tokenizer it loads: one changed since admission would train other tokens."""
    root = tmp_path / "bases"
    load_base("kiln-tiny", root)[0].close()
    settings = settings_in(tmp_path / "home", root)
    admission = admit_sft(sft_request(settings.home, base_model="kiln-tiny"), settings)
    path = root / "bases" / "kiln-tiny" / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["chat_template"] = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    path.write_text(json.dumps(config))
    with pytest.raises(AdmissionError) as info:
        run_sft(admission, settings, StopAt(None))
    assert info.value.code == "tokenizer_changed"
    assert "tokenizer.chat_template_sha256" in {d["field"] for d in info.value.differences}
    assert not list(settings.registry.iterdir())  # nothing trained, nothing published


def test_a_checkpoint_that_does_not_record_its_clock_is_refused_as_drift(bases_root, tmp_path, clock):
    """A clock-reading template's checkpoint without template_clock (written before runs pinned it) cannot prove
    the date its data was rendered with: its resume is refused, naming the field, not continued on today's date."""
    from state_runs import rewrite

    settings = settings_in(tmp_path, bases_root)
    first = run_sft(admit_sft(sft_request(settings.home), settings), settings, StopAt(1))
    path = settings.registry / first.latest_checkpoint["resume_checkpoint"]
    manifest = json.loads((path / "checkpoint_manifest.json").read_text())
    del manifest["tokenizer"]["template_clock"]
    rewrite(path, manifest=manifest)
    with pytest.raises(AdmissionError) as info:
        admit_sft(sft_request(settings.home, resume_checkpoint=path.name), settings)
    assert info.value.code == "resume_drift"
    drift = {d["field"]: d for d in info.value.differences}
    assert drift["tokenizer.template_clock"]["checkpoint"] is None
    assert drift["tokenizer.template_clock"]["request"] == DAY_ONE.isoformat()
