"""`./dev test`'s runner (tests/run_suite.py): its PostgreSQL pass uses a private cluster, never the machine's,
and it fails, naming the reason, when PostgreSQL is installed but its pass could not run or skipped tests; a
terminated run stops what it started."""

import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest

import run_suite
from private_services import PrivatePostgres, postgres_bindir

pytestmark = pytest.mark.skipif(postgres_bindir() is None,
                                reason="PostgreSQL's server is not installed (apt-get install postgresql)")


@pytest.fixture(scope="module")
def debian_like_cluster():
    """A cluster configured as a stock Debian one is: scram-sha-256 on 127.0.0.1, no database `test`."""
    cluster = PrivatePostgres(auth="scram-sha-256", password="the-machine-secret")
    try:
        yield cluster
    finally:
        cluster.destroy()


@pytest.mark.slow
def test_the_postgresql_pass_runs_every_test_whatever_the_machine_cluster_is(debian_like_cluster):
    import psycopg

    machine = debian_like_cluster
    with pytest.raises(psycopg.OperationalError, match="password"):  # as Debian answers a passwordless login
        psycopg.connect(f"postgres://kiln@127.0.0.1:{machine.port}/postgres", connect_timeout=5).close()
    with psycopg.connect(machine.url("postgres"), connect_timeout=5) as connection:
        assert connection.execute("SELECT 1 FROM pg_database WHERE datname = 'test'").fetchone() is None
    # a user's environment that points every PostgreSQL client at the machine's cluster
    env = {key: value for key, value in os.environ.items() if key not in run_suite.SERVICE_VARIABLES}
    env |= {"PGHOST": "127.0.0.1", "PGPORT": str(machine.port), "PGUSER": "postgres", "PGDATABASE": "test",
            "PGPASSWORD": "wrong", "DATABASE_URL": f"postgres://postgres@127.0.0.1:{machine.port}/test"}
    result = subprocess.run(
        [sys.executable, "tests/run_suite.py", "-q", "-p", "no:cacheprovider", "tests/web/test_health.py",
         "--postgresql-paths", "tests/controlplane/test_jobs.py"],
        cwd=run_suite.ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    line = next(line for line in result.stderr.splitlines() if line.startswith("dev: postgresql pass: PostgreSQL"))
    assert "private cluster" in line and f":{machine.port})" not in line, line
    assert " 0 failed, 0 skipped" in line, line  # the PostgreSQL-only claim race ran
    assert result.stdout.splitlines()[-1].startswith("total: ")


def _refused(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) != 0


@pytest.mark.slow
def test_a_terminated_run_stops_its_services_and_its_pass(tmp_path):
    """A cancelled CI job sends SIGTERM: the runner kills the pytest pass in flight and stops its private Redis and
    PostgreSQL, as at a normal end. The pass here is one test that blocks until released, so the signal surely
    lands while it runs."""
    started, release = tmp_path / "started", tmp_path / "release"
    blocker = tmp_path / "test_blocks.py"
    blocker.write_text(textwrap.dedent(f"""
        import os
        import time
        from pathlib import Path

        def test_blocks():
            Path({str(started)!r}).write_text(str(os.getpid()))
            while not Path({str(release)!r}).exists():
                time.sleep(0.05)
    """))
    env = {key: value for key, value in os.environ.items() if key not in run_suite.SERVICE_VARIABLES}
    runner = subprocess.Popen([sys.executable, "tests/run_suite.py", "-q", "-p", "no:cacheprovider", str(blocker)],
                              cwd=run_suite.ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True)
    lines = []
    reader = threading.Thread(target=lambda: lines.extend(runner.stdout), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 600  # a bound on a broken runner, not a window the test relies on
        while not started.exists():
            assert runner.poll() is None and time.monotonic() < deadline, "".join(lines)[-3000:]
            time.sleep(0.05)
        runner.send_signal(signal.SIGTERM)
        assert runner.wait(timeout=120) == 128 + signal.SIGTERM
    finally:
        release.touch()
        if runner.poll() is None:
            runner.kill()
            runner.wait(timeout=120)
        reader.join(timeout=120)
    services = next(line for line in lines if line.startswith("dev: services:"))
    redis = int(re.search(r"Redis \S+ \(private, 127\.0\.0\.1:(\d+)\)", services).group(1))
    postgres = int(re.search(r"private cluster, 127\.0\.0\.1:(\d+)\)", services).group(1))
    assert _refused(redis) and _refused(postgres), services
    with pytest.raises(ProcessLookupError):  # the pass was killed, not left running
        os.kill(int(started.read_text()), 0)
    assert not any(line.startswith("total:") for line in lines)  # no verdict for a run that did not finish


def fake_pass(name: str, exitstatus: int = 0, skips=None, **counts) -> run_suite.Pass:
    done = run_suite.Pass(name, name, [], {})
    done.report = {"exitstatus": exitstatus, "counts": {"passed": 3, **counts}, "skips": skips or {}}
    return done


def test_a_skip_in_the_postgresql_pass_fails_the_run_and_says_why():
    assert run_suite.judge([fake_pass("sqlite", skipped=1), fake_pass("postgresql")], []) == []
    problems = run_suite.judge([fake_pass("sqlite"), fake_pass("postgresql", skipped=2)], [])
    assert problems == ["the PostgreSQL pass skipped 2 tests it must run (reasons above)"]
    no_gpu = "no usable GPU: the CUDA driver (libcuda.so.1) is not installed"
    hardware = fake_pass("postgresql", skipped=3, skips={no_gpu: 3})  # the GPU halves on a machine without one
    assert run_suite.judge([fake_pass("sqlite"), hardware], []) == []
    mixed = fake_pass("postgresql", skipped=4, skips={no_gpu: 3, "KILN_TEST_REDIS_URL is unset": 1})
    assert run_suite.judge([fake_pass("sqlite"), mixed], []) == [
        "the PostgreSQL pass skipped 1 tests it must run (reasons above)"]
    no_bf16 = "no bfloat16 route here: this CPU has no BF16 dot-product instructions (avx512_bf16 or amx_bf16)"
    missing = "no bfloat16 route here: the oneDNN library libdnnl.so.3 is not installed"  # an install fault
    cpu = fake_pass("postgresql", skipped=3, skips={no_bf16: 1, missing: 2})
    assert run_suite.judge([fake_pass("sqlite"), cpu], []) == [
        "the PostgreSQL pass skipped 2 tests it must run (reasons above)"]
    assert run_suite.judge([fake_pass("sqlite", exitstatus=1, failed=1)], []) == [
        "the sqlite pass failed (pytest exit 1)"]


def test_postgresql_installed_but_its_cluster_not_starting_fails_the_run(monkeypatch, capsys):
    def refuse():
        raise RuntimeError("initdb failed (1): no space left")

    ran = []
    monkeypatch.setattr(run_suite, "PrivatePostgres", refuse)
    monkeypatch.setattr(run_suite.Pass, "run", lambda self, scratch: (ran.append(self.name),
                                                                       setattr(self, "report", {"exitstatus": 0})))
    assert run_suite.main(["-q"]) == 1
    assert ran == ["sqlite"]
    err = capsys.readouterr().err
    assert "FAILED: PostgreSQL is installed" in err and "initdb failed (1): no space left" in err


def test_named_paths_run_one_pass_unless_postgresql_paths_are_named():
    assert run_suite.names_paths(["-q", "tests/web/test_health.py::test_x"])
    assert not run_suite.names_paths(["-q", "-k", "not slow"])
    assert run_suite.split_args(["-q", "--postgresql-paths", "tests/a,tests/b", "-x"]) == (
        ["-q", "-x"], ["tests/a", "tests/b"])
    assert run_suite.options_only(["-q", "tests/web", "-k", "health"]) == ["-q", "-k", "health"]


def test_the_runtime_install_has_no_test_tooling():
    """`./dev up` installs `.` (the runtime), `./dev test` `.[test]`; torch and the other reference libraries
    are test extras only, so a server's venv holds none of them."""
    import re
    import tomllib

    project = tomllib.loads((run_suite.ROOT / "pyproject.toml").read_text())["project"]
    runtime = {re.split(r"[\[<>=;! ]", requirement, maxsplit=1)[0].lower() for requirement in project["dependencies"]}
    test_only = {"torch", "transformers", "peft", "bitsandbytes", "playwright", "pytest"}
    assert runtime & test_only == set()
    extras = {re.split(r"[\[<>=;! ]", r, maxsplit=1)[0].lower() for r in project["optional-dependencies"]["test"]}
    assert test_only <= extras
    dev = (run_suite.ROOT / "dev").read_text()
    assert re.search(r"cmd_up\(\) \{\n    ensure_venv runtime\n", dev)
    assert 'target=".[test]"' in dev and re.search(r"cmd_test\(\) \{\n    ensure_venv test\n", dev)
