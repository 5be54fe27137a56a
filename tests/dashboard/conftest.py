"""Dashboard fixtures: signed-in browsers (Django test clients) and jobs run by the fake SFT runner."""

import json
import re

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.test import Client

from controlplane.conftest import adapter_name, ada, bob, fake_runner, make_user  # noqa: F401 (fixtures)
from kiln_web.jobs import actions
from kiln_web.jobs.worker import EmbeddedWorker

RECORDS = [{"prompt": f"q{i}", "completion": f"a{i}"} for i in range(4)]


def jsonl(records=RECORDS) -> bytes:
    return "".join(json.dumps(record) + "\n" for record in records).encode()


def upload(records=RECORDS, name="train.jsonl") -> SimpleUploadedFile:
    return SimpleUploadedFile(name, jsonl(records), content_type="application/jsonl")


@pytest.fixture
def browser(ada):
    """A signed-in person (ada) with CSRF checks on, as a real browser session has."""
    client = Client(enforce_csrf_checks=True)
    client.force_login(ada)
    return client


@pytest.fixture
def signed_in(ada):
    client = Client()
    client.force_login(ada)
    return client


def csrf_post(client: Client, path: str, data: dict | None = None, **extra):
    """POST the way the page does: first GET the form for its CSRF cookie, then send the token back."""
    client.get("/")
    token = client.cookies["csrftoken"].value
    return client.post(path, {**(data or {}), "csrfmiddlewaretoken": token}, **extra)


def field_errors(page: str, field: str) -> list[str]:
    """The error texts a new-job form page shows under FIELD (AssertionError, with the page, when it has none)."""
    block = re.search(rf'data-field="{field}">(.*?)</div>', page, re.S)
    assert block, page[:2000]
    return re.findall(r'class="field-error"[^>]*>(.*?)</p>', block.group(1), re.S)


def cancel_at(monkeypatch, step):
    """Cancel the job (as "Stop and save" does) right after STEP is recorded."""
    record = actions.do_record_step

    def record_then_cancel(job_id, worker_id, metrics):
        recorded = record(job_id, worker_id, metrics)
        if metrics["step"] == step:
            actions.do_cancel_job(job_id, reason="test")
        return recorded

    monkeypatch.setattr(actions, "do_record_step", record_then_cancel)


def run_queued():
    assert EmbeddedWorker().run_once()


@pytest.fixture(autouse=True)
def cancel_checked_every_step(settings):
    """A run asks at every step boundary whether it was stopped, so a test can stop it at a chosen step."""
    settings.KILN_CANCEL_POLL_SECONDS = 0
