"""KV-cached passes of CudaModel (trainer/cuda_decode.py) against the CPU engine's forward_cached and generate, on
a GPU (skipped, with the probe's reason, without one) and on the host emulation of the CUDA library.

Tolerance as in test_cuda_model.py: a maximum relative difference of 1e-4 for logits and log-probabilities; greedy
tokens are compared with `==` (the tiny models here have no near-ties at that tolerance), and on one device the
same generation gives the same bits twice.
"""

import numpy as np
import pytest

from test_cuda_model import SHAPE, make_model
from trainer.cuda_model import CudaModel
from trainer.generation import SamplingConfig, SamplingRNG, generate
from trainer.lora import LoraConfig

TOLERANCE = 1e-4
CASES = {
    "dense": dict(),
    "lora": dict(lora=LoraConfig(rank=4, alpha=8.0)),
    "qlora": dict(lora=LoraConfig(rank=4, alpha=8.0), quantize=dict(block_size=32, double_quantization=True)),
    "qwen3-window": dict(sliding_window=5, attention_bias=True, qk_norm=True, family="qwen3"),
    "llama3-mha-tied": dict(rope_scaling=("llama3", 8.0, 1.0, 4.0, 8), kv_head_count=4, tie_embeddings=True,
                            family="llama"),
}
CHUNKS = (5, 1, 1, 3, 1)  # a prompt, single steps and a chunk in the middle: positions 0..10


def tokens(seed, B, T):
    return np.random.default_rng(seed).integers(0, SHAPE["vocabulary_size"], (B, T))


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("B", [1, 2])
def test_cached_logits_follow_the_cpu_engine(lib, assert_close, case, B):
    """Chunk after chunk through one cache: every chunk's logits within TOLERANCE of the CPU engine's cached pass
    and of the device's own uncached logits over the whole prefix; last_only is the last row of the same pass."""
    model = make_model(**CASES[case])
    sequence = tokens(3, B, sum(CHUNKS))
    with CudaModel(model, lib) as device:
        cpu_cache, device_cache = model.kv_cache(B), device.kv_cache(B)
        start = 0
        for number, size in enumerate(CHUNKS):
            chunk = sequence[:, start:start + size]
            last_only = number == 2
            expected = model.forward_cached(chunk, cpu_cache, last_only=last_only)
            actual = device.forward_cached(chunk, device_cache, last_only=last_only)
            assert actual.shape == expected.shape == (B, 1 if last_only else size, SHAPE["vocabulary_size"])
            assert_close(actual, expected, TOLERANCE, f"chunk {number}")
            whole = device.logits(sequence[:, :start + size])[:, start:]
            assert_close(actual, whole[:, -1:] if last_only else whole, TOLERANCE, f"chunk {number} uncached")
            start += size
            assert device_cache.length == cpu_cache.length == start


@pytest.mark.parametrize("case", ["lora", "qwen3-window"])
def test_greedy_generation_equals_the_cpu_engine(lib, assert_close, case):
    """trainer.generation.generate on the device: the CPU engine's greedy tokens, log-probabilities within
    TOLERANCE (prompt ones too, with echo), and the same bits when generated again."""
    model = make_model(**CASES[case])
    prompt = tokens(11, 1, 4)[0]
    config = SamplingConfig(max_new_tokens=SHAPE["maximum_context"] - 4, temperature=0)
    expected = generate(model, prompt, config, echo=True, top_logprobs=3)
    with CudaModel(model, lib) as device:
        first = generate(device, prompt, config, echo=True, top_logprobs=3)
        again = generate(device, prompt, config, echo=True, top_logprobs=3)
    assert first.tokens == expected.tokens and len(first.tokens) == SHAPE["maximum_context"] - 4
    assert first.finish_reason == expected.finish_reason == "length"
    assert_close(first.logprobs, expected.logprobs, TOLERANCE, "log-probabilities")
    assert_close(first.prompt_logprobs, expected.prompt_logprobs, TOLERANCE, "prompt log-probabilities")
    assert [[t for t, _ in row] for row in first.top_logprobs] == [[t for t, _ in row] for row in expected.top_logprobs]
    assert (first.tokens, first.logprobs, first.prompt_logprobs, first.top_logprobs) == \
        (again.tokens, again.logprobs, again.prompt_logprobs, again.top_logprobs)


def test_sampling_on_the_device_is_reproducible_from_the_rng_state(lib):
    """Temperature sampling with one SamplingRNG state twice: the same tokens and log-probabilities, bit for bit."""
    model = make_model(**CASES["lora"])
    config = SamplingConfig(max_new_tokens=8, temperature=0.9, top_p=0.95, top_k=20)
    state = SamplingRNG(21).state()
    with CudaModel(model, lib) as device:
        runs = [generate(device, [1, 2, 3], config, SamplingRNG.from_state(state)) for _ in range(2)]
    assert runs[0].tokens == runs[1].tokens and runs[0].logprobs == runs[1].logprobs
    assert len(runs[0].tokens) == 8


def test_caches_are_independent_and_checked(lib, assert_close):
    """Two live caches of one model interleave token by token (as concurrent serving requests do) and each
    follows its own sequence; a closed cache, another model's cache, a wrong batch and a full cache are refused."""
    model = make_model(**CASES["lora"])
    first, second = tokens(1, 1, 6), tokens(2, 1, 6)
    with CudaModel(model, lib) as device, CudaModel(model, lib) as other:
        caches = device.kv_cache(), device.kv_cache(1, 6)
        expected = [model.forward_cached(sequence, model.kv_cache()) for sequence in (first, second)]
        for position in range(6):
            for cache, sequence, logits in zip(caches, (first, second), expected):
                step = device.forward_cached(sequence[:, position:position + 1], cache)
                assert_close(step[0, 0], logits[0, position], TOLERANCE, f"position {position}")
        with pytest.raises(ValueError, match="exceed the cache's positions 6"):
            device.forward_cached(np.array([[1]]), caches[1])
        closed = device.kv_cache()
        closed.close()
        with pytest.raises(ValueError, match="not made by this model"):
            device.forward_cached(np.array([[1]]), closed)
        with pytest.raises(ValueError, match="not made by this model"):
            device.forward_cached(np.array([[1]]), other.kv_cache())
        with pytest.raises(ValueError, match="not made by this model"):
            device.forward_cached(np.array([[1]]), model.kv_cache())
        with pytest.raises(ValueError, match="holds 1 sequences"):
            device.forward_cached(np.array([[1], [2]]), device.kv_cache())
        full = device.kv_cache()
        device.forward_cached(tokens(0, 1, SHAPE["maximum_context"] - 1), full)
        with pytest.raises(ValueError, match="exceed maximum_context"):
            device.forward_cached(np.array([[1, 2]]), full)
        for bad in (dict(batch_size=0), dict(positions=0), dict(positions=SHAPE["maximum_context"] + 1)):
            with pytest.raises(ValueError, match="batch_size|positions"):
                device.kv_cache(**bad)
