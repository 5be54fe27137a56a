"""fused_linear_cross_entropy against a float64 numpy twin that materialises the whole logits."""

import numpy as np
import pytest

from trainer.crossentropy import IGNORE_INDEX, fused_linear_cross_entropy
from trainer.parameters import Parameter

N, C, V = 13, 8, 29  # 13 rows: chunks of 5 leave a partial last chunk
FLOAT32_VS_FLOAT64 = 1e-5


def problem(seed=0):
    """hidden [N,C], weight [V,C], targets [N] with some ignored rows."""
    rng = np.random.default_rng(seed)
    hidden = rng.standard_normal((N, C), dtype=np.float32)
    weight = rng.standard_normal((V, C), dtype=np.float32) * np.float32(0.5)
    targets = rng.integers(0, V, N)
    targets[[1, 6, 12]] = IGNORE_INDEX
    return hidden, weight, targets


def twin(hidden, weight, targets, row_scales):
    """log p(target) [N], d(sum_t row_scales_t * -log p_t) / d hidden and / d weight, in float64."""
    h, w = hidden.astype(np.float64), weight.astype(np.float64)
    logits = h @ w.T  # [N,V]
    logits -= logits.max(axis=1, keepdims=True)
    logp_all = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
    safe = np.where(targets == IGNORE_INDEX, 0, targets)
    logp = np.where(targets == IGNORE_INDEX, 0.0, logp_all[np.arange(N), safe])
    dlogits = np.exp(logp_all)
    dlogits[np.arange(N), safe] -= 1.0
    dlogits *= row_scales[:, None]
    return logp, dlogits @ w, dlogits.T @ h


@pytest.mark.parametrize("chunk", [1, 5, N, 64])
def test_log_probabilities_without_gradients(chunk, rel_diff):
    hidden, weight, targets = problem()
    logp, dhidden = fused_linear_cross_entropy(hidden, weight, targets, chunk)
    assert dhidden is None and logp.dtype == np.float32
    expected, _, _ = twin(hidden, weight, targets, np.zeros(N))
    assert rel_diff(logp, expected) <= FLOAT32_VS_FLOAT64
    assert np.all(logp[targets == IGNORE_INDEX] == 0.0)


@pytest.mark.parametrize("chunk", [1, 5, N])
@pytest.mark.parametrize("route", ["mean", "weighted"])
def test_losses_and_gradients_match_twin(chunk, route, rel_diff):
    hidden, weight, targets = problem(1)
    valid = targets != IGNORE_INDEX
    head = Parameter("lm_head.weight", weight, np.full_like(weight, np.nan))
    if route == "mean":
        scales = np.where(valid, 1.0 / valid.sum(), 0.0)
        losses, dhidden = fused_linear_cross_entropy(hidden, weight, targets, chunk,
                                                     grad_scale=1.0 / valid.sum(), head=head)
    else:
        scales = np.where(valid, np.linspace(-1.0, 2.0, N), 0.0)
        losses, dhidden = fused_linear_cross_entropy(hidden, weight, targets, chunk,
                                                     row_scales=scales.astype(np.float32), head=head)
    logp, expected_dhidden, expected_dweight = twin(hidden, weight, targets, scales)
    assert rel_diff(losses[valid], -logp[valid]) <= FLOAT32_VS_FLOAT64
    assert rel_diff(dhidden, expected_dhidden) <= FLOAT32_VS_FLOAT64
    assert head.pending, "the head gradient is marked pending"
    assert rel_diff(head.grad, expected_dweight) <= FLOAT32_VS_FLOAT64


def test_head_gradient_accumulates_across_calls(rel_diff):
    hidden, weight, targets = problem(2)
    head = Parameter("lm_head.weight", weight, np.zeros_like(weight))
    for _ in range(2):
        fused_linear_cross_entropy(hidden, weight, targets, 5, grad_scale=1.0, head=head)
    _, _, once = twin(hidden, weight, targets, (targets != IGNORE_INDEX).astype(np.float64))
    assert rel_diff(head.grad, 2 * once) <= FLOAT32_VS_FLOAT64


def test_finite_differences_of_the_mean_loss():
    hidden, weight, targets = problem(3)
    valid = int(np.count_nonzero(targets != IGNORE_INDEX))
    _, dhidden = fused_linear_cross_entropy(hidden, weight, targets, 5, grad_scale=1.0 / valid)

    def loss(h):
        logp = twin(h, weight, targets, np.zeros(N))[0]
        return -logp.sum() / valid
    h64 = hidden.astype(np.float64)
    for row, col in [(0, 0), (4, 3), (12, 7), (1, 2)]:
        step = np.zeros_like(h64)
        step[row, col] = 1e-6
        numeric = (loss(h64 + step) - loss(h64 - step)) / 2e-6
        assert abs(numeric - dhidden[row, col]) <= 1e-4 * max(1.0, abs(numeric))


@pytest.mark.parametrize("kwargs, message", [
    ({"chunk": 0}, "chunk must be a positive"),
    ({"targets": np.zeros(N - 1, np.int64)}, "one id per hidden row"),
    ({"grad_scale": 1.0, "row_scales": np.zeros(N, np.float32)}, "exclusive"),
    ({"head": Parameter("w", np.zeros((V, C), np.float32), np.zeros((V, C), np.float32))}, "head gradient"),
])
def test_preconditions_are_asserted(kwargs, message):
    hidden, weight, targets = problem()
    arguments = {"hidden": hidden, "weight": weight, "targets": targets, "chunk": 5, **kwargs}
    with pytest.raises(AssertionError, match=message):
        fused_linear_cross_entropy(**arguments)
