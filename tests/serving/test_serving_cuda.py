"""The serving process on the cuda backend: this process's pool computes on the backend KILN_TRAINING_BACKEND
resolves to (kiln_web.serving.runtime.serving_backend), so /v1/completions answers from a CudaModel; an explicit
cuda without a device refuses every load with the loader's reason instead of serving on the CPU.

Each test runs on a GPU where the loader finds one and on the host emulation of the CUDA library, which the
loader finds through KILN_CUDA_LIBRARY (tests/engine/conftest.py's cuda_environment, cuda_loads).
"""

import pytest
from django.test import Client

from kiln_web.serving import runtime
from tests.engine.conftest import cuda_environment, cuda_loads, emulated_library  # noqa: F401  (fixtures)
from trainer.cuda_model import CudaModel

pytestmark = pytest.mark.django_db


def complete(ada, model):
    http = Client(HTTP_AUTHORIZATION=f"Bearer {ada.token}")
    return http.post("/v1/completions", {"model": model, "prompt": "clay", "max_tokens": 8, "temperature": 0,
                                         "logprobs": 1}, content_type="application/json")


def test_completions_on_cuda_answer_as_on_cpu(cuda_loads, settings, ada, api, publish,  # noqa: F811
                                               adapter_name):
    publish(adapter_name, seed=3)
    settings.KILN_TRAINING_BACKEND = "cpu"
    assert runtime.serving_backend() == "cpu"
    assert api.post(f"/v1/adapters/{adapter_name}/load").status_code == 200
    on_cpu = complete(ada, adapter_name)
    assert on_cpu.status_code == 200, on_cpu.content
    assert not cuda_loads  # nothing was loaded on the device
    runtime.close_serving()
    settings.KILN_TRAINING_BACKEND = "cuda"
    assert runtime.serving_backend() == "cuda"
    on_cuda = complete(ada, adapter_name)  # the new pool reconciles: the served adapter is loaded on the device
    assert on_cuda.status_code == 200, on_cuda.content
    assert cuda_loads and isinstance(runtime.serving().pool.resolve(adapter_name).model, CudaModel)
    cpu_choice, cuda_choice = on_cpu.json()["choices"][0], on_cuda.json()["choices"][0]
    assert cuda_choice["text"] == cpu_choice["text"] and cuda_choice["text"]
    expected, actual = cpu_choice["logprobs"]["token_logprobs"], cuda_choice["logprobs"]["token_logprobs"]
    assert len(actual) == len(expected) and all(abs(a - e) <= 1e-4 * max(1.0, abs(e)) for a, e in zip(actual, expected))


def test_an_explicit_cuda_without_a_device_refuses_to_serve(settings, ada, monkeypatch):
    from native_ext import cuda

    def refuse(min_capability=(8, 0)):
        raise cuda.CudaUnavailable("driver_missing", None, "libcuda.so.1 is not installed")

    monkeypatch.setattr(cuda, "load", refuse)
    settings.KILN_TRAINING_BACKEND = "cuda"
    assert runtime.serving_backend() == "cuda"  # stays cuda: nothing is served on another backend
    refused = complete(ada, "kiln-tiny")
    assert refused.status_code == 503
    error = refused.json()["error"]
    assert error["code"] == "backend_unavailable" and "libcuda.so.1 is not installed" in error["message"]
    settings.KILN_TRAINING_BACKEND = "auto"
    assert runtime.serving_backend() == "cpu"  # auto without a qualified device serves on the CPU
