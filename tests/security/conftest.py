"""Security fixtures: two people and a staff member with tokens and sessions, and a `world` of objects the
first one owns (a finished job with checkpoints, metrics and events, a queued job, adapters with a PEFT
snapshot, a teacher alias, a suite and a queued evaluation), so every endpoint has something to refuse."""

import json
import re
from dataclasses import dataclass

import pytest
from django.test import Client

from controlplane.conftest import ApiClient, ada, adapter_name, bob, fake_runner, make_user, sft_body  # noqa: F401
from kiln_web.api import api as ninja_api
from kiln_web.jobs.worker import EmbeddedWorker
from kiln_web.serving import runtime as serving_runtime
from serving.helpers import publish_adapter

FAKE_RUNNER = "controlplane.fake_sft"
PATH_PARAMETER = re.compile(r"\{(\w+)\}|<(?:\w+:)?(\w+)>")


def operations() -> list[tuple[str, str, dict]]:
    """(METHOD, path, operation) for every operation /v1/openapi.json lists, in schema order."""
    schema = ninja_api.get_openapi_schema()
    return [(method.upper(), path, operation) for path, methods in schema["paths"].items()
            for method, operation in methods.items()]


def fill(template: str, values: dict) -> str:
    """A path or URL pattern with its {name} / <type:name> parameters replaced from VALUES."""
    return PATH_PARAMETER.sub(lambda match: str(values[match.group(1) or match.group(2)]), template)


def call(client: Client, method: str, path: str, body=None, **headers):
    """One request with a JSON body (or none) through the Django test client."""
    if method == "GET":
        return client.get(path, **headers)
    return client.generic(method, path, data=b"" if body is None else json.dumps(body),
                          content_type="application/json", **headers)


@dataclass
class World:
    owner: object  # ada
    other: object  # bob, who owns nothing
    staff: object  # root
    job_id: str  # ada's finished job (fake runner, checkpoints every 2 steps)
    queued_job_id: str
    checkpoint: str  # a checkpoint basename of ada's finished job
    adapter: str  # ada's adapter, with a PEFT snapshot
    teacher: str
    suite: str
    eval_run_id: str

    def path_values(self) -> dict:
        return {"job_id": self.job_id, "name": self.adapter, "run_id": self.eval_run_id, "kind": "user",
                "target": self.other.get_username()}


@pytest.fixture(autouse=True)
def fresh_serving_pool():
    serving_runtime.close_serving()
    yield
    serving_runtime.close_serving()


@pytest.fixture
def world(settings, make_user, adapter_name) -> World:
    from kiln_web.evals.actions import do_create_suite, do_enqueue_evaluation
    from kiln_web.jobs import actions
    from kiln_web.jobs.models import TrainingJob
    from kiln_web.teachers.actions import do_create_teacher

    settings.KILN_HEARTBEAT_SECONDS = 3600  # no heartbeat thread touches the test database
    runner = settings.KILN_SFT_RUNNER
    settings.KILN_SFT_RUNNER = FAKE_RUNNER
    ada_, bob_, root = make_user("ada"), make_user("bob"), make_user("root", staff=True)
    response = ApiClient(ada_.token).post("/v1/train/sft", sft_body(adapter_name, records=4, checkpoint_interval=2))
    assert response.status_code == 201, response.content
    job_id = response.json()["id"]
    assert EmbeddedWorker().run_once()
    job = TrainingJob.objects.get(pk=job_id)
    assert job.status == "succeeded", (job.error_code, job.error_message)
    queued = actions.do_submit_job(ada_, sft_body(adapter_name + "-q"), sft_body(adapter_name + "-q"))
    publish_adapter(settings.KILN_HOME, settings.KILN_ADAPTERS_DIR, adapter_name)
    teacher = do_create_teacher(ada_, f"{adapter_name}@openai", {"endpoint": "http://127.0.0.1:9", "model": "m"})
    suite = do_create_suite(ada_, f"{adapter_name}-suite", '{"prompt": "a", "expected": "b"}\n')
    run = do_enqueue_evaluation(ada_, adapter_name, suite.name)
    settings.KILN_SFT_RUNNER = runner
    return World(ada_, bob_, root, str(job_id), str(queued.pk), job.latest_checkpoint["resume_checkpoint"],
                 adapter_name, teacher.name, suite.name, str(run.pk))


def session(user, csrf: bool = True) -> Client:
    """A signed-in browser; with CSRF checks on, as a real browser session has."""
    client = Client(enforce_csrf_checks=csrf)
    client.force_login(user)
    return client
