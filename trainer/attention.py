"""Causal grouped-query attention: the dense and the tiled (online softmax) algorithms.

Dimension letters: B batch, T time (queries), S keys, KV key/value heads, g query heads
per KV head, D head size, G = B*KV head groups, R = T*g rows of one group (row r is
query position past + r // g). Queries arrive as [G,R,D], keys and values as [G,S,D].
Both algorithms return the output [G,R,D] and a cache for their backward; the tiled
one never materialises an [R,S] score matrix, only [block*g, block] tiles.
With a sliding window W, query position p sees keys p-W+1..p: the scores of keys before that
are set to -inf before the kernels run (they turn to probability 0 there, as the causal
mask's), and the tiled algorithm skips key blocks no query of its block can see.
"""

import numpy as np

from native_ext import blas, kernels


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


def dense_forward(q, k, v, scale, group_size, past=0, window=None):
    # q [G,R,D], k/v [G,S,D]
    probs = blas.matmul(q, k.transpose(0, 2, 1))  # [G,R,S]
    hide_outside_window(probs, group_size, past, 0, window)
    kernels.softmax_causal_forward(probs, scale, group_size, past)
    out = blas.matmul(probs, v)  # [G,R,D]
    return out, probs


def dense_backward(dout, q, k, v, probs, scale):
    # dout [G,R,D] -> dq [G,R,D], dk [G,S,D], dv [G,S,D]
    dv = blas.matmul(probs.transpose(0, 2, 1), dout)  # [G,S,D]
    dscores = blas.matmul(dout, v.transpose(0, 2, 1))  # [G,R,S]
    kernels.softmax_backward(probs, dscores, scale)
    dq = blas.matmul(dscores, k)  # [G,R,D]
    dk = blas.matmul(dscores.transpose(0, 2, 1), q)  # [G,S,D]
    return dq, dk, dv


def _query_blocks(T, block):
    return [(start, min(start + block, T)) for start in range(0, T, block)]


def tiled_forward(q, k, v, scale, group_size, block, past=0, window=None):
    # q [G,R,D] with R = T*g; k/v [G,S,D]. Returns out [G,R,D] and logsumexp [G,R].
    G, R, D = q.shape
    S = k.shape[1]
    T = R // group_size
    out = np.empty_like(q)
    logsumexp = np.empty((G, R), dtype=np.float32)
    for qs, qe in _query_blocks(T, block):
        rows = slice(qs * group_size, qe * group_size)
        q_block = q[:, rows]  # [G,Rq,D]
        Rq = q_block.shape[1]
        running_max = np.full((G, Rq), -np.inf, dtype=np.float32)
        running_sum = np.zeros((G, Rq), dtype=np.float32)
        alpha = np.empty((G, Rq), dtype=np.float32)
        acc = np.zeros((G, Rq, D), dtype=np.float32)
        last_key = min(S, past + qe)  # keys beyond the block's last query are masked
        for ks in range(_first_key(past + qs, window, block), last_key, block):
            ke = min(ks + block, S)
            scores = blas.matmul(q_block, k[:, ks:ke].transpose(0, 2, 1))  # [G,Rq,Bk]
            hide_outside_window(scores, group_size, past + qs, ks, window)
            kernels.flash_block_forward(scores, running_max, running_sum, alpha, scale,
                                        group_size, past + qs, ks)
            acc *= alpha[..., None]
            acc += blas.matmul(scores, v[:, ks:ke])
        out[:, rows] = acc / running_sum[..., None]
        logsumexp[:, rows] = running_max + np.log(running_sum)
    return out, logsumexp


def tiled_backward(dout, q, k, v, out, logsumexp, scale, group_size, block, past=0, window=None):
    G, R, D = q.shape
    S = k.shape[1]
    T = R // group_size
    delta = np.einsum("grd,grd->gr", dout, out, dtype=np.float32)  # [G,R]
    dq = np.zeros_like(q)
    dk = np.zeros_like(k)
    dv = np.zeros_like(v)
    for qs, qe in _query_blocks(T, block):
        rows = slice(qs * group_size, qe * group_size)
        q_block, dout_block = q[:, rows], dout[:, rows]
        lse_block = np.ascontiguousarray(logsumexp[:, rows])
        delta_block = np.ascontiguousarray(delta[:, rows])
        last_key = min(S, past + qe)
        for ks in range(_first_key(past + qs, window, block), last_key, block):
            ke = min(ks + block, S)
            k_block, v_block = k[:, ks:ke], v[:, ks:ke]
            scores = blas.matmul(q_block, k_block.transpose(0, 2, 1))  # [G,Rq,Bk]
            hide_outside_window(scores, group_size, past + qs, ks, window)
            dscores = blas.matmul(dout_block, v_block.transpose(0, 2, 1))  # [G,Rq,Bk]
            kernels.flash_block_backward(scores, lse_block, dscores, delta_block, scale,
                                         group_size, past + qs, ks)
            dv[:, ks:ke] += blas.matmul(scores.transpose(0, 2, 1), dout_block)
            dq[:, rows] += blas.matmul(dscores, k_block)
            dk[:, ks:ke] += blas.matmul(dscores.transpose(0, 2, 1), q_block)
    return dq, dk, dv
