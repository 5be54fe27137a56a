"""Request bodies are bounded by KILN_UPLOAD_MAX_BYTES: the API answers 413 (and creates nothing) for every
operation that takes a body, the dashboard's new-job form says what to do instead, and the ASGI app that
`kiln up` serves refuses an oversized body before reading it, declared or chunked, without spooling it."""

import asyncio
import json

import pytest
from asgiref.sync import async_to_sync
from django.core.files.uploadedfile import SimpleUploadedFile
from django.test import Client

from kiln_web.asgi import application
from kiln_web.core.limits import FORM_OVERHEAD_BYTES
from kiln_web.jobs.models import TrainingJob

from .conftest import call, fill, operations, session

pytestmark = pytest.mark.django_db

LIMIT = 4096


@pytest.fixture
def limit(settings):
    # settings.py sets DATA_UPLOAD_MAX_MEMORY_SIZE from KILN_UPLOAD_MAX_BYTES; an override sets both
    settings.KILN_UPLOAD_MAX_BYTES = settings.DATA_UPLOAD_MAX_MEMORY_SIZE = LIMIT
    return LIMIT


def test_the_settings_bind_djangos_limit_to_kiln_upload_max_bytes():
    from kiln_web import settings as kiln_settings

    assert kiln_settings.DATA_UPLOAD_MAX_MEMORY_SIZE == kiln_settings.KILN_UPLOAD_MAX_BYTES


def _oversized(size: int) -> dict:
    return {"data": [{"prompt": "x" * size, "completion": "y"}], "config": {"output_name": "big"}}


def test_every_operation_with_a_body_answers_413(world, limit):
    headers = {"HTTP_AUTHORIZATION": f"Bearer {world.owner.token}"}
    checked = []
    jobs = TrainingJob.objects.count()
    for method, template, operation in operations():
        if "requestBody" not in operation:
            continue
        response = call(Client(), method, fill(template, world.path_values()), _oversized(limit), **headers)
        assert response.status_code == 413, (method, template, response.content[:200])
        assert response.json()["error"]["code"] == "request_too_large"
        assert "KILN_UPLOAD_MAX_BYTES" in response.json()["error"]["message"]
        checked.append(operation["operationId"])
    assert {"submit_sft", "submit_grpo", "submit_opd", "create_teacher", "create_suite"} <= set(checked)
    assert TrainingJob.objects.count() == jobs


def test_a_body_at_the_limit_is_read(world, limit, settings):
    settings.KILN_SFT_RUNNER = "controlplane.fake_sft"
    body = _oversized(0)
    body["config"]["output_name"] = world.adapter + "-fits"
    body["data"][0]["prompt"] = "x" * (limit - len(json.dumps(body)))
    assert len(json.dumps(body).encode()) == limit
    response = Client().post("/v1/train/sft", json.dumps(body), content_type="application/json",
                             HTTP_AUTHORIZATION=f"Bearer {world.owner.token}")
    assert response.status_code == 201, response.content


def test_the_dashboard_form_refuses_an_oversized_upload_with_a_message(world, limit):
    browser = session(world.owner, csrf=False)
    records = "".join(json.dumps({"prompt": "x" * 100, "completion": "y"}) + "\n" for _ in range(60)).encode()
    assert len(records) > limit
    response = browser.post("/jobs/new/sft/", {"output_name": "too-big", "data": SimpleUploadedFile(
        "train.jsonl", records, content_type="application/jsonl")})
    assert response.status_code == 400
    assert "larger than KILN_UPLOAD_MAX_BYTES" in response.content.decode()
    assert not TrainingJob.objects.filter(adapter__name="too-big").exists()


# -- the ASGI app `kiln up` serves --


def _asgi_post(path: str, chunks: list[bytes], declared: int | None, token: str | None = None):
    """POST CHUNKS to the ASGI app; returns (status, body, bytes the app read)."""
    consumed = {"bytes": 0}
    sent = []

    async def run():
        pending = list(chunks)

        async def receive():
            if not pending:  # the client waits for the answer (Django listens for a disconnect meanwhile)
                await asyncio.sleep(60)
                return {"type": "http.disconnect"}
            chunk = pending.pop(0)
            consumed["bytes"] += len(chunk)
            return {"type": "http.request", "body": chunk, "more_body": bool(pending)}

        async def send(message):
            sent.append(message)

        headers = [(b"host", b"localhost"), (b"content-type", b"application/json")]
        if declared is not None:
            headers.append((b"content-length", str(declared).encode()))
        if token:
            headers.append((b"authorization", f"Bearer {token}".encode()))
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
                 "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
                 "headers": headers, "client": ("127.0.0.1", 5000), "server": ("127.0.0.1", 8000)}
        await application(scope, receive, send)

    async_to_sync(run)()
    start = next(message for message in sent if message["type"] == "http.response.start")
    body = b"".join(message.get("body", b"") for message in sent if message["type"] == "http.response.body")
    return start["status"], body, consumed["bytes"]


CHUNK = b" " * 1024


@pytest.mark.django_db(transaction=True)
def test_the_server_refuses_a_declared_oversized_body_without_reading_it(limit):
    status, body, read = _asgi_post("/v1/train/sft", [CHUNK] * 64, declared=64 * 1024)
    assert status == 413 and json.loads(body)["error"]["code"] == "request_too_large"
    assert read == 0


@pytest.mark.django_db(transaction=True)
def test_the_server_stops_reading_a_chunked_body_past_the_limit(limit):
    status, body, read = _asgi_post("/v1/train/sft", [CHUNK] * 1024, declared=None)  # 1 MiB, no length
    assert status == 413 and json.loads(body)["error"]["code"] == "request_too_large"
    assert read <= limit + len(CHUNK)
    status, body, read = _asgi_post("/jobs/new/sft/", [CHUNK] * (2048 + FORM_OVERHEAD_BYTES // 1024), declared=None)
    assert status == 413 and b"KILN_UPLOAD_MAX_BYTES" in body
    assert read <= limit + FORM_OVERHEAD_BYTES + len(CHUNK)


@pytest.mark.django_db(transaction=True)
def test_the_server_reads_a_chunked_body_within_the_limit(world, limit):
    """Not refused for lacking a length: a small chunked body reaches the API (which answers 400: not JSON)."""
    status, body, read = _asgi_post("/v1/train/sft", [b"{", b"}"], declared=None, token=world.owner.token)
    assert status == 400, body
    assert read == 2
