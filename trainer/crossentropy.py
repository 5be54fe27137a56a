"""The fused linear cross-entropy: log-probabilities, losses and gradients of hidden @ W.T chunk by chunk over tokens, never the whole [tokens, vocabulary] logits.

Dimension letters: N token rows, n rows of one chunk, C model width, V vocabulary.
The one function serves every caller: per-token log-probabilities without gradients
(token_losses, the first pass of a policy-gradient step), the mean cross-entropy of SFT
(grad_scale) and the per-row weighted one of policy-gradient objectives (row_scales).
Each chunk's logits become their own gradient in place, so a chunk's [n,V] buffer is
the largest thing it allocates; the caller picks the chunk (all N rows for the
full-logits route).
"""

import numpy as np

from native_ext import bf16, blas, kernels, onednn
from trainer.blocks import accumulate_weight_grad

IGNORE_INDEX = -100  # target id that contributes no loss (padding, prompt tokens)


def fused_linear_cross_entropy(hidden, weight, targets, chunk, grad_scale=None, row_scales=None,
                               head=None, weight_bf16=None):
    """Cross-entropy of softmax(hidden [N,C] @ weight.T [C,V]) against targets [N] int64.

    Without grad_scale and row_scales: returns (log p(target) [N] float32, None), 0 where
    the target is IGNORE_INDEX. With grad_scale: returns (losses [N], dhidden [N,C]) of
    the loss grad_scale * sum of -log p over non-ignored rows. With row_scales [N] float32:
    returns (losses [N], dhidden [N,C]) of sum_t row_scales[t] * -log p_t; an ignored row
    must carry a zero scale. When head (the Parameter behind weight) is given, its
    gradient [V,C] accumulates chunk by chunk and is marked pending. With weight_bf16 (the
    frozen weight's bfloat16 bits, base_precision "bfloat16") both products take bfloat16
    operands on oneDNN (output_product).
    """
    assert weight_bf16 is None or head is None, "a bfloat16 output weight is frozen"
    N = hidden.shape[0]
    assert chunk >= 1, f"chunk must be a positive row count, got {chunk}"
    assert targets.shape == (N,), f"targets {targets.shape} must be one id per hidden row ({N})"
    assert grad_scale is None or row_scales is None, "grad_scale and row_scales are exclusive"
    backward = grad_scale is not None or row_scales is not None
    assert backward or head is None, "a head gradient needs grad_scale or row_scales"
    ignored = targets == IGNORE_INDEX  # [N]
    safe = np.where(ignored, 0, targets)  # [N] the kernels gathering a row need an id
    per_row = np.empty(N, np.float32)  # [N] log p (forward only) or losses
    dhidden = np.empty_like(hidden) if backward else None  # [N,C]
    for start in range(0, N, chunk):
        rows = slice(start, min(start + chunk, N))
        logits = output_product(hidden[rows], weight, weight_bf16)  # [n,V], becomes dlogits in place
        if not backward:
            kernels.log_softmax_gather(logits, safe[rows], per_row[rows])
            continue
        if row_scales is None:
            kernels.cross_entropy_forward_backward(logits, targets[rows], per_row[rows],
                                                   grad_scale, IGNORE_INDEX)
        else:
            kernels.weighted_cross_entropy(logits, safe[rows], per_row[rows], row_scales[rows])
        if weight_bf16 is None:
            blas.matmul(logits, weight, out=dhidden[rows])  # [n,C]
        else:
            onednn.gemm(dhidden[rows], bf16.to_bf16(logits), weight_bf16)
        if head is not None:
            accumulate_weight_grad(head.grad, logits, hidden[rows], head.pending)  # [V,C]
            head.pending = True
    if not backward:
        per_row[ignored] = 0.0
    return per_row, dhidden


def output_product(hidden, weight, weight_bf16=None):
    """hidden [n,C] @ weight.T [C,V]: float32, or from bfloat16 operands on oneDNN given the weight's bits."""
    if weight_bf16 is None:
        return blas.matmul(hidden, weight.T)
    logits = np.empty((hidden.shape[0], weight_bf16.shape[0]), np.float32)
    onednn.gemm(logits, bf16.to_bf16(hidden), weight_bf16, trans_b=True)
    return logits
