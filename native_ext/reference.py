"""Plain numpy twins of every kernel in native_ext._kernels, with the same signatures.

Dimension letters: N rows (tokens), C width, F feed-forward width, V vocabulary,
B batch, T time, H heads, D head size, G head groups (batch x KV heads), R rows of a
group (queries x heads sharing one KV head), S keys. Every function writes into its
output arguments exactly like the Cython kernel it mirrors; the tests compare the two.
"""

import numpy as np


def rmsnorm_forward(x, weight, eps, out, rstd):
    # x [N,C], weight [C], out [N,C], rstd [N]
    mean_square = np.mean(x.astype(np.float64) ** 2, axis=1)
    rstd[:] = (1.0 / np.sqrt(mean_square + eps)).astype(np.float32)
    out[:] = (x * rstd[:, None]) * weight


def rmsnorm_backward(dout, x, weight, rstd, dx, dweight):
    # accumulates into dx [N,C] and dweight [C]
    normed = x * rstd[:, None]  # [N,C]
    dweight += np.sum((dout * normed).astype(np.float64), axis=0).astype(np.float32)
    dnormed = dout * weight  # [N,C]
    dot = np.mean((dnormed * x).astype(np.float64), axis=1).astype(np.float32)  # [N]
    dx += rstd[:, None] * dnormed - x * (rstd**3 * dot)[:, None]


def rope_forward(x, cos, sin, position_offset, out):
    # x [B,T,NH,D] (last axis contiguous) -> out [B,KV,T,g,D] with NH = KV*g: head h goes
    # to (h // g, h % g), so the g query heads that share a KV head sit next to each other
    # for every position. Rotate-half convention (pairs i and i+D/2).
    B, T, NH, D = x.shape
    KV, g = out.shape[1], out.shape[3]
    half = D // 2
    c = cos[position_offset:position_offset + T][None, :, None, :]  # [1,T,1,D/2]
    s = sin[position_offset:position_offset + T][None, :, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    rotated = np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)  # [B,T,NH,D]
    out[:] = rotated.reshape(B, T, KV, g, D).transpose(0, 2, 1, 3, 4)


def rope_backward(dout, cos, sin, position_offset, dx):
    # dout [B,KV,T,g,D] -> dx [B,T,NH,D] (written; last axis contiguous)
    B, KV, T, g, D = dout.shape
    half = D // 2
    grad = dout.transpose(0, 2, 1, 3, 4).reshape(B, T, KV * g, D)  # [B,T,NH,D]
    c = cos[position_offset:position_offset + T][None, :, None, :]
    s = sin[position_offset:position_offset + T][None, :, None, :]
    g1, g2 = grad[..., :half], grad[..., half:]
    dx[:] = np.concatenate([g1 * c + g2 * s, g2 * c - g1 * s], axis=-1)


def _causal_mask(R, S, group_size, past, key_start):
    rows = np.arange(R)
    query_position = past + rows // group_size  # [R]
    keys = key_start + np.arange(S)  # [S]
    return keys[None, :] <= query_position[:, None]  # [R,S]


def softmax_causal_forward(scores, scale, group_size, past):
    # scores [G,R,S] in place -> probabilities; row r is query position past + r // group_size
    G, R, S = scores.shape
    valid = _causal_mask(R, S, group_size, past, 0)
    z = np.where(valid, scores * np.float32(scale), -np.inf)
    z = z - z.max(axis=-1, keepdims=True)
    e = np.exp(z)
    scores[:] = e / e.sum(axis=-1, keepdims=True)


def softmax_backward(probs, dprobs, scale):
    # dprobs [G,R,S] in place -> dscores (already multiplied by scale)
    dot = np.sum(probs * dprobs, axis=-1, keepdims=True)
    dprobs[:] = probs * (dprobs - dot) * np.float32(scale)


def flash_block_forward(scores, running_max, running_sum, alpha, scale, group_size, past, key_start):
    # scores [G,R,Bk] in place -> unnormalised block probabilities; running_max/sum [G,R]
    # updated; alpha [G,R] receives the factor that rescales the accumulator.
    G, R, S = scores.shape
    valid = _causal_mask(R, S, group_size, past, key_start)
    z = np.where(valid, scores * np.float32(scale), -np.inf)
    new_max = np.maximum(running_max, z.max(axis=-1))
    safe_max = np.where(np.isneginf(new_max), 0.0, new_max).astype(np.float32)
    with np.errstate(invalid="ignore"):
        a = np.where(np.isneginf(running_max), 0.0, np.exp(running_max - safe_max))
    a = np.where(np.isneginf(new_max), 1.0, a).astype(np.float32)
    p = np.where(valid, np.exp(z - safe_max[..., None]), 0.0).astype(np.float32)
    scores[:] = p
    running_sum[:] = running_sum * a + p.sum(axis=-1)
    running_max[:] = new_max
    alpha[:] = a


def flash_block_backward(scores, logsumexp, dprobs, delta, scale, group_size, past, key_start):
    # scores [G,R,Bk] in place -> probabilities recomputed from logsumexp [G,R];
    # dprobs [G,R,Bk] in place -> dscores (times scale); delta [G,R] = rowsum(dout * out).
    G, R, S = scores.shape
    valid = _causal_mask(R, S, group_size, past, key_start)
    p = np.where(valid, np.exp(scores * np.float32(scale) - logsumexp[..., None]), 0.0).astype(np.float32)
    scores[:] = p
    dprobs[:] = p * (dprobs - delta[..., None]) * np.float32(scale)


def hide_outside_window(scores, group_size, first_query, key_start, window):
    """scores [G,R,Sk] in place: -inf where key key_start+j lies W or more before query row r's position."""
    if window is None:
        return
    R, S = scores.shape[1:]
    positions = first_query + np.arange(R) // group_size  # [R]
    outside = key_start + np.arange(S)[None, :] <= positions[:, None] - window  # [R,Sk]
    if outside.any():
        scores[:, outside] = -np.inf


def _first_key(first_query, window, block):
    """The first key block any query from first_query on can see (0 without a window)."""
    if window is None:
        return 0
    return max(0, first_query - window + 1) // block * block


def attention_forward(q, k, v, scale, group_size, block, past=0, window=None):
    """Twin of native_ext.attention.forward: (out [G,R,D], logsumexp [G,R]) by the online softmax over
    key blocks of `block` keys, one query block of `block` positions at a time."""
    G, R, D = q.shape
    S = k.shape[1]
    T = R // group_size
    out = np.empty_like(q)
    logsumexp = np.empty((G, R), dtype=np.float32)
    for qs in range(0, T, block):
        qe = min(qs + block, T)
        rows = slice(qs * group_size, qe * group_size)
        q_block = q[:, rows]  # [G,Rq,D]
        Rq = q_block.shape[1]
        running_max = np.full((G, Rq), -np.inf, dtype=np.float32)
        running_sum = np.zeros((G, Rq), dtype=np.float32)
        alpha = np.empty((G, Rq), dtype=np.float32)
        acc = np.zeros((G, Rq, D), dtype=np.float32)
        for ks in range(_first_key(past + qs, window, block), min(S, past + qe), block):
            ke = min(ks + block, S)
            scores = np.matmul(q_block, k[:, ks:ke].transpose(0, 2, 1))  # [G,Rq,Bk]
            hide_outside_window(scores, group_size, past + qs, ks, window)
            flash_block_forward(scores, running_max, running_sum, alpha, scale, group_size, past + qs, ks)
            acc = acc * alpha[..., None] + np.matmul(scores, v[:, ks:ke])
        out[:, rows] = acc / running_sum[..., None]
        logsumexp[:, rows] = running_max + np.log(running_sum)
    return out, logsumexp


def attention_backward(dout, q, k, v, out, logsumexp, scale, group_size, block, past=0, window=None):
    """Twin of native_ext.attention.backward: (dq, dk, dv), each tile's probabilities recomputed from
    logsumexp."""
    G, R, D = q.shape
    S = k.shape[1]
    T = R // group_size
    delta = np.einsum("grd,grd->gr", dout, out, dtype=np.float32)  # [G,R]
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    for qs in range(0, T, block):
        qe = min(qs + block, T)
        rows = slice(qs * group_size, qe * group_size)
        q_block, dout_block = q[:, rows], dout[:, rows]
        for ks in range(_first_key(past + qs, window, block), min(S, past + qe), block):
            ke = min(ks + block, S)
            scores = np.matmul(q_block, k[:, ks:ke].transpose(0, 2, 1))  # [G,Rq,Bk]
            hide_outside_window(scores, group_size, past + qs, ks, window)
            dscores = np.matmul(dout_block, v[:, ks:ke].transpose(0, 2, 1))  # [G,Rq,Bk]
            flash_block_backward(scores, logsumexp[:, rows], dscores, delta[:, rows], scale, group_size,
                                 past + qs, ks)
            dv[:, ks:ke] += np.matmul(scores.transpose(0, 2, 1), dout_block)
            dq[:, rows] += np.matmul(dscores, k[:, ks:ke])
            dk[:, ks:ke] += np.matmul(dscores.transpose(0, 2, 1), q_block)
    return dq, dk, dv


def swiglu_forward(gate_up, out):
    # gate_up [N,2F] (gate then up), out [N,F] = silu(gate) * up
    F = out.shape[1]
    gate, up = gate_up[:, :F], gate_up[:, F:]
    out[:] = gate / (1.0 + np.exp(-gate)) * up


def swiglu_backward(dout, gate_up, dgate_up):
    # dout [N,F] -> dgate_up [N,2F] (written)
    F = dout.shape[1]
    gate, up = gate_up[:, :F], gate_up[:, F:]
    sig = 1.0 / (1.0 + np.exp(-gate))
    dgate_up[:, :F] = dout * up * sig * (1.0 + gate * (1.0 - sig))
    dgate_up[:, F:] = dout * gate * sig


def cross_entropy_forward_backward(logits, targets, losses, grad_scale, ignore_index):
    # logits [N,V] in place -> dlogits (times grad_scale); targets [N]; losses [N]
    N, V = logits.shape
    valid = targets != ignore_index
    z = logits.astype(np.float64)
    m = z.max(axis=1, keepdims=True)
    lse = (np.log(np.exp(z - m).sum(axis=1, keepdims=True)) + m)[:, 0]
    safe_targets = np.where(valid, targets, 0)
    losses[:] = np.where(valid, lse - z[np.arange(N), safe_targets], 0.0)
    grad = np.exp(z - lse[:, None])
    grad[np.arange(N), safe_targets] -= 1.0
    grad *= grad_scale
    grad[~valid] = 0.0
    logits[:] = grad


def weighted_cross_entropy(logits, targets, losses, row_scales):
    # logits [N,V] in place -> (softmax - onehot) * row_scales[n]; losses [N] = -log p(target)
    N, V = logits.shape
    z = logits.astype(np.float64)
    m = z.max(axis=1, keepdims=True)
    lse = (np.log(np.exp(z - m).sum(axis=1, keepdims=True)) + m)[:, 0]
    losses[:] = lse - z[np.arange(N), targets]
    grad = np.exp(z - lse[:, None])
    grad[np.arange(N), targets] -= 1.0
    logits[:] = grad * row_scales[:, None]


def log_softmax_gather(logits, targets, out):
    # logits [N,V], targets [N] -> out [N] = log softmax(logits)[target]
    z = logits.astype(np.float64)
    m = z.max(axis=1, keepdims=True)
    lse = (np.log(np.exp(z - m).sum(axis=1, keepdims=True)) + m)[:, 0]
    out[:] = z[np.arange(len(targets)), targets] - lse


def embedding_backward(dout, tokens, dtable):
    # dout [N,C], tokens [N] -> dtable [V,C] accumulated in row order
    np.add.at(dtable, tokens, dout)


def adam_update(param, grad, m, v, learning_rate, beta1, beta2, epsilon, weight_decay,
                bias_correction1, bias_correction2):
    # all [n] float32; PyTorch Adam arithmetic in float32, scalars rounded once to float32
    f = np.float32
    g = grad + f(weight_decay) * param if weight_decay != 0.0 else grad
    m *= f(beta1)
    m += f(1.0 - beta1) * g
    v *= f(beta2)
    v += f(1.0 - beta2) * (g * g)
    step_size = f(learning_rate / bias_correction1)
    bc2_sqrt = f(np.sqrt(bias_correction2))
    denom = np.sqrt(v) / bc2_sqrt + f(epsilon)
    param -= step_size * (m / denom)


def to_bf16(x, out):
    # x [N,C] float32 -> out [N,C] uint16: the upper half of the bits, rounded to nearest, ties to even
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    quiet = ((bits >> 16) | 0x40).astype(np.uint16)
    out[:] = np.where((bits & 0x7FFFFFFF) > 0x7F800000, quiet, rounded)


def from_bf16(bits):
    """uint16 bfloat16 bits -> the float32 values they stand for (exact)."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)
