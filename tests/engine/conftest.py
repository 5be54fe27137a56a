"""Shared helpers of the engine suite: a max-difference check, a tiny-config factory and the host
emulation of the CUDA library (built once per session for the CUDA kernel and model tests).

They are fixtures (not importable functions) because tests/ and tests/engine/ both hold
a top-level `conftest` module, so `from conftest import ...` would be ambiguous.
"""

import functools
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from trainer import TransformerConfig

CUDA_DIR = Path(__file__).resolve().parents[2] / "native_ext" / "cuda"

TINY = dict(  # small enough that a forward/backward takes about a millisecond
    vocabulary_size=23,  # odd and prime: no accidental alignment with chunk sizes
    maximum_context=16,
    model_width=16,
    head_count=4,
    kv_head_count=2,  # grouped-query attention with g = 2
    block_count=2,  # two blocks: the residual gradient flows through a block
    feed_forward_width=24,
    initializer_range=0.2,  # large enough that attention is far from uniform
    attention_block_size=4,  # tiled attention uses several, partly masked tiles
    loss_chunk_tokens=5,  # the fused loss route uses several chunks, the last partial
)


def max_relative_difference(actual, expected) -> float:
    """max |actual - expected| over max |expected| (or the absolute maximum if expected is 0)."""
    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    assert actual.shape == expected.shape, f"shape {actual.shape} != {expected.shape}"
    if actual.size == 0:
        return 0.0
    assert np.array_equal(np.isneginf(actual), np.isneginf(expected)), "-inf positions differ"
    finite = np.isfinite(expected)
    assert np.all(np.isfinite(actual[finite])), "non-finite values where the reference is finite"
    scale = float(np.max(np.abs(expected[finite]), initial=0.0))
    difference = float(np.max(np.abs(actual[finite] - expected[finite]), initial=0.0))
    return difference / scale if scale > 0.0 else difference


def assert_relative_close(actual, expected, tolerance, what=""):
    difference = max_relative_difference(actual, expected)
    assert difference <= tolerance, f"{what}: max relative difference {difference:.3e} > {tolerance:.1e}"


@pytest.fixture
def rel_diff():
    """max_relative_difference(actual, expected) -> float."""
    return max_relative_difference


@pytest.fixture
def assert_close():
    """assert_close(actual, expected, tolerance, what) on the max relative difference."""
    return assert_relative_close


@pytest.fixture
def tiny_config():
    """tiny_config(**overrides) -> a TransformerConfig built on TINY."""
    def make(**overrides):
        return TransformerConfig(**{**TINY, **overrides})
    return make


@pytest.fixture
def batch():
    """batch(B, T, V, seed, ignored) -> (inputs, targets) int64 [B,T]; `ignored` targets at -100."""
    def make(B=2, T=11, V=TINY["vocabulary_size"], seed=0, ignored=3):
        rng = np.random.default_rng(seed)
        inputs = rng.integers(0, V, size=(B, T))
        targets = rng.integers(0, V, size=(B, T))
        targets[0, :ignored] = -100  # a prompt-like prefix of row 0 carries no loss
        if B > 1 and ignored:
            targets[-1, -1] = -100  # and a padding-like slot at the end of the last row
        return inputs, targets
    return make


@pytest.fixture(autouse=True)
def _single_threaded_torch():
    """Tiny tensors gain nothing from threads. Torch's OpenMP pool spinning beside another
    thread pool (the engine's former prange kernels) once made this suite 20x slower on a
    2-core machine (one finite-difference test: 41 s instead of 0.1 s). Per test, and set back after it:
    torch's set_num_threads sets GNU OpenMP's thread count for the calling thread, which oneDNN (the
    engine's float32 products) computes with too, so a later test outside tests/engine would otherwise
    train in this process on one thread and a fresh process on two (another execution identity)."""
    try:
        import torch
    except ImportError:  # pragma: no cover - the engine tests that need torch import it
        yield
        return
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def emulated_library(tmp_path_factory):
    """The CUDA library's kernel source compiled by g++ for the host (-DKILN_CUDA_EMULATE) into a .so, once
    per session; KILN_TEST_CUDA_EMULATION names a build of one's own instead."""
    if os.environ.get("KILN_TEST_CUDA_EMULATION"):  # a build of one's own, e.g. with -fsanitize=address
        return Path(os.environ["KILN_TEST_CUDA_EMULATION"])
    compiler = shutil.which("g++")
    if compiler is None:
        pytest.skip("no g++ to build the host emulation of the CUDA kernels")
    output = tmp_path_factory.mktemp("cuda-emulation") / "libkiln_cuda_emulated.so"
    sources = [str(CUDA_DIR / name) for name in ("kernels.cu", "attention.cu", "composite.cu")]
    subprocess.run([compiler, "-std=c++17", "-O2", "-Wall", "-Werror", "-DKILN_CUDA_EMULATE", "-fPIC", "-shared",
                    "-ffp-contract=off", "-I", str(CUDA_DIR), "-x", "c++", *sources, "-x", "none",
                    str(CUDA_DIR / "emulate_runtime.cpp"), "-o", str(output)], check=True)
    return output


@functools.cache
def cuda_probe() -> dict:
    """The CUDA loader's probe, once per test process (isolated: collection does not initialise CUDA here)."""
    from native_ext import cuda

    return cuda.probe(isolated=True)


@pytest.fixture(scope="module", params=["gpu", "emulated"])
def lib(request):
    """The CUDA library twice: on the GPU where one is (else skipped with the probe's reason), and as the host
    emulation (always)."""
    from native_ext import cuda

    if request.param == "gpu":
        if not cuda_probe()["available"]:
            pytest.skip(f"no usable GPU: {cuda_probe()['reason']}")
        return cuda.load()
    return cuda.open_library(request.getfixturevalue("emulated_library"))


@pytest.fixture(params=["gpu", "emulated"])
def cuda_environment(request):
    """This process (and the fresh processes it starts) on a CUDA device, twice: on the GPU where the loader finds
    one (else skipped with the probe's reason), and on the host emulation, named by KILN_CUDA_LIBRARY so that the
    loader, its isolated probe and child processes all find it (it reports one device of compute capability 8.0).
    Yields the library path, or None on the GPU; the per-process caches are emptied before and after."""
    from trainer.runs import backend, execution

    if request.param == "gpu" and not cuda_probe()["available"]:
        pytest.skip(f"no usable GPU: {cuda_probe()['reason']}")
    path = None if request.param == "gpu" else request.getfixturevalue("emulated_library")
    caches = (execution._cached, backend._absent_for_this_process)
    with pytest.MonkeyPatch.context() as patch:  # its own: a test's monkeypatch.undo() leaves it in place
        if path is not None:
            patch.setenv("KILN_CUDA_LIBRARY", str(path))
        for cache in caches:
            cache.cache_clear()
        yield path
        for cache in caches:
            cache.cache_clear()


@pytest.fixture
def cuda_loads(cuda_environment):
    """cuda_environment with a spy: yields the list of native_ext.cuda.load calls (one per CudaModel built)."""
    from native_ext import cuda

    real, opened = cuda.load, []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cuda, "load", lambda min_capability=(8, 0): opened.append(1) or real(min_capability))
        yield opened


@pytest.fixture
def greeter_registry(tmp_path):
    """(home, registry): kiln-tiny's home and an adapter registry holding one PEFT snapshot, "greeter", whose
    adapters are random enough to change what kiln-tiny says."""
    from trainer import LoraConfig
    from trainer.bases import load_base
    from trainer.peft import publish_final_adapter

    registry = tmp_path / "adapters"
    registry.mkdir()
    model, _ = load_base("kiln-tiny", tmp_path)
    model.attach_lora(LoraConfig(rank=4, alpha=8))
    rng = np.random.default_rng(0)
    model.load_adapter_state_dict({k: rng.standard_normal(v.shape).astype(np.float32) * 0.5
                                   for k, v in model.adapter_state_dict().items()})
    publish_final_adapter(model, registry, "greeter", "kiln-tiny")
    model.close()
    return tmp_path, registry
