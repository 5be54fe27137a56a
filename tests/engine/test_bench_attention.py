"""bench/attention_kernel.py: its layouts (Kiln's [KV, T*g, D] against PyTorch's [1, H, T, D]) and that the two
sides it times compute the same attention (the arithmetic, not the timing)."""

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import attention_kernel  # noqa: E402


def test_layouts_round_trip():
    q, k, v, dout = attention_kernel.inputs(7)
    tq, tk, tv, tdout = attention_kernel.to_torch(q, k, v, dout)
    assert tuple(tq.shape) == (1, attention_kernel.HEADS, 7, attention_kernel.HEAD_DIM)
    assert tuple(tk.shape) == (1, attention_kernel.KV_HEADS, 7, attention_kernel.HEAD_DIM)
    np.testing.assert_array_equal(attention_kernel.kiln_layout(tq), q)
    np.testing.assert_array_equal(attention_kernel.kiln_layout(tdout), dout)
    # query head kv * g + j at position t is Kiln's row t * g + j of group kv
    g = attention_kernel.HEADS // attention_kernel.KV_HEADS
    np.testing.assert_array_equal(tq[0, 1 * g + 2, 5].numpy(), q[1, 5 * g + 2])


def test_kiln_and_pytorch_compute_the_same_attention():
    """Kiln's kernel against torch's scaled_dot_product_attention and its autograd backward: more than one key
    block (block 64), a context that is not a multiple of it."""
    q, k, v, dout = attention_kernel.inputs(150)
    _, _, kiln, _ = attention_kernel.run_kiln(q, k, v, dout, repeats=1)
    _, _, reference = attention_kernel.run_torch(*attention_kernel.to_torch(q, k, v, dout), repeats=1)
    assert attention_kernel.relative(kiln, reference) <= 1e-5
    assert attention_kernel.flops(150) == (4 * 9 * (150 * 151 // 2) * 64, 10 * 9 * (150 * 151 // 2) * 64)
