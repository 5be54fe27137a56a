"""trainer.blocks: one block's forward/backward pair and its saved BlockActivations."""

import dataclasses

import numpy as np
import pytest

from trainer.blocks import Block, BlockActivations, block_backward, block_forward, rope_tables


def forward(config, seed=0, B=2, T=7):
    rng = np.random.default_rng(seed)
    block = Block(0, config)
    for p in block.parameters():
        if p.value.ndim == 2:
            p.value[...] = rng.standard_normal(p.shape, dtype=np.float32) * np.float32(0.2)
    x = rng.standard_normal((B * T, config.model_width), dtype=np.float32)  # [N,C]
    rope = rope_tables(config)
    out, saved = block_forward(block, x, config, rope, B, T)
    return block, x, rope, out, saved


def test_forward_saves_named_activations(tiny_config):
    config = tiny_config()
    _, x, _, out, saved = forward(config)
    assert isinstance(saved, BlockActivations)
    assert (saved.batch, saved.time) == (2, 7) and saved.x is x
    F = config.feed_forward_width
    assert saved.gate_up.shape == (14, 2 * F) and saved.act.shape == (14, F)
    assert out.shape == x.shape and {f.name for f in dataclasses.fields(saved)} >= {"h1", "h2", "x_mid"}


@pytest.mark.parametrize("algorithm", ["dense", "tiled"])
def test_backward_input_gradient_matches_finite_differences(tiny_config, algorithm):
    config = tiny_config(attention_algorithm=algorithm)
    block, x, rope, out, saved = forward(config, seed=1)
    block.allocate_grads()
    probe = np.random.default_rng(2).standard_normal(out.shape)  # loss = sum(probe * out)
    d = probe.astype(np.float32)
    block_backward(block, saved, d, config, rope, trainable=True)
    assert block.ln1.pending and block.q.pending and block.down.pending

    def loss(x_):
        y, _ = block_forward(block, x_.astype(np.float32), config, rope, 2, 7)
        return float(np.sum(probe * y.astype(np.float64)))
    for row, col in [(0, 0), (5, 3), (13, config.model_width - 1)]:
        step = np.zeros_like(x)
        step[row, col] = 1e-2
        numeric = (loss(x + step) - loss(x - step)) / 2e-2
        assert abs(numeric - d[row, col]) <= 2e-2 * max(1.0, abs(numeric)), (row, col)


def test_backward_needs_forward_and_matching_shapes(tiny_config):
    config = tiny_config()
    block, x, rope, _, saved = forward(config)
    block.allocate_grads()
    with pytest.raises(AssertionError, match="forward before backward"):
        block_backward(block, None, np.zeros_like(x), config, rope, trainable=True)
    with pytest.raises(AssertionError, match="does not match the block input"):
        block_backward(block, saved, np.zeros((3, config.model_width), np.float32), config, rope, True)
    with pytest.raises(AssertionError, match="block input"):
        block_forward(block, x[:5], config, rope, 2, 7)
