"""Every Cython kernel in native_ext.kernels against its numpy twin in native_ext.reference.

Dimension letters as in native_ext.reference (N rows, C width, F feed-forward width,
V vocabulary, B batch, T time, NH heads, KV key/value heads, g = NH/KV, D head size,
G head groups, R = T*g rows of a group, S keys, Bk keys of one tile).

Tolerances, as max |kernel - twin| / max |twin| (`rel_diff`):
  2e-6  elementwise kernels whose float32 operations are the same up to one rounding
        (rope, swiglu, rmsnorm forward, log-softmax, cross-entropy, softmax forward);
  1e-5  kernels that reduce a row in a different order or precision than numpy
        (rmsnorm backward, softmax backward, the flash tiles);
  ==    adam_update, whose twin is written to be bit-identical.
"""

import subprocess
import sys
import textwrap
import zlib

import numpy as np
import pytest

from native_ext import kernels, reference

ELEMENTWISE = 2e-6
REDUCTION = 1e-5


def rng_for(*key):
    """A generator seeded by the test's name and parameters (stable across runs)."""
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


def randn(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def twin_copies(*arrays):
    """Two independent copies of each array: one for the kernel, one for the twin."""
    return [a.copy() for a in arrays], [a.copy() for a in arrays]


def rope_tables(P, D, theta=10000.0):
    inv_freq = 1.0 / (theta ** (np.arange(0, D, 2, dtype=np.float64) / D))
    angles = np.outer(np.arange(P, dtype=np.float64), inv_freq)  # [P,D/2]
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


# -- rmsnorm ------------------------------------------------------------------------------


@pytest.mark.parametrize("N,C", [(1, 1), (7, 13), (33, 64)])
def test_rmsnorm_forward_matches_twin(N, C, rel_diff):
    rng = rng_for("rmsnorm_forward", N, C)
    x = randn(rng, N, C, scale=3.0)  # [N,C]
    weight = randn(rng, C)  # [C]
    (out_k, rstd_k), (out_r, rstd_r) = twin_copies(np.full((N, C), np.nan, np.float32),
                                                   np.full(N, np.nan, np.float32))
    kernels.rmsnorm_forward(x, weight, 1e-5, out_k, rstd_k)
    reference.rmsnorm_forward(x, weight, 1e-5, out_r, rstd_r)
    assert rel_diff(rstd_k, rstd_r) <= ELEMENTWISE
    assert rel_diff(out_k, out_r) <= ELEMENTWISE
    # and the twin itself is an RMSNorm
    expected = x / np.sqrt(np.mean(x.astype(np.float64) ** 2, axis=1, keepdims=True) + 1e-5) * weight
    assert rel_diff(out_r, expected) <= 1e-6


@pytest.mark.parametrize("N,C", [(1, 1), (7, 13), (33, 64)])
def test_rmsnorm_backward_accumulates_like_twin(N, C, rel_diff):
    rng = rng_for("rmsnorm_backward", N, C)
    x, dout = randn(rng, N, C, scale=2.0), randn(rng, N, C)  # [N,C]
    weight = randn(rng, C)
    rstd = np.empty(N, np.float32)
    reference.rmsnorm_forward(x, weight, 1e-5, np.empty_like(x), rstd)
    # non-zero starting buffers: backward must add, not overwrite
    (dx_k, dw_k), (dx_r, dw_r) = twin_copies(randn(rng, N, C), randn(rng, C))
    kernels.rmsnorm_backward(dout, x, weight, rstd, dx_k, dw_k)
    reference.rmsnorm_backward(dout, x, weight, rstd, dx_r, dw_r)
    assert rel_diff(dx_k, dx_r) <= REDUCTION
    assert rel_diff(dw_k, dw_r) <= REDUCTION


# -- rotary positions -----------------------------------------------------------------------


@pytest.mark.parametrize("B,T,KV,g,D,offset", [
    (1, 1, 1, 1, 2, 0),
    (2, 5, 2, 1, 8, 0),  # MHA
    (2, 7, 2, 3, 6, 4),  # GQA with a past offset
    (3, 4, 1, 4, 10, 11),  # multi-query, offset to the end of the table
])
def test_rope_forward_and_backward_match_twin(B, T, KV, g, D, offset, rel_diff):
    rng = rng_for("rope", B, T, KV, g, D, offset)
    NH = KV * g
    cos, sin = rope_tables(offset + T, D)
    # x is a strided head slice of a fused projection output, as in the model
    fused = randn(rng, B, T, NH + 2 * KV, D)  # [B,T,NH+2KV,D]
    x = fused[:, :, :NH]  # [B,T,NH,D], only the last axis contiguous
    assert B * T == 1 or not x.flags.c_contiguous
    out_k, out_r = (np.full((B, KV, T, g, D), np.nan, np.float32) for _ in range(2))
    kernels.rope_forward(x, cos, sin, offset, out_k)
    reference.rope_forward(x, cos, sin, offset, out_r)
    assert rel_diff(out_k, out_r) <= ELEMENTWISE

    dout = randn(rng, B, KV, T, g, D)  # [B,KV,T,g,D]
    dx_fused_k, dx_fused_r = (np.full((B, T, NH + 2 * KV, D), 7.0, np.float32) for _ in range(2))
    kernels.rope_backward(dout, cos, sin, offset, dx_fused_k[:, :, :NH])
    reference.rope_backward(dout, cos, sin, offset, dx_fused_r[:, :, :NH])
    assert rel_diff(dx_fused_k, dx_fused_r) <= ELEMENTWISE
    assert np.all(dx_fused_k[:, :, NH:] == 7.0), "rope_backward wrote outside its view"

    # backward is the adjoint (transpose) of forward: <rope(x), dout> == <x, rope^T(dout)>
    lhs = np.sum(out_k.astype(np.float64) * dout)
    rhs = np.sum(x.astype(np.float64) * dx_fused_k[:, :, :NH])
    assert abs(lhs - rhs) <= 1e-5 * np.sum(np.abs(out_k.astype(np.float64) * dout))


def test_rope_is_a_rotation_by_position():
    """Position 0 is the identity; every rotated pair keeps its norm."""
    rng = rng_for("rope_identity")
    B, T, NH, D = 1, 5, 2, 8
    cos, sin = rope_tables(T, D)
    x = randn(rng, B, T, NH, D)
    out = np.empty((B, NH, T, 1, D), np.float32)
    kernels.rope_forward(x, cos, sin, 0, out)
    rotated = out[:, :, :, 0].transpose(0, 2, 1, 3)  # [B,T,NH,D]
    np.testing.assert_array_equal(rotated[:, 0], x[:, 0])
    pair_norm = lambda a: a[..., : D // 2] ** 2 + a[..., D // 2:] ** 2  # noqa: E731
    np.testing.assert_allclose(pair_norm(rotated), pair_norm(x), rtol=1e-5, atol=1e-6)


# -- dense causal softmax ---------------------------------------------------------------------


@pytest.mark.parametrize("G,T,g,past", [
    (1, 1, 1, 0),
    (3, 7, 1, 0),  # MHA
    (2, 5, 3, 0),  # GQA: 3 query heads share one key row
    (2, 5, 2, 6),  # decode-like: 6 cached keys before the queries
])
def test_softmax_causal_forward_and_backward_match_twin(G, T, g, past, rel_diff):
    rng = rng_for("softmax", G, T, g, past)
    R, S = T * g, past + T
    scale = 1.0 / np.sqrt(8)
    scores = randn(rng, G, R, S, scale=4.0)  # [G,R,S]
    probs_k, probs_r = scores.copy(), scores.copy()
    kernels.softmax_causal_forward(probs_k, scale, g, past)
    reference.softmax_causal_forward(probs_r, scale, g, past)
    assert rel_diff(probs_k, probs_r) <= ELEMENTWISE
    np.testing.assert_allclose(probs_k.sum(axis=-1), 1.0, rtol=1e-6)
    query_position = past + np.arange(R) // g  # [R]
    masked = np.arange(S)[None, :] > query_position[:, None]  # [R,S]
    assert np.all(probs_k[:, masked] == 0.0), "a future key got probability mass"

    dprobs = randn(rng, G, R, S)
    dscores_k, dscores_r = dprobs.copy(), dprobs.copy()
    kernels.softmax_backward(probs_k, dscores_k, scale)
    reference.softmax_backward(probs_k, dscores_r, scale)
    assert rel_diff(dscores_k, dscores_r) <= REDUCTION
    assert np.all(dscores_k[:, masked] == 0.0)


# -- flash (online softmax) tiles ---------------------------------------------------------------


def flash_inputs(rng, G, T, g, Bk, fresh_fraction=0.5):
    R = T * g
    scores = randn(rng, G, R, Bk, scale=3.0)  # [G,R,Bk]
    running_max = randn(rng, G, R)  # [G,R]
    fresh = rng.random((G, R)) < fresh_fraction  # rows that have seen no key yet
    running_max[fresh] = -np.inf
    running_sum = np.where(fresh, 0.0, rng.random((G, R)) * 3 + 0.5).astype(np.float32)
    return scores, running_max, running_sum


@pytest.mark.parametrize("G,T,g,Bk,past,key_start", [
    (1, 1, 1, 1, 0, 0),
    (2, 4, 1, 4, 0, 0),  # diagonal tile
    (2, 4, 3, 5, 0, 0),  # GQA, key tile wider than the query tile
    (3, 5, 2, 3, 8, 4),  # query block at position 8, keys 4..6: all visible
    (2, 6, 2, 4, 0, 3),  # keys 3..6 for queries 0..5: rows of queries 0..2 fully masked
    (2, 3, 2, 4, 0, 9),  # every row fully masked
])
def test_flash_block_forward_matches_twin(G, T, g, Bk, past, key_start, rel_diff):
    rng = rng_for("flash_forward", G, T, g, Bk, past, key_start)
    scale = 0.35
    scores, running_max, running_sum = flash_inputs(rng, G, T, g, Bk)
    (s_k, m_k, l_k, a_k), (s_r, m_r, l_r, a_r) = twin_copies(
        scores, running_max, running_sum, np.full(running_max.shape, np.nan, np.float32))
    kernels.flash_block_forward(s_k, m_k, l_k, a_k, scale, g, past, key_start)
    with np.errstate(invalid="ignore", over="ignore"):
        reference.flash_block_forward(s_r, m_r, l_r, a_r, scale, g, past, key_start)
    np.testing.assert_array_equal(m_k, m_r)  # a max of identical products: exact
    assert rel_diff(a_k, a_r) <= ELEMENTWISE
    assert rel_diff(l_k, l_r) <= REDUCTION
    assert rel_diff(s_k, s_r) <= REDUCTION
    for array in (s_k, l_k, a_k):
        assert not np.any(np.isnan(array))

    query_position = past + np.arange(T * g) // g  # [R]
    fully_masked = np.broadcast_to(query_position < key_start, running_max.shape)  # [G,R]
    untouched = fully_masked & np.isneginf(running_max)
    # a row with no visible key so far keeps max -inf, sum 0 and gets alpha 1, zeros, no NaN
    assert np.all(np.isneginf(m_k[untouched]))
    assert np.all(l_k[untouched] == 0.0)
    assert np.all(a_k[untouched] == 1.0)
    assert np.all(s_k[untouched] == 0.0)
    # a fully masked row that has seen keys keeps its state exactly
    seen = fully_masked & ~np.isneginf(running_max)
    np.testing.assert_array_equal(m_k[seen], running_max[seen])
    np.testing.assert_array_equal(l_k[seen], running_sum[seen])
    assert np.all(a_k[seen] == 1.0)
    # a row seeing its first keys drops the (empty) accumulator: alpha 0
    first = ~fully_masked & np.isneginf(running_max)
    assert np.all(a_k[first] == 0.0)


@pytest.mark.parametrize("G,T,g,Bk,past,key_start", [
    (1, 1, 1, 1, 0, 0),
    (2, 4, 3, 5, 0, 0),
    (3, 5, 2, 3, 8, 4),
    (2, 6, 2, 4, 0, 3),  # partly fully masked rows
])
def test_flash_block_backward_matches_twin(G, T, g, Bk, past, key_start, rel_diff):
    rng = rng_for("flash_backward", G, T, g, Bk, past, key_start)
    R, scale = T * g, 0.35
    scores = randn(rng, G, R, Bk, scale=3.0)
    logsumexp = (np.max(scores, axis=-1) * scale + 1.0 + rng.random((G, R))).astype(np.float32)
    dprobs, delta = randn(rng, G, R, Bk), randn(rng, G, R)
    (s_k, d_k), (s_r, d_r) = twin_copies(scores, dprobs)
    kernels.flash_block_backward(s_k, logsumexp, d_k, delta, scale, g, past, key_start)
    reference.flash_block_backward(s_r, logsumexp, d_r, delta, scale, g, past, key_start)
    assert rel_diff(s_k, s_r) <= REDUCTION
    assert rel_diff(d_k, d_r) <= REDUCTION
    masked = key_start + np.arange(Bk)[None, :] > (past + np.arange(R) // g)[:, None]  # [R,Bk]
    assert np.all(s_k[:, masked] == 0.0) and np.all(d_k[:, masked] == 0.0)


@pytest.mark.parametrize("G,T,g,D,past,block", [
    (2, 9, 1, 4, 0, 4),
    (3, 7, 2, 6, 0, 3),
    (2, 5, 3, 4, 6, 2),  # tiles over 6 cached keys before the queries
    (1, 6, 2, 4, 0, 64),  # one tile covers everything
])
def test_tiled_attention_matches_dense(G, T, g, D, past, block, rel_diff):
    """The flash tiles composed by trainer.attention equal the dense softmax path."""
    from trainer import attention

    rng = rng_for("tiled_vs_dense", G, T, g, D, past, block)
    R, S, scale = T * g, past + T, 1.0 / np.sqrt(D)
    q, k, v = randn(rng, G, R, D, scale=2.0), randn(rng, G, S, D, scale=2.0), randn(rng, G, S, D)
    dout = randn(rng, G, R, D)
    out_d, probs = attention.dense_forward(q, k, v, scale, g, past)
    out_t, lse = attention.tiled_forward(q, k, v, scale, g, block, past)
    assert rel_diff(out_t, out_d) <= REDUCTION
    grads_d = attention.dense_backward(dout, q, k, v, probs, scale)
    grads_t = attention.tiled_backward(dout, q, k, v, out_t, lse, scale, g, block, past)
    for name, a, b in zip("qkv", grads_t, grads_d):
        assert rel_diff(a, b) <= REDUCTION, f"d{name}"


# -- SwiGLU -------------------------------------------------------------------------------------


@pytest.mark.parametrize("N,F", [(1, 1), (5, 7), (32, 48)])
def test_swiglu_forward_and_backward_match_twin(N, F, rel_diff):
    rng = rng_for("swiglu", N, F)
    gate_up = randn(rng, N, 2 * F, scale=3.0)  # [N,2F]
    out_k, out_r = (np.full((N, F), np.nan, np.float32) for _ in range(2))
    kernels.swiglu_forward(gate_up, out_k)
    reference.swiglu_forward(gate_up, out_r)
    assert rel_diff(out_k, out_r) <= ELEMENTWISE
    dout = randn(rng, N, F)
    d_k, d_r = (np.full((N, 2 * F), np.nan, np.float32) for _ in range(2))  # written, not added
    kernels.swiglu_backward(dout, gate_up, d_k)
    reference.swiglu_backward(dout, gate_up, d_r)
    assert rel_diff(d_k, d_r) <= ELEMENTWISE


# -- cross-entropy and log-softmax ------------------------------------------------------------------


@pytest.mark.parametrize("N,V,ignore_index", [(1, 2, -100), (9, 23, -100), (16, 101, 5)])
def test_cross_entropy_forward_backward_matches_twin(N, V, ignore_index, rel_diff):
    rng = rng_for("cross_entropy", N, V, ignore_index)
    logits = randn(rng, N, V, scale=4.0)  # [N,V]
    targets = rng.integers(0, V, size=N)
    if N > 1:
        targets[::3] = ignore_index  # ignored rows (for ignore_index=5 a real-looking id)
    valid = targets != ignore_index
    grad_scale = 1.0 / max(1, valid.sum())
    (lg_k, loss_k), (lg_r, loss_r) = twin_copies(logits, np.full(N, np.nan, np.float32))
    kernels.cross_entropy_forward_backward(lg_k, targets, loss_k, grad_scale, ignore_index)
    reference.cross_entropy_forward_backward(lg_r, targets, loss_r, grad_scale, ignore_index)
    assert rel_diff(loss_k, loss_r) <= ELEMENTWISE
    assert rel_diff(lg_k, lg_r) <= ELEMENTWISE
    assert np.all(loss_k[~valid] == 0.0) and np.all(lg_k[~valid] == 0.0)
    np.testing.assert_allclose(lg_k[valid].sum(axis=1), 0.0, atol=1e-6)  # softmax - onehot
    # the twin is the textbook formula
    z = logits.astype(np.float64)
    lse = np.log(np.exp(z - z.max(1, keepdims=True)).sum(1)) + z.max(1)
    rows = np.flatnonzero(valid)
    np.testing.assert_allclose(loss_r[rows], lse[rows] - z[rows, targets[rows]], rtol=1e-6)


@pytest.mark.parametrize("N,V", [(1, 1), (9, 23), (16, 101)])
def test_log_softmax_gather_matches_twin(N, V, rel_diff):
    rng = rng_for("log_softmax_gather", N, V)
    logits = randn(rng, N, V, scale=4.0)
    targets = rng.integers(0, V, size=N)
    out_k, out_r = np.full(N, np.nan, np.float32), np.full(N, np.nan, np.float32)
    kernels.log_softmax_gather(logits, targets, out_k)
    reference.log_softmax_gather(logits, targets, out_r)
    assert rel_diff(out_k, out_r) <= ELEMENTWISE
    assert np.all(out_k <= 0.0)


# -- embedding backward ---------------------------------------------------------------------------


@pytest.mark.parametrize("N,V,C", [(1, 1, 1), (13, 5, 7), (40, 23, 16)])
def test_embedding_backward_accumulates_like_twin(N, V, C, rel_diff):
    rng = rng_for("embedding_backward", N, V, C)
    dout = randn(rng, N, C)
    tokens = rng.integers(0, V, size=N)  # repeated ids: rows must add up
    (table_k,), (table_r,) = twin_copies(randn(rng, V, C))
    kernels.embedding_backward(dout, tokens, table_k)
    reference.embedding_backward(dout, tokens, table_r)
    assert rel_diff(table_k, table_r) <= ELEMENTWISE


# -- Adam -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 7, 1000])
@pytest.mark.parametrize("hyper", [
    dict(learning_rate=1e-3, beta1=0.9, beta2=0.999, epsilon=1e-8, weight_decay=0.0),
    dict(learning_rate=3e-2, beta1=0.8, beta2=0.95, epsilon=1e-6, weight_decay=0.1),
    dict(learning_rate=0.5, beta1=0.0, beta2=0.5, epsilon=1e-3, weight_decay=2.0),
])
def test_adam_update_is_bit_identical_to_twin(n, hyper):
    rng = rng_for("adam", n, hyper["learning_rate"])
    param_k = randn(rng, n)
    start = param_k.copy()
    m_k, v_k = np.zeros(n, np.float32), np.zeros(n, np.float32)
    param_r, m_r, v_r = param_k.copy(), m_k.copy(), v_k.copy()
    for step in range(1, 5):
        grad = randn(rng, n, scale=10.0 ** -step)
        grad[1::5] = 0.0  # exact zeros too
        bc1, bc2 = 1.0 - hyper["beta1"] ** step, 1.0 - hyper["beta2"] ** step
        kernels.adam_update(param_k, grad, m_k, v_k, bias_correction1=bc1, bias_correction2=bc2, **hyper)
        reference.adam_update(param_r, grad, m_r, v_r, bias_correction1=bc1, bias_correction2=bc2, **hyper)
        assert np.array_equal(m_k, m_r), f"first moment differs at step {step}"
        assert np.array_equal(v_k, v_r), f"second moment differs at step {step}"
        assert np.array_equal(param_k, param_r), f"parameters differ at step {step}"
    assert not np.array_equal(param_k, start), "the update did nothing"


# -- validation --------------------------------------------------------------------------------------


def f32(*shape):
    return np.zeros(shape, np.float32)


COS, SIN = rope_tables(8, 4)  # an 8-position table for head size 4


def rope_x(T=3):
    return f32(1, T, 2, 4)  # [B,T,NH,D]


INVALID_CALLS = {
    # name: (call, exception, message fragment)
    "dtype float64": (lambda: kernels.rmsnorm_forward(np.zeros((2, 3)), f32(3), 1e-5, f32(2, 3), f32(2)),
                      TypeError, "x must be float32"),
    "not an array": (lambda: kernels.rmsnorm_forward([[0.0]], f32(1), 1e-5, f32(1, 1), f32(1)),
                     TypeError, "x must be a numpy array"),
    "wrong ndim": (lambda: kernels.rmsnorm_forward(f32(6), f32(3), 1e-5, f32(2, 3), f32(2)),
                   ValueError, "x must have 2 dimensions"),
    "weight shape": (lambda: kernels.rmsnorm_forward(f32(2, 3), f32(4), 1e-5, f32(2, 3), f32(2)),
                     ValueError, "weight has shape (4,), expected (3,)"),
    "rstd shape": (lambda: kernels.rmsnorm_backward(f32(2, 3), f32(2, 3), f32(3), f32(3), f32(2, 3), f32(3)),
                   ValueError, "rstd has shape"),
    "non-contiguous": (lambda: kernels.rmsnorm_forward(f32(2, 6)[:, ::2], f32(3), 1e-5, f32(2, 3), f32(2)),
                       ValueError, "x must be C-contiguous"),
    "read-only output": (lambda: kernels.swiglu_forward(f32(2, 4), _readonly(f32(2, 2))),
                         ValueError, "out must be writable"),
    "swiglu width": (lambda: kernels.swiglu_forward(f32(2, 5), f32(2, 2)),
                     ValueError, "gate_up has shape (2, 5), expected (2, 4)"),
    "rope beyond table": (lambda: kernels.rope_forward(rope_x(3), COS, SIN, 6, f32(1, 2, 3, 1, 4)),
                          ValueError, "positions 6..8 exceed the rotary table of 8 positions"),
    "rope negative offset": (lambda: kernels.rope_forward(rope_x(3), COS, SIN, -1, f32(1, 2, 3, 1, 4)),
                             ValueError, "exceed the rotary table"),
    "rope backward beyond table": (lambda: kernels.rope_backward(f32(1, 2, 9, 1, 4), COS, SIN, 0,
                                                                 f32(1, 9, 2, 4)),
                                   ValueError, "exceed the rotary table"),
    "rope odd head size": (lambda: kernels.rope_forward(f32(1, 3, 2, 3), COS, SIN, 0, f32(1, 2, 3, 1, 3)),
                           ValueError, "head size must be even"),
    "rope table width": (lambda: kernels.rope_forward(f32(1, 3, 2, 6), COS, SIN, 0, f32(1, 2, 3, 1, 6)),
                         ValueError, "cos has shape"),
    "rope groups": (lambda: kernels.rope_forward(rope_x(3), COS, SIN, 0, f32(1, 3, 3, 1, 4)),
                    ValueError, "do not cover 2 heads"),
    "rope last axis strided": (lambda: kernels.rope_forward(f32(1, 3, 2, 8)[..., ::2], COS, SIN, 0,
                                                            f32(1, 2, 3, 1, 4)),
                               ValueError, "contiguous along its last axis"),
    "rope x dtype": (lambda: kernels.rope_forward(np.zeros((1, 3, 2, 4)), COS, SIN, 0, f32(1, 2, 3, 1, 4)),
                     TypeError, "x must be a 4-d float32"),
    "softmax groups": (lambda: kernels.softmax_causal_forward(f32(1, 5, 5), 1.0, 2, 0),
                       ValueError, "not a multiple of group_size 2"),
    "softmax group zero": (lambda: kernels.softmax_causal_forward(f32(1, 4, 4), 1.0, 0, 0),
                           ValueError, "group_size"),
    "softmax backward shape": (lambda: kernels.softmax_backward(f32(1, 2, 3), f32(1, 3, 2), 1.0),
                               ValueError, "dprobs has shape"),
    "flash state shape": (lambda: kernels.flash_block_forward(f32(2, 3, 4), f32(2, 4), f32(2, 3), f32(2, 3),
                                                              1.0, 1, 0, 0),
                          ValueError, "running_max has shape"),
    "flash backward lse": (lambda: kernels.flash_block_backward(f32(2, 3, 4), f32(3, 2), f32(2, 3, 4),
                                                                f32(2, 3), 1.0, 1, 0, 0),
                           ValueError, "logsumexp has shape"),
    "targets dtype": (lambda: kernels.cross_entropy_forward_backward(f32(2, 3), np.zeros(2, np.int32),
                                                                     f32(2), 1.0),
                      TypeError, "targets must be int64"),
    "targets range": (lambda: kernels.cross_entropy_forward_backward(f32(2, 3), np.array([0, 3]), f32(2), 1.0),
                      ValueError, "targets must lie in [0, 3)"),
    "negative target": (lambda: kernels.log_softmax_gather(f32(2, 3), np.array([0, -100]), f32(2)),
                        ValueError, "targets must lie in [0, 3)"),
    "losses shape": (lambda: kernels.cross_entropy_forward_backward(f32(2, 3), np.array([0, 1]), f32(3), 1.0),
                     ValueError, "losses has shape"),
    "token beyond table": (lambda: kernels.embedding_backward(f32(2, 3), np.array([0, 4]), f32(4, 3)),
                           ValueError, "targets must lie in [0, 4)"),
    "embedding width": (lambda: kernels.embedding_backward(f32(2, 3), np.array([0, 1]), f32(4, 2)),
                        ValueError, "dtable has shape"),
    "adam moment shape": (lambda: kernels.adam_update(f32(4), f32(4), f32(3), f32(4), 1e-3, 0.9, 0.999,
                                                      1e-8, 0.0, 0.1, 0.001),
                          ValueError, "m has shape (3,), expected (4,)"),
    "adam grad dtype": (lambda: kernels.adam_update(f32(4), np.zeros(4), f32(4), f32(4), 1e-3, 0.9, 0.999,
                                                    1e-8, 0.0, 0.1, 0.001),
                        TypeError, "grad must be float32"),
    "adam param 2-d": (lambda: kernels.adam_update(f32(2, 2), f32(4), f32(4), f32(4), 1e-3, 0.9, 0.999,
                                                   1e-8, 0.0, 0.1, 0.001),
                       ValueError, "param must have 1 dimensions"),
}


def _readonly(array):
    array.setflags(write=False)
    return array


@pytest.mark.parametrize("case", list(INVALID_CALLS))
def test_wrapper_rejects_invalid_arguments(case):
    call, exception, fragment = INVALID_CALLS[case]
    with pytest.raises(exception) as info:
        call()
    assert fragment in str(info.value), f"unhelpful message: {info.value}"


def test_rejected_call_leaves_outputs_untouched():
    out = np.full((2, 2), 3.0, np.float32)
    with pytest.raises(ValueError):
        kernels.swiglu_forward(f32(2, 5), out)
    assert np.all(out == 3.0)


# Calls that would corrupt memory or die with SIGFPE inside the kernel if the wrapper let
# them through: each runs in a child process, so a regression fails one test, not the suite.
POSITION_CALLS = {
    "softmax negative past": (
        "kernels.softmax_causal_forward(np.ones((1, 2, 3), np.float32), 1.0, 1, -3)", "past"),
    "flash forward group_size 0": (
        "kernels.flash_block_forward(np.zeros((1, 2, 3), np.float32), np.full((1, 2), -np.inf, np.float32),"
        " np.zeros((1, 2), np.float32), np.zeros((1, 2), np.float32), 1.0, 0, 0, 0)", "group_size"),
    "flash backward group_size 0": (
        "kernels.flash_block_backward(np.zeros((1, 2, 3), np.float32), np.zeros((1, 2), np.float32),"
        " np.zeros((1, 2, 3), np.float32), np.zeros((1, 2), np.float32), 1.0, 0, 0, 0)", "group_size"),
    "flash rows not a multiple of group_size": (
        "kernels.flash_block_forward(np.zeros((1, 3, 3), np.float32), np.full((1, 3), -np.inf, np.float32),"
        " np.zeros((1, 3), np.float32), np.zeros((1, 3), np.float32), 1.0, 2, 0, 0)", "group_size 2"),
}


@pytest.mark.parametrize("case", list(POSITION_CALLS))
def test_wrapper_rejects_positions_that_would_crash_the_kernel(case):
    call, fragment = POSITION_CALLS[case]
    script = textwrap.dedent(f"""
        import numpy as np
        from native_ext import kernels
        try:
            {call}
        except ValueError as error:
            print("ValueError:", error)
        else:
            print("accepted")
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, f"the child died with {result.returncode}: {result.stderr[-300:]}"
    assert result.stdout.startswith("ValueError") and fragment in result.stdout, result.stdout


# -- threads ------------------------------------------------------------------------------------


def test_row_kernels_give_the_same_bytes_on_any_thread_count():
    """RMSNorm, rotary positions, SwiGLU and the cross-entropy rows on 1, 2, 3 and 5 threads of the pool
    (rows.h): the rows are cut into fixed chunks, and RMSNorm's weight gradient adds the chunks' partial sums
    in chunk order."""
    from native_ext import _kernels

    rng = rng_for("row kernel threads")
    N, C, F, V = 333, 72, 40, 517  # several chunks of every kernel, with a short last one
    x, dout, gate_up = randn(rng, N, C, scale=2.0), randn(rng, N, C), randn(rng, N, 2 * F, scale=2.0)
    weight, dswiglu = randn(rng, C), randn(rng, N, F)
    logits, targets = randn(rng, N, V, scale=3.0), rng.integers(0, V, N).astype(np.int64)
    targets[::7] = -100
    B, T, KV, g, D = 2, 37, 2, 3, 8
    fused = randn(rng, B, T, KV * g * D + 5)  # the heads are a strided view of a wider projection output
    heads = fused[:, :, :KV * g * D].reshape(B, T, KV * g, D)
    drotated = randn(rng, B, KV, T, g, D)
    cos, sin = rope_tables(T + 4, D)

    def run(threads):
        out, rstd = np.empty((N, C), np.float32), np.empty(N, np.float32)
        _kernels.rmsnorm_forward(x, weight, 1e-5, out, rstd, threads)
        dx, dweight = np.ones((N, C), np.float32), np.ones(C, np.float32)
        _kernels.rmsnorm_backward(dout, x, weight, rstd, dx, dweight, threads)
        swiglu, dgate_up = np.empty((N, F), np.float32), np.empty((N, 2 * F), np.float32)
        _kernels.swiglu_forward(gate_up, swiglu, threads)
        _kernels.swiglu_backward(dswiglu, gate_up, dgate_up, threads)
        grads, losses = logits.copy(), np.empty(N, np.float32)
        _kernels.cross_entropy_forward_backward(grads, targets, losses, 0.5, -100, threads)
        rotated, dheads = np.empty((B, KV, T, g, D), np.float32), np.full((B, T, KV * g, D + 3), 7.0, np.float32)
        _kernels.rope_forward(heads, cos, sin, 3, rotated, threads)
        _kernels.rope_backward(drotated, cos, sin, 3, dheads[..., :D], threads)
        return [a.tobytes() for a in (out, rstd, dx, dweight, swiglu, dgate_up, grads, losses, rotated, dheads)]

    one = run(1)
    for threads in (2, 3, 5):
        assert run(threads) == one, f"{threads} threads"
    # and the weight gradient is still the twin's
    dx_r, dweight_r = np.ones((N, C), np.float32), np.ones(C, np.float32)
    rstd = np.frombuffer(one[1], np.float32)
    reference.rmsnorm_backward(dout, x, weight, rstd, dx_r, dweight_r)
    assert np.max(np.abs(np.frombuffer(one[3], np.float32) - dweight_r)) <= REDUCTION * np.max(np.abs(dweight_r))
    rotated_r = np.empty((B, KV, T, g, D), np.float32)
    reference.rope_forward(heads, cos, sin, 3, rotated_r)
    assert np.max(np.abs(np.frombuffer(one[8], np.float32).reshape(rotated_r.shape) - rotated_r)) <= 1e-6
    dheads = np.frombuffer(one[9], np.float32).reshape(B, T, KV * g, D + 3)
    assert (dheads[..., D:] == 7.0).all()  # nothing outside the view is written


def test_adam_gives_the_twins_bytes_on_any_thread_count():
    """Adam over several of rows.h's 65,536-element chunks with a short last one, on 1, 2 and 3 threads of the
    pool, starting from an unaligned element: the twin's bytes every time."""
    from native_ext import _kernels

    rng = rng_for("adam threads")
    n = 3 * 65536 + 1237
    start, grad = randn(rng, n + 3), randn(rng, n + 3, scale=1e-2)
    moments = np.abs(randn(rng, 2, n + 3, scale=1e-3))
    hyper = (3e-2, 0.8, 0.95, 1e-6, 0.1, 1.0 - 0.8 ** 3, 1.0 - 0.95 ** 3)

    def run(threads):
        param, m, v = start.copy(), moments[0].copy(), moments[1].copy()
        _kernels.adam_update(param[3:], grad[3:], m[3:], v[3:], *hyper, threads)
        return [a.tobytes() for a in (param, m, v)]

    param_r, m_r, v_r = start.copy(), moments[0].copy(), moments[1].copy()
    reference.adam_update(param_r[3:], grad[3:], m_r[3:], v_r[3:], *hyper)
    twin = [a.tobytes() for a in (param_r, m_r, v_r)]
    assert twin[0] != start.tobytes()
    for threads in (1, 2, 3):
        assert run(threads) == twin, f"{threads} threads"
