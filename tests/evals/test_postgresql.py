"""The serving and evaluation tests again on PostgreSQL (row locks, the one-active-adapter constraint), in
a second pytest run. Runs when KILN_TEST_DATABASE_URL is set (./dev test sets it when PostgreSQL answers)."""

import os

import pytest

from controlplane.services import pytest_on_postgresql


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("KILN_TEST_DATABASE_URL") is None,
                    reason="KILN_TEST_DATABASE_URL is unset (./dev test sets it when PostgreSQL answers)")
def test_serving_and_evaluation_suites_on_postgresql():
    result = pytest_on_postgresql(["tests/serving", "tests/evals"], "kiln_sv")
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert " passed" in result.stdout, result.stdout[-2000:]
