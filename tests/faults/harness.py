"""Throwaway services for fault tests, and the checks every fault ends with.

Each service is this test run's own (tests/private_services.py): a redis-server on a free port, a PostgreSQL
cluster made with initdb in a temporary folder and run with pg_ctl on a free port, and a size-limited tmpfs
for the adapter registry. Each can be stopped and started again on the same port, which is what a restart
fault is.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from controlplane.services import ROOT, STATE_FILES, TERMINAL, Process, Stack
from kiln_web.client import ApiError
from trainer.runs import checkpoint_dir
from trainer.runs.sft import MANIFEST_FIELDS


class SmallVolume:
    """A tmpfs of SIZE bytes mounted at PATH (root only); `fill` leaves only so many bytes free."""

    def __init__(self, path: Path, size: int):
        self.path, self.size = path, size
        path.mkdir(parents=True, exist_ok=True)
        result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)],
                                capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"cannot mount a tmpfs at {path}: {result.stderr.strip() or result.returncode}")
        self.filler = path / ".filler"

    def free(self) -> int:
        stats = os.statvfs(self.path)
        return stats.f_bavail * stats.f_frsize

    def fill(self, leave: int) -> None:
        """Write a hidden filler file so that about LEAVE bytes stay free."""
        self.unfill()
        with open(self.filler, "wb") as handle:
            remaining = self.free() - leave
            block = b"\0" * (1 << 20)
            while remaining > 0:
                remaining -= handle.write(block[:min(len(block), remaining)])

    def unfill(self) -> None:
        self.filler.unlink(missing_ok=True)

    def unmount(self) -> None:
        subprocess.run(["umount", "-l", str(self.path)], capture_output=True)


# -- the stack, restartable --


class FaultStack(Stack):
    """controlplane.services.Stack whose web process can be killed and started again on the same port."""

    def restart_web(self, sig=signal.SIGKILL) -> None:
        self.web.stop(sig, timeout=30)
        self.web = Process([sys.executable, "-m", "kiln_web.cli", "up", "--port", str(self.port)], self.env)
        self.web.wait_for("Kiln is serving", 300)
        self._wait_healthy()

    def ensure_running(self) -> None:
        if self.web.popen.poll() is not None:
            self.restart_web()
        if self.redis_url is not None and (self.worker is None or self.worker.popen.poll() is not None):
            self.start_worker()

    def job(self, job_id: str) -> dict | None:
        """The job, or None while the server cannot answer (a fault in progress)."""
        try:
            return self.client.job(job_id)
        except (ApiError, OSError):
            return None

    def wait(self, job_id, until, timeout=300) -> dict:
        deadline = time.monotonic() + timeout
        job = None
        while time.monotonic() < deadline:
            job = self.job(job_id) or job
            if job is not None and until(job):
                return job
            time.sleep(0.05)
        logs = f"web:\n{self.web.output[-3000:]}\nworker:\n{(self.worker.output if self.worker else '')[-3000:]}"
        raise AssertionError(f"job {job_id} is still {job and job['status']} at {job and job['progress']}\n{logs}")

    def submit(self, body) -> dict:
        deadline = time.monotonic() + 30
        while True:
            try:
                return self.client.submit_sft(body)
            except (ApiError, OSError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    @property
    def registry(self) -> Path:
        return self.home / "adapters"

    @property
    def redis_url(self):
        return self.env.get("REDIS_URL")


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/healthz", timeout=2):
            return True
    except OSError:
        return False


# -- what every fault ends with --


def check_registry(registry: Path) -> dict:
    """Every canonically named checkpoint passes the full load (every file hashed); everything else in the
    registry (staging orphans, PEFT snapshots, filler) is refused by the loader. Returns counts."""
    counts = {"checkpoints": 0, "refused": 0, "orphans": 0}
    for path in sorted(registry.iterdir()):
        try:
            checkpoint_dir.parse_basename(path.name)
        except checkpoint_dir.CheckpointError:
            try:
                checkpoint_dir.load_checkpoint(path, full=True, allowed_manifest_fields=MANIFEST_FIELDS)
            except (checkpoint_dir.CheckpointError, OSError):
                counts["refused"] += 1
                counts["orphans"] += path.name.startswith(".") and ".staging-" in path.name
                continue
            raise AssertionError(f"{path.name} is not canonically named but loads as a checkpoint")
        checkpoint_dir.load_checkpoint(path, full=True, allowed_manifest_fields=MANIFEST_FIELDS)  # raises if damaged
        counts["checkpoints"] += 1
    return counts


def assert_truthful(stack: FaultStack, job: dict) -> None:
    """A final job state that says what happened: never succeeded without its final checkpoint and adapter."""
    assert job["status"] in TERMINAL, job["status"]
    newest = checkpoint_dir.latest_checkpoint(stack.registry, job["adapter"])
    if newest is not None and (job["resume_from"] is None or newest.name != job["resume_from"]):
        # the job names the newest checkpoint on disk (the authority), even one its worker died before recording
        assert job["latest_checkpoint"] and job["latest_checkpoint"]["resume_checkpoint"] == newest.name, job
    if job["status"] == "succeeded":
        checkpoint = job["latest_checkpoint"]
        assert checkpoint and checkpoint["complete"] is True, job
        assert checkpoint["committed_step"] == job["progress"]["total_steps"] == job["progress"]["committed_step"]
        snapshot = stack.registry / job["adapter"]
        assert (snapshot / "adapter_model.safetensors").is_file() and (snapshot / "adapter_config.json").is_file()
    else:
        assert job["error"] is not None or job["status"] == "cancelled", job
        if job["latest_checkpoint"] is not None:
            assert job["latest_checkpoint"]["complete"] is False
            assert job["latest_checkpoint_error"] is None, job["latest_checkpoint_error"]


def finish_by_resuming(stack: FaultStack, job: dict, request: dict, timeout: float = 300) -> dict:
    """JOB if it succeeded; else the resume of its latest checkpoint (or a fresh run when it published none),
    run to success."""
    if job["status"] == "succeeded":
        return job
    request = {**request, "config": dict(request["config"])}
    if job["latest_checkpoint"] is not None:
        request["config"]["resume_checkpoint"] = job["latest_checkpoint"]["resume_checkpoint"]
    resumed = stack.submit(request)
    resumed = stack.wait(resumed["id"], lambda j: j["status"] in TERMINAL, timeout=timeout)
    assert resumed["status"] == "succeeded", (resumed["error"], stack.worker and stack.worker.output[-3000:])
    return resumed


def final_bytes(stack: FaultStack, job: dict) -> dict:
    path = stack.registry / job["latest_checkpoint"]["resume_checkpoint"]
    return {name: (path / name).read_bytes() for name in STATE_FILES}


__all__ = ["ROOT", "FaultStack", "SmallVolume", "assert_truthful",
           "check_registry", "final_bytes", "finish_by_resuming", "healthy"]
