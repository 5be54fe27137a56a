"""Causal grouped-query attention: the dense and the tiled (online softmax) algorithms.

Dimension letters: B batch, T time (queries), S keys, KV key/value heads, g query heads
per KV head, D head size, G = B*KV head groups, R = T*g rows of one group (row r is
query position past + r // g). Queries arrive as [G,R,D], keys and values as [G,S,D].
Both algorithms return the output [G,R,D] and a cache for their backward; the tiled
one never materialises an [R,S] score matrix, only [block*g, block] tiles.
With a sliding window W, query position p sees keys p-W+1..p: the scores of keys before that
are set to -inf before the kernels run (they turn to probability 0 there, as the causal
mask's), and the tiled algorithm skips key blocks no query of its block can see.

The tiled algorithm is one C kernel per direction (native_ext/attention.h): its tile products,
softmax and accumulation run together on the BLAS thread count, with the same bytes for any count.
"""

from native_ext import attention as fused
from native_ext import blas, kernels
from native_ext.reference import hide_outside_window


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


def tiled_forward(q, k, v, scale, group_size, block, past=0, window=None):
    # q [G,R,D] with R = T*g; k/v [G,S,D]. Returns out [G,R,D] and logsumexp [G,R]: one C kernel
    # (native_ext.attention) on the BLAS thread count, whose numpy twin is reference.attention_forward.
    return fused.forward(q, k, v, scale, group_size, block, past, window)


def tiled_backward(dout, q, k, v, out, logsumexp, scale, group_size, block, past=0, window=None):
    return fused.backward(dout, q, k, v, out, logsumexp, scale, group_size, block, past, window)
