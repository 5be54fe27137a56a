"""The hostile-input suites' shared bounds: per-case time and memory, case counts, a summary line.

Every property runs its cases through `fuzz.case(loader, property)`, which times the case,
optionally traces its memory, and counts it once its assertions have passed. Each property
asserts its own floor with `fuzz.floor(...)`, and the terminal summary prints the totals:
"fuzz: N riftckpt cases, M kiln-checkpoint cases, all refused correctly". `fuzz.atheris(...)`
runs the coverage-guided harness (atheris_loaders.py) for a bounded number of inputs.
"""

import contextlib
import importlib.util
import os
import re
import signal
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path
from collections import Counter
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, settings

CASE_SECONDS = 2.0  # CPU seconds of one hostile load (and restore); a real tiny checkpoint takes milliseconds.
# CPU time, not wall time: another process's load on a busy machine must not fail a case (HANG_SECONDS, a wall
# clock alarm, still ends one that never finishes)
ATHERIS_SLOWEST_SECONDS = 10  # wall seconds (libFuzzer counts whole ones) of the slowest atheris input: 5x CASE_SECONDS
HANG_SECONDS = 30  # wall seconds (at least 5x a case's CPU bound) past which a case is interrupted and fails, so a
# hang cannot stall the suite; generous, as a case on a loaded machine gets a fraction of a core
LOADERS = {"riftckpt": "riftckpt", "kiln": "kiln-checkpoint"}  # log key: name in the summary
HARNESS = Path(__file__).with_name("atheris_loaders.py")
REPOSITORY = Path(__file__).resolve().parents[2]

_LOG = pytest.StashKey["FuzzLog"]()


@dataclass
class FuzzLog:
    """Cases that passed, per (loader, property) and per outcome, with the worst time and memory."""

    cases: Counter = field(default_factory=Counter)  # (loader, property) -> cases
    outcomes: Counter = field(default_factory=Counter)  # (loader, outcome) -> cases
    slowest: float = 0.0  # seconds of the slowest case
    peak: int = 0  # bytes: the largest traced peak of a memory-bounded case

    @staticmethod
    def settings(max_examples: int) -> settings:
        """Bounded and reproducible: the same examples on every run, no example database."""
        return settings(max_examples=max_examples, deadline=None, derandomize=True, database=None,
                        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                               HealthCheck.filter_too_much,
                                               HealthCheck.function_scoped_fixture])

    @contextlib.contextmanager
    def case(self, loader: str, prop: str, memory_bytes: int | None = None, cpu_seconds: float = CASE_SECONDS):
        """Time one case (and trace its memory); count it only if the body's assertions passed.

        The body may set `outcome["kind"]` ("refused" unless it says otherwise). `cpu_seconds` bounds a case
        whose legitimate work grows with its input (CASE_SECONDS unless the property sizes it).
        """
        assert loader in LOADERS, loader
        outcome = {"kind": "refused"}

        hang_seconds = max(HANG_SECONDS, 5 * int(cpu_seconds + 1))

        def hang(signum, frame):
            raise AssertionError(f"{loader} {prop}: a case still ran after {hang_seconds} s")

        previous = signal.signal(signal.SIGALRM, hang)
        signal.alarm(hang_seconds)
        if memory_bytes is not None:
            tracemalloc.start()
        started = time.process_time()
        try:
            yield outcome
            elapsed = time.process_time() - started
            peak = tracemalloc.get_traced_memory()[1] if memory_bytes is not None else 0
        finally:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, previous)
            if memory_bytes is not None:
                tracemalloc.stop()
        assert elapsed < cpu_seconds, f"{loader} {prop}: one case took {elapsed:.2f} s of CPU (bound {cpu_seconds} s)"
        if memory_bytes is not None:
            assert peak < memory_bytes, f"{loader} {prop}: peak {peak} bytes >= {memory_bytes}"
        self.cases[loader, prop] += 1
        self.outcomes[loader, outcome["kind"]] += 1
        self.slowest = max(self.slowest, elapsed)
        self.peak = max(self.peak, peak)

    def atheris(self, loader: str, target: str, scratch: Path, corpus: Path, runs: int) -> int:
        """Run the libFuzzer harness over `runs` inputs from the seeds in `corpus`; count them.

        libFuzzer fails the run on any exception other than CheckpointError (MemoryError included)
        and on an input running past HANG_SECONDS. Its slowest input must take under ATHERIS_SLOWEST_SECONDS:
        libFuzzer times inputs in whole wall-clock seconds, which another process's load stretches. Memory is
        bounded to 2 GiB of heap and private mappings by RLIMIT_DATA in the harness, not by libFuzzer's
        -rss_limit_mb: that reads the peak RSS, which Linux carries from this (large) pytest process into
        the child at exec.
        """
        if importlib.util.find_spec("atheris") is None:
            pytest.skip("atheris is not installed: pip install atheris")
        command = [sys.executable, str(HARNESS), target, str(scratch), str(corpus),
                   f"-runs={runs}", "-seed=1", f"-timeout={HANG_SECONDS}", "-rss_limit_mb=0",
                   f"-artifact_prefix={scratch}/", "-print_final_stats=1"]
        env = {**os.environ, "PYTHONPATH": str(REPOSITORY), "KILN_FUZZ_DATA_LIMIT_MB": "2048"}
        result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300,
                                stdin=subprocess.DEVNULL)
        assert result.returncode == 0, f"atheris {target}:\n{result.stderr[-6000:]}"
        done = int(re.search(r"Done (\d+) runs", result.stderr)[1])
        slowest = float(re.search(r"stat::slowest_unit_time_sec:\s*(\d+)", result.stderr)[1])
        assert done >= runs and slowest < ATHERIS_SLOWEST_SECONDS, result.stderr[-2000:]
        self.cases[loader, f"atheris {target}"] += done
        self.outcomes[loader, "atheris inputs: CheckpointError or a valid load"] += done
        self.slowest = max(self.slowest, slowest)
        return done

    def floor(self, loader: str, prop: str, minimum: int):
        count = self.cases[loader, prop]
        assert count >= minimum, f"{loader} {prop}: only {count} cases ran, expected >= {minimum}"

    def total(self, loader: str) -> int:
        return sum(n for (name, _), n in self.cases.items() if name == loader)


@pytest.fixture(scope="session")
def fuzz(request) -> FuzzLog:
    return request.config.stash.setdefault(_LOG, FuzzLog())


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    log = config.stash.get(_LOG, None)
    if log is None or not log.cases:
        return
    failed = [r for r in terminalreporter.stats.get("failed", []) if "tests/fuzz/" in r.nodeid]
    counts = ", ".join(f"{log.total(key)} {name} cases" for key, name in LOADERS.items())
    kinds = Counter()
    for (_, kind), n in log.outcomes.items():
        kinds[kind] += n
    extra = [f"{n} {kind}" for kind, n in sorted(kinds.items()) if kind != "refused"]
    verdict = (f"{len(failed)} fuzz test(s) FAILED" if failed else
               "all refused correctly" + (f" ({', '.join(extra)})" if extra else ""))
    terminalreporter.write_line(
        f"fuzz: {counts}, {verdict}; slowest case {log.slowest:.3f} s, "
        f"largest traced peak {log.peak / 2**20:.1f} MiB")
    terminalreporter.write_line("fuzz cases: " + ", ".join(
        f"{LOADERS[loader]} {prop} {n}" for (loader, prop), n in sorted(log.cases.items())))
