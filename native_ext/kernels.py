"""The validating public layer over the Cython kernels in native_ext._kernels (and the attention kernel's row work
on one key block, in native_ext._attention).

Every function checks dtypes, shapes and contiguity, then calls the kernel, which
releases the GIL. The numpy twins with the same signatures live in native_ext.reference.
"""

import numpy as np

from native_ext import blas
from native_ext.validate import built
from native_ext.validate import check_array as _check

_kernels = built("_kernels", "the Cython kernels")
_attention = built("_attention", "the fused attention kernel")
# RMSNorm, rotary positions, SwiGLU, the cross-entropy rows and Adam run on the process's one thread pool
# (native_ext/pool.h, shared with OpenBLAS), on as many threads as OpenBLAS computes on at the call; their
# bytes do not depend on it
_kernels.use_pool(blas.POOL_RUN)

F32 = np.float32
I64 = np.int64


def _same(name, shape, expected):
    if tuple(shape) != tuple(expected):
        raise ValueError(f"{name} has shape {tuple(shape)}, expected {tuple(expected)}")


def rmsnorm_forward(x, weight, eps, out, rstd):
    _check("x", x, F32, 2)
    _check("weight", weight, F32, 1)
    _check("out", out, F32, 2, True)
    _check("rstd", rstd, F32, 1, True)
    N, C = x.shape
    _same("weight", weight.shape, (C,))
    _same("out", out.shape, (N, C))
    _same("rstd", rstd.shape, (N,))
    _kernels.rmsnorm_forward(x, weight, float(eps), out, rstd, blas.threads())


def rmsnorm_backward(dout, x, weight, rstd, dx, dweight):
    for name, a in (("dout", dout), ("x", x)):
        _check(name, a, F32, 2)
    _check("dx", dx, F32, 2, True)
    _check("weight", weight, F32, 1)
    _check("rstd", rstd, F32, 1)
    _check("dweight", dweight, F32, 1, True)
    N, C = x.shape
    _same("dout", dout.shape, (N, C))
    _same("dx", dx.shape, (N, C))
    _same("weight", weight.shape, (C,))
    _same("dweight", dweight.shape, (C,))
    _same("rstd", rstd.shape, (N,))
    _kernels.rmsnorm_backward(dout, x, weight, rstd, dx, dweight, blas.threads())


def _rope_checks(table_cos, table_sin, T, D, position_offset):
    _check("cos", table_cos, F32, 2)
    _check("sin", table_sin, F32, 2)
    if D % 2:
        raise ValueError(f"head size must be even for rotary positions, got {D}")
    _same("cos", table_cos.shape[1:], (D // 2,))
    _same("sin", table_sin.shape, table_cos.shape)
    if position_offset < 0 or position_offset + T > table_cos.shape[0]:
        raise ValueError(
            f"positions {position_offset}..{position_offset + T - 1} exceed the rotary table "
            f"of {table_cos.shape[0]} positions (maximum_context)"
        )


def _check_rows(name, array, ndim, writable=False):
    # a strided [B,T,NH,D] view into a fused projection output: only the last axis
    # needs to be contiguous
    if not isinstance(array, np.ndarray) or array.dtype != F32 or array.ndim != ndim:
        raise TypeError(f"{name} must be a {ndim}-d float32 numpy array")
    if array.strides[-1] != array.itemsize:
        raise ValueError(f"{name} must be contiguous along its last axis")
    if any(stride % array.itemsize for stride in array.strides):
        raise ValueError(f"{name} must have strides that are whole elements")
    if writable and not array.flags.writeable:
        raise ValueError(f"{name} must be writable")


def rope_forward(x, cos, sin, position_offset, out):
    """x [B,T,NH,D] -> out [B,KV,T,g,D] (NH = KV*g), rotated."""
    _check_rows("x", x, 4)
    _check("out", out, F32, 5, True)
    B, T, NH, D = x.shape
    KV, g = out.shape[1], out.shape[3]
    _same("out", out.shape, (B, KV, T, g, D))
    if KV * g != NH:
        raise ValueError(f"out groups {KV}x{g} do not cover {NH} heads")
    _rope_checks(cos, sin, T, D, position_offset)
    _kernels.rope_forward(x, cos, sin, int(position_offset), out, blas.threads())


def rope_backward(dout, cos, sin, position_offset, dx):
    """dout [B,KV,T,g,D] -> dx [B,T,NH,D] (written)."""
    _check("dout", dout, F32, 5)
    _check_rows("dx", dx, 4, True)
    B, KV, T, g, D = dout.shape
    _same("dx", dx.shape, (B, T, KV * g, D))
    _rope_checks(cos, sin, T, D, position_offset)
    _kernels.rope_backward(dout, cos, sin, int(position_offset), dx, blas.threads())


def _check_positions(scores, group_size, past, key_start=0):
    if isinstance(group_size, bool) or not isinstance(group_size, (int, np.integer)) or group_size <= 0:
        raise ValueError(f"group_size must be a positive integer, got {group_size!r}")
    if scores.shape[1] % group_size:
        raise ValueError(f"rows {scores.shape[1]} are not a multiple of group_size {group_size}")
    for name, value in (("past", past), ("key_start", key_start)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
            raise ValueError(f"{name} must be a non-negative integer, got {value!r}")


def softmax_causal_forward(scores, scale, group_size, past):
    """scores [G,R,S] in place; row r is query position past + r // group_size."""
    _check("scores", scores, F32, 3, True)
    _check_positions(scores, group_size, past)
    _kernels.softmax_causal_forward(scores, float(scale), int(group_size), int(past))


def softmax_backward(probs, dprobs, scale):
    _check("probs", probs, F32, 3)
    _check("dprobs", dprobs, F32, 3, True)
    _same("dprobs", dprobs.shape, probs.shape)
    _kernels.softmax_backward(probs, dprobs, float(scale))


def flash_block_forward(scores, running_max, running_sum, alpha, scale, group_size, past, key_start):
    _check("scores", scores, F32, 3, True)
    for name, a in (("running_max", running_max), ("running_sum", running_sum), ("alpha", alpha)):
        _check(name, a, F32, 2, True)
        _same(name, a.shape, scores.shape[:2])
    _check_positions(scores, group_size, past, key_start)
    _attention.flash_block_forward(scores, running_max, running_sum, alpha, float(scale),
                                   int(group_size), int(past), int(key_start))


def flash_block_backward(scores, logsumexp, dprobs, delta, scale, group_size, past, key_start):
    _check("scores", scores, F32, 3, True)
    _check("dprobs", dprobs, F32, 3, True)
    _same("dprobs", dprobs.shape, scores.shape)
    for name, a in (("logsumexp", logsumexp), ("delta", delta)):
        _check(name, a, F32, 2)
        _same(name, a.shape, scores.shape[:2])
    _check_positions(scores, group_size, past, key_start)
    _attention.flash_block_backward(scores, logsumexp, dprobs, delta, float(scale),
                                    int(group_size), int(past), int(key_start))


def swiglu_forward(gate_up, out):
    """out [N,F] = silu(gate) * up from gate_up [N,2F] (rows of a wider array allowed)."""
    _check_rows("gate_up", gate_up, 2)
    _check("out", out, F32, 2, True)
    N, F = out.shape
    _same("gate_up", gate_up.shape, (N, 2 * F))
    _kernels.swiglu_forward(gate_up, out, blas.threads())


def swiglu_backward(dout, gate_up, dgate_up):
    """dgate_up [N,2F] (written) from dout [N,F] and gate_up [N,2F]; both [N,2F] may be rows of wider arrays."""
    _check("dout", dout, F32, 2)
    _check_rows("gate_up", gate_up, 2)
    _check_rows("dgate_up", dgate_up, 2, True)
    N, F = dout.shape
    _same("gate_up", gate_up.shape, (N, 2 * F))
    _same("dgate_up", dgate_up.shape, (N, 2 * F))
    _kernels.swiglu_backward(dout, gate_up, dgate_up, blas.threads())


def _check_targets(targets, N, V, ignore_index=None):
    _check("targets", targets, I64, 1)
    _same("targets", targets.shape, (N,))
    valid = targets if ignore_index is None else targets[targets != ignore_index]
    if valid.size and (valid.min() < 0 or valid.max() >= V):
        raise ValueError(f"targets must lie in [0, {V}) (or equal ignore_index {ignore_index})")


def cross_entropy_forward_backward(logits, targets, losses, grad_scale, ignore_index=-100):
    _check("logits", logits, F32, 2, True)
    _check("losses", losses, F32, 1, True)
    N, V = logits.shape
    _same("losses", losses.shape, (N,))
    _check_targets(targets, N, V, ignore_index)
    _kernels.cross_entropy_forward_backward(logits, targets, losses, float(grad_scale), int(ignore_index),
                                            blas.threads())


def weighted_cross_entropy(logits, targets, losses, row_scales):
    """logits [N,V] in place -> (softmax - onehot) * row_scales[n]; losses [N] = -log p(target)."""
    _check("logits", logits, F32, 2, True)
    _check("losses", losses, F32, 1, True)
    _check("row_scales", row_scales, F32, 1)
    N, V = logits.shape
    _same("losses", losses.shape, (N,))
    _same("row_scales", row_scales.shape, (N,))
    _check_targets(targets, N, V)
    _kernels.weighted_cross_entropy(logits, targets, losses, row_scales, blas.threads())


def log_softmax_gather(logits, targets, out):
    _check("logits", logits, F32, 2)
    _check("out", out, F32, 1, True)
    N, V = logits.shape
    _same("out", out.shape, (N,))
    _check_targets(targets, N, V)
    _kernels.log_softmax_gather(logits, targets, out)


def embedding_backward(dout, tokens, dtable):
    _check("dout", dout, F32, 2)
    _check("dtable", dtable, F32, 2, True)
    N, C = dout.shape
    _same("dtable", dtable.shape[1:], (C,))
    _check_targets(tokens, N, dtable.shape[0])
    _kernels.embedding_backward(dout, tokens, dtable)


def adam_update(param, grad, m, v, learning_rate, beta1, beta2, epsilon, weight_decay,
                bias_correction1, bias_correction2):
    _check("param", param, F32, 1, True)
    for name, a, w in (("grad", grad, False), ("m", m, True), ("v", v, True)):
        _check(name, a, F32, 1, w)
        _same(name, a.shape, param.shape)
    _kernels.adam_update(param, grad, m, v, float(learning_rate), float(beta1), float(beta2),
                         float(epsilon), float(weight_decay), float(bias_correction1),
                         float(bias_correction2), blas.threads())


def to_bf16(x, out):
    """out [N,C] uint16 = x [N,C] float32 rounded to bfloat16 (nearest, ties to even; NaN stays NaN)."""
    _check("x", x, F32, 2)
    _check("out", out, np.uint16, 2, True)
    _same("out", out.shape, x.shape)
    _kernels.to_bf16(x, out)
