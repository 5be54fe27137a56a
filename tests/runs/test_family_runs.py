"""SFT through the run logic on bases of other families: a Qwen3 base under QLoRA and a Phi-3 base
(sliding window, fused projections) under LoRA, imported from tiny transformers directories.
An interrupted and resumed run ends with the bytes of an uninterrupted one; the final PEFT snapshot
loads in peft over transformers."""

import pytest

from test_sft import StopAt, final_files, make_settings, request, write_dataset
from trainer.bases import import_base
from trainer.runs.sft import admit_sft, run_sft

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

COMMON = dict(vocab_size=300, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6, initializer_range=0.1)
FAMILIES = {  # family -> (config class, model class, fields, request config)
    "qwen3-qlora": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=12),
                    {"quantization": {"type": "nf4", "block_size": 32}}),
    "phi3-lora": ("Phi3Config", "Phi3ForCausalLM", dict(sliding_window=9, pad_token_id=0, bos_token_id=1,
                                                        eos_token_id=2),
                  {"lora": {"rank": 4, "alpha": 8, "targets": ["qkv_proj", "o_proj", "gate_up_proj"]}}),
}


def family_home(home, family):
    """A run home whose registry holds the family's tiny base as "fam"; returns (settings, HF directory)."""
    from tests.models.conftest import _tiny_tokenizer

    config_class, model_class, fields, _ = FAMILIES[family]
    torch.manual_seed(3)
    model = getattr(transformers, model_class)(getattr(transformers, config_class)(**COMMON, **fields))
    directory = home / "hf"
    model.save_pretrained(directory)
    _tiny_tokenizer().save_pretrained(directory)
    settings = make_settings(home)
    import_base(directory, "fam", root=home)
    return settings, directory


def family_request(home, family, **more):
    return request(write_dataset(home), base_model="fam", **FAMILIES[family][3], **more)


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_run_cancel_then_resume_is_byte_identical(family, tmp_path):
    settings, directory = family_home(tmp_path / "whole", family)
    whole = run_sft(admit_sft(family_request(tmp_path / "whole", family), settings), settings, StopAt(None))
    assert whole.status == "succeeded" and whole.steps_completed == 8
    if family == "phi3-lora":  # peft's fused names in the request; the effective configuration lists projections
        assert whole.final_adapter is not None
        import json
        config = json.loads((settings.registry / "support-bot" / "adapter_config.json").read_text())
        assert sorted(config["target_modules"]) == ["gate_up_proj", "o_proj", "qkv_proj"]

    resumed_settings, _ = family_home(tmp_path / "parts", family)
    req = family_request(tmp_path / "parts", family)
    first = run_sft(admit_sft(req, resumed_settings), resumed_settings, StopAt(3))
    assert first.status == "cancelled" and first.steps_completed == 3
    again = family_request(tmp_path / "parts", family, resume_checkpoint=first.latest_checkpoint["resume_checkpoint"])
    second = run_sft(admit_sft(again, resumed_settings), resumed_settings, StopAt(None))
    assert second.status == "succeeded"
    assert second.loss_history == whole.loss_history
    assert final_files(resumed_settings) == final_files(settings)

    base = getattr(transformers, FAMILIES[family][1]).from_pretrained(directory, dtype=torch.float32)
    tuned = peft.PeftModel.from_pretrained(base, settings.registry / "support-bot")
    tokens = torch.tensor([[5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        adapted = tuned(tokens).logits
        with tuned.disable_adapter():  # peft wraps the base in place: its own logits need the adapter off
            plain = tuned(tokens).logits
    assert not torch.allclose(adapted, plain)  # it loads, and it was trained
