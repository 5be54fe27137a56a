"""The serving and evaluation tests again on PostgreSQL (row locks, the one-active-adapter constraint), in
a second pytest run. Runs when KILN_TEST_DATABASE_URL is set (./dev test sets it when PostgreSQL answers)."""

import os
import secrets
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import pytest

ROOT = Path(__file__).resolve().parents[2]
DATABASE_URL = os.environ.get("KILN_TEST_DATABASE_URL")


@pytest.mark.slow
@pytest.mark.skipif(DATABASE_URL is None, reason="KILN_TEST_DATABASE_URL is unset (./dev test sets it when "
                                                 "PostgreSQL answers)")
def test_serving_and_evaluation_suites_on_postgresql():
    url = urlunsplit(urlsplit(DATABASE_URL)._replace(path=f"/kiln_sv_{secrets.token_hex(4)}"))
    env = {key: value for key, value in os.environ.items() if key not in {"REDIS_URL", "DJANGO_SETTINGS_MODULE"}}
    env["DATABASE_URL"] = url
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "tests/serving", "tests/evals", "-q", "-m", "not slow", "-p",
         "no:cacheprovider", "--create-db"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert " passed" in result.stdout, result.stdout[-2000:]
