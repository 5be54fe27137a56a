"""The serving pool on the cuda backend (trainer.serving.ServingPool(backend="cuda")): bases and adapters copied to
trainer.cuda_model.CudaModel, completions sampled through its device KV caches (trainer/cuda_decode.py), and the
evaluation harness (trainer.evals.evaluate) over them.

Each test runs on a GPU where the loader finds one and on the host emulation of the CUDA library (the same kernel
source built by g++), which the loader finds through KILN_CUDA_LIBRARY (conftest.py's cuda_environment). Greedy tokens are compared with `==` against a cpu pool and the
log-probabilities within 1e-4 relative (the device and the CPU engine sum in different orders).
"""

import threading
from contextlib import closing

import numpy as np
import pytest

from trainer.cuda_model import CudaModel
from trainer.evals import evaluate, parse_suite
from trainer.generation import SamplingConfig
from trainer.serving import ServingError, ServingPool

TOLERANCE = 1e-4
GREEDY = SamplingConfig(max_new_tokens=10, temperature=0)


def pools(greeter_registry):
    home, adapters = greeter_registry
    return ServingPool(home, adapters, "cpu"), ServingPool(home, adapters, "cuda")


def prompt_of(pool, text):
    tokenizer = pool.resolve("kiln-tiny").tokenizer
    return tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                          add_generation_prompt=True))


def relative(actual, expected):
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return float(np.max(np.abs(actual - expected)) / max(float(np.max(np.abs(expected))), 1e-30))


def test_a_cuda_pool_serves_what_a_cpu_pool_serves(cuda_loads, greeter_registry):
    """Base and adapter on the device: the cpu pool's greedy tokens, log-probabilities (echoed prompt ones too)
    within TOLERANCE; the canary passes; the served models are CudaModels, and unloading closes them."""
    cpu, gpu = pools(greeter_registry)
    with closing(cpu), closing(gpu):
        prompt = prompt_of(cpu, "hi")
        for name in ("kiln-tiny", "greeter"):
            if name == "greeter":
                cpu.load_adapter("greeter", "kiln-tiny")
                gpu.load_adapter("greeter", "kiln-tiny")
            _, expected = cpu.complete(name, prompt, GREEDY, echo=True, top_logprobs=2)
            served, actual = gpu.complete(name, prompt, GREEDY, echo=True, top_logprobs=2)
            assert isinstance(served.model, CudaModel) and cuda_loads
            assert actual.tokens == expected.tokens and len(actual.tokens) == 10, name
            assert actual.text == expected.text
            assert relative(actual.logprobs, expected.logprobs) <= TOLERANCE, name
            assert relative(actual.prompt_logprobs, expected.prompt_logprobs) <= TOLERANCE, name
        _, base = gpu.complete("kiln-tiny", prompt, GREEDY)
        _, adapted = gpu.complete("greeter", prompt, GREEDY)
        assert adapted.tokens != base.tokens  # the adapter is on the device too
        assert gpu.canary("greeter") == (True, "loaded, generated and scored")
        model = gpu.resolve("greeter").model
        gpu.unload("greeter")
        assert model.closed


def test_concurrent_requests_on_the_device_keep_their_own_caches(cuda_loads, greeter_registry):
    """Two streams on one served device model, taking turns token by token: each gets the tokens it gets alone."""
    _, gpu = pools(greeter_registry)
    with closing(gpu):
        gpu.load_adapter("greeter", "kiln-tiny")
        prompts = [prompt_of(gpu, "hi"), prompt_of(gpu, "tell me a story")]
        alone = [gpu.complete("greeter", p, GREEDY)[1].tokens for p in prompts]
        both_started, results = threading.Barrier(2), [None, None]

        def stream(index):
            both_started.wait()
            results[index] = gpu.complete("greeter", prompts[index], GREEDY)[1].tokens

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert results == alone and alone[0] != alone[1]


def test_an_evaluation_on_the_device_scores_what_the_cpu_scores(cuda_loads, greeter_registry):
    """trainer.evals.evaluate over a device model: the same completions and verdicts as over the CPU model."""
    cpu, gpu = pools(greeter_registry)
    with closing(cpu), closing(gpu):
        lines = [f'{{"prompt": "say {word}", "expected": "{word}", "metric": "contains"}}'
                 for word in ("hello", "yes", "no")]
        suite = parse_suite("words", "\n".join(lines))
        results = []
        for pool in (cpu, gpu):
            served = pool.load_adapter("greeter", "kiln-tiny")
            results.append(evaluate(served.model, served.tokenizer, suite, max_new_tokens=6))
        expected, actual = results
        assert any(e["output"] for e in expected.examples)
        assert [e["output"] for e in actual.examples] == [e["output"] for e in expected.examples]
        assert actual.accuracy == expected.accuracy


def test_a_pool_without_the_library_refuses_loads_with_the_loaders_reason(monkeypatch, greeter_registry):
    from native_ext import cuda

    def refuse(min_capability=(8, 0)):
        raise cuda.CudaUnavailable("driver_missing", None, "libcuda.so.1 is not installed")

    monkeypatch.setattr(cuda, "load", refuse)
    _, gpu = pools(greeter_registry)
    with closing(gpu):
        for load in (lambda: gpu.resolve("kiln-tiny"), lambda: gpu.load_adapter("greeter", "kiln-tiny")):
            with pytest.raises(ServingError) as refused:
                load()
            assert refused.value.code == "backend_unavailable"
            assert "libcuda.so.1 is not installed" in refused.value.message
        assert gpu.loaded() == []
    with pytest.raises(ValueError, match="backend must be cpu or cuda"):
        ServingPool(*greeter_registry, "tpu")
