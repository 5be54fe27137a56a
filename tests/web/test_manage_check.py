"""`manage.py check` and `kiln` run as a person would start them, in subprocesses."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _env(kiln_home: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in {"DATABASE_URL", "REDIS_URL", "DJANGO_SETTINGS_MODULE"}}
    env["KILN_HOME"] = str(kiln_home)
    return env


@pytest.mark.slow
def test_manage_check(tmp_path):
    result = subprocess.run([sys.executable, "manage.py", "check", "--fail-level", "WARNING"],
                            cwd=ROOT, env=_env(tmp_path), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "secret_key").is_file()


@pytest.mark.slow
def test_bad_setting_stops_manage_py(tmp_path):
    env = _env(tmp_path) | {"DEBUG": "perhaps"}
    result = subprocess.run([sys.executable, "manage.py", "check"],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "DEBUG='perhaps' is not a boolean" in result.stderr


@pytest.mark.slow
def test_kiln_version(tmp_path):
    result = subprocess.run([sys.executable, "-m", "kiln_web.cli", "version"],
                            cwd=ROOT, env=_env(tmp_path), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("kiln ")
