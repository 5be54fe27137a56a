"""pytest plugin (loaded by `-p` in pyproject.toml): tests run with KILN_HOME in a fresh temporary folder
and a Celery queue name of their own; with KILN_TEST_REPORT set, the run's counts and skip reasons are
written there as JSON for tests/run_suite.py (`./dev test`) to summarise and judge.

A plugin rather than tests/conftest.py because pytest-django imports the settings
before any conftest is loaded, and the settings read KILN_HOME when they load.
"""

import collections
import json
import os
import shutil
import tempfile

import pytest

_STASH_KEY = pytest.StashKey[str]()
BROWSER_FIXTURE = "chromium"  # tests/dashboard/test_browser.py: a passed test that used it drove Chromium


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config: pytest.Config) -> None:
    kiln_home = tempfile.mkdtemp(prefix="kiln-test-home-")
    early_config.stash[_STASH_KEY] = kiln_home
    os.environ["KILN_HOME"] = kiln_home
    # a queue of this run's own, so that another test run against the same Redis cannot take its jobs
    os.environ.setdefault("KILN_TRAINING_QUEUE", f"training-test-{os.getpid()}")
    # the suites tests gate on have a few examples; the server default (20) has tests of its own
    os.environ.setdefault("KILN_GATE_MIN_EXAMPLES", "1")


def pytest_configure(config: pytest.Config) -> None:
    path = os.environ.get("KILN_TEST_REPORT")
    if path and not hasattr(config, "workerinput"):
        config.pluginmanager.register(OutcomeReport(path), "kiln-outcome-report")


def pytest_unconfigure(config: pytest.Config) -> None:
    kiln_home = config.stash.get(_STASH_KEY, None)
    if kiln_home is not None:
        shutil.rmtree(kiln_home, ignore_errors=True)


class OutcomeReport:
    """Counts outcomes as pytest reports them and writes {exitstatus, counts, skips, browser_passed}."""

    def __init__(self, path: str):
        self.path = path
        self.counts: collections.Counter = collections.Counter()
        self.skips: collections.Counter = collections.Counter()  # reason -> tests
        self.browser_passed = 0

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call):
        outcome = yield
        outcome.get_result().kiln_browser = BROWSER_FIXTURE in getattr(item, "fixturenames", ())

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when == "call" and report.passed:
            self.counts["passed"] += 1
            self.browser_passed += getattr(report, "kiln_browser", False)
        elif report.failed:
            self.counts["failed" if report.when == "call" else "errors"] += 1
        elif report.skipped and hasattr(report, "wasxfail"):
            self.counts["xfailed"] += 1
        elif report.skipped:
            self.counts["skipped"] += 1
            reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
            self.skips[reason.removeprefix("Skipped: ")] += 1

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        report = {"exitstatus": int(exitstatus), "counts": dict(self.counts), "skips": dict(self.skips),
                  "browser_passed": self.browser_passed}
        with open(self.path, "w", encoding="utf-8") as handle:
            json.dump(report, handle, indent=1, sort_keys=True)
