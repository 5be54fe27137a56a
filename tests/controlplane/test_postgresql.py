"""The control-plane tests again on PostgreSQL, in a second pytest run (pytest-django binds one database
per session). Runs when KILN_TEST_DATABASE_URL is set (./dev test sets it when PostgreSQL answers)."""

import os

import pytest

from .services import pytest_on_postgresql


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("KILN_TEST_DATABASE_URL") is None,
                    reason="KILN_TEST_DATABASE_URL is unset (./dev test sets it when PostgreSQL answers)")
def test_controlplane_suite_on_postgresql():
    result = pytest_on_postgresql(["tests/controlplane"], "kiln_cp")
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert " passed" in result.stdout and "skipped" not in result.stdout.splitlines()[-1], result.stdout[-2000:]
