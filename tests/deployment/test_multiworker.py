"""Kiln as deployed across machines, on one: a temporary PostgreSQL database, Redis, the web server (`kiln up`)
and TWO separate Celery worker processes sharing one KILN_HOME. Four SFT jobs run concurrently across both
workers and are correct (twins with the same request and seed end with the same bytes on different workers);
a worker SIGKILLed mid-run leaves its job `lost` with its last checkpoint intact, and the other worker resumes
it to the bytes of an uninterrupted run. Heartbeats are shortened through the environment (services.Stack)."""

import os
import secrets
import signal
import subprocess
import sys
from datetime import datetime
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import pytest

from controlplane.services import ROOT, TERMINAL, Process, Stack, sft_request

pytestmark = pytest.mark.slow

REDIS_URL = os.environ.get("KILN_TEST_REDIS_URL")
DATABASE_URL = os.environ.get("KILN_TEST_DATABASE_URL")
WORKERS = ("alpha", "beta")


def _unavailable() -> str | None:
    """Why this test cannot run here, or None."""
    if REDIS_URL is None:
        return "KILN_TEST_REDIS_URL is unset (./dev test sets it when Redis answers)"
    if DATABASE_URL is None:
        return "KILN_TEST_DATABASE_URL is unset (./dev test sets it when PostgreSQL answers)"
    import psycopg
    import redis

    try:
        redis.Redis.from_url(REDIS_URL, socket_connect_timeout=2).ping()
    except redis.RedisError as exc:
        return f"Redis at {REDIS_URL} does not answer ({exc})"
    try:
        psycopg.connect(DATABASE_URL, connect_timeout=3).close()
    except psycopg.Error as exc:
        return f"PostgreSQL at {DATABASE_URL} does not answer ({exc})"
    return None


@pytest.fixture(scope="module")
def database():
    """A PostgreSQL database of this test's own, created and dropped here."""
    reason = _unavailable()
    if reason:
        pytest.skip(reason)
    import psycopg

    name = f"kiln_multiworker_{secrets.token_hex(4)}"
    with psycopg.connect(DATABASE_URL, autocommit=True) as connection:
        connection.execute(f'CREATE DATABASE "{name}"')
    try:
        yield urlunsplit(urlsplit(DATABASE_URL)._replace(path=f"/{name}"))
    finally:
        with psycopg.connect(DATABASE_URL, autocommit=True) as connection:
            connection.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


class Cluster:
    """`kiln up` on PostgreSQL and Redis, and a separate Celery worker process per name, on a queue of its own."""

    def __init__(self, home: Path, database_url: str):
        queue = f"{os.environ.get('KILN_TRAINING_QUEUE', 'training')}-multiworker-{secrets.token_hex(3)}"
        # redis_url=None: Stack starts no worker of its own; REDIS_URL still reaches every process
        self.stack = Stack(home, redis_url=None, REDIS_URL=REDIS_URL, DATABASE_URL=database_url,
                           KILN_TRAINING_QUEUE=queue)
        self.queue = queue
        self.workers = {name: self._worker(name) for name in WORKERS}
        for worker in self.workers.values():
            worker.wait_for("ready.", 300)

    def _worker(self, name: str) -> Process:
        return Process([sys.executable, "-m", "celery", "-A", "kiln_web", "worker", "-Q", self.queue,
                        "--pool", "solo", "-l", "info", "-n", f"{name}-{self.stack.port}@%h"], self.stack.env)

    def worker_of(self, job: dict) -> str:
        """The name of the worker that ran JOB (worker_id is celery:NAME-PORT@HOST:PID)."""
        return job["worker_id"].split(":")[1].split("-")[0]

    def output(self) -> str:
        return "\n".join(f"--- {name}\n{worker.output[-3000:]}" for name, worker in self.workers.items())

    def stop(self):
        for worker in self.workers.values():
            worker.stop(signal.SIGTERM)
        self.stack.stop()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, database):
    running = Cluster(tmp_path_factory.mktemp("kiln-multiworker-home"), database)
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture(scope="module")
def four_jobs(cluster) -> dict:
    """Four SFT jobs submitted together through the API, each run to its end: twins (same request and seed) and
    two others. The twins are held after their first step until both are running, so they run at the same time
    on the two workers (a solo-pool worker takes no second task while it runs one)."""
    stack = cluster.stack
    requests = {"twin-a": sft_request("twin-a"), "twin-b": sft_request("twin-b"),
                "other-c": sft_request("other-c", seed=31), "other-d": sft_request("other-d", seed=37, epochs=20)}
    for twin in ("twin-a", "twin-b"):
        stack.hold(twin, step=1)
    submitted = {name: stack.submit(body) for name, body in requests.items()}
    assert all(job["status"] == "queued" for job in submitted.values())
    for twin in ("twin-a", "twin-b"):
        stack.wait_held(twin, submitted[twin]["id"])
    for twin in ("twin-a", "twin-b"):
        stack.release(twin)
    return {name: stack.wait(job["id"], lambda j: j["status"] in TERMINAL)
            for name, job in submitted.items()}


def _time(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def checkpoint_verify(stack, basename: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kiln_web.cli", "checkpoint", "verify",
                           str(stack.home / "adapters" / basename)], cwd=ROOT, env=stack.env, capture_output=True,
                          text=True, timeout=120)


def replay_verify(stack, adapter: str) -> subprocess.CompletedProcess:
    script = Path(sys.executable).parent / "kiln-replay"
    argv = [str(script)] if script.exists() else [sys.executable, "-m", "trainer.lineage"]
    return subprocess.run(argv + ["verify", "--adapter", adapter], cwd=ROOT, env=stack.env, capture_output=True,
                          text=True, timeout=60)


def test_four_jobs_run_concurrently_across_both_workers_with_correct_results(cluster, four_jobs):
    stack = cluster.stack
    for name, job in four_jobs.items():
        assert job["status"] == "succeeded", (name, job["error"], cluster.output())
        total = job["progress"]["total_steps"]
        assert job["progress"]["committed_step"] == total == (80 if name == "other-d" else 100)
        assert job["latest_checkpoint"]["complete"] is True and job["latest_checkpoint"]["committed_step"] == total
        assert (stack.home / "adapters" / name / "adapter_model.safetensors").is_file()  # the final PEFT snapshot

    # both workers ran jobs, at the same time
    ran_on = {name: cluster.worker_of(job) for name, job in four_jobs.items()}
    assert set(ran_on.values()) == set(WORKERS), ran_on
    spans = [(cluster.worker_of(job), _time(job["started_at"]), _time(job["finished_at"]))
             for job in four_jobs.values()]
    assert any(a[0] != b[0] and a[1] < b[2] and b[1] < a[2] for a in spans for b in spans), spans

    # fresh-repeat equality across worker processes: the twins started together, so on different workers
    assert ran_on["twin-a"] != ran_on["twin-b"], ran_on
    assert stack.final_bytes(four_jobs["twin-a"]) == stack.final_bytes(four_jobs["twin-b"])
    assert stack.final_bytes(four_jobs["other-c"]) != stack.final_bytes(four_jobs["twin-a"])  # the seed matters

    result = checkpoint_verify(stack, four_jobs["twin-b"]["latest_checkpoint"]["resume_checkpoint"])
    assert result.returncode == 0 and result.stdout.startswith("valid:"), result.stdout + result.stderr
    # the lineage the web process and the workers wrote to the shared data root verifies
    result = replay_verify(stack, "twin-b")
    assert result.returncode == 0 and "4 records, chain intact" in result.stdout, result.stdout + result.stderr
    assert "23 entries, chain intact" in result.stdout  # request, job, 20 checkpoints, final adapter


def test_a_killed_worker_leaves_its_job_lost_and_the_other_resumes_it_byte_identically(cluster, four_jobs):
    stack = cluster.stack
    request = sft_request("killed")  # the request and seed of twin-a
    stack.hold("killed", step=12)
    job = stack.submit(request)
    stack.wait_held("killed", job["id"])
    job = stack.wait(job["id"], lambda j: j["progress"]["committed_step"] == 12)  # a status poll may lag 1 s
    victim = cluster.worker_of(job)
    (survivor,) = set(WORKERS) - {victim}
    cluster.workers[victim].stop(signal.SIGKILL)
    assert job["progress"]["committed_step"] == 12  # mid-run, held

    job = stack.wait(job["id"], lambda j: j["status"] in TERMINAL)
    stack.release("killed")
    assert job["status"] == "lost", job
    assert job["error"]["code"] == "worker_lost" and victim in job["error"]["message"]
    basename = job["latest_checkpoint"]["resume_checkpoint"]
    assert basename in job["error"]["message"]  # the message names the checkpoint to resume from
    assert 10 <= job["latest_checkpoint"]["committed_step"] < 100
    result = checkpoint_verify(stack, basename)  # every file's size and SHA-256
    assert result.returncode == 0 and result.stdout.startswith(f"valid: {basename}"), result.stdout + result.stderr

    request["config"]["resume_checkpoint"] = basename
    resumed = stack.submit(request)
    assert resumed["resume_from"] == basename
    resumed = stack.wait(resumed["id"], lambda j: j["status"] in TERMINAL)
    assert resumed["status"] == "succeeded", (resumed["error"], cluster.output())
    assert cluster.worker_of(resumed) == survivor
    assert resumed["progress"]["committed_step"] == 100
    assert stack.final_bytes(resumed) == stack.final_bytes(four_jobs["twin-a"])

    result = replay_verify(stack, "killed")
    assert result.returncode == 0 and result.stdout.count("chain intact") == 2, result.stdout + result.stderr
