"""LoRA against PyTorch + peft, and QLoRA's packed bases in the model."""

import numpy as np
import peft
import pytest
import torch
import transformers

import trainer.model as model_module
from trainer import Adam, DecoderOnlyTransformer, LoraConfig, TransformerConfig, quantization
from trainer.parameters import ParameterList

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def tiny(**overrides):
    values = dict(vocabulary_size=64, maximum_context=32, model_width=32, head_count=4,
                  kv_head_count=2, block_count=2, feed_forward_width=48)
    values.update(overrides)
    return TransformerConfig(**values)


def randomise_adapters(model, seed=1):
    rng = np.random.default_rng(seed)
    values = {k: rng.standard_normal(v.shape).astype(np.float32) * 0.1
              for k, v in model.adapter_state_dict().items()}
    model.load_adapter_state_dict(values)
    return values


def batch_with_ignored_prefix(seed, vocabulary=64):
    """Inputs and targets [2, 12] whose first row ignores its first three targets (-100)."""
    rng = np.random.default_rng(seed)
    inputs, targets = rng.integers(0, vocabulary, (2, 12)), rng.integers(0, vocabulary, (2, 12))
    targets[0, :3] = -100
    return inputs, targets


def peft_twin(model, lora):
    cfg = model.config
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=cfg.vocabulary_size, hidden_size=cfg.model_width,
        intermediate_size=cfg.feed_forward_width, num_hidden_layers=cfg.block_count,
        num_attention_heads=cfg.head_count, num_key_value_heads=cfg.kv_heads,
        max_position_embeddings=cfg.maximum_context, rms_norm_eps=cfg.norm_epsilon,
        rope_theta=cfg.rope_theta, tie_word_embeddings=cfg.tie_embeddings)).float()
    state = {k: torch.from_numpy(v) for k, v in model.state_dict().items()}
    if cfg.tie_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    hf.load_state_dict(state)
    wrapped = peft.get_peft_model(hf, peft.LoraConfig(
        r=lora.rank, lora_alpha=lora.alpha, use_rslora=lora.use_rslora,
        target_modules=list(lora.targets), lora_dropout=0.0))
    live = wrapped.state_dict()
    for name, value in model.adapter_state_dict().items():
        live["base_model.model." + name.replace(".weight", ".default.weight")].copy_(torch.from_numpy(value))
    return wrapped


@pytest.mark.parametrize("lora,tied", [
    (LoraConfig(rank=4, alpha=8), False),
    (LoraConfig(rank=2, alpha=3, targets=("q_proj", "v_proj", "down_proj"), use_rslora=True), True),
])
def test_logits_and_adapter_gradients_match_peft(lora, tied):
    model = DecoderOnlyTransformer(tiny(tie_embeddings=tied))
    model.attach_lora(lora)
    randomise_adapters(model)
    twin = peft_twin(model, lora)
    inputs, targets = batch_with_ignored_prefix(seed=2)
    ours = model.logits(inputs)
    theirs = twin(input_ids=torch.from_numpy(inputs)).logits.detach().numpy()
    assert np.abs(ours - theirs).max() <= 1e-4 * np.abs(theirs).max()
    loss = model.forward_backward(inputs, targets)
    logits = twin(input_ids=torch.from_numpy(inputs)).logits
    reference = torch.nn.functional.cross_entropy(logits.reshape(-1, 64), torch.from_numpy(targets).reshape(-1),
                                                  ignore_index=-100)
    reference.backward()
    assert abs(loss - reference.item()) <= 1e-4 * abs(reference.item())
    named = dict(twin.named_parameters())
    with model.adapter_parameters() as adapters:
        assert len(adapters) == 2 * len(lora.targets) * model.config.block_count
        for p in adapters:
            expected = named["base_model.model." + p.name.replace(".weight", ".default.weight")].grad.numpy()
            assert np.abs(p.grad - expected).max() <= 1e-4 * np.abs(expected).max(), p.name


def test_attached_adapter_starts_as_identity_and_freezes_the_base():
    model = DecoderOnlyTransformer(tiny())
    tokens = np.random.default_rng(0).integers(0, 64, (1, 8))
    before = model.logits(tokens)
    model.attach_lora(LoraConfig(rank=4, alpha=8))
    assert np.array_equal(model.logits(tokens), before)  # lora_B starts at zero
    with model.adapter_parameters() as adapters:
        shapes = {p.name.rsplit(".", 2)[-2]: p.shape for p in adapters[:2]}
        assert shapes == {"lora_A": (4, 32), "lora_B": (32, 4)}
    model.forward_backward(tokens, tokens)
    with model.parameters() as base:
        assert all(p.grad is None and not p.pending for p in base)  # nothing for frozen weights
    with model.adapter_parameters() as adapters:
        assert all(p.pending for p in adapters)


def test_optimizer_ownership_rules():
    model = DecoderOnlyTransformer(tiny())
    model.attach_lora(LoraConfig(rank=2, alpha=2))
    with pytest.raises(ValueError, match="frozen"):
        Adam(model.parameters())
    with model.adapter_parameters() as adapters:
        with pytest.raises(ValueError, match="complete adapter"):
            Adam(ParameterList(adapters[:-1], owner=model, kind="adapter"))
        with pytest.raises(TypeError):
            Adam(list(adapters))
        Adam(adapters)
    with pytest.raises(ValueError, match="already attached"):
        model.attach_lora(LoraConfig(rank=2, alpha=2))


def test_lora_config_validation():
    for bad, field in (({"rank": 0, "alpha": 1}, "rank"), ({"rank": 2, "alpha": -1}, "alpha"),
                       ({"rank": 2, "alpha": 1, "targets": ("qkv",)}, "targets"),
                       ({"rank": 2, "alpha": 1, "targets": ()}, "targets")):
        with pytest.raises(ValueError, match=field):
            LoraConfig(**bad)
    assert LoraConfig(rank=4, alpha=8, use_rslora=True).scaling == 4.0
    assert LoraConfig(rank=2, alpha=1, targets=("v_proj", "q_proj")).targets == ("q_proj", "v_proj")
    # Phi-3's fused module names, as peft names them, mean their projections
    assert LoraConfig(rank=2, alpha=1, targets=("gate_up_proj", "qkv_proj")).targets == (
        "q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
    with pytest.raises(ValueError, match="repeat"):
        LoraConfig(rank=2, alpha=1, targets=("qkv_proj", "k_proj"))


@pytest.mark.parametrize("double", [False, True])
def test_qlora_matches_dense_model_on_dequantized_weights(double):
    quantized = DecoderOnlyTransformer(tiny(model_width=64, feed_forward_width=96))
    quantized.quantize(block_size=64, double_quantization=double)
    quantized.attach_lora(LoraConfig(rank=4, alpha=8))
    adapters = randomise_adapters(quantized)
    dense = DecoderOnlyTransformer(tiny(model_width=64, feed_forward_width=96))
    dense.load_state_dict(quantized.state_dict())  # dequantized copies, for inspection
    dense.attach_lora(LoraConfig(rank=4, alpha=8))
    dense.load_adapter_state_dict(adapters)
    rng = np.random.default_rng(3)
    inputs, targets = rng.integers(0, 64, (2, 16)), rng.integers(0, 64, (2, 16))
    np.testing.assert_allclose(quantized.logits(inputs), dense.logits(inputs), atol=1e-5)
    assert abs(quantized.forward_backward(inputs, targets) - dense.forward_backward(inputs, targets)) < 1e-5
    with quantized.adapter_parameters() as a, dense.adapter_parameters() as b:
        for x, y in zip(a, b):
            np.testing.assert_allclose(x.grad, y.grad, atol=1e-5)


def test_qlora_dequantizes_bounded_tiles_and_never_the_model(monkeypatch):
    """Forward and backward dequantize at most NF4_TILE_ELEMENTS at a time: with a tile of 5 rows every group is
    cut into tiles that also span two projections (q|k, k|v, gate|up), and the step matches one with whole-group
    tiles; no call ever dequantizes a whole model's weights (dequantize_nf4)."""
    from trainer import blocks

    def step(tile_rows):
        monkeypatch.setattr(blocks, "NF4_TILE_ELEMENTS", tile_rows * 64)
        model = DecoderOnlyTransformer(tiny(model_width=64, feed_forward_width=128, block_count=1))
        model.quantize(block_size=64)
        model.attach_lora(LoraConfig(rank=2, alpha=2))
        tokens = np.random.default_rng(0).integers(0, 64, (1, 16))
        loss = model.forward_backward(tokens, tokens)
        with model.adapter_parameters() as adapters:
            return loss, [p.grad.copy() for p in adapters]

    seen = []
    real = quantization.dequantize_rows

    def spy(nf4, start, end, out):
        seen.append((start, end, nf4.shape))
        return real(nf4, start, end, out)

    def forbidden(*args, **kwargs):
        raise AssertionError("a whole weight was dequantized during training")

    monkeypatch.setattr(quantization, "dequantize_rows", spy)  # trainer.blocks calls through here
    for module in (quantization, model_module):
        monkeypatch.setattr(module, "dequantize_nf4", forbidden)
    whole_loss, whole_grads = step(1 << 20)
    assert seen and all(end - start == shape[0] for start, end, shape in seen)  # one tile per group
    seen.clear()
    loss, grads = step(5)
    assert seen and max(end - start for start, end, _ in seen) <= 5
    assert any(end < shape[0] and end - start < 5 for start, end, shape in seen)  # a tile's first projection part
    assert abs(loss - whole_loss) < 1e-6
    for a, b in zip(grads, whole_grads):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_qlora_resident_memory_and_refusals():
    model = DecoderOnlyTransformer(tiny(model_width=128, feed_forward_width=256))
    assert model.quantization is None
    model.quantize(block_size=64)
    memory = model.resident_memory()
    assert memory["packed_bytes"] <= 0.16 * memory["fp32_equivalent_bytes"]
    with pytest.raises(ValueError, match="already quantized"):
        model.quantize()
    with pytest.raises(ValueError, match="frozen"):
        Adam(model.parameters())
    packed = model.packed_state()
    name = next(iter(packed))
    with pytest.raises(KeyError, match="missing"):
        model.load_packed_state({name: packed[name]})
    with pytest.raises(ValueError, match="load_packed_state"):
        model.load_state_dict(model.state_dict())
