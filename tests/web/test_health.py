"""The health check answers without a session; the landing page needs one."""

import pytest

import kiln_web


def test_healthz(client):
    response = client.get("/healthz")
    assert response.status_code == 200
    assert response["Content-Type"] == "application/json"
    assert response.json() == {"status": "ok", "version": kiln_web.__version__}


def test_healthz_refuses_post(client):
    assert client.post("/healthz").status_code == 405


@pytest.mark.django_db
def test_index_redirects_anonymous_to_login(client):
    response = client.get("/")
    assert response.status_code == 302
    assert response["Location"] == "/accounts/login/?next=/"


@pytest.mark.django_db
def test_login_page_renders(client):
    response = client.get("/accounts/login/")
    assert response.status_code == 200
    assert b"Sign in" in response.content


@pytest.mark.django_db
def test_index_for_signed_in_user(client, django_user_model):
    user = django_user_model.objects.create_user(username="ada", password="pw-not-checked")
    client.force_login(user)
    response = client.get("/")
    assert response.status_code == 200
    assert b"Kiln" in response.content
    assert b"ada" in response.content


def test_static_css_served_through_asgi_app():
    """`kiln up` serves the ASGI app alone, so it must hand out the static files itself."""
    from asgi_http import asgi_request
    from asgiref.sync import async_to_sync

    from kiln_web.asgi import application

    status, _, body = async_to_sync(asgi_request)(application, "GET", "/static/kiln.css")
    assert status == 200
    assert b"Kiln" in body
