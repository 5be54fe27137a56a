"""Names and links that could reach someone else's weights or files (a review of 2026-12-07).

- An adapter cannot take a registered base's name: requests name bases and adapters in one field, and a base's
  name must always mean the base (else one person's adapter would answer everyone's default requests).
- An adapter cannot take a name the registry keeps for lineage files (NAME.lineage.json, NAME.lineage.lock);
  deleting an adapter's snapshot never removes a plain file.
- A warm start's or a teacher's adapter directory whose files are links is judged by where the links lead: out
  of the registry and data roots is refused, into an adapter the caller may not see is refused as a directory
  that does not exist, and so is a link swapped in between the visibility check and admission.
- A served teacher's endpoint is never followed through a redirect, its error bodies are not handed to the
  person (the server's log has them), and its model id cannot climb out of /v1/models/.
"""

from __future__ import annotations

import os
import shutil
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from django.test import Client

from kiln_web.adapters.models import Adapter
from kiln_web.serving import actions as serving_actions
from serving.helpers import publish_adapter
from trainer import teachers
from trainer.peft import ADAPTER_FILES
from trainer.serving import ServingError, ServingPool

from .conftest import call

pytestmark = pytest.mark.django_db


def api(user) -> Client:
    return Client(HTTP_AUTHORIZATION=f"Bearer {user.token}")


def sft(user, output_name: str, **config):
    body = {"data": [{"prompt": "q", "completion": "a"}], "config": {"output_name": output_name, **config}}
    return call(api(user), "POST", "/v1/train/sft", body)


@pytest.fixture
def alices(settings, make_user, adapter_name):
    """alice's adapter ADAPTER_NAME, published in the registry, shared with nobody; bob and carol own nothing."""
    alice, bob = make_user("alice"), make_user("bob")
    publish_adapter(settings.KILN_HOME, settings.KILN_ADAPTERS_DIR, adapter_name, seed=1)
    Adapter.objects.create(name=adapter_name, owner=alice)
    return alice, bob, adapter_name


# -- names --


def test_an_adapter_cannot_take_a_base_name(settings, make_user):
    bob = make_user("bob")
    refused = sft(bob, "kiln-tiny")
    assert refused.status_code == 400, refused.content
    error = refused.json()["error"]
    assert error["field"] == "config.output_name" and "registered base" in error["message"]
    # a snapshot of that name already in the registry (put there by hand, or before this rule) is not served
    publish_adapter(settings.KILN_HOME, settings.KILN_ADAPTERS_DIR, "kiln-tiny", seed=3)
    try:
        pool = ServingPool(settings.KILN_HOME, settings.KILN_ADAPTERS_DIR)
        with pytest.raises(ServingError) as caught:
            pool.load_adapter("kiln-tiny", "kiln-tiny")
        assert caught.value.code == "adapter_name_reserved"
        assert pool.resolve("kiln-tiny").adapter_path is None  # the name means the base
        pool.close()
        response = call(api(bob), "POST", "/v1/adapters/kiln-tiny/load", {})
        assert (response.status_code, response.json()["error"]["code"]) == (409, "adapter_name_reserved")
    finally:
        shutil.rmtree(settings.KILN_ADAPTERS_DIR / "kiln-tiny")


def test_the_pool_answers_a_base_name_with_the_base_even_beside_an_adapter(settings, adapter_name):
    """Bases and adapters are kept apart in the pool: loading an adapter never replaces a loaded base."""
    publish_adapter(settings.KILN_HOME, settings.KILN_ADAPTERS_DIR, adapter_name, seed=2)
    pool = ServingPool(settings.KILN_HOME, settings.KILN_ADAPTERS_DIR)
    try:
        base = pool.resolve("kiln-tiny")
        adapter = pool.load_adapter(adapter_name, "kiln-tiny")
        assert pool.resolve("kiln-tiny") is base and pool.base("kiln-tiny") is base
        assert pool.resolve(adapter_name) is adapter and pool.adapter(adapter_name) is adapter
        with pytest.raises(ServingError) as caught:
            pool.adapter("kiln-tiny")
        assert caught.value.code == "model_not_found"
        assert {(m["name"], m["adapter"]) for m in pool.loaded()} == {("kiln-tiny", False), (adapter_name, True)}
    finally:
        pool.close()


@pytest.mark.parametrize("suffix", [".lineage.json", ".lineage.lock"])
def test_an_adapter_cannot_take_a_lineage_files_name(alices, suffix):
    _, bob, name = alices
    refused = sft(bob, name + suffix)
    assert refused.status_code == 400, refused.content
    assert refused.json()["error"]["field"] == "config.output_name" and suffix in refused.json()["error"]["message"]


def test_removing_a_snapshot_leaves_a_plain_file_of_that_name(settings, alices):
    from kiln_web.serving.runtime import remove_snapshot

    _, _, name = alices
    lineage = settings.KILN_ADAPTERS_DIR / f"{name}.lineage.json"
    lineage.write_text("{}")
    try:
        assert remove_snapshot(lineage.name) == []
        assert lineage.read_text() == "{}"
    finally:
        lineage.unlink()


# -- links --


def linked_copy(settings, target_directory, name: str):
    """A folder NAME in the data root whose PEFT files are links to TARGET_DIRECTORY's."""
    folder = settings.KILN_DATASETS_DIR / name
    folder.mkdir(parents=True)
    for file in ADAPTER_FILES:
        os.symlink(target_directory / file, folder / file)
    return folder


def teacher(user, name: str, adapter: str):
    return call(api(user), "POST", "/v1/teachers", {"name": f"{name}@native", "base": "kiln-tiny", "adapter": adapter})


def test_links_into_a_hidden_adapter_are_refused_as_missing(settings, alices):
    alice, bob, name = alices
    folder = linked_copy(settings, settings.KILN_ADAPTERS_DIR / name, f"{name}-links")
    gone = str(settings.KILN_DATASETS_DIR / f"{name}-gone")
    assert serving_actions.registry_adapter_hidden(bob, str(folder))
    assert not serving_actions.registry_adapter_hidden(alice, str(folder))

    refused, unknown = sft(bob, f"{name}-bobs", base_adapter=str(folder)), sft(bob, f"{name}-bobs", base_adapter=gone)
    assert refused.json()["error"]["code"] == unknown.json()["error"]["code"] == "base_adapter_not_found"
    refused, unknown = teacher(bob, f"{name}-t", str(folder)), teacher(bob, f"{name}-t", gone)
    assert refused.json()["error"]["code"] == unknown.json()["error"]["code"] == "adapter_not_found"
    # its owner may: the same links are her own adapter's files
    assert sft(alice, f"{name}-alices", base_adapter=str(folder)).status_code == 201


def test_links_out_of_the_roots_are_refused(settings, alices, tmp_path):
    _, bob, name = alices
    outside = tmp_path / "elsewhere"
    shutil.copytree(settings.KILN_ADAPTERS_DIR / name, outside)
    folder = linked_copy(settings, outside, f"{name}-out")
    refused = sft(bob, f"{name}-bobs", base_adapter=str(folder))
    assert refused.json()["error"]["code"] == "base_adapter_outside_roots", refused.content
    assert "adapter_config.json" in refused.json()["error"]["message"]
    refused = teacher(bob, f"{name}-t", str(folder))
    assert refused.json()["error"]["code"] == "adapter_outside_roots", refused.content


def test_hidden_registry_entries_are_nobodys(settings, alices):
    _, bob, name = alices
    for entry in (f".retired-{name}-0123456789ab", f".staging-final-{name}-0123456789ab"):
        assert serving_actions.registry_adapter_hidden(bob, str(settings.KILN_ADAPTERS_DIR / entry))


def test_a_link_swapped_after_the_visibility_check_is_refused(settings, alices, monkeypatch):
    """The request's path passes (bob's own copy), then becomes a link to alice's snapshot before admission
    resolves it: the directory admission resolved is checked too."""
    _, bob, name = alices
    mine = settings.KILN_DATASETS_DIR / f"{name}-mine"
    shutil.copytree(settings.KILN_ADAPTERS_DIR / name, mine)
    checked = serving_actions.registry_adapter_hidden
    swaps = []

    def check_then_swap(user, path_text):
        answer = checked(user, path_text)
        if not swaps and path_text == str(mine):
            shutil.rmtree(mine)
            os.symlink(settings.KILN_ADAPTERS_DIR / name, mine)
            swaps.append(path_text)
        return answer

    monkeypatch.setattr(serving_actions, "registry_adapter_hidden", check_then_swap)
    refused = sft(bob, f"{name}-bobs", base_adapter=str(mine))
    assert swaps == [str(mine)]
    assert (refused.status_code, refused.json()["error"]["code"]) == (400, "base_adapter_not_found"), refused.content


# -- served teachers --


class Endpoint:
    """A local HTTP server answering every GET with STATUS, HEADERS and BODY; `paths` records what was asked."""

    def __init__(self, status: int, body: bytes = b"", headers: dict | None = None):
        endpoint = self
        self.paths = []

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (http.server's name)
                endpoint.paths.append(self.path)
                self.send_response(status)
                for key, value in (headers or {}).items():
                    self.send_header(key, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=120)


def served(endpoint: str, model: str = "tutor") -> dict:
    spec = {"alias": "probe@openai", "route": "openai", "endpoint": endpoint, "model": model}
    return {**spec, "identity_revision": teachers.identity_revision(spec)}


def test_an_endpoints_error_body_stays_in_the_servers_log(caplog):
    endpoint = Endpoint(403, b"internal-only: db_password=hunter2")
    try:
        with caplog.at_level("WARNING", logger="kiln.teachers"), pytest.raises(teachers.TeacherError) as caught:
            teachers.endpoint_content(teachers.parse_teacher(served(endpoint.url)))
    finally:
        endpoint.close()
    assert "HTTP 403" in caught.value.message and "hunter2" not in caught.value.message
    assert "hunter2" in caplog.text


def test_an_endpoint_is_not_followed_through_a_redirect():
    inside = Endpoint(200, b'{"id": "tutor"}')
    redirecting = Endpoint(302, headers={"Location": f"{inside.url}/v1/models/tutor"})
    try:
        with pytest.raises(teachers.TeacherError) as caught:
            teachers.endpoint_content(teachers.parse_teacher(served(redirecting.url)))
    finally:
        redirecting.close()
        inside.close()
    assert "HTTP 302" in caught.value.message and "redirect" in caught.value.message
    assert redirecting.paths == ["/v1/models/tutor"] and inside.paths == []


@pytest.mark.parametrize("model", ["../../admin/secrets", "a/../b", "x?y=1", "x#y", "a b", "a//b", "/x"])
def test_a_model_id_cannot_climb_out_of_the_models_path(model):
    with pytest.raises(ValueError, match="served model id"):
        teachers.parse_teacher(served("http://127.0.0.1:9", model))


@pytest.mark.parametrize("endpoint", ["http://h:1/?x=1", "http://h:1/#f", "ftp://h/", "http:///x", "http://h /"])
def test_an_endpoint_is_a_servers_root(endpoint):
    with pytest.raises(ValueError, match="endpoint"):
        teachers.parse_teacher(served(endpoint))


def test_a_model_id_with_a_namespace_is_asked_for_as_it_is():
    endpoint = Endpoint(404)
    try:
        with pytest.raises(teachers.TeacherError):
            teachers.endpoint_content(teachers.parse_teacher(served(endpoint.url, "Qwen/Qwen2.5-0.5B:q8")))
    finally:
        endpoint.close()
    assert endpoint.paths == ["/v1/models/Qwen/Qwen2.5-0.5B:q8"]


@pytest.mark.parametrize("endpoint", ["http://ada:s3cr3t@127.0.0.1:9", "https://key@gpu-1:8000/", "http://:pw@h:1"])
def test_an_endpoint_holds_no_credentials(endpoint):
    """Aliases are listed to everyone with their endpoint, and Kiln sends a teacher no credentials (urllib would
    take 'ada:s3cr3t@127.0.0.1' for a host name): a user name or password in the URL is refused, naming why."""
    with pytest.raises(ValueError, match="user name or password") as refused:
        teachers.parse_teacher(served(endpoint))
    assert "s3cr3t" not in str(refused.value) and getattr(refused.value, "field", None) == "endpoint"
