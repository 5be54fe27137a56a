"""Control-plane load on loopback: API pollers and dashboard WebSockets while two kiln-tiny jobs train.

Kiln as deployed on one host, in a temporary KILN_HOME: `kiln up` (uvicorn, --web-processes processes, default one) with REDIS_URL
set (KILN_STATUS_CACHE_SECONDS from --status-cache, default 1 as Kiln's own), two `celery -A kiln_web worker --pool solo` processes (one job each), a redis-server of the bench's
own on a free loopback port, and SQLite or the PostgreSQL named by --database-url (the bench creates a
fresh database there and drops it). Two SFT jobs are submitted and, once both run, for DURATION seconds:

- CLIENTS asyncio HTTP/1.1 keep-alive clients each poll GET /v1/train/jobs/{id} (the status the CLI and
  scripts read) every POLL_INTERVAL seconds, alternating between the two jobs: request throughput,
  latency p50/p95/p99, errors (anything but 200, or no answer);
- SOCKETS dashboard WebSockets, signed in as the admin (half on the jobs list, a quarter on each job's
  page): every `job.event` message carries the time its row was written in the worker; delivery latency
  is the receive time minus that time (same machine, same clock), plus errors (a socket that closes).

Then both jobs are cancelled, every process stopped and every temporary thing removed; the bench ends
by itself after about DURATION + 60 seconds at most. Only 127.0.0.1 is ever contacted.

    python bench/load.py [--duration 30] [--clients 200] [--sockets 100] [--poll-interval 1]
                         [--database-url postgres://postgres@127.0.0.1:5432/postgres] [--web-processes 1]
                         [--json FILE]

Targets: no errors, p95 status latency under 50 ms, p95 event delivery under 250 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from datetime import datetime
from http.cookiejar import CookieJar
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HOST = "127.0.0.1"
TARGETS = {"status_p95_ms": 50.0, "event_p95_ms": 250.0}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


class Child:
    """A child process whose output is collected by a thread (so it never blocks on a full pipe)."""

    def __init__(self, argv: list[str], env: dict):
        self.popen = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True, start_new_session=True)
        self.lines: list[str] = []
        threading.Thread(target=lambda: self.lines.extend(self.popen.stdout), daemon=True).start()

    def wait_for(self, pattern: str, timeout: float) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.lines):
                match = re.search(pattern, line)
                if match:
                    return match
            if self.popen.poll() is not None:
                break
            time.sleep(0.1)
        raise SystemExit(f"{pattern!r} not seen; output:\n{''.join(self.lines)[-3000:]}")

    def stop(self, sig=signal.SIGTERM, timeout: float = 30) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(sig)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()


# -- the deployment --


class Deployment:
    def __init__(self, database_url: str | None, worker_nice: int, status_cache: float, web_processes: int = 1):
        self.home = Path(tempfile.mkdtemp(prefix="kiln-load-home-"))
        self.children: list[Child] = []
        self.database_url, self.database_name = None, None
        if database_url is not None:
            self._create_database(database_url)
        redis_port = free_port()
        self.redis = Child(["redis-server", "--port", str(redis_port), "--bind", HOST, "--save", "",
                            "--appendonly", "no", "--dir", str(self.home)], dict(os.environ))
        self.children.append(self.redis)
        self.redis.wait_for(r"Ready to accept connections", 20)
        self.port = free_port()
        self.url = f"http://{HOST}:{self.port}"
        self.env = {key: value for key, value in os.environ.items() if key not in {"DATABASE_URL", "REDIS_URL"}}
        self.env |= {"KILN_HOME": str(self.home), "REDIS_URL": f"redis://{HOST}:{redis_port}/0",
                     "PYTHONUNBUFFERED": "1", "KILN_TRAINING_QUEUE": "training", "KILN_LOG_LEVEL": "WARNING",
                     "KILN_STATUS_CACHE_SECONDS": str(status_cache)}
        if self.database_url:
            self.env["DATABASE_URL"] = self.database_url
        self.web = Child([sys.executable, "-m", "kiln_web.cli", "up", "--host", HOST, "--port", str(self.port),
                          "--processes", str(web_processes)], self.env)
        self.children.append(self.web)
        self.password = self.web.wait_for(r"admin user 'admin' with password: (\S+)", 180).group(1)
        self.token = self.web.wait_for(r"API token for 'admin': (\S+)", 60).group(1)
        self.web.wait_for(r"Kiln is serving", 60)
        for index in range(2):
            worker = Child(["nice", "-n", str(worker_nice), sys.executable, "-m", "celery", "-A", "kiln_web", "worker", "-Q", "training", "--pool",
                            "solo", "-l", "warning", "-n", f"kiln-load-{index}@%h"], self.env)
            self.children.append(worker)
        for worker in self.children[-2:]:
            self._wait_worker(worker)

    def _wait_worker(self, worker: Child) -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # -l warning prints no "ready"; the banner's last line comes first
            if any("[queues]" in line for line in worker.lines) and worker.popen.poll() is None:
                time.sleep(2.0)
                return
            time.sleep(0.2)
        raise SystemExit("a Celery worker did not start:\n" + "".join(worker.lines)[-3000:])

    def _create_database(self, url: str) -> None:
        import psycopg

        parts = urllib.parse.urlsplit(url)
        if parts.hostname not in ("127.0.0.1", "localhost", "::1"):
            raise SystemExit("--database-url must name a PostgreSQL on loopback (127.0.0.1)")
        self.database_name = f"kiln_load_{secrets.token_hex(4)}"
        with psycopg.connect(url, autocommit=True) as connection:
            connection.execute(f"CREATE DATABASE {self.database_name}")
        self.admin_url = url
        self.database_url = urllib.parse.urlunsplit(parts._replace(path=f"/{self.database_name}"))

    def api(self, method: str, path: str, body: dict | None = None) -> dict:
        request = urllib.request.Request(self.url + path, method=method,
                                         data=json.dumps(body).encode() if body is not None else None,
                                         headers={"Authorization": f"Bearer {self.token}",
                                                  "Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as response:
            return json.loads(response.read())

    def session_cookie(self) -> str:
        """Sign in as the admin through the sign-in form; returns the Cookie header for WebSockets."""
        jar = CookieJar()
        opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(jar))
        opener.open(f"{self.url}/accounts/login/", timeout=30).read()
        csrf = next(cookie.value for cookie in jar if cookie.name == "csrftoken")
        form = urllib.parse.urlencode({"username": "admin", "password": self.password,
                                       "csrfmiddlewaretoken": csrf}).encode()
        opener.open(urllib.request.Request(f"{self.url}/accounts/login/", data=form,
                                           headers={"Referer": f"{self.url}/accounts/login/"}), timeout=30).read()
        cookies = {cookie.name: cookie.value for cookie in jar}
        if "sessionid" not in cookies:
            raise SystemExit("signing in as the admin failed")
        return "; ".join(f"{name}={value}" for name, value in cookies.items())

    def stop(self) -> None:
        for child in reversed(self.children):
            child.stop(signal.SIGINT if child is self.web else signal.SIGTERM)
        if self.database_name is not None:
            import psycopg

            with psycopg.connect(self.admin_url, autocommit=True) as connection:
                connection.execute(f"DROP DATABASE IF EXISTS {self.database_name} WITH (FORCE)")
        shutil.rmtree(self.home, ignore_errors=True)


def job_request(adapter: str, epochs: int, accumulation: int) -> dict:
    words = ("kiln", "clay", "glaze", "fire")
    data = [{"messages": [{"role": "user", "content": f"Say {word}, and describe it at length."},
                          {"role": "assistant", "content": f"{word.upper()}! " * 24}]} for word in words]
    return {"data": data, "config": {"output_name": adapter, "epochs": epochs, "checkpoint_interval": 5, "seed": 7,
                                     "batch_size": 4, "gradient_accumulation_steps": accumulation}}


# -- the load --


async def poller(port: int, token: str, paths: list[str], interval: float, deadline: float, stats: dict,
                 offset: float) -> None:
    """One API client on one keep-alive connection, polling PATHS in turn every INTERVAL seconds."""
    await asyncio.sleep(offset)
    reader = writer = None
    turn = 0
    while time.monotonic() < deadline:
        started = time.monotonic()
        path = paths[turn % len(paths)]
        turn += 1
        try:
            if writer is None:
                reader, writer = await asyncio.open_connection(HOST, port)
            writer.write(f"GET {path} HTTP/1.1\r\nHost: {HOST}:{port}\r\nAuthorization: Bearer {token}\r\n"
                         "Accept: application/json\r\n\r\n".encode())
            await writer.drain()
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            status = int(head.split(b" ", 2)[1])
            length = int(re.search(rb"(?i)content-length:\s*(\d+)", head).group(1))
            body = await asyncio.wait_for(reader.readexactly(length), 10)
            latency = time.monotonic() - started
            if status != 200 or b'"status"' not in body:
                stats["errors"].append(f"HTTP {status}")
            else:
                stats["latencies"].append(latency)
            if re.search(rb"(?i)connection:\s*close", head):
                writer.close()
                reader = writer = None
        except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, ValueError, AttributeError) as exc:
            stats["errors"].append(f"{type(exc).__name__}: {exc}")
            if writer is not None:
                writer.close()
            reader = writer = None
        await asyncio.sleep(max(0.0, interval - (time.monotonic() - started)))
    if writer is not None:
        writer.close()


async def listener(port: int, path: str, cookie: str, deadline: float, stats: dict, opened: asyncio.Event) -> None:
    """One dashboard WebSocket: counts messages and times each job.event from its row's time."""
    from websockets.asyncio.client import connect
    from websockets.exceptions import WebSocketException

    try:
        async with connect(f"ws://{HOST}:{port}{path}", additional_headers={"Cookie": cookie},
                           origin=f"http://{HOST}:{port}", open_timeout=30, ping_interval=None) as websocket:
            stats["connected"] += 1
            if stats["connected"] == stats["wanted"]:
                opened.set()
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return
                try:
                    raw = await asyncio.wait_for(websocket.recv(), remaining)
                except asyncio.TimeoutError:
                    return
                received = time.time()
                message = json.loads(raw)
                stats["messages"][message.get("type")] = stats["messages"].get(message.get("type"), 0) + 1
                if message.get("type") == "job.event" and stats["measuring"]:
                    sent = datetime.fromisoformat(message["time"].replace("Z", "+00:00")).timestamp()
                    stats["delivery"].append(received - sent)
    except (OSError, WebSocketException, asyncio.TimeoutError) as exc:
        stats["errors"].append(f"{path}: {type(exc).__name__}: {exc}")


async def load(deployment: Deployment, jobs: list[str], args) -> dict:
    cookie = deployment.session_cookie()
    paths = ["/ws/jobs/"] * (args.sockets - args.sockets // 2)
    paths += [f"/ws/jobs/{jobs[index % 2]}/" for index in range(args.sockets // 2)]
    sockets = {"connected": 0, "wanted": len(paths), "messages": {}, "delivery": [], "errors": [],
               "measuring": False}
    opened = asyncio.Event()
    listen_deadline = time.monotonic() + args.duration + 60
    listeners = [asyncio.create_task(listener(deployment.port, path, cookie, listen_deadline, sockets, opened))
                 for path in paths]
    await asyncio.wait_for(opened.wait(), 60)
    sockets["measuring"] = True
    polls = {"latencies": [], "errors": []}
    started = time.monotonic()
    deadline = started + args.duration
    job_paths = [f"/v1/train/jobs/{job}" for job in jobs]
    await asyncio.gather(*[poller(deployment.port, deployment.token, job_paths[index % 2:] + job_paths[:index % 2],
                                  args.poll_interval, deadline, polls, args.poll_interval * index / args.clients)
                           for index in range(args.clients)])
    elapsed = time.monotonic() - started
    sockets["measuring"] = False
    for task in listeners:
        task.cancel()
    await asyncio.gather(*listeners, return_exceptions=True)
    return {"polls": polls, "sockets": sockets, "elapsed": elapsed}


def milliseconds(value: float | None) -> float | None:
    return None if value is None else round(value * 1000, 1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=30.0, help="seconds of measured load (default 30)")
    parser.add_argument("--clients", type=int, default=200, help="concurrent API pollers (default 200)")
    parser.add_argument("--sockets", type=int, default=100, help="open dashboard WebSockets (default 100)")
    parser.add_argument("--poll-interval", type=float, default=1.0,
                        help="seconds between one client's polls (default 1, as `kiln train ... --follow` polls)")
    parser.add_argument("--epochs", type=int, default=400, help="of each job's 4 records: long enough to outlast "
                                                                "the load; both are cancelled at the end")
    parser.add_argument("--accumulation", type=int, default=16,
                        help="micro-batches of 4 per optimizer step: kiln-tiny steps at a pace a real base "
                             "would (a few a second) instead of hundreds, so events arrive at a realistic rate")
    parser.add_argument("--worker-nice", type=int, default=10,
                        help="the Celery workers' nice level: training yields the CPU to the web process, as "
                             "workers on machines of their own would (0: compete as equals)")
    parser.add_argument("--database-url", default=None, help="a loopback PostgreSQL server to create a "
                                                             "database in (default: SQLite in KILN_HOME)")
    parser.add_argument("--status-cache", type=float, default=1.0,
                        help="KILN_STATUS_CACHE_SECONDS for the web process (default 1; 0: every poll through Django)")
    parser.add_argument("--web-processes", type=int, default=1,
                        help="kiln up --processes: web processes sharing the port (default 1)")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args()
    if shutil.which("redis-server") is None:
        raise SystemExit("redis-server is needed: apt-get install redis-server")

    deployment = Deployment(args.database_url, args.worker_nice, args.status_cache, args.web_processes)
    try:
        jobs = [deployment.api("POST", "/v1/train/sft", job_request(f"load-{index}", args.epochs,
                                                                    args.accumulation))["id"] for index in range(2)]
        deadline = time.monotonic() + 120
        while any(deployment.api("GET", f"/v1/train/jobs/{job}")["status"] != "running" for job in jobs):
            if time.monotonic() > deadline:
                raise SystemExit("the two jobs did not both start running")
            time.sleep(0.2)
        before = {job: deployment.api("GET", f"/v1/train/jobs/{job}")["progress"]["committed_step"] for job in jobs}
        result = asyncio.run(load(deployment, jobs, args))
        after = {job: deployment.api("GET", f"/v1/train/jobs/{job}") for job in jobs}
        for job in jobs:
            if after[job]["status"] in ("running", "queued"):
                deployment.api("POST", f"/v1/train/jobs/{job}/cancel")
    finally:
        deployment.stop()
        errors = [line for line in deployment.web.lines if "Error" in line or "error" in line]
        if errors:
            log = Path(tempfile.mkstemp(prefix="kiln-load-web-", suffix=".log")[1])
            log.write_text("".join(deployment.web.lines))
            print(f"web process errors (last 5 kinds; its whole output is in {log}):", *sorted(set(errors))[-5:],
                  sep="\n  ", file=sys.stderr)

    polls, sockets = result["polls"], result["sockets"]
    latencies, delivery = polls["latencies"], sockets["delivery"]
    report = {
        "setup": {"web": f"kiln up (uvicorn, {args.web_processes} process{'es' if args.web_processes > 1 else ''}) "
                         "with REDIS_URL",
                  "status_cache_s": args.status_cache,
                  "workers": f"2 x celery --pool solo, nice {args.worker_nice}",
                  "database": "postgresql" if args.database_url else "sqlite", "clients": args.clients,
                  "sockets": args.sockets, "poll_interval_s": args.poll_interval,
                  "duration_s": round(result["elapsed"], 1), "cpus": os.cpu_count()},
        "status_requests": {"count": len(latencies), "throughput_rps": round(len(latencies) / result["elapsed"], 1),
                            "p50_ms": milliseconds(percentile(latencies, 50)),
                            "p95_ms": milliseconds(percentile(latencies, 95)),
                            "p99_ms": milliseconds(percentile(latencies, 99)),
                            "max_ms": milliseconds(max(latencies) if latencies else None),
                            "errors": len(polls["errors"]), "error_kinds": sorted(set(polls["errors"]))[:5]},
        "websockets": {"connected": sockets["connected"], "messages": sockets["messages"],
                       "event_samples": len(delivery),
                       "delivery_p50_ms": milliseconds(percentile(delivery, 50)),
                       "delivery_p95_ms": milliseconds(percentile(delivery, 95)),
                       "delivery_p99_ms": milliseconds(percentile(delivery, 99)),
                       "errors": len(sockets["errors"]), "error_kinds": sorted(set(sockets["errors"]))[:5]},
        "training": {job: {"steps_during_load": after[job]["progress"]["committed_step"] - before[job],
                           "status": after[job]["status"]} for job in jobs},
    }
    report["targets"] = {
        "no_errors": report["status_requests"]["errors"] == 0 and report["websockets"]["errors"] == 0,
        "status_p95_under_50_ms": (report["status_requests"]["p95_ms"] or 1e9) < TARGETS["status_p95_ms"],
        "event_p95_under_250_ms": (report["websockets"]["delivery_p95_ms"] or 1e9) < TARGETS["event_p95_ms"],
    }
    print(json.dumps(report, indent=2))
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0 if all(report["targets"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
