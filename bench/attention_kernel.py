"""The fused attention kernel alone (native_ext.attention) against PyTorch's CPU attention on the same work.

One layer's causal grouped-query attention at SmolLM2-135M's shape (9 query heads, 3 KV heads, head dimension 64,
block 64), batch 1, forward then backward, for each context. Prints, per context and side, the best and median
milliseconds over the repeats, GFLOP/s and the share of the measured float32 GEMM peak (counted FLOPs: the causal
half of QK^T and PV forward, five such products backward), the largest difference between the two sides' outputs
relative to PyTorch's largest, and the SHA-256 of Kiln's outputs, so that two builds' bytes compare at a glance.
PyTorch computes torch.nn.functional.scaled_dot_product_attention(is_causal=True, enable_gqa=True) in float32
and its backward by autograd, on as many threads as Kiln.

    python bench/attention_kernel.py [--contexts 256,1024,2048] [--repeats 9]

Run with OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE unset, the machine otherwise idle (docs/engine.md).
"""

import argparse
import hashlib
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from machine import describe, gemm_peak  # noqa: E402
from native_ext import attention, blas  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 64


def flops(context):
    """(forward, backward) FLOPs of one layer: 2 products forward and 5 backward over the causal pairs."""
    pairs = context * (context + 1) // 2
    one = 2 * HEADS * pairs * HEAD_DIM
    return 2 * one, 5 * one


def inputs(context):
    """Kiln's layout: q, dout [KV, T*g, D] (row r: position r // g, query head kv * g + r % g), k, v [KV, T, D]."""
    rng = np.random.default_rng(context)
    g = HEADS // KV_HEADS
    q, dout = (rng.standard_normal((KV_HEADS, context * g, HEAD_DIM), dtype=np.float32) for _ in range(2))
    k, v = (rng.standard_normal((KV_HEADS, context, HEAD_DIM), dtype=np.float32) for _ in range(2))
    return q, k, v, dout


def to_torch(q, k, v, dout):
    """The same tensors in PyTorch's layout: q, dout [1, H, T, D], k, v [1, KV, T, D]."""
    g = HEADS // KV_HEADS
    T = k.shape[1]

    def heads(a):  # [KV, T*g, D] -> [1, H, T, D]
        return torch.from_numpy(a.reshape(KV_HEADS, T, g, HEAD_DIM).transpose(0, 2, 1, 3)
                                .reshape(1, HEADS, T, HEAD_DIM).copy())

    return heads(q), torch.from_numpy(k[None].copy()), torch.from_numpy(v[None].copy()), heads(dout)


def kiln_layout(t):
    """PyTorch's [1, H, T, D] back to Kiln's [KV, T*g, D]."""
    g = HEADS // KV_HEADS
    _, _, T, D = t.shape
    return t.detach().numpy().reshape(KV_HEADS, g, T, D).transpose(0, 2, 1, 3).reshape(KV_HEADS, T * g, D)


def run_kiln(q, k, v, dout, repeats):
    scale = HEAD_DIM ** -0.5
    g = HEADS // KV_HEADS
    forward, backward = [], []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        out, lse = attention.forward(q, k, v, scale, g, BLOCK)
        middle = time.perf_counter()
        grads = attention.backward(dout, q, k, v, out, lse, scale, g, BLOCK)
        end = time.perf_counter()
        forward.append(middle - start)
        backward.append(end - middle)
    digest = hashlib.sha256(b"".join(np.ascontiguousarray(a).tobytes() for a in (out, lse, *grads))).hexdigest()
    return forward[1:], backward[1:], (out, *grads), digest


def run_torch(q, k, v, dout, repeats):
    forward, backward = [], []
    for _ in range(repeats + 1):
        tq, tk, tv = (t.detach().requires_grad_() for t in (q, k, v))
        start = time.perf_counter()
        out = F.scaled_dot_product_attention(tq, tk, tv, is_causal=True, enable_gqa=True)
        middle = time.perf_counter()
        out.backward(dout)
        end = time.perf_counter()
        forward.append(middle - start)
        backward.append(end - middle)
    return forward[1:], backward[1:], (out, tq.grad, tk.grad, tv.grad)


def relative(kiln, torch_outputs):
    """max |kiln - torch| / max |torch| over the output and the three gradients."""
    out, dq, dk, dv = torch_outputs
    pairs = [(kiln[0], kiln_layout(out)), (kiln[1], kiln_layout(dq)),
             (kiln[2], dk[0].numpy()), (kiln[3], dv[0].numpy())]
    return max(float(np.max(np.abs(a - b)) / np.max(np.abs(b))) for a, b in pairs)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", default="256,1024,2048")
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    threads = blas.threads()
    torch.set_num_threads(threads)
    peak = gemm_peak()
    print(describe(peak) + f"; torch {torch.__version__} x{torch.get_num_threads()}; Kiln x{threads}")
    print(f"one layer of causal GQA attention: {HEADS} query heads, {KV_HEADS} KV heads, head dimension {HEAD_DIM}, "
          f"block {BLOCK}, batch 1, float32; best (median) of {args.repeats}")
    print(f"{'context':>7} {'side':7} {'forward ms':>17} {'backward ms':>17} {'GFLOP/s':>8} {'of peak':>8}")
    for context in (int(c) for c in args.contexts.split(",")):
        q, k, v, dout = inputs(context)
        kiln_forward, kiln_backward, kiln_outputs, digest = run_kiln(q, k, v, dout, args.repeats)
        torch_forward, torch_backward, torch_outputs = run_torch(*to_torch(q, k, v, dout), args.repeats)
        work = sum(flops(context))
        for side, fw, bw in (("kiln", kiln_forward, kiln_backward), ("pytorch", torch_forward, torch_backward)):
            rate = work / (min(fw) + min(bw))
            print(f"{context:7d} {side:7} {min(fw) * 1e3:8.2f} ({np.median(fw) * 1e3:6.2f}) "
                  f"{min(bw) * 1e3:8.2f} ({np.median(bw) * 1e3:6.2f}) {rate / 1e9:8.1f} {rate / peak:8.1%}")
        ratio = (np.median(torch_forward) + np.median(torch_backward)) / (np.median(kiln_forward)
                                                                          + np.median(kiln_backward))
        print(f"{context:7d} kiln / pytorch speed ratio {ratio:.2f} (medians of forward + backward); outputs differ "
              f"by {relative(kiln_outputs, torch_outputs):.1e} of PyTorch's largest; kiln sha256 {digest[:16]}")


if __name__ == "__main__":
    main()
