"""Against real services when ./dev test found them: migrations on PostgreSQL, the Redis channel layer."""

import asyncio
import os
import secrets
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import pytest

ROOT = Path(__file__).resolve().parents[2]
DATABASE_URL = os.environ.get("KILN_TEST_DATABASE_URL")
REDIS_URL = os.environ.get("KILN_TEST_REDIS_URL")


@pytest.fixture
def scratch_database_url():
    """A fresh, empty PostgreSQL database on the test server, dropped afterwards."""
    import psycopg

    name = f"kiln_t_{secrets.token_hex(6)}"
    with psycopg.connect(DATABASE_URL, autocommit=True) as connection:
        connection.execute(f'CREATE DATABASE "{name}"')
    try:
        yield urlunsplit(urlsplit(DATABASE_URL)._replace(path=f"/{name}"))
    finally:
        with psycopg.connect(DATABASE_URL, autocommit=True) as connection:
            connection.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.mark.slow
@pytest.mark.skipif(DATABASE_URL is None, reason="KILN_TEST_DATABASE_URL is unset (./dev test sets it when PostgreSQL answers)")
def test_migrate_on_postgresql(scratch_database_url, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in {"REDIS_URL", "DJANGO_SETTINGS_MODULE"}}
    env |= {"KILN_HOME": str(tmp_path), "DATABASE_URL": scratch_database_url}
    for command in (["migrate", "--noinput"], ["migrate", "--check"]):
        result = subprocess.run([sys.executable, "manage.py", *command], cwd=ROOT, env=env,
                                capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.skipif(REDIS_URL is None, reason="KILN_TEST_REDIS_URL is unset (./dev test sets it when Redis answers)")
def test_redis_channel_layer_round_trip():
    from django.utils.module_loading import import_string

    from kiln_web.settings import broker_config

    _, layers = broker_config(REDIS_URL)
    config = layers["default"]
    layer = import_string(config["BACKEND"])(**config["CONFIG"])

    async def round_trip():
        channel = await layer.new_channel()
        await layer.send(channel, {"type": "kiln.ping", "n": 1})
        message = await layer.receive(channel)
        await layer.flush()
        return message

    assert asyncio.run(round_trip()) == {"type": "kiln.ping", "n": 1}


@pytest.mark.slow
@pytest.mark.skipif(REDIS_URL is None, reason="KILN_TEST_REDIS_URL is unset (./dev test sets it when Redis answers)")
def test_an_idle_consumer_keeps_waiting_on_the_redis_channel_layer():
    """A WebSocket consumer with nothing to relay waits in the channel layer's receive; a message sent after the
    layer's 5 s blocking pop has come back empty at least once still arrives (redis-py 8's default 5 s read
    timeout once raised TimeoutError there, which closed every idle dashboard socket)."""
    from django.utils.module_loading import import_string

    from kiln_web.settings import broker_config

    _, layers = broker_config(REDIS_URL)
    config = layers["default"]
    layer = import_string(config["BACKEND"])(**config["CONFIG"])

    async def idle_then_message():
        channel = await layer.new_channel()
        waiting = asyncio.create_task(layer.receive(channel))
        # idle past one whole blocking pop: the failure needed that much idle time, and nothing but an error
        # can end the wait before the message is sent, however busy the machine
        await asyncio.sleep(layer.brpop_timeout + 1.5)
        assert not waiting.done(), waiting.exception()
        await layer.send(channel, {"type": "kiln.ping", "n": 2})
        message = await asyncio.wait_for(waiting, 30)
        await layer.flush()
        return message

    assert asyncio.run(idle_then_message()) == {"type": "kiln.ping", "n": 2}
    assert config["CONFIG"]["hosts"][0]["socket_timeout"] > layer.brpop_timeout


@pytest.mark.skipif(REDIS_URL is None, reason="KILN_TEST_REDIS_URL is unset (./dev test sets it when Redis answers)")
def test_job_events_reach_a_redis_channel_layer_in_order():
    """A worker's events go out from one long-lived loop (kiln_web.jobs.events._Sender), in the order
    they were published, every one by the time flush returns."""
    from django.utils.module_loading import import_string

    from kiln_web.jobs import events
    from kiln_web.settings import broker_config

    _, layers = broker_config(REDIS_URL)
    config = layers["default"]
    layer = import_string(config["BACKEND"])(**config["CONFIG"])
    group = f"kiln.job.{secrets.token_hex(8)}"
    channel = asyncio.run(_join(layer, group))
    sender = events._Sender(layer)
    for n in range(100):
        sender.send([group], {"type": events.JOB_STEP, "job_id": "j", "n": n})
    assert sender.flush(30)

    async def drain():
        return [(await asyncio.wait_for(layer.receive(channel), 10))["n"] for _ in range(100)]

    assert asyncio.run(drain()) == list(range(100))


async def _join(layer, group):
    channel = await layer.new_channel()
    await layer.group_add(group, channel)
    return channel
