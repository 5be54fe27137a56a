"""Services of the test run's own: a redis-server and a PostgreSQL cluster on free loopback ports in temporary
folders, started and removed by whoever made them (tests/run_suite.py for the whole suite, tests/faults for
restart faults). Neither reads nor needs the machine's own services, their configuration or their ports.

PostgreSQL is a fresh cluster made with initdb (trust authentication for a role of its own, `kiln`), run with
pg_ctl; as root it runs as an unprivileged OS user (`postgres` when it exists, else `kiln-pg`, created),
since PostgreSQL refuses to run as root. Stdlib only: the suite runner imports this before pytest starts.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

ROLE = "kiln"  # the private cluster's superuser; trust authentication, so no password
SERVICE_USER = "kiln-pg"  # the OS user a root test run creates to run PostgreSQL when there is no `postgres`


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_port(port: int, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{what} did not open port {port} within {timeout:g} s")


class PrivateRedis:
    """redis-server on a free loopback port, without persistence: a restart loses whatever it held."""

    def __init__(self, directory: Path):
        self.program = shutil.which("redis-server")
        if self.program is None:
            raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
        self.directory, self.port = Path(directory), free_port()
        self.process: subprocess.Popen | None = None
        self.start()

    def url(self, database: int = 0) -> str:
        return f"redis://127.0.0.1:{self.port}/{database}"

    def version(self) -> str:
        out = subprocess.run([self.program, "--version"], capture_output=True, text=True).stdout
        return next((part[2:] for part in out.split() if part.startswith("v=")), "?")

    def start(self) -> None:
        self.process = subprocess.Popen(
            [self.program, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.directory), "--protected-mode", "yes", "--maxclients", "4000"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        wait_port(self.port, 20, "redis-server")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()  # a crash: nothing is saved
            self.process.wait(10)

    def restart(self, down_seconds: float = 0.0) -> None:
        self.stop()
        time.sleep(down_seconds)
        self.start()


def postgres_bindir() -> Path | None:
    """The newest installed PostgreSQL server's bin folder (Debian's layout, else pg_config's), or None."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(Path(p).parts[-3]))
    if found:
        return Path(found[-1]).parent
    pg_config = shutil.which("pg_config")
    if pg_config:
        bindir = Path(subprocess.run([pg_config, "--bindir"], capture_output=True, text=True).stdout.strip())
        if (bindir / "initdb").exists() and (bindir / "pg_ctl").exists():
            return bindir
    return None


def _service_user() -> pwd.struct_passwd:
    """The unprivileged OS user that runs PostgreSQL for a root test run; `kiln-pg` is created when needed."""
    for name in ("postgres", SERVICE_USER):
        try:
            return pwd.getpwnam(name)
        except KeyError:
            continue
    result = subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", SERVICE_USER],
                            capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"running as root and no unprivileged user can run PostgreSQL: useradd {SERVICE_USER} "
                           f"failed: {result.stderr.strip()}")
    return pwd.getpwnam(SERVICE_USER)


class PrivatePostgres:
    """A PostgreSQL cluster of its own (initdb) on a free loopback port, stopped and started with pg_ctl.

    `auth` and `password` exist so that a test can also make a cluster configured like a stock Debian one
    (scram-sha-256, no `test` database) and show the suite does not depend on it."""

    def __init__(self, auth: str = "trust", password: str | None = None, durable: bool = False):
        bindir = postgres_bindir()
        if bindir is None:
            raise RuntimeError("PostgreSQL's server (initdb, pg_ctl) is not installed (apt-get install postgresql)")
        self.bin = bindir
        self.as_user = _service_user() if os.geteuid() == 0 else None
        self.directory = Path(tempfile.mkdtemp(prefix="kiln-test-pg-"))
        if self.as_user is not None:
            os.chown(self.directory, self.as_user.pw_uid, self.as_user.pw_gid)
        self.data = self.directory / "data"
        self.port = free_port()
        self.password = password
        self.durable = durable
        try:
            args = ["-D", str(self.data), "-U", ROLE, f"--auth={auth}", "-E", "UTF8", "--locale=C", "--no-sync"]
            if password is not None:
                secret = self.directory / "pwfile"
                secret.write_text(password + "\n")
                if self.as_user is not None:
                    os.chown(secret, self.as_user.pw_uid, self.as_user.pw_gid)
                args.append(f"--pwfile={secret}")
            self._run("initdb", *args)
            self.start()
        except BaseException:
            shutil.rmtree(self.directory, ignore_errors=True)
            raise

    def url(self, database: str = "postgres") -> str:
        secret = f":{self.password}" if self.password is not None else ""
        return f"postgres://{ROLE}{secret}@127.0.0.1:{self.port}/{database}"

    def version(self) -> str:
        out = subprocess.run([str(self.bin / "postgres"), "--version"], capture_output=True, text=True).stdout
        words = out.split()  # postgres (PostgreSQL) 15.20 (Debian 15.20-0+deb12u1)
        return words[2] if len(words) > 2 else "?"

    def _run(self, program: str, *args: str, timeout: float = 120) -> None:
        argv = [str(self.bin / program), *args]
        if self.as_user is not None:
            argv = ["runuser", "-u", self.as_user.pw_name, "--", *argv]
        env = {key: value for key, value in os.environ.items() if not key.startswith("PG")}  # no PGHOST etc.
        result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=self.directory, env=env)
        if result.returncode != 0:
            raise RuntimeError(f"{program} failed ({result.returncode}): {(result.stderr or result.stdout)[-2000:]}")

    def _ctl(self, action: str, *extra: str) -> None:
        options = f"-p {self.port} -k {self.directory} -c listen_addresses=127.0.0.1 -c max_connections=300"
        if not self.durable:  # a test cluster: nothing needs to survive a power cut
            options += " -c fsync=off -c synchronous_commit=off -c full_page_writes=off"
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.directory / "log"), "-o", options, "-w",
                  "-t", "60", *extra, action)

    def start(self) -> None:
        self._ctl("start")

    def stop(self) -> None:
        self._ctl("stop", "-m", "immediate")  # a crash: connections drop at once

    def restart(self, down_seconds: float = 0.0) -> None:
        self.stop()
        time.sleep(down_seconds)
        self.start()

    def destroy(self) -> None:
        try:
            self.stop()
        except (RuntimeError, subprocess.TimeoutExpired):
            pass
        shutil.rmtree(self.directory, ignore_errors=True)
