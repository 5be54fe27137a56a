"""Runs one training job in its own process (for kill tests): python run_worker.py job.json; tests call
`run_until_killed`, and `run_to_end` to resume (or run) in a fresh process.

job.json: {"kind": "sft" | "grpo" | "opd", "home": KILN_HOME, "request": {...}, "bases_root": optional (default
KILN_HOME; an OPD teacher's base lives in the test's shared bases root)}. The worker prints one JSON line:
{"status", "steps", "loss_history"}. With KILN_TEST_HOLD_AFTER_STEP=N
the run stops after step N is committed and its checkpoint (if due) published: before recording step N+1 it
writes KILN_TEST_HELD_FILE and waits until it is killed, so the parent kills it mid-run by construction.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from trainer.runs import run_kind
from trainer.runs.admission import RunSettings
from trainer.runs.step import NullHooks


class HoldingHooks(NullHooks):
    def __init__(self, hold_after: int | None, held_file: str | None):
        self.hold_after, self.held_file = hold_after, held_file

    def on_step(self, metrics):
        if self.hold_after is not None and metrics["step"] > self.hold_after:
            Path(self.held_file).write_text(str(self.hold_after))
            while True:  # until the parent's SIGKILL
                time.sleep(1)


class StopAt(NullHooks):
    """Hooks that record metrics (without wall time) and checkpoints, and cancel after `step` steps."""

    def __init__(self, step):
        self.step, self.seen, self.metrics, self.checkpoints = step, 0, [], []

    def on_step(self, metrics):
        self.seen = metrics["step"]
        self.metrics.append({k: v for k, v in metrics.items() if k != "elapsed_seconds"})

    def should_cancel(self):
        return self.step is not None and self.seen >= self.step

    def on_checkpoint(self, summary, timing):
        self.checkpoints.append(summary)


def _spec(home: Path, kind: str, request: dict, bases_root: Path | None, name: str) -> Path:
    spec = home / name
    spec.write_text(json.dumps({"kind": kind, "home": str(home), "request": request,
                                "bases_root": str(bases_root or home)}))
    return spec


def run_until_killed(home: Path, kind: str, request: dict, hold_after: int, bases_root: Path | None = None) -> None:
    """Run the job in a worker process held after step HOLD_AFTER (its checkpoint, if due, published); SIGKILL it."""
    spec = _spec(home, kind, request, bases_root, "job.json")
    held = home / "held"
    env = {**os.environ, "KILN_TEST_HOLD_AFTER_STEP": str(hold_after), "KILN_TEST_HELD_FILE": str(held)}
    worker = subprocess.Popen([sys.executable, __file__, str(spec)], env=env)
    try:
        deadline = time.monotonic() + 600
        while not held.exists():
            assert worker.poll() is None, "the worker ended before it was held"
            assert time.monotonic() < deadline, "the worker was not held within 600 s"
            time.sleep(0.05)
        worker.send_signal(signal.SIGKILL)
        worker.wait(timeout=30)
    finally:
        if worker.poll() is None:
            worker.kill()


def run_to_end(home: Path, kind: str, request: dict, bases_root: Path | None = None) -> dict:
    """Run the job (a resume names its checkpoint in the request) in a fresh worker process to its end; its
    {"status", "steps", "loss_history"}."""
    spec = _spec(home, kind, request, bases_root, "job-to-end.json")
    env = {k: v for k, v in os.environ.items() if k not in ("KILN_TEST_HOLD_AFTER_STEP", "KILN_TEST_HELD_FILE")}
    done = subprocess.run([sys.executable, __file__, str(spec)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def main():
    spec = json.loads(Path(sys.argv[1]).read_text())
    home = Path(spec["home"])
    settings = RunSettings(home=home, registry=home / "adapters", bases_root=Path(spec.get("bases_root", home)),
                           data_roots=(home / "datasets",))
    kind = run_kind(spec["kind"])
    hold_after = os.environ.get("KILN_TEST_HOLD_AFTER_STEP")
    hooks = HoldingHooks(int(hold_after) if hold_after else None, os.environ.get("KILN_TEST_HELD_FILE"))
    result = kind.run(kind.admit(spec["request"], settings), settings, hooks)
    print(json.dumps({"status": result.status, "steps": result.steps_completed,
                      "loss_history": result.loss_history}))


if __name__ == "__main__":
    main()
