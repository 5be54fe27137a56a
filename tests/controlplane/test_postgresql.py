"""The control-plane tests again on PostgreSQL, in a second pytest run (pytest-django binds one database
per session). Runs when KILN_TEST_DATABASE_URL is set (./dev test sets it when PostgreSQL answers)."""

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
def test_controlplane_suite_on_postgresql():
    # pytest-django creates test_<name> beside it and drops it afterwards; a fresh name lets runs overlap
    url = urlunsplit(urlsplit(DATABASE_URL)._replace(path=f"/kiln_cp_{secrets.token_hex(4)}"))
    env = {key: value for key, value in os.environ.items() if key not in {"REDIS_URL", "DJANGO_SETTINGS_MODULE"}}
    env["DATABASE_URL"] = url
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "tests/controlplane", "-q", "-m", "not slow", "-p", "no:cacheprovider",
         "--create-db"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert " passed" in result.stdout and "skipped" not in result.stdout.splitlines()[-1], result.stdout[-2000:]
