"""Every /v1/ error is the API's coded JSON error, including those Django and django-ninja answer before any of
Kiln's handlers: a path no route has (Django's HTML 404), a method an operation does not take (ninja's plain-text
405), a body that is not JSON (ninja's "Cannot parse request body"), and a crash (Django's HTML 500)."""

import pytest
from django.test import Client

pytestmark = pytest.mark.django_db


def coded(response, status, code):
    assert response.status_code == status, response.content
    assert response["Content-Type"].startswith("application/json"), response.content[:200]
    error = response.json()["error"]
    assert error["code"] == code and error["message"], error
    return error


@pytest.mark.parametrize("path", ["/v1/nope", "/v1/train/nope/", "/v1/train/jobs/x/y/z"])
def test_a_path_no_route_has_is_a_coded_404(api, path):
    error = coded(api.get(path), 404, "not_found")
    assert path in error["message"] and "/v1/docs" in error["message"]
    coded(Client().get(path), 404, "not_found")  # without a token too: the same answer, no HTML


def test_a_method_an_operation_does_not_take_is_a_coded_405(api):
    response = api.get("/v1/train/sft")
    error = coded(response, 405, "method_not_allowed")
    assert "POST" in response["Allow"] and error["message"] == "GET is not allowed on /v1/train/sft; use POST"


@pytest.mark.parametrize("path", ["/v1/train/sft", "/v1/train/grpo", "/v1/completions"])
def test_a_body_that_is_not_json_is_refused_in_the_same_words_everywhere(api, path):
    response = api.client.post(path, "{not json", content_type="application/json")
    assert coded(response, 400, "invalid_request")["message"] == "the request body is not JSON"


def test_a_crash_is_a_coded_500(api, monkeypatch):
    from kiln_web.jobs import api as jobs_api

    def crash(request):
        raise RuntimeError("a bug")

    monkeypatch.setattr(jobs_api, "_visible_jobs", crash)
    client = api.client
    client.raise_request_exception = False
    error = coded(client.get("/v1/train/jobs"), 500, "internal_error")
    assert "a bug" not in error["message"]


def test_pages_outside_the_api_keep_their_own_errors(client):
    response = client.get("/no-such-page/")
    assert response.status_code in (302, 404) and not response.get("Content-Type", "").startswith("application/json")


def test_a_host_not_in_allowed_hosts_is_named(api):
    """KILN_URL=http://gpu-box:8000 against a server whose ALLOWED_HOSTS lacks gpu-box: Django answers a bare 400
    "Bad Request", which the CLI printed as `invalid_request: Bad Request`; the message names the host and the
    setting."""
    error = coded(Client(HTTP_HOST="gpu-box:8000").get("/v1/train/jobs"), 400, "invalid_request")
    assert "the host 'gpu-box:8000' is not in the server's ALLOWED_HOSTS" in error["message"]
    assert "add gpu-box to ALLOWED_HOSTS" in error["message"]
