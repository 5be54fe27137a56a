"""forward_backward_weighted: gradients of sum_t c_t * log p_t (policy-gradient objectives)."""

import numpy as np
import pytest
import torch

from native_ext import kernels, reference
from trainer import DecoderOnlyTransformer, LoraConfig, TransformerConfig

from torch_reference import TorchLlama


def tiny(**overrides):
    values = dict(vocabulary_size=40, maximum_context=16, model_width=16, head_count=4, kv_head_count=2,
                  block_count=2, feed_forward_width=24, loss_chunk_tokens=5)
    values.update(overrides)
    return TransformerConfig(**values)


def test_weighted_cross_entropy_kernel_matches_twin():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((9, 33)).astype(np.float32)
    targets = rng.integers(0, 33, 9)
    scales = rng.standard_normal(9).astype(np.float32)
    ours, twin = logits.copy(), logits.copy()
    loss_ours, loss_twin = np.empty(9, np.float32), np.empty(9, np.float32)
    kernels.weighted_cross_entropy(ours, targets, loss_ours, scales)
    reference.weighted_cross_entropy(twin, targets, loss_twin, scales)
    np.testing.assert_allclose(ours, twin, atol=1e-6)
    np.testing.assert_allclose(loss_ours, loss_twin, atol=1e-5)


@pytest.mark.parametrize("route", ["full_logits", "kt_tape_flce"])
def test_mean_log_likelihood_coefficients_reproduce_cross_entropy(route):
    config = tiny(loss_route=route)
    rng = np.random.default_rng(1)
    inputs, targets = rng.integers(0, 40, (2, 9)), rng.integers(0, 40, (2, 9))
    targets[1, :4] = -100
    plain = DecoderOnlyTransformer(config)
    loss = plain.forward_backward(inputs, targets)
    weighted = DecoderOnlyTransformer(config)
    valid = targets != -100
    logp = weighted.forward_backward_weighted(inputs, targets, lambda lp: np.where(valid, -1.0 / valid.sum(), 0.0))
    assert abs(-logp[valid].mean() - loss) < 1e-5
    assert np.all(logp[~valid] == 0)
    with plain.parameters() as a, weighted.parameters() as b:
        for x, y in zip(a, b):
            np.testing.assert_allclose(x.grad, y.grad, atol=1e-6, rtol=1e-4, err_msg=x.name)


def test_nonlinear_objective_matches_torch_autograd():
    config = tiny()
    model = DecoderOnlyTransformer(config)
    rng = np.random.default_rng(2)
    inputs, targets = rng.integers(0, 40, (2, 8)), rng.integers(0, 40, (2, 8))
    targets[0, 0] = -100
    old = rng.standard_normal((2, 8)) * 0.1 - 3.7
    weights = rng.standard_normal((2, 8))
    valid = targets != -100

    # objective: sum_t w_t * exp(logp_t - old_t)  ->  c_t = w_t * exp(logp_t - old_t)
    logp = model.forward_backward_weighted(inputs, targets, lambda lp: weights * np.exp(lp - old) * valid)
    twin = TorchLlama(config, model.state_dict(), torch.float64)
    logits = twin.logits(torch.tensor(inputs))
    logprobs = torch.log_softmax(logits, -1).gather(-1, torch.tensor(np.where(valid, targets, 0))[..., None])[..., 0]
    objective = (torch.tensor(weights * valid) * torch.exp(logprobs - torch.tensor(old))).sum()
    objective.backward()
    np.testing.assert_allclose(logp[valid], logprobs.detach().numpy()[valid], atol=1e-5)
    grads = twin.grads()
    with model.parameters() as params:
        for p in params:
            scale = np.abs(grads[p.name]).max() + 1e-12
            assert np.abs(p.grad - grads[p.name]).max() <= 1e-4 * scale, p.name


def test_adapter_only_and_refusals():
    model = DecoderOnlyTransformer(tiny())
    model.attach_lora(LoraConfig(rank=2, alpha=4))
    inputs = np.zeros((1, 4), np.int64)
    with pytest.raises(ValueError, match="shape"):
        model.forward_backward_weighted(inputs, inputs, lambda lp: np.zeros(3))
    with pytest.raises(ValueError, match="finite"):
        model.forward_backward_weighted(inputs, inputs, lambda lp: np.full(lp.shape, np.nan))
    model.forward_backward_weighted(inputs, inputs, lambda lp: np.ones(lp.shape))
    with model.adapter_parameters() as adapters:
        assert all(p.pending for p in adapters)
