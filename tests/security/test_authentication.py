"""Every /v1 operation (enumerated from /v1/openapi.json, so a new endpoint is covered without editing this
file), the OpenAI-compatible endpoints and the schema itself refuse a request without a valid bearer token,
and every WebSocket route (enumerated from the routing) refuses a socket without a signed-in session.

A signed-in browser session is not an API credential: the API is bearer-only, so a page on another
site cannot make a signed-in browser change anything through /v1 (no CSRF surface)."""

import pytest
from asgiref.sync import async_to_sync
from channels.testing import WebsocketCommunicator
from django.conf import settings
from django.test import Client

from kiln_web.accounts.models import ApiToken
from kiln_web.asgi import application
from kiln_web.dashboard.routing import websocket_urlpatterns
from kiln_web.serving.urls import urlpatterns as openai_urlpatterns

from .conftest import call, fill, operations, session

pytestmark = pytest.mark.django_db

OPERATIONS = operations()
OPENAI = [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models")]
UNAUTHENTICATED, NOT_FOUND = 4401, 4404


def test_the_openai_list_matches_the_routes():
    assert {path for _, path in OPENAI} == {"/v1/" + str(pattern.pattern) for pattern in openai_urlpatterns}


def bad_credentials(world) -> dict:
    """name -> headers: nothing usable as a token, and tokens that once were or nearly are."""
    revoked = ApiToken.objects.get(user=world.other)
    revoked_token = world.other.token
    revoked.delete()
    world.staff.is_active = False
    world.staff.save()
    token = world.owner.token
    changed = token[:-1] + ("A" if token[-1] != "A" else "B")
    return {
        "none": {},
        "unknown token": {"HTTP_AUTHORIZATION": "Bearer kiln_not-a-real-token"},
        "empty bearer": {"HTTP_AUTHORIZATION": "Bearer "},
        "basic scheme": {"HTTP_AUTHORIZATION": "Basic YWRhOnB3"},
        "token without scheme": {"HTTP_AUTHORIZATION": token},
        "token with a character changed": {"HTTP_AUTHORIZATION": f"Bearer {changed}"},
        "token's stored hash": {"HTTP_AUTHORIZATION": f"Bearer {ApiToken.objects.get(user=world.owner).token_hash}"},
        "revoked token": {"HTTP_AUTHORIZATION": f"Bearer {revoked_token}"},
        "inactive user's token": {"HTTP_AUTHORIZATION": f"Bearer {world.staff.token}"},
    }


def test_every_operation_refuses_every_bad_credential(world):
    """401 with the API's error shape and a WWW-Authenticate challenge; nothing changes."""
    from kiln_web.jobs.models import TrainingJob

    statuses = dict(TrainingJob.objects.values_list("pk", "status"))
    failures = []
    for name, headers in bad_credentials(world).items():
        for method, template, _ in OPERATIONS + [(m, p, None) for m, p in OPENAI]:
            response = call(Client(), method, fill(template, world.path_values()), {}, **headers)
            if (response.status_code != 401 or not response["WWW-Authenticate"].startswith("Bearer")
                    or response.json()["error"]["code"] != "unauthorized"):
                failures.append((name, method, template, response.status_code))
    assert failures == []
    assert dict(TrainingJob.objects.values_list("pk", "status")) == statuses


def test_a_signed_in_session_is_not_an_api_credential(world):
    """Even with a valid session (and its CSRF token), /v1 answers 401: cookies never authorise a change."""
    browser = session(world.owner, csrf=False)
    for method, template, _ in OPERATIONS + [(m, p, None) for m, p in OPENAI]:
        response = call(browser, method, fill(template, world.path_values()), {})
        assert response.status_code == 401, (method, template, response.content[:200])


def test_the_schema_and_docs_need_a_token_or_a_session(world):
    assert Client().get("/v1/openapi.json").status_code == 401
    assert Client().get("/v1/docs").status_code == 401
    assert Client().get("/v1/openapi.json", HTTP_AUTHORIZATION="Bearer kiln_wrong").status_code == 401
    assert Client().get("/v1/openapi.json", HTTP_AUTHORIZATION=f"Bearer {world.owner.token}").status_code == 200
    assert session(world.owner).get("/v1/docs").status_code == 200


def test_every_operation_answers_a_valid_token(world):
    """The other side of the refusals: with a valid token no operation answers 401 (the table is not vacuous)."""
    headers = {"HTTP_AUTHORIZATION": f"Bearer {world.owner.token}"}
    for method, template, _ in OPERATIONS:
        if method in ("DELETE",):
            continue  # deleting would change the world the other operations read
        response = call(Client(), method, fill(template, world.path_values()), {}, **headers)
        assert response.status_code != 401, (method, template)


# -- WebSockets --


def _socket_paths(world) -> list[str]:
    return ["/" + fill(str(pattern.pattern), world.path_values()) for pattern in websocket_urlpatterns]


def _cookie(user) -> bytes:
    client = Client()
    client.force_login(user)
    return f"{settings.SESSION_COOKIE_NAME}={client.cookies[settings.SESSION_COOKIE_NAME].value}".encode()


def _close_code(path: str, cookie: bytes | None, origin: bytes = b"http://localhost") -> int | None:
    """The close code a socket gets (None when it is accepted)."""
    async def connect():
        headers = [(b"origin", origin)] + ([(b"cookie", cookie)] if cookie else [])
        communicator = WebsocketCommunicator(application, path, headers=headers)
        accepted, code = await communicator.connect(timeout=30)
        await communicator.disconnect(timeout=30)
        return None if accepted else code

    return async_to_sync(connect)()


@pytest.mark.django_db(transaction=True)  # the consumers read the session from another thread
def test_every_websocket_refuses_a_missing_or_forged_session(world):
    paths = _socket_paths(world)
    assert len(paths) == len(websocket_urlpatterns) >= 2
    forged = f"{settings.SESSION_COOKIE_NAME}=0123456789abcdefghijklmnopqrstuv".encode()
    for path in paths:
        assert _close_code(path, None) == UNAUTHENTICATED, path
        assert _close_code(path, forged) == UNAUTHENTICATED, path
        assert _close_code(path, _cookie(world.owner)) is None, path  # the owner's own session is accepted
        # a page on another site cannot open a socket with the person's cookie
        assert _close_code(path, _cookie(world.owner), origin=b"http://evil.example") is not None, path


@pytest.mark.django_db(transaction=True)
def test_a_job_socket_refuses_someone_elses_job_and_admits_staff(world):
    job_path = next(path for path in _socket_paths(world) if world.job_id in path)
    assert _close_code(job_path, _cookie(world.other)) == NOT_FOUND
    assert _close_code(job_path, _cookie(world.staff)) is None
