"""Kiln as deployed, for end-to-end tests: `kiln up` in a temporary KILN_HOME and, with a Redis URL,
a separate `celery -A kiln_web worker` process on a queue of the stack's own; both stopped by the caller.

Tests never wait for a time window: they hold a run at a step or inside a checkpoint publication with a
gate (`Stack.hold`, kiln_web.jobs.pacing), wait until the worker reports it is held (`Stack.wait_held`),
act, then release it; and each test starts with no job of an earlier test still active (`Stack.settle`).
"""

import contextlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from kiln_web.client import Client

ROOT = Path(__file__).resolve().parents[2]
REDIS_URL = os.environ.get("KILN_TEST_REDIS_URL")
STATE_FILES = ("adapter.safetensors", "optimizer.safetensors", "state.json")
TERMINAL = {"succeeded", "cancelled", "failed", "lost"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Process:
    """A child process whose combined output is collected by a thread, so it never blocks on a full pipe."""

    def __init__(self, argv, env):
        self.popen = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True, start_new_session=True)
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.popen.stdout:
            self.lines.append(line)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_for(self, text: str, timeout: float, since: int = 0) -> str:
        """The first line from line SINCE on that holds TEXT, once printed."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in self.lines[since:]:
                if text in line:
                    return line
            if self.popen.poll() is not None:
                break
            time.sleep(0.1)
        raise AssertionError(f"{text!r} not seen; output:\n{self.output[-4000:]}")

    def stop(self, sig=signal.SIGTERM, timeout: float = 60):
        if self.popen.poll() is None:
            self.popen.send_signal(sig)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()


class Stack:
    """`kiln up` in a temporary KILN_HOME; with a Redis URL, also a separate Celery worker process."""

    def __init__(self, home: Path, redis_url: str | None = REDIS_URL, **env):
        self.home = home
        self.port = free_port()
        self.pace_dir = home / "pace"
        self.pace_dir.mkdir(parents=True, exist_ok=True)
        self.env = {k: v for k, v in os.environ.items()
                    if k not in {"DATABASE_URL", "REDIS_URL", "DJANGO_SETTINGS_MODULE"}}
        # a Celery queue of this stack's own: a new name is empty, so no task of another stack is consumed.
        # A job is lost after 15 s without a heartbeat (30 beats): on a loaded 2-core machine a worker's heartbeat
        # thread went silent for over 3 s (a GRPO job marked lost mid-run at the earlier 3 s); the tests that kill a
        # worker wait for the lost status they observe, so the longer window only makes them slower
        self.env |= {"KILN_HOME": str(home), "PYTHONUNBUFFERED": "1", "KILN_HEARTBEAT_SECONDS": "0.5",
                     "KILN_LOST_AFTER_SECONDS": "15", "KILN_CANCEL_POLL_SECONDS": "0.1",
                     "KILN_WORKER_POLL_SECONDS": "0.2", "KILN_TEST_PACE_DIR": str(self.pace_dir),
                     "KILN_TRAINING_QUEUE": f"kiln-test-{secrets.token_hex(6)}",
                     # the tests train kiln-tiny; naming the default also skips importing the packaged SmolLM2
                     "KILN_DEFAULT_BASE": "kiln-tiny", **env}
        if redis_url is not None:
            self.env["REDIS_URL"] = redis_url
        self.web = Process([sys.executable, "-m", "kiln_web.cli", "up", "--port", str(self.port)], self.env)
        token_line = self.web.wait_for("API token for", 300)
        self.token = token_line.split(": ", 1)[1].strip()
        self.web.wait_for("Kiln is serving", 300)
        self.url = f"http://127.0.0.1:{self.port}"
        self._wait_healthy()
        self.client = Client(self.url, self.token)
        self.worker = None
        if redis_url is not None:
            self.start_worker()

    def _wait_healthy(self):
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/healthz", timeout=10):
                    return
            except OSError:
                time.sleep(0.2)
        raise AssertionError(self.web.output[-4000:])

    def start_worker(self):
        self.worker = Process([sys.executable, "-m", "celery", "-A", "kiln_web", "worker", "-Q",
                               self.env["KILN_TRAINING_QUEUE"],
                               "--pool", "solo", "-l", "info", "-n", f"kiln-test-{self.port}@%h"], self.env)
        self.worker.wait_for("ready.", 300)

    def stop(self):
        if self.worker is not None:
            self.worker.stop(signal.SIGTERM)
        self.web.stop(signal.SIGINT)
        self.web.stop(signal.SIGKILL)

    def submit(self, body) -> dict:
        return self.client.submit_sft(body)

    def wait(self, job_id, until, timeout=300) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            job = self.client.job(job_id)
            if until(job):
                return job
            time.sleep(0.05)
        output = (self.worker or self.web).output[-4000:]
        raise AssertionError(f"job {job_id} is still {job['status']} at {job['progress']}; output:\n{output}")

    # -- holding a run where a test acts (kiln_web.jobs.pacing) --

    def hold(self, adapter: str, step: int, stage: str | None = None) -> None:
        """Hold ADAPTER's run once STEP is committed (or inside its checkpoint publication, after STAGE)."""
        gate = {"step": step} | ({"stage": stage} if stage else {})
        temporary = self.pace_dir / f".{adapter}.tmp"
        temporary.write_text(json.dumps(gate))
        os.replace(temporary, self.pace_dir / adapter)

    def release(self, adapter: str) -> None:
        (self.pace_dir / adapter).unlink(missing_ok=True)

    def wait_held(self, adapter: str, job_id, timeout: float = 300) -> dict:
        """Wait until the worker reports ADAPTER's run held at its gate; returns {"step", "stage"}."""
        marker = self.pace_dir / f"{adapter}.held"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                return json.loads(marker.read_text())
            except (FileNotFoundError, ValueError):
                pass
            job = self.job(job_id)
            if job is not None and job["status"] in TERMINAL:
                raise AssertionError(f"job {job_id} ended {job['status']} before it reached its gate: {job['error']}")
            time.sleep(0.05)
        output = (self.worker or self.web).output[-4000:]
        raise AssertionError(f"job {job_id} was not held at its gate within {timeout:g} s; output:\n{output}")

    def job(self, job_id) -> dict | None:
        return self.client.job(job_id)

    def settle(self, timeout: float = 300) -> None:
        """Cancel every job still active (an earlier test's leftover) and wait until all are terminal."""
        for gate in self.pace_dir.iterdir():
            gate.unlink(missing_ok=True)
        for job in self.client.jobs(limit=200)["items"]:
            if job["status"] not in TERMINAL:
                with contextlib.suppress(Exception):
                    self.client.cancel(job["id"])
                self.wait(job["id"], lambda j: j["status"] in TERMINAL, timeout=timeout)

    def final_bytes(self, job) -> dict:
        path = self.home / "adapters" / job["latest_checkpoint"]["resume_checkpoint"]
        return {name: (path / name).read_bytes() for name in STATE_FILES}


def sft_request(adapter, **config) -> dict:
    """A kiln-tiny SFT request of 100 steps (4 chat records, 25 epochs) with a checkpoint every 5."""
    words = ("kiln", "clay", "glaze", "fire")
    data = [{"messages": [{"role": "user", "content": f"Say {w}."}, {"role": "assistant", "content": f"{w.upper()}!"}]}
            for w in words]
    return {"data": data, "config": {"output_name": adapter, "epochs": 25, "checkpoint_interval": 5, "seed": 29,
                                     **config}}


@contextlib.contextmanager
def celery_stack(home: Path, **kwargs):
    """A Stack with its own Celery worker for a test module (skips without the test Redis); stopped after."""
    if REDIS_URL is None:
        import pytest

        pytest.skip("KILN_TEST_REDIS_URL is unset (./dev test sets it when Redis answers)")
    running = Stack(home, **kwargs)
    try:
        yield running
    finally:
        running.stop()
