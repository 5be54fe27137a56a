"""A dense float32 base keeps each adapted group's weight and a copy of its adapters' A matrices in one matrix with
padded rows (Block.fuse_adapters): one product computes the projection and the adapters' down products, and one the
input gradient through both. These tests hold that path to the separate products it replaces."""

import numpy as np
import pytest

from trainer import Adam, DecoderOnlyTransformer, LoraConfig, TransformerConfig
from trainer.blocks import GROUPS, WEIGHT_ROW_PAD

TARGET_SETS = {
    "all": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
    "some": ("q_proj", "v_proj", "down_proj"),  # qkv and down fused; o and gate_up have no adapters
}


def tiny(**overrides):
    values = dict(vocabulary_size=64, maximum_context=32, model_width=32, head_count=4, kv_head_count=2,
                  block_count=2, feed_forward_width=48)
    values.update(overrides)
    return TransformerConfig(**values)


def lora_model(config, lora, fused):
    model = DecoderOnlyTransformer(config)
    rng = np.random.default_rng(11)  # away from the initialiser's small values, and biases (Qwen2) not zero
    base = {k: v * 3 if "bias" not in k else rng.standard_normal(v.shape).astype(np.float32)
            for k, v in model.state_dict().items()}
    model.load_state_dict(base)
    model.attach_lora(lora)
    if not fused:
        for block in model._blocks:
            block.separate_adapter_products()
    rng = np.random.default_rng(7)
    model.load_adapter_state_dict({k: rng.standard_normal(v.shape).astype(np.float32) * 0.2
                                   for k, v in model.adapter_state_dict().items()})
    return model


def batch(seed=3):
    rng = np.random.default_rng(seed)
    return rng.integers(0, 64, (2, 12)), rng.integers(0, 64, (2, 12))


def close(a, b, what, tolerance=2e-6):
    scale = max(float(np.abs(b).max()), 1e-30)
    assert float(np.abs(a - b).max()) <= tolerance * scale, f"{what}: {np.abs(a - b).max()} against {scale}"


@pytest.mark.parametrize("targets", sorted(TARGET_SETS))
@pytest.mark.parametrize("bias", [False, True], ids=["llama", "qwen2-bias"])
def test_fused_groups_compute_what_the_separate_products_do(targets, bias):
    lora = LoraConfig(rank=4, alpha=8, targets=TARGET_SETS[targets])
    config = tiny(attention_bias=bias)
    fused, separate = lora_model(config, lora, True), lora_model(config, lora, False)
    adapted = {group for group, names in GROUPS.items() if set(names) & set(lora.targets)}
    for block in fused._blocks:
        assert set(block.fused) == adapted
        for name, adapter in block.lora.items():
            group = next(g for g, names in GROUPS.items() if name in names)
            matrix = block.fused[group]
            assert matrix.strides == ((matrix.shape[1] + WEIGHT_ROW_PAD) * 4, 4)  # padded rows
            assert np.shares_memory(block.projection(name).value, matrix)
            assert not np.shares_memory(adapter.A.value, matrix) and adapter.A.value.flags.c_contiguous
    assert all(not block.fused for block in separate._blocks)
    assert fused.adapter_state_dict().keys() == separate.adapter_state_dict().keys()

    inputs, targets_ = batch()
    # the same sums in another order (du @ A inside the base's product): float32 rounding apart
    close(fused.logits(inputs), separate.logits(inputs), "logits", 1e-5)
    with fused.adapter_parameters() as a, separate.adapter_parameters() as b, \
            Adam(a, learning_rate=1e-2) as opt_a, Adam(b, learning_rate=1e-2) as opt_b:
        start = {p.name: p.value.copy() for p in a}
        for step in range(3):
            loss_a, loss_b = fused.forward_backward(inputs, targets_), separate.forward_backward(inputs, targets_)
            assert abs(loss_a - loss_b) <= 2e-6 * abs(loss_b), step
            for p, q in zip(a, b):  # Adam's normalised steps let rounding differences grow a little
                assert p.name == q.name
                close(p.grad, q.grad, f"step {step} {p.name} gradient", 5e-5 if step == 0 else 1e-3)
            opt_a.step()
            opt_b.step()
        # the optimizer's in-place updates of A reach the fused matrix that the products read (copied in per forward;
        # the losses above agree step by step). The values agree within a tenth of one step's move (1e-2): Adam
        # divides by the gradient's own size, so where a gradient element is near zero its float32 rounding apart
        # (another BLAS kernel orders the sums otherwise) moves the element by a visible part of the learning rate
        # (1.4e-5 seen on an AVX-512 EPYC); an update that did not land would be up to 3e-2 off
        for p, q in zip(a, b):
            assert float(np.abs(p.value - q.value).max()) <= 1e-3, p.name
            assert float(np.abs(p.value - q.value).max()) < float(np.abs(p.value - start[p.name]).max()), p.name
        before = fused.logits(inputs)
        a[0].value[...] += 0.5  # lora_A of the first block's q_proj, whose copy sits in its qkv group's matrix
        assert not np.array_equal(fused.logits(inputs), before)
        block = fused._blocks[0]
        assert np.array_equal(block.fused["qkv"][-block._adapter_rows("qkv"):][:4], a[0].value)


def test_padded_rows_give_the_same_bytes_as_contiguous_ones():
    lora = LoraConfig(rank=4, alpha=8)
    inputs, targets = batch(4)
    results = []
    for row_pad in (WEIGHT_ROW_PAD, 0):
        model = lora_model(tiny(model_width=64, feed_forward_width=96), lora, True)
        for block in model._blocks:
            block._unfuse_adapters()
            block.fuse_adapters(row_pad=row_pad)
            assert block.fused["qkv"].strides[0] == (64 + row_pad) * 4
        with model.adapter_parameters() as adapters, Adam(adapters, learning_rate=1e-2) as optimizer:
            losses = []
            for _ in range(2):
                losses.append(model.forward_backward(inputs, targets))
                optimizer.step()
            results.append((losses, [p.value.copy() for p in adapters], model.logits(inputs)))
    (losses_a, values_a, logits_a), (losses_b, values_b, logits_b) = results
    assert losses_a == losses_b
    assert all(np.array_equal(x, y) for x, y in zip(values_a, values_b))
    assert np.array_equal(logits_a, logits_b)


def test_a_step_of_the_fused_path_is_bit_identical_run_to_run():
    lora = LoraConfig(rank=4, alpha=8)
    inputs, targets = batch(5)
    results = []
    for _ in range(2):
        model = lora_model(tiny(), lora, True)
        loss = model.forward_backward(inputs, targets)
        with model.adapter_parameters() as adapters:
            results.append((loss, [p.grad.copy() for p in adapters]))
    assert results[0][0] == results[1][0]
    assert all(np.array_equal(x, y) for x, y in zip(results[0][1], results[1][1]))


def test_quantizing_after_attach_gives_the_adapters_their_own_arrays():
    lora = LoraConfig(rank=2, alpha=4)
    model = lora_model(tiny(model_width=64, feed_forward_width=96), lora, True)
    values = model.adapter_state_dict()
    model.quantize(block_size=32)
    assert all(not block.fused for block in model._blocks)
    for block in model._blocks:
        for adapter in block.lora.values():
            assert adapter.A.value.base is None  # no view keeps the dropped float32 base alive
    after = model.adapter_state_dict()
    assert all(np.array_equal(values[k], after[k]) for k in values)
    inputs, targets = batch()
    assert np.isfinite(model.forward_backward(inputs, targets))


def test_a_bias_free_group_without_adapters_is_not_fused_and_the_gradient_buffer_fits():
    model = lora_model(tiny(), LoraConfig(rank=4, alpha=8, targets=("down_proj",)), True)
    block = model._blocks[0]
    assert set(block.fused) == {"down"}
    qkv_grad = block.output_grad("qkv", 5)
    assert qkv_grad.shape == (5, (4 + 2 * 2) * 8) and qkv_grad.flags.c_contiguous
    down_grad = block.output_grad("down", 5)
    assert down_grad.shape == (5, 32) and down_grad.base.shape == (5, 32 + 4)


@pytest.mark.parametrize("tile_rows", [5, 1 << 20], ids=["five-row-tiles", "group-tiles"])
def test_nf4_tiles_carry_the_adapters_rows_on_the_last_tile(monkeypatch, tile_rows):
    """A quantized group's last tile carries the adapters' A rows: its product gives u, and [dy | du] @ that tile
    the adapters' input gradient. Held to a dense model on the dequantized weights with separate products."""
    from trainer import blocks

    monkeypatch.setattr(blocks, "NF4_TILE_ELEMENTS", tile_rows * 64)
    config, lora = tiny(model_width=64, feed_forward_width=128), LoraConfig(rank=2, alpha=4)
    quantized = DecoderOnlyTransformer(config)
    quantized.quantize(block_size=64)
    quantized.attach_lora(lora)
    rng = np.random.default_rng(4)
    quantized.load_adapter_state_dict({k: rng.standard_normal(v.shape).astype(np.float32) * 0.2
                                       for k, v in quantized.adapter_state_dict().items()})
    assert all(block._widened(group) for block in quantized._blocks for group in GROUPS)
    separate = DecoderOnlyTransformer(config)
    separate.load_state_dict(quantized.state_dict())  # the dequantized weights
    separate.attach_lora(lora)
    for block in separate._blocks:
        block.separate_adapter_products()
    separate.load_adapter_state_dict(quantized.adapter_state_dict())
    inputs, targets = batch(6)
    close(quantized.logits(inputs), separate.logits(inputs), "logits", 1e-5)
    loss_q, loss_s = quantized.forward_backward(inputs, targets), separate.forward_backward(inputs, targets)
    assert abs(loss_q - loss_s) <= 2e-6 * abs(loss_s)
    with quantized.adapter_parameters() as a, separate.adapter_parameters() as b:
        for p, q in zip(a, b):
            close(p.grad, q.grad, p.name, 5e-5)
