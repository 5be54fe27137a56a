"""Every /v1/ endpoint refuses a request without a valid bearer token; tokens are stored hashed."""

import hashlib

import pytest

from kiln_web.accounts.actions import authenticate_token, do_create_token_for_username, do_ensure_token
from kiln_web.accounts.models import ApiToken
from kiln_web.api import api as ninja_api

from .conftest import ApiClient, sft_body

EXPECTED_OPERATIONS = {
    ("post", "/v1/train/sft"),
    ("post", "/v1/train/grpo"),
    ("post", "/v1/train/opd"),
    ("get", "/v1/train/jobs"),
    ("get", "/v1/train/jobs/{job_id}"),
    ("post", "/v1/train/jobs/{job_id}/cancel"),
    ("post", "/v1/train/jobs/{job_id}/resume"),
    ("get", "/v1/train/jobs/{job_id}/checkpoints"),
    ("get", "/v1/train/jobs/{job_id}/metrics"),
    ("get", "/v1/train/jobs/{job_id}/events"),
    ("get", "/v1/teachers"),
    ("post", "/v1/teachers"),
    ("get", "/v1/teachers/{name}"),
    ("put", "/v1/teachers/{name}"),
    ("delete", "/v1/teachers/{name}"),
    ("get", "/v1/adapters"),
    ("get", "/v1/adapters/{name}"),
    ("post", "/v1/adapters/{name}/load"),
    ("post", "/v1/adapters/{name}/unload"),
    ("post", "/v1/adapters/{name}/activate"),
    ("delete", "/v1/adapters/{name}"),
    ("post", "/v1/adapters/{name}/shares"),
    ("delete", "/v1/adapters/{name}/shares/{kind}/{target}"),
    ("get", "/v1/promotions"),
    ("post", "/v1/evals/suites"),
    ("get", "/v1/evals/suites"),
    ("get", "/v1/evals/suites/{name}"),
    ("post", "/v1/evals/runs"),
    ("get", "/v1/evals/runs"),
    ("get", "/v1/evals/runs/{run_id}"),
}


def operations():
    schema = ninja_api.get_openapi_schema()
    return sorted((method, path) for path, methods in schema["paths"].items() for method in methods)


def test_schema_lists_every_endpoint_each_behind_the_bearer_token():
    schema = ninja_api.get_openapi_schema()
    assert set(operations()) == EXPECTED_OPERATIONS
    assert schema["components"]["securitySchemes"] == {"BearerToken": {"type": "http", "scheme": "bearer"}}
    for path, methods in schema["paths"].items():
        for method, operation in methods.items():
            assert operation["security"] == [{"BearerToken": []}], (method, path)


@pytest.fixture
def job_id(fake_runner, api, adapter_name):
    response = api.post("/v1/train/sft", sft_body(adapter_name))
    assert response.status_code == 201, response.content
    return response.json()["id"]


@pytest.mark.django_db
@pytest.mark.parametrize("method, path", sorted(EXPECTED_OPERATIONS))
@pytest.mark.parametrize("credentials", [None, "Bearer kiln_not-a-real-token", "Bearer ", "Basic YWRhOnB3",
                                         "kiln_token-without-scheme"])
def test_refused_without_a_valid_token(job_id, method, path, credentials):
    client = ApiClient(None)
    headers = {"HTTP_AUTHORIZATION": credentials} if credentials else {}
    url = path.replace("{job_id}", job_id)
    if method == "post":
        response = client.client.post(url, sft_body("x"), content_type="application/json", **headers)
    else:
        response = client.client.generic(method.upper(), url, **headers)
    assert response.status_code == 401, response.content
    assert response["WWW-Authenticate"].startswith("Bearer")
    error = response.json()["error"]
    assert error["code"] == "unauthorized"
    assert "kiln token create" in error["message"]


@pytest.mark.django_db
def test_inactive_users_token_is_refused(fake_runner, ada):
    ada.is_active = False
    ada.save()
    assert ApiClient(ada.token).get("/v1/train/jobs").status_code == 401


@pytest.mark.django_db
def test_refusal_changes_nothing(fake_runner, adapter_name):
    from kiln_web.adapters.models import Adapter
    from kiln_web.jobs.models import TrainingJob

    response = ApiClient("kiln_wrong").post("/v1/train/sft", sft_body(adapter_name))
    assert response.status_code == 401
    assert not TrainingJob.objects.exists() and not Adapter.objects.exists()


@pytest.mark.django_db
def test_openapi_schema_and_docs_need_a_token_or_a_session(ada, client):
    assert client.get("/v1/openapi.json").status_code == 401
    assert client.get("/v1/docs").status_code == 401
    response = ApiClient(ada.token).get("/v1/openapi.json")
    assert response.status_code == 200
    paths = response.json()["paths"]
    assert {(method, path) for path, methods in paths.items() for method in methods} == EXPECTED_OPERATIONS
    assert {"SFTRequest", "GRPORequest", "OPDRequest", "TeacherIn"} <= set(response.json()["components"]["schemas"])
    client.force_login(ada)
    assert client.get("/v1/docs").status_code == 200


@pytest.mark.django_db
def test_tokens_are_stored_as_sha256_only(django_user_model):
    row, token, created = do_create_token_for_username("carol", "laptop")
    assert created and token.startswith("kiln_") and len(token) > 40
    stored = ApiToken.objects.get(pk=row.pk)
    assert stored.token_hash == hashlib.sha256(token.encode()).hexdigest()
    assert token not in {str(value) for value in ApiToken.objects.values_list(
        "name", "token_hash", "prefix").get(pk=row.pk)}
    assert token.startswith(stored.prefix) and len(stored.prefix) < 16
    assert authenticate_token(token) == stored.user
    assert authenticate_token(token + "x") is None
    assert authenticate_token(stored.token_hash) is None
    assert not django_user_model.objects.get(username="carol").has_usable_password()
    # a second token for an existing user: the user is not created again
    _, second, created = do_create_token_for_username("carol", "ci")
    assert not created and second != token


@pytest.mark.django_db
def test_authentication_marks_last_used(ada):
    row = ApiToken.objects.get(user=ada)
    assert row.last_used_at is None
    assert ApiClient(ada.token).get("/v1/train/jobs").status_code == 200
    row.refresh_from_db()
    assert row.last_used_at is not None


@pytest.mark.django_db
def test_ensure_token_only_when_the_user_has_none(django_user_model):
    admin = django_user_model.objects.create_superuser("admin", "", "pw")
    token = do_ensure_token(admin, "kiln up")
    assert token and authenticate_token(token) == admin
    assert do_ensure_token(admin, "kiln up") is None
    assert ApiToken.objects.filter(user=admin).count() == 1


def test_the_error_schema_declares_every_field_a_refusal_carries():
    """The schema is the source of truth: every keyword an ActionRefused or error_response is given in kiln_web
    (job_id, matches, candidate_base ...) is an ErrorBody property of /v1/openapi.json."""
    import ast
    from pathlib import Path

    import kiln_web

    carried = {}
    for path in Path(kiln_web.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) in {"ActionRefused", "error_response"}:
                for keyword in node.keywords:
                    if keyword.arg is not None:  # not a **splat
                        carried.setdefault(keyword.arg, f"{path.name}:{node.lineno}")
    schema = ninja_api.get_openapi_schema()["components"]["schemas"]["ErrorBody"]["properties"]
    assert {"job_id", "matches", "candidate_base", "baseline_base"} <= set(carried)
    assert {name: where for name, where in carried.items() if name not in schema} == {}
