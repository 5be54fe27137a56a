"""The fused tiled attention (native_ext.attention, C in attention.h and attention_rows.h) against its numpy twin
(native_ext.reference.attention_forward/backward), and its bytes across thread counts and instruction-set versions
(the tile GEMM and the rows' softmax work, chosen together).

Dimension letters as in trainer/attention.py. Tolerance: max |kernel - twin| / max |twin| <= 1e-5 (the
kernel's products are chains of fused multiply-adds, the twin's are BLAS's, and the kernel sums dQ over key
ranges). Bytes: every output element is one fixed sequence of roundings, so the thread count, the order
threads take work items in and the version (AVX-512, AVX2, portable) must not change a single bit.
"""

import hashlib
import os
import subprocess
import sys
import textwrap
import zlib

import numpy as np
import pytest

from native_ext import attention, reference

TOLERANCE = 1e-5

# G, T, g, D, past, window, block: odd sizes on purpose (rows not a multiple of the 6-row register
# tile, D not a multiple of 16, S not a multiple of block, keys cached before the queries)
CASES = [
    (1, 1, 1, 4, 0, None, 4),
    (1, 5, 1, 8, 0, None, 4),
    (2, 37, 3, 20, 0, None, 8),
    (2, 70, 2, 64, 5, None, 16),
    (3, 100, 3, 64, 0, 17, 32),
    (2, 130, 3, 80, 7, 40, 128),
    (1, 300, 1, 33, 0, None, 16),  # more key blocks than key ranges: dQ summed over ranges of 3 blocks
    (3, 256, 3, 64, 0, None, 128),
]


def rng_for(*key):
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


def inputs(G, T, g, D, past, scale=2.0, seed=()):
    rng = rng_for("attention", G, T, g, D, past, *seed)
    R, S = T * g, past + T
    q, k = (rng.standard_normal(shape).astype(np.float32) * scale for shape in ((G, R, D), (G, S, D)))
    v, dout = (rng.standard_normal(shape).astype(np.float32) for shape in ((G, S, D), (G, R, D)))
    return q, k, v, dout


def rel(a, b):
    return float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-30))


@pytest.mark.parametrize("G,T,g,D,past,window,block", CASES)
def test_forward_and_backward_match_twin(G, T, g, D, past, window, block):
    q, k, v, dout = inputs(G, T, g, D, past)
    scale = D ** -0.5
    out, lse = attention.forward(q, k, v, scale, g, block, past, window)
    out_r, lse_r = reference.attention_forward(q, k, v, scale, g, block, past, window)
    assert rel(out, out_r) <= TOLERANCE
    assert rel(lse, lse_r) <= TOLERANCE
    grads = attention.backward(dout, q, k, v, out, lse, scale, g, block, past, window)
    grads_r = reference.attention_backward(dout, q, k, v, out_r, lse_r, scale, g, block, past, window)
    for name, a, b in zip("qkv", grads, grads_r):
        assert a.shape == b.shape
        assert rel(a, b) <= TOLERANCE, f"d{name}"


def test_twin_is_the_dense_softmax():
    """The twin itself against plain attention written out in full (scores, mask, softmax)."""
    G, T, g, D, past, window, block = 2, 23, 3, 8, 4, 9, 5
    q, k, v, dout = inputs(G, T, g, D, past)
    scale = D ** -0.5
    R, S = T * g, past + T
    scores = np.einsum("grd,gsd->grs", q.astype(np.float64), k.astype(np.float64)) * scale
    position = past + np.arange(R) // g
    visible = (np.arange(S)[None] <= position[:, None]) & (np.arange(S)[None] > position[:, None] - window)
    scores = np.where(visible, scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    out, _ = reference.attention_forward(q, k, v, scale, g, block, past, window)
    assert rel(out, np.einsum("grs,gsd->grd", probs, v.astype(np.float64))) <= TOLERANCE


def digest(*arrays):
    return hashlib.sha256(b"".join(np.ascontiguousarray(a).tobytes() for a in arrays)).hexdigest()


def run_all(threads):
    """One digest over forward and backward of four shapes at THREADS threads."""
    parts = []
    # block 20: tiles whose rows are padded to whole vectors; window 33: rows with hidden keys
    for G, T, g, D, past, window, block in [(3, 300, 3, 64, 0, None, 32), (2, 170, 2, 40, 9, 33, 16),
                                            (1, 1100, 1, 64, 0, None, 16), (2, 97, 3, 24, 5, 41, 20)]:
        q, k, v, dout = inputs(G, T, g, D, past, seed=("bytes",))
        out, lse = attention.forward(q, k, v, 0.3, g, block, past, window, threads=threads)
        grads = attention.backward(dout, q, k, v, out, lse, 0.3, g, block, past, window, threads=threads)
        parts.append(digest(out, lse, *grads))
    return parts


def test_bytes_do_not_depend_on_the_thread_count():
    one = run_all(1)
    for threads in (2, 3, 7):
        assert run_all(threads) == one, f"{threads} threads"


CHILD = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, {tests!r})
    from test_attention_kernel import run_all
    print(json.dumps(run_all(2)))
""")


@pytest.mark.parametrize("version,flag", [("portable", None), ("avx2", "avx2"), ("avx512", "avx512f")])
def test_every_version_gives_the_same_bytes(version, flag):
    """Each version (tile GEMM and row work) in a fresh process (the version is chosen once per process) against
    the bytes this process computes with the version its CPU picked."""
    from trainer.runs.execution import device_identity

    if flag is not None and flag not in (device_identity()["cpu_flags"] or ()):
        pytest.skip(f"this CPU has no {flag}: the {version} version cannot run here")
    env = {**os.environ, "KILN_ATTENTION_ISA": version}
    child = CHILD.format(tests=os.path.dirname(__file__))
    result = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, env=env, check=True)
    assert result.stdout.strip().startswith("[")
    assert __import__("json").loads(result.stdout) == run_all(2)


def test_fresh_process_gives_the_same_bytes():
    child = CHILD.format(tests=os.path.dirname(__file__))
    result = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, check=True)
    assert __import__("json").loads(result.stdout) == run_all(1)


def test_inputs_are_checked():
    q, k, v, dout = inputs(1, 4, 2, 8, 0)
    with pytest.raises(ValueError, match="do not fit"):
        attention.forward(q, k[:, :, :4].copy(), v, 1.0, 2, 4)
    with pytest.raises(TypeError, match="float32"):
        attention.forward(q.astype(np.float64), k, v, 1.0, 2, 4)
    with pytest.raises(ValueError, match="C-contiguous"):
        attention.forward(q[:, ::2], k, v, 1.0, 1, 4)
    with pytest.raises(ValueError, match="contiguous rows"):
        attention.forward(q, k[:, ::2], v[:, ::2], 1.0, 2, 4)
    with pytest.raises(ValueError, match="multiple of group_size"):
        attention.forward(q, k, v, 1.0, 3, 4)
    with pytest.raises(ValueError, match="block"):
        attention.forward(q, k, v, 1.0, 2, 0)
    with pytest.raises(ValueError, match="window"):
        attention.forward(q, k, v, 1.0, 2, 4, window=0)
    with pytest.raises(ValueError, match="threads"):
        attention.forward(q, k, v, 1.0, 2, 4, threads=0)
    out, lse = attention.forward(q, k, v, 1.0, 2, 4)
    with pytest.raises(ValueError, match="logsumexp has shape"):
        attention.backward(dout, q, k, v, out, lse[:, :3].copy(), 1.0, 2, 4)


def test_keys_and_values_may_be_views_of_a_longer_cache():
    """Generation reads the first S rows of a [G, capacity, D] cache: the same bytes as a contiguous copy."""
    G, T, g, D, past = 3, 9, 3, 16, 20
    q, k, v, dout = inputs(G, T, g, D, past)
    cache_k, cache_v = (np.full((G, past + T + 11, D), np.nan, np.float32) for _ in range(2))
    cache_k[:, :past + T], cache_v[:, :past + T] = k, v
    view_k, view_v = cache_k[:, :past + T], cache_v[:, :past + T]
    assert not view_k.flags.c_contiguous
    expected = attention.forward(q, k, v, 0.25, g, 8, past)
    got = attention.forward(q, view_k, view_v, 0.25, g, 8, past)
    assert digest(*got) == digest(*expected)
    assert digest(*attention.backward(dout, q, view_k, view_v, *got, 0.25, g, 8, past)) == \
        digest(*attention.backward(dout, q, k, v, *expected, 0.25, g, 8, past))


def test_empty_inputs_give_empty_outputs():
    q = np.zeros((2, 0, 8), np.float32)
    k = np.zeros((2, 0, 8), np.float32)
    out, lse = attention.forward(q, k, k, 1.0, 1, 4)
    assert out.shape == (2, 0, 8) and lse.shape == (2, 0)
    dq, dk, dv = attention.backward(q, q, k, k, out, lse, 1.0, 1, 4)
    assert dq.shape == (2, 0, 8) and dk.shape == dv.shape == (2, 0, 8)
