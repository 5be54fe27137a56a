"""CSRF: every page outside /v1 (the dashboard, sign-in and sign-out, the admin; enumerated from the URL
configuration) refuses a POST without the CSRF token with 403, for a signed-in person and for anyone;
every POST form in the templates and on the rendered pages carries the token, and the same POST with the
token gets past the check. (/v1 takes bearer tokens only, never the session: test_authentication.)"""

import re
from pathlib import Path

import pytest
from django.conf import settings
from django.test import Client
from django.urls import URLResolver, get_resolver

from kiln_web.dashboard.forms import JOB_FORMS

from .conftest import fill, session

pytestmark = pytest.mark.django_db

POST_FORM = re.compile(r"<form\b[^>]*method=\"post\"[^>]*>(.*?)</form>", re.IGNORECASE | re.DOTALL)


def site_routes() -> list[str]:
    """Every URL pattern outside /v1/, with its parameters as templates ({name})."""
    routes = []

    def walk(patterns, prefix=""):
        for pattern in patterns:
            route = prefix + str(pattern.pattern)
            if route.startswith("v1/"):
                continue
            if isinstance(pattern, URLResolver):
                if route.startswith("admin/"):  # the admin's own pages: its sign-in and one change form
                    routes.extend(["admin/login/", "admin/auth/user/add/", "admin/jobs/trainingjob/{job_id}/change/"])
                    continue
                walk(pattern.url_patterns, route)
            else:
                routes.append(route)

    walk(get_resolver().url_patterns)
    return routes


def _values(world) -> dict:
    return {"kind": "sft", "job_id": world.job_id, "name": world.teacher, "uidb64": "MQ", "token": "set-password",
            "action": "unload", "run_id": world.eval_run_id}


def _path(world, route: str) -> str:
    path = "/" + fill(route, _values(world))
    return path.replace(f"/adapters/{world.teacher}/", f"/adapters/{world.adapter}/")


def test_the_enumeration_finds_the_dashboard_forms():
    routes = site_routes()
    for route in ("jobs/new/<slug:kind>/", "jobs/<uuid:job_id>/stop/", "jobs/<uuid:job_id>/resume/", "teachers/",
                  "teachers/<str:name>/delete/", "adapters/<str:name>/<str:action>/", "accounts/login/",
                  "accounts/logout/"):
        assert route in routes


def test_every_post_without_the_token_is_refused(world):
    staff = session(world.staff)
    failures = []
    for route in site_routes():
        path = _path(world, route)
        for who, client in (("signed in", staff), ("anyone", Client(enforce_csrf_checks=True))):
            response = client.post(path, {"name": "x@openai", "output_name": "x"})
            if response.status_code != 403:
                failures.append((route, who, response.status_code))
    assert failures == []


def test_every_post_form_in_the_templates_carries_the_token():
    root = Path(settings.TEMPLATES[0]["DIRS"][0])
    forms = [(path.name, body) for path in root.rglob("*.html") for body in POST_FORM.findall(path.read_text())]
    assert len(forms) >= 6
    assert [name for name, body in forms if "{% csrf_token %}" not in body] == []


def _rendered_forms(client, page: str) -> list[tuple[str, str]]:
    """(action, body) of each POST form on PAGE as rendered."""
    html = client.get(page).content.decode()
    out = []
    for match in re.finditer(r"(<form\b[^>]*method=\"post\"[^>]*>)(.*?)</form>", html, re.IGNORECASE | re.DOTALL):
        action = re.search(r"action=\"([^\"]*)\"", match.group(1))
        out.append((action.group(1) if action else page, match.group(2)))
    return out


def test_rendered_forms_carry_the_token_and_pass_the_check_with_it(world):
    browser = session(world.owner)
    pages = ["/", f"/jobs/{world.queued_job_id}/", "/teachers/", "/adapters/",
             *[f"/jobs/new/{kind}/" for kind in JOB_FORMS]]
    seen = set()
    for page in pages:
        for action, body in _rendered_forms(browser, page):
            assert 'name="csrfmiddlewaretoken"' in body, (page, action)
            seen.add(action)
    assert {"/accounts/logout/", f"/jobs/{world.queued_job_id}/stop/", "/teachers/",
            f"/teachers/{world.teacher}/delete/", "/jobs/new/sft/"} <= seen

    for action in sorted(seen - {"/accounts/logout/"}):  # signing out last
        token = browser.cookies["csrftoken"].value
        without = browser.post(action, {"name": "x@openai"})
        assert without.status_code == 403, action
        assert browser.post(action, {"name": "x@openai", "csrfmiddlewaretoken": token}).status_code != 403, action
    token = browser.cookies["csrftoken"].value
    assert browser.post("/accounts/logout/").status_code == 403
    assert browser.post("/accounts/logout/", {"csrfmiddlewaretoken": token}).status_code == 302


def test_the_sign_in_form_needs_the_token(world):
    world.owner.set_password("a long enough password 1")
    world.owner.save()
    browser = Client(enforce_csrf_checks=True)
    credentials = {"username": "ada", "password": "a long enough password 1"}
    assert browser.post("/accounts/login/", credentials).status_code == 403
    browser.get("/accounts/login/")
    token = browser.cookies["csrftoken"].value
    assert browser.post("/accounts/login/", credentials | {"csrfmiddlewaretoken": token}).status_code == 302
