"""Schemathesis against /v1/openapi.json of the in-process app (Django's WSGI application, the real trainer's
admission), with a valid token: for schema-valid and schema-violating requests to every operation, no 5xx,
every status code documented, every response body, content type and header as the schema says, and
schema-violating data refused. Each generated case runs twice where the path names an object: as
generated, and with the path pointing at an object the caller owns (a finished job with checkpoints,
metrics and events, its adapter with a PEFT snapshot, a teacher alias, a suite, a queued evaluation), so
the 200 answers are checked as well as the 404s.

Bounded and derandomized: MAX_EXAMPLES per operation, a fixed seed, no example database.
"""

import json

import pytest
import schemathesis
from django.core.wsgi import get_wsgi_application
from django.test import Client
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (content_type_conformance, negative_data_rejection,
                                               response_headers_conformance, response_schema_conformance,
                                               status_code_conformance)

from kiln_web.api import api as ninja_api

pytestmark = pytest.mark.django_db

MAX_EXAMPLES = 25  # about 30 s for every operation on the shared 2-core box
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_headers_conformance,
          response_schema_conformance, negative_data_rejection]  # the last one only for the generated path

# the schema as the app builds it; test_the_served_schema_is_the_one_tested checks /v1/openapi.json is this
SCHEMA = ninja_api.get_openapi_schema()
schema = schemathesis.openapi.from_dict(json.loads(json.dumps(SCHEMA, default=str)))
schema.app = get_wsgi_application()
# the token is ours, sent on every case: mutating the security header would only test the harness
schema.config.generation.update(with_security_parameters=False, database="none")


def test_the_served_schema_is_the_one_tested(world):
    response = Client().get("/v1/openapi.json", HTTP_AUTHORIZATION=f"Bearer {world.owner.token}")
    assert response.status_code == 200
    assert response.json() == json.loads(json.dumps(SCHEMA, default=str))


@schema.parametrize()
@settings(max_examples=MAX_EXAMPLES, derandomize=True, deadline=None, database=None,
          suppress_health_check=list(HealthCheck))
def test_api_conforms_to_its_schema(case, world):
    headers = {"Authorization": f"Bearer {world.owner.token}"}
    case.call_and_validate(headers=headers, checks=CHECKS)
    if case.path_parameters:  # again, at objects the caller owns
        owned = world.path_values() | {"name": _owned_name(case.operation.path, world)}
        case.path_parameters = {key: owned.get(key, value) for key, value in case.path_parameters.items()}
        # the path is now ours, whatever the generated one was: a negative case may have become a valid one
        case.call_and_validate(headers=headers, checks=CHECKS[:-1])


def _owned_name(path: str, world) -> str:
    if path.startswith("/v1/teachers"):
        return world.teacher
    if path.startswith("/v1/evals/suites"):
        return world.suite
    return world.adapter


# -- what schemathesis found (with more examples than the bounded run above), kept as plain regressions --


@pytest.mark.parametrize("path", ["/v1/train/jobs", "/v1/evals/runs"])
def test_an_offset_past_what_the_database_holds_is_refused_not_a_500(world, path):
    client = Client(raise_request_exception=False, HTTP_AUTHORIZATION=f"Bearer {world.owner.token}")
    response = client.get(path, {"offset": 1820492699202929828036608, "status": "queued"})
    assert response.status_code == 400 and response.json()["error"]["field"] == "offset"


def test_a_run_longer_than_the_step_counter_is_refused_not_a_500(world):
    client = Client(raise_request_exception=False, HTTP_AUTHORIZATION=f"Bearer {world.owner.token}")
    for epochs in (2**31, 2**62, 2**70):  # PostgreSQL's integer step counter; SQLite's 64 bits; past them
        body = {"data": [{"prompt": "q", "completion": "a"}], "config": {"output_name": "long", "epochs": epochs}}
        response = client.post("/v1/train/sft", json.dumps(body), content_type="application/json")
        assert response.status_code == 400, response.content[:200]
        if epochs < 2**63:
            assert "optimizer steps" in response.json()["error"]["message"]
        else:  # no checkpoint manifest holds it (64-bit integers): refused as the field's value, before counting steps
            assert response.json()["error"]["field"] == "config.epochs"
