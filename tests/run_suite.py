"""The whole test suite as `./dev test` runs it: private services, two passes, one line per pass, a verdict.

    python tests/run_suite.py [--postgresql-paths P[,P...]] [pytest options] [paths]

1. Starts a redis-server and a PostgreSQL cluster of this run's own on free loopback ports
   (tests/private_services.py); the machine's own services, their configuration and ports are never used.
2. The main pass: pytest over ARGS (the whole suite by default) on SQLite, with the private Redis
   (KILN_TEST_REDIS_URL) and the private PostgreSQL server (KILN_TEST_DATABASE_URL) for the tests that
   need them as a server.
3. The PostgreSQL pass, when no paths were named (or on --postgresql-paths): the control-plane, serving and
   evaluation tests again, slow end-to-end tests with the real trainer included, with PostgreSQL as Kiln's
   database.
4. One line per pass (database, Redis, Chromium, counts, wall time), the reasons of every skip, then a
   closing `total:` line. Exit 1 when a pass failed, when PostgreSQL is installed but its pass could not
   run, or when the PostgreSQL pass skipped any test but the GPU half of a CUDA test on a machine without a GPU.

Stdlib only; it runs in the project's venv so that pytest is the venv's.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from private_services import PrivatePostgres, PrivateRedis, postgres_bindir

ROOT = Path(__file__).resolve().parents[1]
POSTGRESQL_PATHS = ("tests/controlplane", "tests/serving", "tests/evals")  # every test of Kiln's own database
CHROMIUM = Path(os.environ.get("KILN_TEST_CHROMIUM", "/usr/bin/chromium"))
SERVICE_VARIABLES = {"DATABASE_URL", "REDIS_URL", "DJANGO_SETTINGS_MODULE", "KILN_TEST_DATABASE_URL",
                     "KILN_TEST_REDIS_URL", "KILN_TEST_REPORT"}


def say(message: str) -> None:
    print(f"dev: {message}", file=sys.stderr, flush=True)


@dataclass
class Pass:
    name: str
    database: str
    args: list[str]
    env: dict[str, str]
    report: dict = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def counts(self) -> dict:
        return self.report.get("counts", {})

    @property
    def failed(self) -> bool:
        return self.report.get("exitstatus", 1) != 0

    def run(self, scratch: Path) -> None:
        report_path = scratch / f"{self.name}.json"
        env = {key: value for key, value in os.environ.items() if key not in SERVICE_VARIABLES}
        env |= self.env | {"KILN_TEST_REPORT": str(report_path)}
        say(f"{self.name} pass: pytest {' '.join(self.args)}")
        started = time.monotonic()
        code = subprocess.run([sys.executable, "-m", "pytest", *self.args], cwd=ROOT, env=env).returncode
        self.seconds = time.monotonic() - started
        try:
            self.report = json.loads(report_path.read_text())
        except (OSError, ValueError):  # pytest died before its session ended
            self.report = {"exitstatus": code or 1, "counts": {}, "skips": {}, "browser_passed": 0}
        self.report["exitstatus"] = code

    def line(self, redis: str) -> str:
        counts = self.counts
        browser = (f"Chromium used ({self.report.get('browser_passed', 0)} browser tests)"
                   if self.report.get("browser_passed") else "Chromium not used")
        errors = f", {counts['errors']} errors" if counts.get("errors") else ""
        return (f"{self.name} pass: {self.database}; {redis}; {browser}: {counts.get('passed', 0)} passed, "
                f"{counts.get('failed', 0)} failed{errors}, {counts.get('skipped', 0)} skipped "
                f"in {self.seconds:.0f} s (pytest exit {self.report.get('exitstatus')})")


def names_paths(args: list[str]) -> bool:
    """True when ARGS name a test path (the user runs part of the suite)."""
    return any(not arg.startswith("-") and (ROOT / arg.split("::")[0]).exists() for arg in args)


def options_only(args: list[str]) -> list[str]:
    return [arg for arg in args if arg.startswith("-") or not (ROOT / arg.split("::")[0]).exists()]


# the skips the PostgreSQL pass may take, for hardware this machine lacks: the GPU half of a CUDA test without a GPU
# (tests/engine/conftest.py's lib and cuda_environment say this, with the loader's reason), and a bfloat16-route
# test on a CPU without BF16 instructions (native_ext.onednn's reason; a missing library is no such reason)
HARDWARE_SKIP = ("no usable GPU:", "no bfloat16 route here: this CPU has no BF16")


def judge(passes: list[Pass], problems: list[str]) -> list[str]:
    """PROBLEMS plus every failed pass and every skip of the PostgreSQL pass: the reasons to exit 1."""
    problems = list(problems)
    for each in passes:
        if each.failed:
            problems.append(f"the {each.name} pass failed (pytest exit {each.report.get('exitstatus')})")
    postgresql = next((each for each in passes if each.name == "postgresql"), None)
    if postgresql is not None:
        hardware = sum(count for reason, count in postgresql.report.get("skips", {}).items()
                       if reason.startswith(HARDWARE_SKIP))
        skipped = postgresql.counts.get("skipped", 0) - hardware
        if skipped:
            problems.append(f"the PostgreSQL pass skipped {skipped} tests it must run (reasons above)")
    return problems


def split_args(args: list[str]) -> tuple[list[str], list[str] | None]:
    """(pytest args, the PostgreSQL pass's paths when --postgresql-paths names them)."""
    rest, paths = [], None
    iterator = iter(args)
    for arg in iterator:
        if arg == "--postgresql-paths":
            paths = next(iterator, "").split(",")
        elif arg.startswith("--postgresql-paths="):
            paths = arg.split("=", 1)[1].split(",")
        else:
            rest.append(arg)
    return rest, paths


def _stop_on_signal(signum, _frame) -> None:
    """SIGTERM or SIGHUP (a cancelled CI job, a closed terminal) ends the run as Ctrl-C does: the pytest pass in
    flight is killed and the finally in main stops the private services (Python's default would leave them)."""
    raise SystemExit(128 + signum)


def main(argv: list[str]) -> int:
    for each in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(each, _stop_on_signal)
    args, postgresql_paths = split_args(argv)
    scratch = Path(tempfile.mkdtemp(prefix="kiln-suite-"))
    redis = postgres = None
    problems: list[str] = []
    try:
        try:
            redis = PrivateRedis(scratch)
            redis_line = f"Redis {redis.version()} (private, 127.0.0.1:{redis.port})"
        except RuntimeError as exc:
            redis_line = f"no Redis ({exc})"
            say(f"{exc}: the tests that need Redis skip")
        bindir = postgres_bindir()
        postgres_line = "PostgreSQL is not installed (apt-get install postgresql): its pass does not run"
        if bindir is not None:
            try:
                postgres = PrivatePostgres()
                postgres_line = f"PostgreSQL {postgres.version()} (private cluster, 127.0.0.1:{postgres.port})"
            except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
                postgres_line = f"PostgreSQL's private cluster did not start: {exc}"
                problems.append(f"PostgreSQL is installed ({bindir}) but its pass cannot run: {exc}")
        say(f"services: {redis_line}; {postgres_line}")

        services = {}
        if redis is not None:
            services["KILN_TEST_REDIS_URL"] = redis.url(0)
        if postgres is not None:
            services["KILN_TEST_DATABASE_URL"] = postgres.url("postgres")
        passes = [Pass("sqlite", "SQLite", args, services)]
        if postgres is not None and (postgresql_paths or not names_paths(args)):
            paths = postgresql_paths or list(POSTGRESQL_PATHS)
            passes.append(Pass("postgresql", postgres_line, [*options_only(args), *paths],
                               services | {"DATABASE_URL": postgres.url("kiln_suite")}))
            if redis is not None:
                passes[-1].env["KILN_TEST_REDIS_URL"] = redis.url(2)
        elif postgres is not None:
            postgres_line = "PostgreSQL pass not run: test paths were named"

        for each in passes:
            each.run(scratch)
    finally:
        if redis is not None:
            redis.stop()
        if postgres is not None:
            postgres.destroy()
        shutil.rmtree(scratch, ignore_errors=True)

    for each in passes:
        say(each.line(redis_line))
        for reason, count in sorted(each.report.get("skips", {}).items()):
            say(f"  skipped {count}: {reason}")
    if len(passes) == 1:
        say(postgres_line)
    problems = judge(passes, problems)
    for problem in problems:
        say(f"FAILED: {problem}")
    total = {key: sum(each.counts.get(key, 0) for each in passes) for key in ("passed", "failed", "errors", "skipped")}
    total["failed"] += total.pop("errors")
    print(f"total: {total['passed']} passed, {total['failed']} failed, {total['skipped']} skipped", flush=True)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
