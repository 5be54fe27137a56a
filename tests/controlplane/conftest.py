"""Control-plane fixtures: users with API tokens, an authenticated test client, the fake SFT runner."""

import itertools

import pytest
from django.test import Client

from kiln_web.accounts.actions import do_create_token

FAKE_RUNNER = "controlplane.fake_sft"
_names = itertools.count()


class ApiClient:
    """A Django test client that sends one user's bearer token, speaking JSON."""

    def __init__(self, token: str | None):
        headers = {"HTTP_AUTHORIZATION": f"Bearer {token}"} if token else {}
        self.client = Client(**headers)

    def get(self, path, **query):
        return self.client.get(path, query)

    def post(self, path, body=None):
        return self.client.post(path, body if body is not None else {}, content_type="application/json")


@pytest.fixture
def fake_runner(settings):
    settings.KILN_SFT_RUNNER = FAKE_RUNNER
    settings.KILN_HEARTBEAT_SECONDS = 3600  # no heartbeat thread touches the test database
    return settings


@pytest.fixture
def make_user(django_user_model):
    def make(username: str, staff: bool = False):
        user = django_user_model.objects.create_user(username=username, password=None, is_staff=staff)
        _, token = do_create_token(user, "test")
        user.token = token
        return user

    return make


@pytest.fixture
def ada(make_user):
    return make_user("ada")


@pytest.fixture
def bob(make_user):
    return make_user("bob")


@pytest.fixture
def api(ada):
    return ApiClient(ada.token)


@pytest.fixture
def adapter_name():
    """A fresh adapter name: KILN_HOME (and its checkpoint registry) is shared by the whole session."""
    return f"bot-{next(_names)}-{__import__('uuid').uuid4().hex[:8]}"


def sft_body(adapter: str, records: int = 4, **config) -> dict:
    data = [{"prompt": f"q{i}", "completion": f"a{i}"} for i in range(records)]
    return {"data": data, "config": {"output_name": adapter, **config}}


def cli_runner(url, token, monkeypatch, capsys, tmp_path):
    """run(*argv) -> (exit code, stdout, stderr): `kiln ...` in-process against URL with TOKEN."""
    from kiln_web.cli import main

    monkeypatch.setenv("KILN_URL", url)
    monkeypatch.setenv("KILN_TOKEN", token)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))

    def run(*argv):
        capsys.readouterr()
        code = main(list(argv))
        out, err = capsys.readouterr()
        return code, out, err

    return run
