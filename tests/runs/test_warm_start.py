"""`config.base_adapter` for SFT and GRPO (OPD has had it): a weights-only warm start of a new run from a PEFT
snapshot. The run's adapter starts from the snapshot's weights (its first loss is the snapshot's loss), the
snapshot's files are bound into the checkpoint, resume keeps them, and a changed or misplaced snapshot is refused."""

import shutil

import numpy as np
import pytest

import test_grpo
from test_sft import StopAt, make_settings, request, write_dataset
from trainer.runs import grpo
from trainer.runs.admission import AdmissionError, RequestError
from trainer.runs.sft import admit_sft, revalidate_sft, run_sft


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory):
    """A finished SFT run's PEFT snapshot and its last loss."""
    home = tmp_path_factory.mktemp("first")
    settings = make_settings(home)
    result = run_sft(admit_sft(request(write_dataset(home), epochs=4, checkpoint_interval=None), settings), settings,
                     StopAt(None))
    assert result.status == "succeeded"
    return settings.registry / "support-bot", result.loss_history


def copy_snapshot(snapshot, settings, name="warm"):
    target = settings.registry / name
    shutil.copytree(snapshot, target)
    return str(target)


def test_an_sft_run_starts_from_the_snapshot_s_weights(snapshot, tmp_path):
    path, first_losses = snapshot
    settings = make_settings(tmp_path)
    warm = copy_snapshot(path, settings)
    fresh = run_sft(admit_sft(request(write_dataset(tmp_path), output_name="fresh", epochs=1), settings), settings,
                    StopAt(None))
    admission = admit_sft(request(write_dataset(tmp_path), output_name="warmed", epochs=1, base_adapter=warm,
                                  lora=None), settings)
    assert admission.effective_config["lora"]["rank"] == 4  # the snapshot's shape
    assert admission.identities["base_adapter"]["files"]["adapter_model.safetensors"]
    warmed = run_sft(admission, settings, StopAt(None))
    # the warm run's first batch is scored by the trained adapter: its loss is where the first run ended, not
    # where a fresh adapter starts
    start, fresh_start, trained = warmed.loss_history[0], fresh.loss_history[0], np.mean(first_losses[-4:])
    assert abs(start - trained) < abs(fresh_start - trained) and start < fresh_start, (start, fresh_start, trained)
    from trainer.runs import checkpoint_dir
    loaded = checkpoint_dir.load_checkpoint(checkpoint_dir.latest_checkpoint(settings.registry, "warmed"), full=True)
    assert loaded.manifest["training"]["base_adapter"] == admission.identities["base_adapter"]
    assert "base_adapter" not in checkpoint_dir.load_checkpoint(
        checkpoint_dir.latest_checkpoint(settings.registry, "fresh"), full=True).manifest["training"]


def test_a_warm_started_sft_run_resumes_exactly_and_refuses_a_changed_snapshot(snapshot, tmp_path):
    path, _ = snapshot
    settings = make_settings(tmp_path)
    warm = copy_snapshot(path, settings)
    req = request(write_dataset(tmp_path), output_name="warmed", base_adapter=warm, lora=None)
    stopped = run_sft(admit_sft(req, settings), settings, StopAt(2))
    basename = stopped.latest_checkpoint["resume_checkpoint"]
    resumed = admit_sft({**req, "config": {**req["config"], "resume_checkpoint": basename}}, settings)
    assert resumed.resume["checkpoint"] == basename
    with pytest.raises(AdmissionError) as info:  # resuming without the warm start is drift
        admit_sft({**req, "config": {**req["config"], "base_adapter": None, "lora": {"rank": 4, "alpha": 8},
                                     "resume_checkpoint": basename}}, settings)
    assert info.value.code == "resume_drift"
    assert any(d["field"].startswith(("config.base_adapter", "training.base_adapter"))
               for d in info.value.differences), info.value.differences
    weights = settings.registry / "warm" / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-4] + b"\0\0\0\0")  # the snapshot changes after admission
    with pytest.raises(AdmissionError) as changed:
        revalidate_sft(resumed, settings)
    assert changed.value.code == "base_adapter_changed"


def test_refusals(snapshot, tmp_path):
    path, _ = snapshot
    settings = make_settings(tmp_path)
    warm = copy_snapshot(path, settings)
    with pytest.raises(RequestError) as info:
        admit_sft(request(write_dataset(tmp_path), base_adapter=warm, lora={"rank": 8, "alpha": 16}), settings)
    assert info.value.field == "config.lora"
    outside = tmp_path / "elsewhere"
    shutil.copytree(path, outside)
    with pytest.raises(AdmissionError) as info:
        admit_sft(request(write_dataset(tmp_path), base_adapter=str(outside), lora=None), settings)
    assert info.value.code == "base_adapter_outside_roots"
    with pytest.raises(RequestError) as info:
        admit_sft(request(write_dataset(tmp_path), base_adapter="relative/dir", lora=None), settings)
    assert info.value.field == "config.base_adapter"


def test_a_grpo_run_starts_from_a_snapshot(tmp_path):
    settings = test_grpo.make_settings(tmp_path)
    first, _ = test_grpo.run(settings, test_grpo.inline_request(checkpoint_interval=None))
    assert first.status == "succeeded"
    warm = str(settings.registry / "reward-bot")
    request = test_grpo.inline_request(output_name="warm-bot", base_adapter=warm, lora=None, epochs=1)
    admission = grpo.admit_grpo(request, settings)
    assert admission.identities["base_adapter"]["path"] == warm
    result, _ = test_grpo.run(settings, request)
    fresh, _ = test_grpo.run(settings, test_grpo.inline_request(output_name="fresh-bot", epochs=1))
    assert result.status == fresh.status == "succeeded"
    assert result.loss_history != fresh.loss_history  # the same data and seed; only the starting weights differ


def test_a_peft_adapter_whose_rank_exceeds_a_narrow_projection_warm_starts(tmp_path):
    """PEFT does not bound r by a projection's sides, and Kiln admitted rank 40 over kiln-tiny (k_proj [32, 64])
    before config.lora.rank was bounded: such a snapshot is a PEFT-compatible base_adapter, whose own files give
    the rank (the run imports every tensor with its shape). It was refused config.lora.rank ('ask for at most
    32'), a rank the request never asked for; a request's own rank is still bounded."""
    from trainer.bases import load_base
    from trainer.lora import LoraConfig
    from trainer.peft import export_adapter

    settings = make_settings(tmp_path)
    warm = settings.registry / "wide"
    model, _ = load_base("kiln-tiny", settings.bases_root)
    with model:
        model.attach_lora(LoraConfig(rank=40, alpha=8, initializer_seed=3))
        export_adapter(model, warm)
    admission = admit_sft(request(write_dataset(tmp_path), output_name="warmed", epochs=1, base_adapter=str(warm),
                                  lora=None), settings)
    assert admission.effective_config["lora"]["rank"] == 40
    with pytest.raises(RequestError) as info:
        admit_sft(request(write_dataset(tmp_path), output_name="asked", lora={"rank": 40, "alpha": 8}), settings)
    assert info.value.field == "config.lora.rank"


def test_a_base_adapter_whose_config_rank_its_weights_do_not_bear_out_is_refused(snapshot, tmp_path):
    """adapter_config.json's r sizes what the run allocates; a hand-edited r of 2**40 beside rank-4 weights was
    admitted (the rank bound leaves a base_adapter's rank to its files) and failed the run with a MemoryError."""
    import json

    path, _ = snapshot
    settings = make_settings(tmp_path)
    warm = copy_snapshot(path, settings)
    config_file = tmp_path / "adapters" / "warm" / "adapter_config.json"
    config = json.loads(config_file.read_text())
    for rank in (2**40, 8, 3):
        config_file.write_text(json.dumps({**config, "r": rank}))
        with pytest.raises(RequestError) as info:
            admit_sft(request(write_dataset(tmp_path), base_adapter=warm, lora=None), settings)
        assert info.value.field == "config.base_adapter"
        assert f"r={rank}, but adapter_model.safetensors has lora_A tensors of 4 rows" in info.value.message
    config_file.write_text(json.dumps(config))
    assert admit_sft(request(write_dataset(tmp_path), base_adapter=warm, lora=None), settings).effective_config[
        "lora"]["rank"] == 4
