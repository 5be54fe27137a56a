"""Promotion across processes: `kiln up` and a SEPARATE Celery worker on a real Redis broker, the real
trainer on kiln-tiny. The worker trains, runs the gate's evaluation as a Celery task, and promotes;
the web process then serves the promoted adapter as the default model (its pool follows the
database), to the official openai client."""

import json
import time

import pytest

from controlplane.services import celery_stack

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with celery_stack(tmp_path_factory.mktemp("kiln-promotion-home")) as running:
        yield running


def test_a_worker_promotes_and_the_web_process_serves_it(stack):
    openai = pytest.importorskip("openai")
    client = stack.client
    client.request("POST", "/evals/suites", {"name": "held-out", "default_metric": "regex", "content": "".join(
        json.dumps({"prompt": f"Say {w}.", "expected": "."}) + "\n" for w in ("kiln", "clay"))})
    data = [{"messages": [{"role": "user", "content": f"Say {w}."}, {"role": "assistant", "content": f"{w}!"}]}
            for w in ("kiln", "clay")]
    job = client.submit_sft({"data": data, "config": {"output_name": "celery-bot", "epochs": 2, "seed": 8},
                             "auto_load": True, "gate": {"suite": "held-out", "min_accuracy": 0.0}})
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        job = client.job(job["id"])
        if job["promotion"]["outcome"] not in (None, "pending"):
            break
        time.sleep(0.2)
    assert job["status"] == "succeeded", job["error"]
    assert job["promotion"]["outcome"] == "promoted", (job["promotion"], stack.worker.output[-3000:])
    run = client.request("GET", f"/evals/runs/{job['evaluation_ids'][0]}")
    assert run["status"] == "succeeded" and run["worker_id"].startswith("celery:")
    chat = openai.OpenAI(base_url=f"{stack.url}/v1", api_key=stack.token, max_retries=0).chat.completions.create(
        model="", messages=[{"role": "user", "content": "Say kiln."}], max_tokens=4, temperature=0)
    assert chat.model == "celery-bot"
