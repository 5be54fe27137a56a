"""PEFT interchange: Kiln-exported adapters run in peft over transformers; imports refuse misfits."""

import json

import numpy as np
import pytest

from trainer import LoraConfig
from trainer.bases import load_base
from trainer.peft import export_adapter, import_adapter

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

TOKENS = np.array([[5, 17, 99, 250, 3, 42, 7, 8, 120, 64], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]])


@pytest.fixture(scope="module")
def base_dir(save_tiny_llama):
    directory, _ = save_tiny_llama(seed=11)
    return directory


def _kiln_with_adapter(base_dir, lora, seed=0):
    model, _ = load_base(base_dir)
    model.attach_lora(lora)
    rng = np.random.default_rng(seed)
    model.load_adapter_state_dict({name: rng.normal(0, 0.2, value.shape).astype(np.float32)
                                   for name, value in model.adapter_state_dict().items()})
    return model


@pytest.mark.parametrize("lora", [
    LoraConfig(rank=4, alpha=8.0),
    LoraConfig(rank=2, alpha=3.0, targets=("q_proj", "v_proj", "down_proj"), use_rslora=True),
], ids=["all-projections", "some-rslora"])
def test_exported_adapter_gives_kiln_logits_in_peft(base_dir, tmp_path, lora, max_abs_diff):
    model = _kiln_with_adapter(base_dir, lora)
    with model:
        logits = model.logits(TOKENS)
        export_adapter(model, tmp_path / "adapter", base_model_name_or_path="tiny-llama")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["task_type"] == "CAUSAL_LM"
    assert (config["r"], config["lora_alpha"], config["use_rslora"]) == \
        (lora.rank, lora.alpha, lora.use_rslora)
    assert config["base_model_name_or_path"] == "tiny-llama" and config["bias"] == "none"
    hf = transformers.LlamaForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    peft_model = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
    with torch.no_grad():
        expected = peft_model(torch.tensor(TOKENS)).logits.numpy()
    assert max_abs_diff(logits, expected) <= 1e-4
    with torch.no_grad(), peft_model.disable_adapter():
        plain = peft_model(torch.tensor(TOKENS)).logits.numpy()
    assert max_abs_diff(logits, plain) > 1e-2  # the adapter really changes the output


def test_round_trip_is_exact(base_dir, tmp_path):
    lora = LoraConfig(rank=3, alpha=6.0, targets=("k_proj", "o_proj", "gate_proj", "up_proj"))
    with _kiln_with_adapter(base_dir, lora, seed=1) as model:
        export_adapter(model, tmp_path / "adapter")
        original = model.adapter_state_dict()
    fresh, _ = load_base(base_dir)
    with fresh:
        assert import_adapter(fresh, tmp_path / "adapter") == lora  # attached from the config
        restored = fresh.adapter_state_dict()
        assert list(restored) == list(original)
        assert all(np.array_equal(restored[k], original[k]) for k in original)
    fresh, _ = load_base(base_dir)
    with fresh:
        fresh.attach_lora(LoraConfig(rank=3, alpha=6.0, targets=lora.targets, initializer_seed=9))
        import_adapter(fresh, tmp_path / "adapter")  # an attached adapter that fits: warm start
        assert all(np.array_equal(fresh.adapter_state_dict()[k], original[k]) for k in original)


def test_peft_trained_adapter_imports(base_dir, tmp_path, max_abs_diff):
    """An adapter written by peft itself (random B, so it is not a no-op) loads into Kiln."""
    hf = transformers.LlamaForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = peft.LoraConfig(r=2, lora_alpha=5, target_modules=["q_proj", "up_proj"],
                             task_type="CAUSAL_LM", lora_dropout=0.1)
    peft_model = peft.get_peft_model(hf, config)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, parameter in peft_model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.3)
    peft_model.save_pretrained(tmp_path / "from-peft")
    peft_model.eval()
    with torch.no_grad():
        expected = peft_model(torch.tensor(TOKENS)).logits.numpy()
    model, _ = load_base(base_dir)
    with model:
        import_adapter(model, tmp_path / "from-peft")
        assert model.lora_config.targets == ("q_proj", "up_proj")
        assert max_abs_diff(model.logits(TOKENS), expected) <= 1e-4


def test_import_refuses_what_does_not_fit(base_dir, save_tiny_llama, tmp_path):
    lora = LoraConfig(rank=4, alpha=8.0, targets=("q_proj", "v_proj"))
    with _kiln_with_adapter(base_dir, lora) as model:
        export_adapter(model, tmp_path / "adapter")
        with pytest.raises(FileExistsError):
            export_adapter(model, tmp_path / "adapter")
    adapter = tmp_path / "adapter"
    qv = ("q_proj", "v_proj")
    cases = [(LoraConfig(rank=8, alpha=8.0, targets=qv), r"rank 4 \(adapter\) vs 8 \(model\)"),
             (LoraConfig(rank=4, alpha=16.0, targets=qv), r"alpha 8.0 \(adapter\) vs 16.0"),
             (LoraConfig(rank=4, alpha=8.0, targets=("q_proj",)),
              r"targets \['q_proj', 'v_proj'\] \(adapter\)"),
             (LoraConfig(rank=4, alpha=8.0, targets=qv, use_rslora=True),
              r"use_rslora False \(adapter\) vs True")]
    for attached, message in cases:
        model, _ = load_base(base_dir)
        with model:
            model.attach_lora(attached)
            before = model.adapter_state_dict()
            with pytest.raises(ValueError, match=message):
                import_adapter(model, adapter)
            assert all(np.array_equal(before[k], v) for k, v in model.adapter_state_dict().items())

    other_base, _ = save_tiny_llama(seed=12)
    config = json.loads((other_base / "config.json").read_text())
    config.update(hidden_size=32, intermediate_size=48)  # another base: other projection shapes
    wider = tmp_path / "other-base"
    wider.mkdir()
    for file in other_base.iterdir():
        if file.suffix != ".safetensors":
            (wider / file.name).write_bytes(file.read_bytes())
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**{
        k: v for k, v in config.items() if k not in ("architectures", "transformers_version")
    })).save_pretrained(wider)
    model, _ = load_base(wider)
    with model:
        with pytest.raises(ValueError, match="trained over another base"):
            import_adapter(model, adapter)
        assert model.lora_config is None  # refused before anything was attached

    broken = tmp_path / "dora"
    broken.mkdir()
    (broken / "adapter_model.safetensors").write_bytes((adapter / "adapter_model.safetensors").read_bytes())
    settings = json.loads((adapter / "adapter_config.json").read_text())
    for key, value, message in [("use_dora", True, "use_dora"), ("bias", "all", "bias 'all'"),
                                ("target_modules", ".*proj", "not a regular expression"),
                                ("peft_type", "IA3", "peft_type 'IA3'"),
                                ("layers_to_transform", [0], "layers_to_transform")]:
        (broken / "adapter_config.json").write_text(json.dumps({**settings, key: value}))
        model, _ = load_base(base_dir)
        with model, pytest.raises(ValueError, match=message):
            import_adapter(model, broken)


def test_export_needs_an_adapter(base_dir, tmp_path):
    model, _ = load_base(base_dir)
    with model, pytest.raises(ValueError, match="no LoRA adapter"):
        export_adapter(model, tmp_path / "adapter")
    assert not (tmp_path / "adapter").exists()
