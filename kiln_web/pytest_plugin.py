"""pytest plugin (loaded by `-p` in pyproject.toml): tests run with KILN_HOME in a fresh temporary folder
and a Celery queue name of their own.

A plugin rather than tests/conftest.py because pytest-django imports the settings
before any conftest is loaded, and the settings read KILN_HOME when they load.
"""

import os
import shutil
import tempfile

import pytest

_STASH_KEY = pytest.StashKey[str]()


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config: pytest.Config) -> None:
    kiln_home = tempfile.mkdtemp(prefix="kiln-test-home-")
    early_config.stash[_STASH_KEY] = kiln_home
    os.environ["KILN_HOME"] = kiln_home
    # a queue of this run's own, so that another test run against the same Redis cannot take its jobs
    os.environ.setdefault("KILN_TRAINING_QUEUE", f"training-test-{os.getpid()}")


def pytest_unconfigure(config: pytest.Config) -> None:
    kiln_home = config.stash.get(_STASH_KEY, None)
    if kiln_home is not None:
        shutil.rmtree(kiln_home, ignore_errors=True)
