"""Evaluations on the cuda backend: a run queued with backend cuda generates on trainer.cuda_model.CudaModel in its
scratch pool (kiln_web.evals.runtime.compare -> trainer.serving.ServingPool(backend="cuda")) and records cuda; its
answers are those of the same run on cpu.

It runs on a GPU where the loader finds one and on the host emulation of the CUDA library, which the loader finds
through KILN_CUDA_LIBRARY (tests/engine/conftest.py's cuda_environment, cuda_loads).
"""

import json

import pytest

from kiln_web.evals.models import EvalExampleResult
from kiln_web.jobs.worker import EmbeddedWorker
from tests.engine.conftest import cuda_environment, cuda_loads, emulated_library  # noqa: F401  (fixtures)

pytestmark = pytest.mark.django_db


def run_evaluation(api, adapter_name, backend, capture):
    with capture(execute=True):
        queued = api.post("/v1/evals/runs", {"adapter": adapter_name, "suite": "words", "baseline": "kiln-tiny",
                                             "backend": backend})
    assert queued.status_code == 201, queued.content
    assert EmbeddedWorker().run_once()
    run = api.get(f"/v1/evals/runs/{queued.json()['id']}").json()
    assert run["status"] == "succeeded", run["error"]
    outputs = list(EvalExampleResult.objects.filter(run_id=run["id"]).order_by("index")
                   .values_list("candidate_output", "baseline_output"))
    return run, outputs


def test_an_evaluation_on_cuda_generates_on_the_device_and_answers_as_on_cpu(
        cuda_loads, api, publish, adapter_name, django_capture_on_commit_callbacks):  # noqa: F811
    publish(adapter_name)
    content = "\n".join(json.dumps({"prompt": f"Say {word}.", "expected": word, "metric": "contains"})
                        for word in ("kiln", "fire", "clay"))
    assert api.post("/v1/evals/suites", {"name": "words", "content": content}).status_code == 201
    cpu_run, cpu_outputs = run_evaluation(api, adapter_name, "cpu", django_capture_on_commit_callbacks)
    assert cpu_run["backend"]["resolved"] == "cpu" and not cuda_loads  # the cpu run loaded no library
    cuda_run, cuda_outputs = run_evaluation(api, adapter_name, "cuda", django_capture_on_commit_callbacks)
    assert cuda_run["backend"]["resolved"] == "cuda"
    assert len(cuda_loads) == 2  # the candidate's and the baseline's models were built on the device
    assert cuda_outputs == cpu_outputs and len(cuda_outputs) == 3
    assert any(candidate != baseline for candidate, baseline in cuda_outputs)  # the adapter changed the answers
    assert cuda_run["candidate"]["summary"] == cpu_run["candidate"]["summary"]
