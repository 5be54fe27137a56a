"""The settings helpers accept good values and refuse bad ones with ImproperlyConfigured."""

import os
import stat
from pathlib import Path

import pytest
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

from kiln_web.settings import (
    broker_config,
    database_config,
    env_bool,
    env_int,
    env_list,
    env_path,
    env_secret,
    load_or_create_secret_key,
)


def test_settings_use_the_test_kiln_home():
    assert settings.KILN_HOME == Path(os.environ["KILN_HOME"])


@pytest.mark.parametrize("raw, expected", [("1", True), ("true", True), ("YES", True), (" on ", True),
                                           ("0", False), ("False", False), ("no", False), ("off", False)])
def test_env_bool_accepts(monkeypatch, raw, expected):
    monkeypatch.setenv("KILN_T_FLAG", raw)
    assert env_bool("KILN_T_FLAG", not expected) is expected


@pytest.mark.parametrize("raw", ["maybe", "2", "tru", "y e s"])
def test_env_bool_refuses(monkeypatch, raw):
    monkeypatch.setenv("KILN_T_FLAG", raw)
    with pytest.raises(ImproperlyConfigured, match="KILN_T_FLAG"):
        env_bool("KILN_T_FLAG", False)


def test_unset_or_empty_gives_default(monkeypatch):
    monkeypatch.delenv("KILN_T_UNSET", raising=False)
    assert env_bool("KILN_T_UNSET", True) is True
    assert env_int("KILN_T_UNSET", 7) == 7
    monkeypatch.setenv("KILN_T_UNSET", "")
    assert env_int("KILN_T_UNSET", 7) == 7
    assert env_list("KILN_T_UNSET", ["a"]) == ["a"]


@pytest.mark.parametrize("raw", ["eight", "8.0", "0x10", "1e3"])
def test_env_int_refuses(monkeypatch, raw):
    monkeypatch.setenv("KILN_T_INT", raw)
    with pytest.raises(ImproperlyConfigured, match="KILN_T_INT"):
        env_int("KILN_T_INT", 3)


def test_env_int_minimum(monkeypatch):
    monkeypatch.setenv("KILN_T_INT", " 12 ")
    assert env_int("KILN_T_INT", 3, minimum=1) == 12
    monkeypatch.setenv("KILN_T_INT", "0")
    with pytest.raises(ImproperlyConfigured, match="minimum"):
        env_int("KILN_T_INT", 3, minimum=1)


def test_env_path_expands_home_and_refuses_relative(monkeypatch):
    monkeypatch.setenv("KILN_T_PATH", "~/kiln-data")
    assert env_path("KILN_T_PATH", "/unused") == Path.home() / "kiln-data"
    monkeypatch.setenv("KILN_T_PATH", "relative/dir")
    with pytest.raises(ImproperlyConfigured, match="absolute"):
        env_path("KILN_T_PATH", "/unused")


def test_env_list(monkeypatch):
    monkeypatch.setenv("KILN_T_LIST", " a.example, b.example ,,")
    assert env_list("KILN_T_LIST", []) == ["a.example", "b.example"]


def test_env_secret_reads_file(monkeypatch, tmp_path):
    secret_file = tmp_path / "secret"
    secret_file.write_text("s3cret\n")
    monkeypatch.delenv("KILN_T_SECRET", raising=False)
    monkeypatch.setenv("KILN_T_SECRET_FILE", str(secret_file))
    assert env_secret("KILN_T_SECRET") == "s3cret"

    monkeypatch.setenv("KILN_T_SECRET", "direct")
    with pytest.raises(ImproperlyConfigured, match="not both"):
        env_secret("KILN_T_SECRET")

    monkeypatch.delenv("KILN_T_SECRET")
    monkeypatch.setenv("KILN_T_SECRET_FILE", str(tmp_path / "missing"))
    with pytest.raises(ImproperlyConfigured, match="cannot be read"):
        env_secret("KILN_T_SECRET")


def test_database_defaults_to_sqlite_in_kiln_home(tmp_path):
    config = database_config(None, tmp_path)
    assert config["ENGINE"] == "django.db.backends.sqlite3"
    assert config["NAME"] == tmp_path / "kiln.sqlite3"


@pytest.mark.parametrize("scheme", ["postgres", "postgresql"])
def test_database_url_postgres(tmp_path, scheme):
    config = database_config(f"{scheme}://kiln:pw@db.internal:5433/kiln_prod", tmp_path)
    assert config["ENGINE"] == "django.db.backends.postgresql"
    assert (config["NAME"], config["USER"], config["PASSWORD"]) == ("kiln_prod", "kiln", "pw")
    assert (config["HOST"], config["PORT"]) == ("db.internal", 5433)


def test_postgres_connections_are_pooled(tmp_path, monkeypatch):
    monkeypatch.delenv("KILN_DATABASE_POOL_SIZE", raising=False)
    config = database_config("postgres://kiln:pw@db.internal:5433/kiln_prod?sslmode=require", tmp_path)
    assert config["OPTIONS"] == {"sslmode": "require", "pool": {"min_size": 2, "max_size": 10, "timeout": 10.0}}
    assert config["CONN_MAX_AGE"] == 0 and config["CONN_HEALTH_CHECKS"] is True  # Django refuses a pool otherwise
    monkeypatch.setenv("KILN_DATABASE_POOL_SIZE", "1")
    assert database_config("postgres://u:p@h:5432/db", tmp_path)["OPTIONS"]["pool"] == {
        "min_size": 1, "max_size": 1, "timeout": 10.0}
    monkeypatch.setenv("KILN_DATABASE_POOL_SIZE", "0")
    with pytest.raises(ImproperlyConfigured, match="KILN_DATABASE_POOL_SIZE=0 is below the minimum"):
        database_config("postgres://u:p@h:5432/db", tmp_path)
    assert "pool" not in database_config(None, tmp_path)["OPTIONS"]


def test_django_builds_the_pool_from_those_settings(tmp_path, monkeypatch):
    """psycopg_pool is installed and Django accepts the configuration; nothing is connected."""
    from django.db.utils import ConnectionHandler
    from psycopg_pool import ConnectionPool

    monkeypatch.delenv("KILN_DATABASE_POOL_SIZE", raising=False)
    config = database_config("postgres://u:p@h:5432/db", tmp_path)
    wrapper = ConnectionHandler({"default": {}, "pooled": config})["pooled"]
    try:
        pool = wrapper.pool
        assert isinstance(pool, ConnectionPool) and (pool.min_size, pool.max_size, pool.timeout) == (2, 10, 10.0)
        assert pool._check is not None  # each connection is checked before it is handed out again
    finally:
        type(wrapper)._connection_pools.pop("pooled", None)


@pytest.mark.parametrize("url", ["mysql://u:p@h/db", "sqlite:///tmp/x.db", "db.internal:5432/kiln",
                                 "postgres://u:p@h:5432/"])
def test_database_url_refused(tmp_path, url):
    with pytest.raises(ImproperlyConfigured, match="DATABASE_URL"):
        database_config(url, tmp_path)


def test_database_url_refusal_hides_the_password(tmp_path):
    with pytest.raises(ImproperlyConfigured) as excinfo:
        database_config("mysql://u:hunter2@h/db", tmp_path)
    assert "hunter2" not in str(excinfo.value)


def test_broker_switches_on_redis_url():
    broker, layers = broker_config(None)
    assert broker == "memory://"
    assert layers["default"]["BACKEND"] == "channels.layers.InMemoryChannelLayer"

    broker, layers = broker_config("redis://cache:6379/2")
    assert broker == "redis://cache:6379/2"
    assert layers["default"]["BACKEND"] == "channels_redis.core.RedisChannelLayer"
    assert layers["default"]["CONFIG"]["hosts"] == [{"address": "redis://cache:6379/2", "max_connections": 1000,
                                                     "socket_timeout": 30}]

    with pytest.raises(ImproperlyConfigured, match="REDIS_URL"):
        broker_config("amqp://guest@rabbit//")


def test_secret_key_generated_once_with_private_mode(tmp_path):
    first = load_or_create_secret_key(tmp_path)
    assert len(first) >= 50
    assert stat.S_IMODE((tmp_path / "secret_key").stat().st_mode) == 0o600
    assert load_or_create_secret_key(tmp_path) == first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["secret_key"]


def test_secret_key_file_too_short_is_refused(tmp_path):
    (tmp_path / "secret_key").write_text("short\n")
    with pytest.raises(ImproperlyConfigured, match="delete it"):
        load_or_create_secret_key(tmp_path)


def test_a_pool_checkout_waits_no_longer_than_a_worker_waits_for_the_database(tmp_path):
    """With KILN_LOST_AFTER_SECONDS=3 a query waits at most 3 s for a pooled connection, so a database that stays
    down longer fails the run (tests/faults/test_postgres_restart.py), instead of the pool's 10 s hiding it."""
    import subprocess
    import sys

    env = {key: value for key, value in os.environ.items() if key not in {"DJANGO_SETTINGS_MODULE", "REDIS_URL"}}
    env |= {"KILN_HOME": str(tmp_path), "DATABASE_URL": "postgres://u:p@127.0.0.1:1/db",
            "KILN_LOST_AFTER_SECONDS": "3", "KILN_HEARTBEAT_SECONDS": "0.5"}
    script = "from kiln_web import settings; print(settings.DATABASES['default']['OPTIONS']['pool']['timeout'])"
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.split() == ["3.0"], out.stderr[-2000:]
