"""Teacher aliases through /v1/teachers, the admin and OPD submission: identity revisions, ownership,
confinement, changes refused under an active job and caught again at dequeue."""

import pytest

from kiln_web.jobs.execution import execute_training_job
from kiln_web.jobs.models import JobStatus, TrainingJob
from kiln_web.teachers.models import TeacherAlias
from trainer import teachers

from .conftest import ApiClient
from .rl_data import opd_request, write_teacher_adapter

pytestmark = pytest.mark.django_db


@pytest.fixture(scope="session")
def teacher_adapter():
    """A PEFT adapter over kiln-tiny in the session's data root ($KILN_HOME/datasets)."""
    from django.conf import settings

    directory = settings.KILN_DATASETS_DIR / "tutor-adapter"
    if not directory.exists():
        write_teacher_adapter(settings.KILN_HOME, directory, seed=5)
    return directory


def create(api, name="tutor@native", status=201, **config):
    response = api.post("/v1/teachers", {"name": name, **config})
    assert response.status_code == status, response.content
    return response.json() if status == 201 else response.json()["error"]


def test_create_list_show_with_the_trainers_identity_revision(api, teacher_adapter):
    alias = create(api, base="kiln-tiny", adapter=str(teacher_adapter))
    spec = {"alias": "tutor@native", "route": "native", "base": "kiln-tiny", "adapter": str(teacher_adapter),
            "endpoint": None, "model": None}
    assert alias["identity_revision"] == teachers.identity_revision(spec)
    assert alias["route"] == "native" and alias["owner"] == "ada" and alias["content_revision"] is None
    assert [item["name"] for item in api.get("/v1/teachers").json()["items"]] == ["tutor@native"]
    assert api.get("/v1/teachers/tutor@native").json() == alias
    remote = create(api, "qwen@openai", endpoint="http://gpu-1:8000", model="qwen35")
    assert remote["route"] == "openai" and remote["identity_revision"] != alias["identity_revision"]
    served = create(api, "qwen35@vllm", endpoint="http://gpu-1:8000", model="qwen35")
    assert served["route"] == "vllm" and served["identity_revision"] != remote["identity_revision"]
    assert create(api, base="kiln-tiny", status=409)["code"] == "teacher_exists"


@pytest.mark.parametrize("name, config, code, words, field", [
    ("tutor", {"base": "kiln-tiny"}, "invalid_request", "pattern", "name"),
    ("tutor@remote", {"base": "kiln-tiny"}, "invalid_request", "pattern", "name"),
    ("tutor@openai", {"endpoint": "http://x:1"}, "invalid_request", "an openai teacher needs model", "model"),
    ("tutor@vllm", {"endpoint": "http://x:1"}, "invalid_request", "needs model", "model"),
    ("tutor@native", {}, "invalid_request", "needs base", "base"),
    ("tutor@native", {"base": "no-such-base"}, "base_not_found", "kiln base import", "base"),
    ("tutor@native", {"base": "kiln-tiny", "endpoint": "http://x:1"}, "invalid_request", "no endpoint", "endpoint"),
    ("tutor@native", {"base": "kiln-tiny", "model": "m"}, "invalid_request", "no endpoint or model", "model"),
    ("tutor@native", {"base": "kiln-tiny", "adapter": "relative/dir"}, "invalid_request", "absolute", "adapter"),
    ("tutor@native", {"base": "kiln-tiny", "adapter": "/etc"}, "adapter_outside_roots", "data roots", "adapter"),
    ("tutor@openai", {"endpoint": "http://x:1"}, "invalid_request", "needs model", "model"),
    ("tutor@openai", {"endpoint": "ftp://x", "model": "m"}, "invalid_request", "http(s) URL", "endpoint"),
    ("tutor@openai", {"endpoint": "http://x:99999", "model": "m"}, "invalid_request", "up to 65535", "endpoint"),
    ("tutor@openai", {"endpoint": "http://x:1", "model": "a/../b"}, "invalid_request", "served model id", "model"),
    ("tutor@openai", {"endpoint": "http://x:1", "model": "m", "base": "kiln-tiny"}, "invalid_request",
     "no base or adapter", "base"),
    ("tutor@native", {"base": "kiln-tiny", "temperature": 1}, "invalid_request", "unknown field", "temperature"),
])
def test_refusals(api, name, config, code, words, field):
    error = create(api, name, status=400, **config)
    assert error["code"] == code and words in error["message"], error
    assert error.get("field") == field, error
    assert not TeacherAlias.objects.exists()


def test_a_directory_without_peft_files_is_refused(api, settings):
    empty = settings.KILN_DATASETS_DIR / "not-an-adapter"
    empty.mkdir(exist_ok=True)
    error = create(api, base="kiln-tiny", adapter=str(empty), status=400)
    assert error["code"] == "adapter_not_found" and "adapter_model.safetensors" in error["message"]


def test_only_the_owner_or_staff_change_or_delete(api, bob, make_user):
    create(api, base="kiln-tiny")
    theirs = ApiClient(bob.token)
    assert theirs.get("/v1/teachers/tutor@native").status_code == 200  # every alias is visible
    response = theirs.client.put("/v1/teachers/tutor@native", {"base": "kiln-tiny"}, content_type="application/json")
    assert response.status_code == 403 and response.json()["error"]["code"] == "teacher_not_yours"
    assert theirs.client.delete("/v1/teachers/tutor@native").status_code == 403
    staff = ApiClient(make_user("root", staff=True).token)
    assert staff.client.delete("/v1/teachers/tutor@native").status_code == 204
    assert api.get("/v1/teachers/tutor@native").status_code == 404
    assert api.client.delete("/v1/teachers/tutor@native").json()["error"]["code"] == "not_found"


def test_changing_the_configuration_changes_the_identity_revision(api, teacher_adapter):
    before = create(api, base="kiln-tiny")
    response = api.client.put("/v1/teachers/tutor@native", {"base": "kiln-tiny", "adapter": str(teacher_adapter)},
                              content_type="application/json")
    assert response.status_code == 200, response.content
    after = response.json()
    assert after["adapter"] == str(teacher_adapter) and after["identity_revision"] != before["identity_revision"]
    restored = api.client.put("/v1/teachers/tutor@native", {"base": "kiln-tiny"}, content_type="application/json")
    assert restored.json()["identity_revision"] == before["identity_revision"]  # the configuration, nothing else


def test_opd_resolves_the_alias_and_job_detail_shows_both_revisions(api, adapter_name, teacher_adapter):
    alias = create(api, base="kiln-tiny", adapter=str(teacher_adapter))
    response = api.post("/v1/train/opd", opd_request(adapter_name, "tutor@native", steps=2))
    assert response.status_code == 201, response.content
    job = response.json()
    assert job["kind"] == "opd" and job["progress"]["total_steps"] == 2
    assert job["teacher"]["alias"] == "tutor@native" and job["teacher"]["route"] == "native"
    assert job["teacher"]["identity_revision"] == alias["identity_revision"]
    assert len(job["teacher"]["content_revision"]) == 64
    row = TrainingJob.objects.get(pk=job["id"])
    assert row.request["config"]["teacher"] == "tutor@native"  # as submitted; the admission holds the spec
    assert row.admission["effective_config"]["teacher"]["adapter"] == str(teacher_adapter)
    shown = api.get("/v1/teachers/tutor@native").json()
    assert shown["content_revision"] == job["teacher"]["content_revision"] and shown["content_checked_at"]


def test_unknown_alias_is_refused(api, adapter_name):
    response = api.post("/v1/train/opd", opd_request(adapter_name, "nobody@native"))
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "teacher_not_found" and error["field"] == "config.teacher"
    assert not TrainingJob.objects.exists()


def test_an_alias_cannot_change_under_an_active_job_and_is_checked_at_dequeue(api, adapter_name, settings):
    settings.KILN_HEARTBEAT_SECONDS = 3600
    create(api, base="kiln-tiny")
    job = api.post("/v1/train/opd", opd_request(adapter_name, "tutor@native", steps=2)).json()
    response = api.client.delete("/v1/teachers/tutor@native")
    assert response.status_code == 409
    assert response.json()["error"] == {"code": "teacher_in_use", "job_id": job["id"], "message": response.json()[
        "error"]["message"]}
    # a change that slipped in after admission (here written directly) fails the job at dequeue
    TeacherAlias.objects.filter(name="tutor@native").update(identity_revision="0" * 64)
    assert execute_training_job(job["id"], "test-worker") == JobStatus.FAILED
    failed = api.get(f"/v1/train/jobs/{job['id']}").json()
    assert failed["error"]["code"] == "teacher_changed"
    assert failed["error"]["details"]["differences"][0]["field"] == "teacher.identity_revision"


def test_admin_creates_through_the_action_and_keeps_revisions_read_only(client, django_user_model, teacher_adapter):
    admin = django_user_model.objects.create_superuser("boss", password="x")
    client.force_login(admin)
    response = client.post("/admin/teachers/teacheralias/add/", {
        "name": "tutor@native", "owner": admin.pk, "base": "kiln-tiny", "adapter": str(teacher_adapter),
        "endpoint": "", "model": "", "identity_revision": "f" * 64})
    assert response.status_code == 302, response.content.decode()[-2000:]
    alias = TeacherAlias.objects.get(name="tutor@native")
    assert alias.identity_revision == teachers.identity_revision(alias.spec_fields())  # not the posted value
    response = client.post("/admin/teachers/teacheralias/add/", {
        "name": "other@native", "owner": admin.pk, "base": "no-such-base", "endpoint": "", "model": ""})
    assert response.status_code == 200 and b"kiln base import" in response.content
    page = client.get(f"/admin/teachers/teacheralias/{alias.pk}/change/").content.decode()
    assert alias.identity_revision in page and 'name="identity_revision"' not in page
    assert client.get("/admin/teachers/teacheralias/add/").status_code == 200
    assert alias.identity_revision[:12] in client.get("/admin/teachers/teacheralias/").content.decode()
    response = client.post(f"/admin/teachers/teacheralias/{alias.pk}/change/", {
        "base": "kiln-tiny", "adapter": "", "endpoint": "", "model": ""})
    assert response.status_code == 302
    changed = TeacherAlias.objects.get(pk=alias.pk)
    assert changed.adapter == "" and changed.identity_revision == teachers.identity_revision(changed.spec_fields())
    assert changed.identity_revision != alias.identity_revision
    client.post(f"/admin/teachers/teacheralias/{alias.pk}/delete/", {"post": "yes"})
    assert not TeacherAlias.objects.exists()


@pytest.mark.parametrize("change", ["delete", "update"])
def test_an_alias_deleted_or_changed_during_admission_refuses_the_submission(api, adapter_name, monkeypatch,
                                                                            teacher_adapter, change):
    """A delete (or change) of the alias that lands between the submission's look at it and the job's creation
    found no active job naming it, so it went through, and the job was queued over an alias that no longer
    existed (failing only at dequeue). The submission now checks the alias again on its locked row, in the
    transaction that creates the job: 409 teacher_changed, and nothing is queued."""
    from kiln_web.teachers import actions as teacher_actions

    create(api, base="kiln-tiny")
    resolve = teacher_actions.resolve_teacher

    def resolve_then_change(name):
        spec = resolve(name)
        if change == "delete":
            assert api.client.delete(f"/v1/teachers/{name}").status_code == 204
        else:
            changed = api.client.put(f"/v1/teachers/{name}", {"base": "kiln-tiny", "adapter": str(teacher_adapter)},
                                     content_type="application/json")
            assert changed.status_code == 200, changed.content
        return spec

    monkeypatch.setattr(teacher_actions, "resolve_teacher", resolve_then_change)
    response = api.post("/v1/train/opd", opd_request(adapter_name, "tutor@native", steps=2))
    assert response.status_code == 409, response.content
    error = response.json()["error"]
    assert error["code"] == "teacher_changed" and "submit the run again" in error["message"]
    assert error["differences"][0]["field"] == "teacher.identity_revision"
    assert not TrainingJob.objects.exists()
