"""`kiln eval` and `kiln train sft --auto-load --gate-*` against a live Kiln (`kiln up`, embedded worker,
the real trainer on kiln-tiny): a suite is created and shown, a gated run is trained, evaluated by its
gate and promoted, and the job, the evaluation and the audit trail say so."""

import json
import os
import subprocess
import sys
import time

import pytest

from controlplane.services import Stack

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def kiln(tmp_path_factory):
    stack = Stack(tmp_path_factory.mktemp("kiln-evals-home"), redis_url=None)
    try:
        yield stack
    finally:
        stack.stop()


def kiln_cli(kiln, *args, ok=True) -> str:
    env = {**os.environ, "KILN_URL": kiln.url, "KILN_TOKEN": kiln.token, "KILN_HOME": str(kiln.home)}
    done = subprocess.run([sys.executable, "-m", "kiln_web.cli", *args], env=env, capture_output=True, text=True,
                          timeout=180)
    assert (done.returncode == 0) == ok, done.stdout + done.stderr
    return done.stdout + done.stderr


def test_a_gated_run_is_evaluated_and_promoted(kiln, tmp_path):
    suite = tmp_path / "suite.jsonl"
    suite.write_text(json.dumps({"prompt": "Say kiln.", "expected": "KILN", "metric": "contains"}) + "\n"
                     + json.dumps({"prompt": "Say clay.", "expected": "\\S", "metric": "regex"}) + "\n")
    assert "created suite held-out: 2 examples" in kiln_cli(kiln, "eval", "suite", "create", "--name", "held-out",
                                                           "--file", str(suite))
    assert "held-out" in kiln_cli(kiln, "eval", "suite", "list")
    assert '"metric": "regex"' in kiln_cli(kiln, "eval", "suite", "show", "held-out")
    refused = kiln_cli(kiln, "eval", "suite", "create", "--name", "held-out", "--file", str(suite), ok=False)
    assert "suite_exists" in refused

    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"Say {w}."},
                                                     {"role": "assistant", "content": f"{w.upper()}!"}]}) + "\n"
                            for w in ("kiln", "clay")))
    out = kiln_cli(kiln, "train", "sft", "--file", str(data), "--adapter", "gated", "--epochs", "2", "--seed", "3",
                   "--auto-load", "--gate-suite", "held-out", "--gate-min-accuracy", "0", "--wait")
    job_id = next(line.split()[1] for line in out.splitlines() if line.startswith("job "))
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        status = kiln_cli(kiln, "train", "status", "--job-id", job_id)
        if "promotion  promoted" in status:
            break
        time.sleep(0.3)
    assert "status     succeeded" in status and "promotion  promoted by gate" in status, status
    evaluation = next(line.split()[1] for line in status.splitlines() if line.startswith("evaluations"))
    shown = kiln_cli(kiln, "eval", "status", "--id", evaluation)
    assert "succeeded  suite held-out (gate)" in shown and "baseline   base kiln-tiny" in shown
    assert evaluation in kiln_cli(kiln, "eval", "list")
    assert "promoted" in kiln_cli(kiln, "adapter", "promotions") and "by gate" in kiln_cli(kiln, "adapter",
                                                                                          "promotions")
    assert "gated" in kiln_cli(kiln, "adapter", "list")
    manual = kiln_cli(kiln, "eval", "run", "--adapter", "gated", "--suite", "held-out", "--wait")
    assert "succeeded" in manual and "baseline   adapter gated" not in manual  # itself active: the base
