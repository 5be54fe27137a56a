"""The job-status fast path (kiln_web.core.fastpath) through the real ASGI stack: what it answers from
memory is byte for byte Django's answer, only to a token Django authenticated for someone who may
see the job, never older than KILN_STATUS_CACHE_SECONDS, and never past a change: one made in this
process, or (with Redis) one another process announced."""

import os

import asyncio
import dataclasses
import json
import time
import types

import pytest
from asgiref.sync import async_to_sync, sync_to_async

from kiln_web.accounts.models import ApiToken
from kiln_web.core import fastpath
from kiln_web.jobs import actions
from kiln_web.jobs.models import TrainingJob

from asgi_http import asgi_request

from .conftest import sft_body

pytestmark = pytest.mark.django_db(transaction=True)


class CountingApp:
    """The whole Kiln HTTP stack behind the fast path, counting the requests that reach it."""

    def __init__(self):
        from kiln_web.asgi import application

        self.inner = application.application_mapping["http"].app  # what JobStatusFastPath wraps
        self.calls = []
        self.gate = None  # an asyncio.Event that requests wait for before reaching Django

    async def __call__(self, scope, receive, send):
        self.calls.append((scope["method"], scope["path"]))
        if self.gate is not None:
            await self.gate.wait()
        await self.inner(scope, receive, send)


@pytest.fixture
def stack(settings, fake_runner):
    settings.KILN_STATUS_CACHE_SECONDS = 30  # long enough that only what a test does expires an answer
    settings.KILN_TOKEN_CACHE_SECONDS = 30
    fastpath.forget_everything()
    counting = CountingApp()
    yield fastpath.JobStatusFastPath(counting), counting
    fastpath.forget_everything()


async def _request(app, method, path, token=None, query=b""):
    headers = [(b"authorization", f"Bearer {token}".encode())] if token else []
    return await asgi_request(app, method, path, headers, query)


def get(app, path, token=None, query=b""):
    return async_to_sync(_request)(app, "GET", path, token, query)


def post(app, path, token=None):
    return async_to_sync(_request)(app, "POST", path, token)


def make_job(owner, adapter_name) -> str:
    return str(actions.do_submit_job(owner, sft_body(adapter_name), sft_body(adapter_name)).pk)


def test_a_repeated_poll_is_django_s_answer_from_memory(stack, ada, adapter_name):
    app, counting = stack
    path = f"/v1/train/jobs/{make_job(ada, adapter_name)}"
    first = get(app, path, ada.token)
    assert first[0] == 200 and json.loads(first[2])["status"] == "queued"
    assert len(counting.calls) == 1
    for _ in range(5):
        assert get(app, path, ada.token) == first  # status, every header and the body, byte for byte
    assert len(counting.calls) == 1


def test_only_the_owner_or_staff_is_answered_from_memory(stack, ada, bob, make_user, adapter_name):
    app, counting = stack
    root = make_user("root", staff=True)
    job_path = f"/v1/train/jobs/{make_job(ada, adapter_name)}"
    ada_answer = get(app, job_path, ada.token)
    bob_job = f"/v1/train/jobs/{make_job(bob, adapter_name + '-b')}"
    assert get(app, bob_job, bob.token)[0] == 200  # bob's token is now known to the fast path
    calls = len(counting.calls)
    status, _, body = get(app, job_path, bob.token)
    assert status == 404 and b"belongs to someone else" in body  # Django's refusal, not ada's answer
    assert len(counting.calls) == calls + 1
    assert get(app, job_path, root.token) == ada_answer  # first time: Django; it authenticates root
    calls = len(counting.calls)
    assert get(app, job_path, root.token) == ada_answer  # then from memory
    assert len(counting.calls) == calls


def test_an_answer_is_matched_to_its_owner_by_id_not_by_name(stack, ada, make_user, adapter_name):
    """ada is renamed and someone new takes the name "ada" while ada's answer is fresh in memory: the
    newcomer's token is authenticated after the rename (so no announcement makes it old), and the answer's
    body still says "owner": "ada". Only the owner's id (or staff) may be given it."""
    app, counting = stack
    path = f"/v1/train/jobs/{make_job(ada, adapter_name)}"
    assert get(app, path, ada.token)[0] == 200  # remembered, "owner": "ada"
    ada.username = "ada-old"
    ada.save()
    newcomer = make_user("ada")
    for _ in range(2):  # the first authenticates the newcomer's token, the second would meet the answer
        calls = len(counting.calls)
        status, _, body = get(app, path, newcomer.token)
        assert status == 404 and b"belongs to someone else" in body
        assert len(counting.calls) == calls + 1


def test_missing_wrong_and_revoked_tokens_always_reach_django(stack, ada, adapter_name):
    app, counting = stack
    path = f"/v1/train/jobs/{make_job(ada, adapter_name)}"
    assert get(app, path, ada.token)[0] == 200
    assert get(app, path)[0] == 401
    assert get(app, path, "kiln_" + "x" * 40)[0] == 401
    assert get(app, path, ada.token.upper())[0] == 401
    calls = len(counting.calls)
    for headers in ([(b"authorization", f"Bearer  {ada.token}".encode())],  # what Django reads as another token
                    [(b"authorization", f"Bearer {ada.token}".encode())] * 2):
        assert async_to_sync(asgi_request)(app, "GET", path, headers)[0] == 401
    assert len(counting.calls) == calls + 2
    calls = len(counting.calls)
    ApiToken.objects.filter(user=ada).delete()  # revoked in this process: forgotten at once
    assert get(app, path, ada.token)[0] == 401
    assert len(counting.calls) == calls + 1


def test_changes_here_reach_the_next_poll(stack, ada, api, adapter_name):
    app, counting = stack
    job_id = make_job(ada, adapter_name)
    path = f"/v1/train/jobs/{job_id}"
    assert json.loads(get(app, path, ada.token)[2])["status"] == "queued"
    status, _, body = post(app, path + "/cancel", ada.token)
    assert status == 200 and json.loads(body)["status"] == "cancelled"
    assert json.loads(get(app, path, ada.token)[2])["status"] == "cancelled"  # the POST forgot the answer
    calls = len(counting.calls)
    assert get(app, path, ada.token)[0] == 200
    assert len(counting.calls) == calls  # remembered again


def test_answers_expire(stack, settings, monkeypatch, ada, adapter_name):
    """The fast path's clock is the test's: however slowly the machine serves the polls, the second comes
    before the answer ages and the third after it expired."""
    app, counting = stack
    now = [1000.0]
    monkeypatch.setattr(fastpath, "time", types.SimpleNamespace(monotonic=lambda: now[0]))
    settings.KILN_STATUS_CACHE_SECONDS = 0.2
    job_id = make_job(ada, adapter_name)
    path = f"/v1/train/jobs/{job_id}"
    get(app, path, ada.token)
    TrainingJob.objects.filter(pk=job_id).update(status="cancelled")  # no signal, as from another process
    assert json.loads(get(app, path, ada.token)[2])["status"] == "queued"  # still the remembered answer
    now[0] += 0.25
    assert json.loads(get(app, path, ada.token)[2])["status"] == "cancelled"
    settings.KILN_STATUS_CACHE_SECONDS = 0  # off: every poll is Django's
    calls = len(counting.calls)
    for _ in range(3):
        get(app, path, ada.token)
    assert len(counting.calls) == calls + 3


def test_other_requests_pass_through(stack, ada, adapter_name):
    app, counting = stack
    job_id = make_job(ada, adapter_name)
    get(app, f"/v1/train/jobs/{job_id}", ada.token)
    calls = len(counting.calls)
    for path, query in ((f"/v1/train/jobs/{job_id}/checkpoints", b""), (f"/v1/train/jobs/{job_id}/events", b""),
                        (f"/v1/train/jobs/{job_id}", b"x=1"), ("/v1/train/jobs", b"")):
        assert get(app, path, ada.token, query)[0] == 200
    assert len(counting.calls) == calls + 4


def test_simultaneous_misses_make_one_trip_through_django(stack, monkeypatch, ada, adapter_name):
    app, counting = stack
    monkeypatch.setattr(fastpath, "FILL_WAIT_SECONDS", 300.0)  # the waiting polls outlast a slow trip
    path = f"/v1/train/jobs/{make_job(ada, adapter_name)}"
    get(app, "/v1/train/jobs", ada.token)  # the token is known; the job's answer is not

    async def many():
        return await asyncio.gather(*(_request(app, "GET", path, ada.token) for _ in range(20)))

    calls = len(counting.calls)
    answers = async_to_sync(many)()
    assert all(answer == answers[0] for answer in answers) and answers[0][0] == 200
    assert len(counting.calls) == calls + 1


def test_an_ageing_answer_is_refreshed_by_one_poll_while_the_rest_get_it(stack, ada, adapter_name):
    app, counting = stack
    job_id = make_job(ada, adapter_name)
    path = f"/v1/train/jobs/{job_id}"
    old = get(app, path, ada.token)
    TrainingJob.objects.filter(pk=job_id).update(status="cancelled")  # no signal, as from another process
    fastpath._answers[job_id] = dataclasses.replace(fastpath._answers[job_id], refresh_after=0.0)

    async def refresh_while_polling():
        counting.gate = asyncio.Event()
        refresher = asyncio.create_task(_request(app, "GET", path, ada.token))
        while len(counting.calls) < 2:  # the refresher is at the gate, on its way to Django
            await asyncio.sleep(0.01)
        others = [await _request(app, "GET", path, ada.token) for _ in range(3)]
        counting.gate.set()
        return await refresher, others

    calls = len(counting.calls)
    refreshed, others = async_to_sync(refresh_while_polling)()
    assert others == [old] * 3  # answered at once, from memory, while the refresh was held
    assert len(counting.calls) == calls + 1
    assert json.loads(refreshed[2])["status"] == "cancelled"
    assert get(app, path, ada.token) == refreshed
    assert len(counting.calls) == calls + 1


@pytest.fixture
def with_redis(settings):
    url = os.environ.get("KILN_TEST_REDIS_URL")
    if not url:
        pytest.skip("KILN_TEST_REDIS_URL is not set: no Redis to hold the versions (./dev test sets it)")
    settings.REDIS_URL = url
    return url


def test_changes_announced_by_another_process_reach_the_next_poll(stack, with_redis, ada, adapter_name):
    """With Redis, a worker's state change or another process's token revocation is announced on a channel
    every web process listens to; until its listener is subscribed, a web process sends polls to Django."""
    app, counting = stack
    job_id = make_job(ada, adapter_name)
    path = f"/v1/train/jobs/{job_id}"

    async def until(condition):
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if condition():
                return
            await asyncio.sleep(0.01)
        raise AssertionError("not within 60 s")

    async def scenario():
        calls = len(counting.calls)
        await _request(app, "GET", path, ada.token)  # starts this event loop's listener
        listener = fastpath._listeners[asyncio.get_running_loop()]
        assert len(counting.calls) == calls + 1
        await until(lambda: listener.live)
        old = await _request(app, "GET", path, ada.token)  # now remembered
        calls = len(counting.calls)
        assert await _request(app, "GET", path, ada.token) == old
        assert len(counting.calls) == calls
        await sync_to_async(TrainingJob.objects.filter(pk=job_id).update)(status="cancelled")  # elsewhere
        assert await _request(app, "GET", path, ada.token) == old  # unannounced: still the remembered answer
        heard = fastpath._job_generations.get(job_id, 0)
        await sync_to_async(fastpath._announce)(f"job:{job_id}")  # what that process's job.status event does
        await until(lambda: fastpath._job_generations.get(job_id, 0) > heard)
        assert json.loads((await _request(app, "GET", path, ada.token))[2])["status"] == "cancelled"
        assert len(counting.calls) == calls + 1
        assert json.loads((await _request(app, "GET", path, ada.token))[2])["status"] == "cancelled"
        assert len(counting.calls) == calls + 1  # and the new answer is remembered
        await sync_to_async(ApiToken.objects.filter(user=ada).update)(token_hash="0" * 64)  # revoked elsewhere
        assert (await _request(app, "GET", path, ada.token))[0] == 200  # unannounced: remembered
        heard = fastpath._auth_generation
        await sync_to_async(fastpath._announce)("auth")  # what that process's token change does
        await until(lambda: fastpath._auth_generation > heard)
        assert (await _request(app, "GET", path, ada.token))[0] == 401
        listener.task.cancel()

    async_to_sync(scenario)()


def test_state_changes_are_announced_and_progress_is_not(stack, with_redis, ada, adapter_name):
    import redis

    job_id = make_job(ada, adapter_name)
    client = redis.Redis.from_url(with_redis)
    pubsub = client.pubsub()
    pubsub.subscribe(fastpath.CHANGES)
    assert pubsub.get_message(timeout=5)["type"] == "subscribe"

    def heard() -> list:
        out = []
        while (message := pubsub.get_message(timeout=0.5)) is not None:
            out.append(message["data"].decode())
        return out

    actions.do_add_event(job_id, "info", "a log line")  # progress-like: several a second while training
    assert f"job:{job_id}" not in heard()
    actions.do_cancel_job(job_id, reason="test")  # a state change: its job.status event after the commit
    assert f"job:{job_id}" in heard()
    ApiToken.objects.filter(user=ada).delete()
    assert "auth" in heard()
    pubsub.close()
    client.close()
