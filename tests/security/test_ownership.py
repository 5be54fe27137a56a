"""People see and act only on their own jobs, checkpoints, adapters, suites and evaluations; staff see and
act on everyone's. One test per /v1 operation (enumerated from the schema: a new operation fails
`test_every_operation_is_classified` until it gets a row here), each across two people and staff.

Someone else's job, suite, evaluation or adapter answers 404, the same as one that does not exist (a
submission under someone else's adapter name is refused 409 adapter_name_taken, without saying whose).
Teacher aliases are global names (OPD runs name teachers by alias), readable by everyone by design, so
changing someone else's answers 403 `teacher_not_yours`. The dashboard's pages are enumerated from the URL
configuration the same way.
"""

import re
from dataclasses import dataclass, field

import pytest
from django.test import Client
from django.urls import URLResolver, get_resolver

from kiln_web.adapters.models import Adapter
from kiln_web.evals.models import EvalRun, EvalSuite
from kiln_web.jobs.models import TrainingJob
from kiln_web.teachers.models import TeacherAlias

from .conftest import call, fill, operations, session

pytestmark = pytest.mark.django_db

TEACHER = {"endpoint": "http://127.0.0.1:9", "model": "other"}


def _sft(world, adapter=None, **config):
    return {"data": [{"prompt": "q", "completion": "a"}], "config": {"output_name": adapter or world.adapter, **config}}


@dataclass
class Case:
    """How the other person attacks one operation: the path's values and body, the status they get (and code),
    and the status staff get for the same request (None: anything but 401, 403 and 404)."""

    body: object = None
    values: dict = field(default_factory=dict)
    other: int = 404
    code: str | None = None
    staff: int | None = None
    listing: str | None = None  # a list operation: the key whose values name the owner's objects


# operationId -> the attack; `world` fills the blanks (see _request)
CASES = {
    "submit_sft": Case(body=_sft, other=409, code="adapter_name_taken"),
    "submit_grpo": Case(body=lambda w: {"groups": [{"prompt": "p", "completions": [{"text": "a", "reward": 1.0}]}],
                                        "config": {"output_name": w.adapter}}, other=409, code="adapter_name_taken"),
    "submit_opd": Case(body=lambda w: {"prompts": ["p"], "config": {"output_name": w.adapter, "teacher": w.teacher}},
                       other=409, code="adapter_name_taken"),
    "list_jobs": Case(listing="id"),
    "get_job": Case(),
    "resume_job": Case(body=lambda w: {}),
    "cancel_job": Case(values={"job_id": "queued_job_id"}),
    "list_job_checkpoints": Case(),
    "list_job_metrics": Case(),
    "list_job_events": Case(),
    "list_teachers": Case(listing=None),  # public: checked in its own test
    "create_teacher": Case(body=lambda w: {"name": w.teacher, **TEACHER}, other=409, code="teacher_exists", staff=409),
    "get_teacher": Case(values={"name": "teacher"}, other=200, staff=200),
    "update_teacher": Case(values={"name": "teacher"}, body=lambda w: TEACHER, other=403, code="teacher_not_yours",
                           staff=200),
    "delete_teacher": Case(values={"name": "teacher"}, other=403, code="teacher_not_yours", staff=204),
    "list_adapters": Case(listing="name"),
    "get_adapter": Case(code="adapter_not_found", staff=200),
    "delete_adapter": Case(code="adapter_not_found", staff=409),  # staff: busy (a queued evaluation)
    "load_adapter": Case(body=lambda w: {}, code="adapter_not_found"),
    "unload_adapter": Case(code="adapter_not_found", staff=409),  # staff: not loaded
    "activate_adapter": Case(code="adapter_not_found", staff=409),  # staff: not loaded
    "share_adapter": Case(body=lambda w: {"user": w.other.username}, code="adapter_not_found", staff=201),
    "unshare_adapter": Case(code="adapter_not_found", staff=404),  # staff: nothing shared yet
    "list_promotions": Case(listing="adapter"),
    "create_suite": Case(body=lambda w: {"name": w.suite, "content": '{"prompt": "x", "expected": "y"}'},
                         other=409, code="suite_exists", staff=409),
    "list_suites": Case(listing="name"),
    "get_suite": Case(values={"name": "suite"}),
    "create_eval_run": Case(body=lambda w: {"adapter": w.adapter, "suite": w.suite}, code="adapter_not_found"),
    "list_eval_runs": Case(listing="id"),
    "get_eval_run": Case(),
}
OPERATIONS = {operation["operationId"]: (method, path) for method, path, operation in operations()}


def test_every_operation_is_classified():
    assert sorted(set(OPERATIONS) - set(CASES)) == [], "add a row to CASES for each new operation"
    assert sorted(set(CASES) - set(OPERATIONS)) == []


def _request(world, operation_id: str, user):
    method, template = OPERATIONS[operation_id]
    case = CASES[operation_id]
    values = world.path_values() | {key: getattr(world, attribute) for key, attribute in case.values.items()}
    body = case.body(world) if callable(case.body) else case.body
    client = Client(HTTP_AUTHORIZATION=f"Bearer {user.token}")
    return call(client, method, fill(template, values), body)


def _snapshot(world) -> dict:
    """What the other person must not be able to change."""
    return {"jobs": dict(TrainingJob.objects.values_list("pk", "status")),
            "adapters": dict(Adapter.objects.values_list("name", "owner_id")),
            "teachers": dict(TeacherAlias.objects.values_list("name", "identity_revision")),
            "suites": sorted(EvalSuite.objects.values_list("name", flat=True)),
            "runs": dict(EvalRun.objects.values_list("pk", "status"))}


@pytest.mark.parametrize("operation_id", sorted(CASES))
def test_the_other_person_is_refused_and_staff_is_not(world, operation_id):
    case = CASES[operation_id]
    if case.listing is not None or operation_id == "list_teachers":
        _check_listing(world, operation_id, case)
        return
    before = _snapshot(world)
    response = _request(world, operation_id, world.other)
    assert response.status_code == case.other, (operation_id, response.content[:300])
    if case.code:
        assert response.json()["error"]["code"] == case.code
    if response.status_code == 404:
        assert "error" in response.json()
    assert _snapshot(world) == before, f"{operation_id} by another person changed something"

    response = _request(world, operation_id, world.staff)
    if case.staff is None:
        assert response.status_code not in (401, 403, 404), (operation_id, response.content[:300])
    else:
        assert response.status_code == case.staff, (operation_id, response.content[:300])


def _check_listing(world, operation_id, case):
    method, template = OPERATIONS[operation_id]
    owner_items = _request(world, operation_id, world.owner).json()["items"]
    other_items = _request(world, operation_id, world.other).json()["items"]
    staff_items = _request(world, operation_id, world.staff).json()["items"]
    if operation_id == "list_teachers":  # aliases are public names: everyone lists them
        assert [item["name"] for item in other_items] == [item["name"] for item in owner_items] == [world.teacher]
        return
    if operation_id == "list_promotions":  # nothing promoted yet: promote the owner's adapter first
        _promote(world)
        owner_items = _request(world, operation_id, world.owner).json()["items"]
        other_items = _request(world, operation_id, world.other).json()["items"]
        staff_items = _request(world, operation_id, world.staff).json()["items"]
    mine = {item[case.listing] for item in owner_items}
    assert mine, f"{operation_id}: the owner lists nothing, so the test would prove nothing"
    assert not mine & {item[case.listing] for item in other_items}, f"{operation_id} shows another person's objects"
    assert mine <= {item[case.listing] for item in staff_items}


def _promote(world) -> None:
    from kiln_web.serving import runtime
    from kiln_web.serving.actions import adapter_for, do_promote

    do_promote(adapter_for(world.owner, world.adapter), "kiln-tiny", runtime.snapshot_sha256(world.adapter),
               decided_by="test", reason="a promotion to list")


def test_a_checkpoint_cannot_be_resumed_into_someone_elses_run(world):
    """Checkpoints are reached only through their adapter: resuming another person's checkpoint under one's own
    adapter name is refused as for a checkpoint that does not exist, and under their name is 409
    adapter_name_taken."""
    bob = Client(HTTP_AUTHORIZATION=f"Bearer {world.other.token}")
    own_name = call(bob, "POST", "/v1/train/sft", _sft(world, adapter="bobs-own", resume_checkpoint=world.checkpoint))
    assert own_name.status_code == 400 and own_name.json()["error"]["code"] == "not_found"  # as if it were not there
    theirs = call(bob, "POST", "/v1/train/sft", _sft(world, resume_checkpoint=world.checkpoint))
    assert theirs.status_code == 409 and theirs.json()["error"]["code"] == "adapter_name_taken"
    assert not TrainingJob.objects.filter(owner=world.other).exists()


@pytest.mark.parametrize("kind", ["sft", "grpo"])
def test_someone_elses_checkpoint_is_answered_as_one_that_does_not_exist(world, settings, kind):
    """Naming another person's checkpoint (by basename or by path) under one's own adapter tells nothing: not that
    it exists (wrong_adapter), nor its kind (wrong_kind), nor anything its manifest holds; the answer is the one for
    a step that was never written. The owner and staff still get wrong_adapter."""
    bob = Client(HTTP_AUTHORIZATION=f"Bearer {world.other.token}")
    missing = world.checkpoint.replace("-step-", "-step-9")
    bodies = {"sft": lambda ref: _sft(world, adapter="bobs-own", resume_checkpoint=ref),
              "grpo": lambda ref: {"groups": [{"prompt": "p", "completions": [{"text": "a", "reward": 1.0},
                                                                                {"text": "b", "reward": 0.0}]}],
                                   "config": {"output_name": "bobs-own", "resume_checkpoint": ref}}}
    for reference in (world.checkpoint, str(settings.KILN_ADAPTERS_DIR / world.checkpoint)):
        theirs = call(bob, "POST", f"/v1/train/{kind}", bodies[kind](reference))
        unknown = call(bob, "POST", f"/v1/train/{kind}", bodies[kind](reference.replace(world.checkpoint, missing)))
        assert unknown.json()["error"]["code"] == "not_found", unknown.content
        assert theirs.status_code == unknown.status_code, theirs.content
        assert theirs.content.decode().replace(world.checkpoint, "C") == unknown.content.decode().replace(missing, "C")
    for who in (world.owner, world.staff):
        response = call(Client(HTTP_AUTHORIZATION=f"Bearer {who.token}"), "POST", f"/v1/train/{kind}",
                        bodies[kind](world.checkpoint))
        assert response.json()["error"]["code"] == ("wrong_adapter" if kind == "sft" else "wrong_kind"), who
    assert not TrainingJob.objects.filter(owner=world.other).exists()


# -- the dashboard (every URL pattern of kiln_web.dashboard.urls, enumerated: a new page fails until classified) --

# URL name -> how the other person is answered: a status for each method (staff get anything but 403 and 404),
# "listing" (the page lists the owner's objects: the other person's shows none of them, staff's shows them), or
# why the page names nobody's objects
DASHBOARD = {
    "job": {"GET": 404},
    "job_snapshot": {"GET": 404},
    "stop_job": {"POST": 404},
    "resume_job": {"GET": 404, "POST": 404},
    "adapter": {"GET": 404},
    "adapter_action": {"POST": 404},  # every action for every person: test_adapter_visibility.py
    "eval_run": {"GET": 404},
    "jobs": "listing",
    "job_rows": "listing",
    "adapters": "listing",
    "eval_runs": "listing",
    "promotions": "listing",
    "new_job": "a blank form; a submission is refused as through the API (test_data_roots.py)",
    "qualification": "the server's receipts, the same for everyone",
    "teachers": "teacher aliases are global names, listed to everyone (their hidden adapters: test_adapter_visibility)",
    "delete_teacher": "test_dashboard_teacher_delete_is_refused_for_the_other_person",
}


def dashboard_routes() -> dict[str, str]:
    """URL name -> route (with <type:name> parameters) for every pattern of the dashboard."""
    resolver = next(pattern for pattern in get_resolver().url_patterns
                    if isinstance(pattern, URLResolver) and pattern.namespace == "dashboard")
    return {pattern.name: str(resolver.pattern) + str(pattern.pattern) for pattern in resolver.url_patterns}


def test_every_dashboard_route_is_classified():
    assert sorted(set(dashboard_routes()) ^ set(DASHBOARD)) == [], "classify each new dashboard page in DASHBOARD"


def _dashboard_path(world, name: str) -> str:
    values = {"job_id": world.queued_job_id if name == "stop_job" else world.job_id, "name": world.adapter,
              "action": "unload", "run_id": world.eval_run_id, "kind": "sft"}
    return "/" + fill(dashboard_routes()[name], values)


@pytest.mark.parametrize("name, method", [(name, method) for name, case in DASHBOARD.items()
                                          if isinstance(case, dict) for method in case])
def test_dashboard_pages_and_actions_refuse_the_other_person(world, name, method):
    path = _dashboard_path(world, name)
    before = _snapshot(world)
    response = call(session(world.other, csrf=False), method, path)
    assert response.status_code == DASHBOARD[name][method], (path, response.status_code)
    assert _snapshot(world) == before
    assert call(session(world.staff, csrf=False), method, path).status_code not in (403, 404), path


LISTED = {"jobs": "job_id", "job_rows": "job_id", "adapters": "adapter", "eval_runs": "eval_run_id",
          "promotions": "adapter"}  # the attribute of `world` that names what the page lists


def test_dashboard_lists_show_only_ones_own(world):
    _promote(world)  # so that the promotions page has the owner's decision to show
    assert sorted(LISTED) == sorted(name for name, case in DASHBOARD.items() if case == "listing")
    bob, root = session(world.other), session(world.staff)
    for name, attribute in LISTED.items():
        path, needle = _dashboard_path(world, name), getattr(world, attribute)
        assert needle not in bob.get(path).content.decode(), path
        assert needle in root.get(path).content.decode(), path


def test_dashboard_teacher_delete_is_refused_for_the_other_person(world):
    response = session(world.other, csrf=False).post(f"/teachers/{world.teacher}/delete/", follow=True)
    assert TeacherAlias.objects.filter(name=world.teacher).exists()
    assert "belongs to" in response.content.decode()


def test_an_alias_in_use_by_someone_elses_job_does_not_name_that_job(world, settings):
    """The alias's owner is refused changing it while another person's OPD job uses it (teacher_in_use), without
    that job's id, which they could neither read nor cancel; staff, who can, are given it."""
    from kiln_web.teachers.actions import do_create_teacher

    alias = do_create_teacher(world.owner, f"{world.adapter}-tiny@native", {"base": "kiln-tiny"}).name
    bob = Client(HTTP_AUTHORIZATION=f"Bearer {world.other.token}")
    job = call(bob, "POST", "/v1/train/opd", {"prompts": ["Say kiln."],
                                              "config": {"output_name": "bobs-opd", "teacher": alias}})
    assert job.status_code == 201, job.content
    job_id = job.json()["id"]
    for method, body in (("PUT", {"base": "kiln-tiny"}), ("DELETE", None)):
        refused = call(Client(HTTP_AUTHORIZATION=f"Bearer {world.owner.token}"), method, f"/v1/teachers/{alias}",
                       body)
        assert refused.status_code == 409 and refused.json()["error"]["code"] == "teacher_in_use"
        assert job_id not in refused.content.decode() and "job_id" not in refused.json()["error"], refused.content
        staff = call(Client(HTTP_AUTHORIZATION=f"Bearer {world.staff.token}"), method, f"/v1/teachers/{alias}", body)
        assert staff.status_code == 409 and staff.json()["error"]["job_id"] == job_id
    assert TeacherAlias.objects.filter(name=alias).exists()


def test_a_shared_adapter_lists_none_of_its_owners_jobs_or_checkpoints(world):
    """Sharing an adapter lets the person use it, not read its owner's training: the adapters list shows them
    neither the owner's latest job (someone else's job is 404 to them) nor its checkpoints, as the adapter's own
    page and the API do not; its owner and staff still see both."""
    from kiln_web.serving.actions import do_share_adapter

    do_share_adapter(world.owner, world.adapter, kind="user", target=world.other.get_username())
    step = f"step {int(world.checkpoint.split('-step-')[1].split('.')[0])}"
    shared = session(world.other).get("/adapters/").content.decode()
    assert world.adapter in shared
    counts = re.compile(r"\d+ valid")  # the checkpoints column: "N valid"
    assert world.job_id not in shared and step not in shared and not counts.search(shared), "the owner's training shows"
    for who in (world.owner, world.staff):
        page = session(who).get("/adapters/").content.decode()
        assert world.job_id in page and step in page and counts.search(page)
    api = {who: Client(HTTP_AUTHORIZATION=f"Bearer {who.token}").get(f"/v1/adapters/{world.adapter}").json()
           for who in (world.owner, world.other, world.staff)}
    assert api[world.other]["checkpoint_records"] is None  # as latest_promotion and shares
    assert api[world.owner]["checkpoint_records"] == api[world.staff]["checkpoint_records"] > 0
