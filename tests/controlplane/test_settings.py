"""The training settings: read from the environment, refused loudly, turned into one RunSettings."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from django.core.exceptions import ImproperlyConfigured

from kiln_web.jobs.runtime import run_settings
from kiln_web.settings import env_choice, env_float, env_paths

ROOT = Path(__file__).resolve().parents[2]


def test_env_paths(monkeypatch):
    monkeypatch.setenv("KILN_T_PATHS", "/data/a::/data/b: ")
    assert env_paths("KILN_T_PATHS") == [Path("/data/a"), Path("/data/b")]
    monkeypatch.setenv("KILN_T_PATHS", "/data/a:relative/b")
    with pytest.raises(ImproperlyConfigured, match="relative/b.*absolute"):
        env_paths("KILN_T_PATHS")
    monkeypatch.delenv("KILN_T_PATHS")
    assert env_paths("KILN_T_PATHS") == []


@pytest.mark.parametrize("raw", ["fast", "nan", "inf", "0.01"])
def test_env_float_refuses(monkeypatch, raw):
    monkeypatch.setenv("KILN_T_FLOAT", raw)
    with pytest.raises(ImproperlyConfigured, match="KILN_T_FLOAT"):
        env_float("KILN_T_FLOAT", 1.0, minimum=0.1)


def test_env_choice(monkeypatch):
    monkeypatch.setenv("KILN_T_CHOICE", "cuda")
    assert env_choice("KILN_T_CHOICE", "cpu", ("cpu", "cuda")) == "cuda"
    monkeypatch.setenv("KILN_T_CHOICE", "rocm")
    with pytest.raises(ImproperlyConfigured, match="cpu, cuda"):
        env_choice("KILN_T_CHOICE", "cpu", ("cpu", "cuda"))


def test_run_settings_from_django_settings(settings, tmp_path):
    from controlplane import fake_sft

    settings.KILN_SFT_RUNNER = "controlplane.fake_sft"
    settings.KILN_DATA_ROOTS = (settings.KILN_DATASETS_DIR, tmp_path)
    settings.KILN_CHECKPOINT_INTERVAL = 25
    built = run_settings()
    assert built == fake_sft.RunSettings(
        home=settings.KILN_HOME, registry=settings.KILN_HOME / "adapters", bases_root=settings.KILN_HOME,
        data_roots=(settings.KILN_HOME / "datasets", tmp_path), default_checkpoint_interval=25, backend="auto")
    assert built.registry.is_dir() and (settings.KILN_HOME / "datasets").is_dir()


@pytest.mark.slow
@pytest.mark.parametrize("variable, value, words", [
    ("KILN_CHECKPOINT_INTERVAL", "0", "KILN_CHECKPOINT_INTERVAL=0 is below the minimum of 1"),
    ("KILN_CHECKPOINT_INTERVAL", "ten", "KILN_CHECKPOINT_INTERVAL='ten' is not an integer"),
    ("KILN_DATA_ROOTS", "data", "KILN_DATA_ROOTS entry 'data' must be an absolute path"),
    ("KILN_UPLOAD_MAX_BYTES", "-1", "KILN_UPLOAD_MAX_BYTES=-1 is below the minimum"),
    ("KILN_LOST_AFTER_SECONDS", "5", "must be at least three heartbeats"),
    ("KILN_TRAINING_BACKEND", "tpu", "KILN_TRAINING_BACKEND='tpu' is not one of: auto, cpu, cuda"),
    ("KILN_TRAINING_QUEUE", " ", "KILN_TRAINING_QUEUE=' ' is not a queue name"),
    ("KILN_TRAINING_QUEUE", "train ing", "KILN_TRAINING_QUEUE='train ing' is not a queue name"),
])
def test_bad_training_settings_stop_the_start(tmp_path, variable, value, words):
    env = {k: v for k, v in os.environ.items() if k not in {"DATABASE_URL", "REDIS_URL", "DJANGO_SETTINGS_MODULE"}}
    env |= {"KILN_HOME": str(tmp_path), variable: value}
    result = subprocess.run([sys.executable, "manage.py", "check"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert words in result.stderr


@pytest.mark.slow
@pytest.mark.parametrize("value, interval", [(None, "50"), ("off", "None"), ("7", "7")])
def test_checkpoints_are_on_by_default_and_off_only_when_asked(tmp_path, value, interval):
    env = {k: v for k, v in os.environ.items()
           if k not in {"DATABASE_URL", "REDIS_URL", "DJANGO_SETTINGS_MODULE", "KILN_CHECKPOINT_INTERVAL"}}
    env |= {"KILN_HOME": str(tmp_path)} | ({"KILN_CHECKPOINT_INTERVAL": value} if value is not None else {})
    result = subprocess.run([sys.executable, "manage.py", "shell", "-c",
                             "from django.conf import settings; print(settings.KILN_CHECKPOINT_INTERVAL)"],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == interval


def test_the_default_base_is_the_setting_else_the_registry_s_choice(settings):
    settings.KILN_DEFAULT_BASE = None
    assert run_settings().default_base == "kiln-tiny"  # no packaged base registered in the test KILN_HOME
    settings.KILN_DEFAULT_BASE = "my-llama"
    assert run_settings().default_base == "my-llama"


@pytest.mark.slow
def test_a_gate_needs_twenty_examples_unless_the_server_says_otherwise(tmp_path):
    env = {k: v for k, v in os.environ.items()
           if k not in {"DATABASE_URL", "REDIS_URL", "DJANGO_SETTINGS_MODULE", "KILN_GATE_MIN_EXAMPLES"}}
    result = subprocess.run([sys.executable, "manage.py", "shell", "-c",
                             "from django.conf import settings; print(settings.KILN_GATE_MIN_EXAMPLES)"],
                            cwd=ROOT, env=env | {"KILN_HOME": str(tmp_path)}, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "20"
