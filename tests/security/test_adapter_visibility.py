"""Serving follows ownership: who may see, use and change an adapter, for every route that touches one.

Three people and staff: alice owns `alicebot` (loaded, active in her scope), bob has nothing shared, carol has
it shared with her (POST /v1/adapters/{name}/shares), root is staff. The routes are enumerated from the OpenAPI
schema and the URL configuration: a route that the tables below do not classify fails
`test_every_route_is_classified`, so a new one cannot be forgotten.

The rule (kiln_web.adapters.models): alice, carol and staff may use it (serve it, list it, evaluate with it);
only alice and staff may change it (load, unload, activate, delete, share). Bob is answered exactly as for a
name that does not exist (404 adapter_not_found, model_not_found); carol asking to change it is
403 adapter_not_yours. A request naming no model gets the caller's own active adapter, else the default base.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
from django.contrib.auth.models import Group
from django.test import Client
from django.urls import URLResolver, get_resolver

from kiln_web.adapters.models import Adapter, AdapterShare
from kiln_web.core import auth_cache
from kiln_web.dashboard import views as dashboard_views
from kiln_web.serving.models import ServedAdapter
from serving.helpers import publish_adapter

from .conftest import call, fill, operations, session

pytestmark = pytest.mark.django_db

PEOPLE = ("alice", "bob", "carol", "root")

# -- the classification: every operation and every URL pattern, adapter-related or said why not --

# operationId -> {person: (status, error code or None)}; None: not asked of that person here. Each test runs
# bob, carol, alice, root in that order on a fresh scene, so later expectations follow earlier effects.
API = {
    "list_adapters": "listing",
    "get_adapter": {"alice": (200, None), "bob": (404, "adapter_not_found"), "carol": (200, None),
                    "root": (200, None)},
    "load_adapter": {"bob": (404, "adapter_not_found"), "carol": (403, "adapter_not_yours"), "alice": (200, None),
                     "root": (200, None)},
    "unload_adapter": {"bob": (404, "adapter_not_found"), "carol": (403, "adapter_not_yours"), "alice": (200, None),
                       "root": (409, "adapter_not_loaded")},
    "activate_adapter": {"bob": (404, "adapter_not_found"), "carol": (403, "adapter_not_yours"),
                         "alice": (200, None), "root": (200, None)},
    "delete_adapter": {"bob": (404, "adapter_not_found"), "carol": (403, "adapter_not_yours"),
                       "alice": (409, "adapter_active"), "root": (409, "adapter_active")},
    "share_adapter": {"bob": (404, "adapter_not_found"), "carol": (403, "adapter_not_yours"), "alice": (201, None),
                      "root": (409, "share_exists")},
    "unshare_adapter": {"bob": (404, "adapter_not_found"), "carol": (403, "adapter_not_yours"),
                        "alice": (204, None), "root": (404, "share_not_found")},
    "create_eval_run": {"bob": (404, "adapter_not_found"), "carol": (201, None), "alice": (201, None),
                        "root": (201, None)},
    # submitting under the name: refused without saying whose (the owner's own run is tested in test_submit)
    "submit_sft": {"bob": (409, "adapter_name_taken"), "carol": (409, "adapter_name_taken")},
    "submit_grpo": {"bob": (409, "adapter_name_taken"), "carol": (409, "adapter_name_taken")},
    "submit_opd": {"bob": (409, "adapter_name_taken"), "carol": (409, "adapter_name_taken")},
    "list_promotions": "listing",  # promotion decisions are management history: the owner's and staff's only
}
API_ELSEWHERE = {  # operations that name no adapter: their owners are tested in test_ownership.py
    **dict.fromkeys(("list_jobs", "get_job", "cancel_job", "resume_job", "list_job_checkpoints",
                     "list_job_metrics", "list_job_events"), "jobs belong to their owner"),
    **dict.fromkeys(("list_teachers", "create_teacher", "get_teacher", "update_teacher", "delete_teacher"),
                    "teacher aliases are global names"),
    **dict.fromkeys(("create_suite", "list_suites", "get_suite"), "suites belong to their owner"),
    **dict.fromkeys(("list_eval_runs", "get_eval_run"), "an evaluation run belongs to whoever asked for it"),
}
# URL patterns outside the Ninja API (those are classified above through the schema), by URL name
ROUTES = {
    "completions": "serving", "chat-completions": "serving", "models": "serving",
    "adapters": "dashboard listing", "adapter": "dashboard page", "adapter_action": "dashboard actions",
    "promotions": "dashboard listing", "eval_runs": "dashboard listing",
}
ROUTES_ELSEWHERE = {
    **dict.fromkeys(("healthz", "openapi-json", "openapi-view", "api-root"), "names no adapter"),
    **dict.fromkeys(("login", "logout", "password_change", "password_change_done", "password_reset",
                     "password_reset_done", "password_reset_confirm", "password_reset_complete"), "accounts"),
    **dict.fromkeys(("jobs", "job_rows", "new_job", "job", "job_snapshot", "stop_job", "resume_job"),
                    "jobs: test_ownership.py"),
    **dict.fromkeys(("teachers", "delete_teacher", "qualification"), "names no adapter"),
    "eval_run": "an evaluation run belongs to whoever asked for it: test_ownership.py, test_eval_pages.py",
}


def url_routes() -> list[tuple[str, str, bool]]:
    """(route, URL name, whether the Ninja API serves it) for every URL pattern; the admin is one entry."""
    routes = []

    def walk(patterns, prefix=""):
        for pattern in patterns:
            route = prefix + str(pattern.pattern)
            if isinstance(pattern, URLResolver):
                if not route.startswith("admin/"):  # the admin: staff only, and it is no route of its own here
                    walk(pattern.url_patterns, route)
            else:
                routes.append((route, pattern.name, pattern.callback.__module__.startswith("ninja")))

    walk(get_resolver().url_patterns)
    return routes


def test_every_route_is_classified():
    operation_ids = {operation["operationId"] for _, _, operation in operations()}
    assert sorted(operation_ids - set(API) - set(API_ELSEWHERE)) == [], "classify each new operation in API"
    assert sorted((set(API) | set(API_ELSEWHERE)) - operation_ids) == []
    routes = url_routes()
    ninja = [name for _, name, is_ninja in routes if is_ninja]
    assert len(ninja) == len(operation_ids)  # the schema lists every API route
    names = {name for _, name, is_ninja in routes if not is_ninja}
    assert sorted(names - set(ROUTES) - set(ROUTES_ELSEWHERE)) == [], "classify each new URL pattern in ROUTES"
    assert sorted((set(ROUTES) | set(ROUTES_ELSEWHERE)) - names) == []


# -- the scene --


@dataclass
class Scene:
    name: str  # alicebot
    people: dict  # username -> user (with .token)

    def api(self, who: str) -> Client:
        return Client(HTTP_AUTHORIZATION=f"Bearer {self.people[who].token}")


@pytest.fixture
def scene(settings, make_user, adapter_name) -> Scene:
    from kiln_web.evals.actions import do_create_suite
    from kiln_web.serving import actions

    people = {who: make_user(who, staff=who == "root") for who in PEOPLE}
    name = adapter_name
    publish_adapter(settings.KILN_HOME, settings.KILN_ADAPTERS_DIR, name, seed=1)
    Adapter.objects.create(name=name, owner=people["alice"])
    actions.do_load_adapter(people["alice"], name)
    actions.do_activate_adapter(people["alice"], name)
    for who in PEOPLE:
        do_create_suite(people[who], f"{name}-{who}", '{"prompt": "a", "expected": "b"}\n')
    shared = Client(HTTP_AUTHORIZATION=f"Bearer {people['alice'].token}")
    response = call(shared, "POST", f"/v1/adapters/{name}/shares", {"user": "carol"})
    assert response.status_code == 201, response.content
    return Scene(name, people)


def _body(scene: Scene, operation_id: str, who: str, name: str):
    return {
        "share_adapter": {"user": "bob"},
        "load_adapter": {},
        "create_eval_run": {"adapter": name, "suite": f"{scene.name}-{who}"},
        "submit_sft": {"data": [{"prompt": "q", "completion": "a"}], "config": {"output_name": name}},
        "submit_grpo": {"groups": [{"prompt": "p", "completions": [{"text": "a", "reward": 1.0}]}],
                        "config": {"output_name": name}},
        "submit_opd": {"prompts": ["p"], "config": {"output_name": name, "teacher": "t@openai"}},
    }.get(operation_id)


def _api_call(scene: Scene, operation_id: str, who: str, name: str | None = None):
    method, template, _ = next(item for item in operations() if item[2]["operationId"] == operation_id)
    name = name or scene.name
    path = fill(template, {"name": name, "kind": "user", "target": "carol"})
    return call(scene.api(who), method, path, _body(scene, operation_id, who, name))


def _state(scene: Scene):
    row = ServedAdapter.objects.filter(adapter__name=scene.name).first()
    return (Adapter.objects.filter(name=scene.name).values_list("owner__username", flat=True).first(),
            sorted(AdapterShare.objects.values_list("user__username", "group__name")),
            row and (row.generation, row.active, row.active_for_id), sorted(Adapter.objects.values_list("name")))


def _unknown_alike(response, unknown, name: str) -> None:
    """RESPONSE says exactly what UNKNOWN (the same request for a name nobody has) says, but for the name."""
    assert response.status_code == unknown.status_code
    assert response.content.decode().replace(name, "NAME") == unknown.content.decode().replace(f"{name}-gone",
                                                                                                 "NAME")


@pytest.mark.parametrize("operation_id", sorted(op for op, case in API.items() if case != "listing"))
def test_each_adapter_operation_for_each_person(scene, operation_id):
    for who in ("bob", "carol", "alice", "root"):
        expected = API[operation_id].get(who)
        if expected is None:
            continue
        before = _state(scene)
        response = _api_call(scene, operation_id, who)
        assert response.status_code == expected[0], (operation_id, who, response.content[:300])
        if expected[1] is not None:
            assert response.json()["error"]["code"] == expected[1], (operation_id, who)
        if who in ("bob", "carol") and response.status_code >= 400:
            assert _state(scene) == before, f"{operation_id} by {who} changed something"
        if who == "bob" and expected[1] == "adapter_not_found":
            _unknown_alike(response, _api_call(scene, operation_id, who, f"{scene.name}-gone"), scene.name)


def test_the_listings_show_what_each_person_may_use(scene):
    from kiln_web.serving.actions import do_promote

    listed = {who: scene.api(who).get("/v1/adapters").json() for who in PEOPLE}
    names = {who: [item["name"] for item in listed[who]["items"]] for who in PEOPLE}
    assert scene.name in names["alice"] and scene.name in names["carol"] and scene.name in names["root"]
    assert scene.name not in names["bob"]
    assert listed["alice"]["active"] == scene.name and listed["carol"]["active"] is None
    assert listed["root"]["active"] is None
    carol = next(item for item in listed["carol"]["items"] if item["name"] == scene.name)
    assert carol["can_manage"] is False and carol["shares"] is None and carol["active"] is False
    assert carol["latest_promotion"] is None
    alice = next(item for item in listed["alice"]["items"] if item["name"] == scene.name)
    assert alice["can_manage"] and [(s["kind"], s["name"]) for s in alice["shares"]] == [("user", "carol")]
    assert alice["latest_promotion"]["outcome"] == "promoted"  # her activation

    adapter = Adapter.objects.get(name=scene.name)
    do_promote(adapter, "kiln-tiny", adapter.serving.adapter_sha256, decided_by="test", reason="listed")
    promotions = {who: [item["adapter"] for item in scene.api(who).get("/v1/promotions").json()["items"]]
                  for who in PEOPLE}
    assert scene.name in promotions["alice"] and scene.name in promotions["root"]
    assert scene.name not in promotions["bob"] and scene.name not in promotions["carol"]


# -- serving --


def _complete(scene: Scene, who: str, path: str, model: str | None):
    body = ({"messages": [{"role": "user", "content": "hi"}]} if path.endswith("chat/completions") else
            {"prompt": "hi"}) | {"max_tokens": 2, "temperature": 0}
    if model is not None:
        body["model"] = model
    return scene.api(who).post(path, json.dumps(body), content_type="application/json")


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_completions_answer_only_those_who_may_use_the_adapter(scene, path):
    for who in ("alice", "carol", "root"):
        response = _complete(scene, who, path, scene.name)
        assert response.status_code == 200, (who, response.content[:300])
        assert response.json()["model"] == scene.name
    refused = _complete(scene, "bob", path, scene.name)
    assert refused.json()["error"]["code"] == "model_not_found"
    _unknown_alike(refused, _complete(scene, "bob", path, f"{scene.name}-gone"), scene.name)
    # no model: one's own active adapter, else the default base; never alice's for anyone else
    assert _complete(scene, "alice", path, None).json()["model"] == scene.name
    for who in ("bob", "carol", "root"):
        assert _complete(scene, who, path, None).json()["model"] == "kiln-tiny", who


def test_models_lists_what_the_caller_may_use(scene):
    listed = {who: {item["id"]: item for item in scene.api(who).get("/v1/models").json()["data"]} for who in PEOPLE}
    for who in PEOPLE:
        assert "kiln-tiny" in listed[who]  # bases: everyone
    assert scene.name not in listed["bob"]
    assert listed["alice"][scene.name]["kiln"]["active"] is True
    assert listed["carol"][scene.name]["kiln"]["active"] is False  # alice's default is not carol's
    assert listed["carol"][scene.name]["owned_by"] == "alice" and scene.name in listed["root"]


def test_staff_activating_sets_their_own_scope(scene):
    assert scene.api("root").post(f"/v1/adapters/{scene.name}/activate").status_code == 200
    row = ServedAdapter.objects.get(adapter__name=scene.name)
    assert row.active_for.username == "root"
    assert _complete(scene, "root", "/v1/completions", None).json()["model"] == scene.name
    assert _complete(scene, "alice", "/v1/completions", None).json()["model"] == "kiln-tiny"  # moved, not shared
    assert _complete(scene, "carol", "/v1/completions", None).json()["model"] == "kiln-tiny"


# -- evaluation --


def test_a_baseline_must_be_visible_to_the_runs_owner(scene, settings):
    own = {}
    for who in ("bob", "carol"):
        own[who] = f"{scene.name}-{who}-own"
        publish_adapter(settings.KILN_HOME, settings.KILN_ADAPTERS_DIR, own[who], seed=2)
        Adapter.objects.create(name=own[who], owner=scene.people[who])

    def run(who, baseline):
        return call(scene.api(who), "POST", "/v1/evals/runs",
                    {"adapter": own[who], "suite": f"{scene.name}-{who}", "baseline": baseline})

    refused = run("bob", scene.name)
    assert refused.json()["error"]["code"] == "adapter_not_found"
    _unknown_alike(refused, run("bob", f"{scene.name}-gone"), scene.name)
    accepted = run("carol", scene.name)
    assert accepted.status_code == 201, accepted.content
    assert accepted.json()["baseline"]["name"] == scene.name
    default = call(scene.api("carol"), "POST", "/v1/evals/runs", {"adapter": own["carol"],
                                                                   "suite": f"{scene.name}-carol"})
    assert default.json()["baseline"]["kind"] == "base"  # alice's active adapter is not carol's baseline


# -- the dashboard --


def test_dashboard_pages_follow_visibility(scene):
    pages = {who: session(scene.people[who]) for who in PEOPLE}
    for who in ("alice", "carol", "root"):
        assert scene.name in pages[who].get("/adapters/").content.decode(), who
    assert scene.name not in pages["bob"].get("/adapters/").content.decode()
    assert pages["bob"].get(f"/adapters/{scene.name}/").status_code == 404
    carol = pages["carol"].get(f"/adapters/{scene.name}/")
    assert carol.status_code == 200 and "data-shared-with-you" in carol.content.decode()
    assert "data-adapter-shares" not in carol.content.decode() and "/unload/" not in carol.content.decode()
    assert "Checkpoints of" not in carol.content.decode()  # the owner's training state stays the owner's
    alice = pages["alice"].get(f"/adapters/{scene.name}/").content.decode()
    assert "data-adapter-shares" in alice and "carol" in alice and "Checkpoints of" in alice
    for listing in ("/promotions/", "/evals/"):
        assert scene.name not in pages["bob"].get(listing).content.decode(), listing


@pytest.mark.parametrize("action", sorted(dashboard_views.ADAPTER_ACTIONS))
def test_dashboard_actions_follow_visibility(scene, action):
    fields = {"kind": "user", "target": "bob" if action == "share" else "carol"}
    path = f"/adapters/{scene.name}/{action}/"
    before = _state(scene)
    assert session(scene.people["bob"], csrf=False).post(path, fields).status_code == 404
    assert _state(scene) == before
    carol = session(scene.people["carol"], csrf=False).post(path, fields, follow=True)
    assert "only its owner" in carol.content.decode() and _state(scene) == before
    if action in ("share", "unshare"):
        session(scene.people["alice"], csrf=False).post(path, fields)
        shared_with = set(AdapterShare.objects.values_list("user__username", flat=True))
        assert shared_with == ({"carol", "bob"} if action == "share" else set())


# -- sharing takes effect at once, in every process --


def test_sharing_and_unsharing_take_effect_on_the_next_request(scene, settings):
    """No process keeps who may see an adapter: each request asks the database, so a share or an unshare (made
    here, or by any other process) holds on the very next request even while the caller's token is remembered
    (kiln_web.core.auth_cache) and the adapter is loaded here."""
    settings.KILN_AUTH_CACHE_SECONDS = 300
    alice = scene.api("alice")
    assert _complete(scene, "bob", "/v1/completions", scene.name).status_code == 404
    assert len(auth_cache.tokens) > 0  # bob's authentication is remembered from here on
    group = Group.objects.create(name=f"{scene.name}-team")
    assert call(alice, "POST", f"/v1/adapters/{scene.name}/shares", {"group": group.name}).status_code == 201
    assert _complete(scene, "bob", "/v1/completions", scene.name).status_code == 404  # not in the group yet
    scene.people["bob"].groups.add(group)
    assert _complete(scene, "bob", "/v1/completions", scene.name).status_code == 200
    assert scene.name in [item["id"] for item in scene.api("bob").get("/v1/models").json()["data"]]
    scene.people["bob"].groups.remove(group)
    assert _complete(scene, "bob", "/v1/completions", scene.name).status_code == 404
    assert call(alice, "DELETE", f"/v1/adapters/{scene.name}/shares/user/carol").status_code == 204
    assert _complete(scene, "carol", "/v1/completions", scene.name).status_code == 404
    assert scene.api("carol").get(f"/v1/adapters/{scene.name}").status_code == 404


# -- reading an adapter's weights by path: a warm start, a teacher --


def test_weights_by_path_follow_visibility(scene, settings):
    """A warm start (config.base_adapter) or a teacher alias naming the registry directory of an adapter the caller
    may not see is refused exactly as a directory that does not exist; one shared with them is not refused so."""
    from kiln_web.serving.actions import registry_adapter_hidden

    registry = settings.KILN_ADAPTERS_DIR
    theirs, gone = str(registry / scene.name), str(registry / f"{scene.name}-gone")
    assert registry_adapter_hidden(scene.people["bob"], theirs)
    assert not registry_adapter_hidden(scene.people["carol"], theirs)
    assert not registry_adapter_hidden(scene.people["alice"], theirs)
    assert registry_adapter_hidden(scene.people["bob"], str(registry / f"{scene.name}-checkpoint-step-00000002"))

    def warm_start(path):
        body = {"data": [{"prompt": "q", "completion": "a"}],
                "config": {"output_name": f"{scene.name}-bobs", "base_adapter": path}}
        return call(scene.api("bob"), "POST", "/v1/train/sft", body)

    refused = warm_start(theirs)
    assert refused.json()["error"]["code"] == "base_adapter_not_found"
    _unknown_alike(refused, warm_start(gone), scene.name)

    def teacher(path):
        return call(scene.api("bob"), "POST", "/v1/teachers",
                    {"name": f"{scene.name}-t@native", "base": "kiln-tiny", "adapter": path})

    refused = teacher(theirs)
    assert refused.json()["error"]["code"] == "adapter_not_found"
    _unknown_alike(refused, teacher(gone), scene.name)


def test_a_teacher_alias_shows_its_adapter_only_to_who_may_see_it(scene, settings):
    """Teacher aliases are global names, listed to everyone; the registry directory of alice's adapter that one
    names is shown to alice, carol (shared) and staff, and left out for bob (`adapter_hidden`), as the adapter's
    own routes answer him as for a name that does not exist. The identity revision is the same for all."""
    path = str(settings.KILN_ADAPTERS_DIR / scene.name)
    name = f"{scene.name}-t@native"
    created = call(scene.api("alice"), "POST", "/v1/teachers", {"name": name, "base": "kiln-tiny", "adapter": path})
    assert created.status_code == 201, created.content
    assert created.json()["adapter"] == path and created.json()["adapter_hidden"] is False
    for person, shown in (("alice", True), ("carol", True), ("root", True), ("bob", False)):
        one = call(scene.api(person), "GET", f"/v1/teachers/{name}").json()
        listed = [item for item in call(scene.api(person), "GET", "/v1/teachers").json()["items"]
                  if item["name"] == name]
        for document in (one, *listed):
            assert document["adapter"] == (path if shown else None), person
            assert document["adapter_hidden"] is (not shown), person
            assert document["identity_revision"] == created.json()["identity_revision"]
        page = session(scene.people[person]).get("/teachers/").content.decode()
        assert (path in page) is shown, person


# -- an unshare holds for work queued before it: the worker asks again when it starts --


def _unshare(scene, who: str = "carol") -> None:
    response = call(scene.api("alice"), "DELETE", f"/v1/adapters/{scene.name}/shares/user/{who}")
    assert response.status_code == 204, response.content


@pytest.mark.parametrize("role", ["candidate", "baseline"])
def test_an_evaluation_queued_before_an_unshare_does_not_use_the_adapter(scene, settings, role):
    """carol queues an evaluation of alice's adapter (or against it), alice stops sharing it, a worker then
    claims the run: it fails adapter_not_found, without a single answer of the adapter, as if it did not exist."""
    from kiln_web.evals.execution import execute_evaluation
    from kiln_web.evals.models import EvalRun

    body = {"adapter": scene.name, "suite": f"{scene.name}-carol"}
    if role == "baseline":
        own = f"{scene.name}-carol-own"
        publish_adapter(settings.KILN_HOME, settings.KILN_ADAPTERS_DIR, own, seed=2)
        Adapter.objects.create(name=own, owner=scene.people["carol"])
        body = {"adapter": own, "suite": f"{scene.name}-carol", "baseline": scene.name}
    queued = call(scene.api("carol"), "POST", "/v1/evals/runs", body)
    assert queued.status_code == 201, queued.content
    _unshare(scene)
    run_id = queued.json()["id"]
    assert execute_evaluation(run_id, "w") == "failed"
    run = EvalRun.objects.get(pk=run_id)
    assert run.error_code == "adapter_not_found", (run.error_code, run.error_message)
    assert scene.name in run.error_message and "alice" not in run.error_message
    assert not run.examples.exists() and run.candidate_summary in (None, {})


def test_a_warm_start_queued_before_an_unshare_does_not_read_the_adapter(scene, settings):
    from kiln_web.jobs.execution import execute_training_job
    from kiln_web.jobs.models import TrainingJob

    settings.KILN_HEARTBEAT_SECONDS = 3600
    body = {"data": [{"prompt": "q", "completion": "a"}],
            "config": {"output_name": f"{scene.name}-carols", "base_adapter": str(settings.KILN_ADAPTERS_DIR /
                                                                                   scene.name)}}
    queued = call(scene.api("carol"), "POST", "/v1/train/sft", body)
    assert queued.status_code == 201, queued.content
    _unshare(scene)
    assert execute_training_job(queued.json()["id"], "w") == "failed"
    job = TrainingJob.objects.get(pk=queued.json()["id"])
    assert job.error_code == "base_adapter_not_found", (job.error_code, job.error_message)
    assert job.committed_step == 0 and not job.metrics.exists()


def test_a_distillation_queued_before_an_unshare_does_not_read_the_teachers_adapter(scene, settings):
    from kiln_web.jobs.execution import execute_training_job
    from kiln_web.jobs.models import TrainingJob

    settings.KILN_HEARTBEAT_SECONDS = 3600
    alias = f"{scene.name}-t@native"
    created = call(scene.api("alice"), "POST", "/v1/teachers",
                   {"name": alias, "base": "kiln-tiny", "adapter": str(settings.KILN_ADAPTERS_DIR / scene.name)})
    assert created.status_code == 201, created.content
    queued = call(scene.api("carol"), "POST", "/v1/train/opd",
                  {"prompts": ["Say kiln."], "config": {"output_name": f"{scene.name}-carols", "teacher": alias}})
    assert queued.status_code == 201, queued.content
    _unshare(scene)
    assert execute_training_job(queued.json()["id"], "w") == "failed"
    job = TrainingJob.objects.get(pk=queued.json()["id"])
    assert job.error_code == "teacher_unavailable", (job.error_code, job.error_message)
    assert job.committed_step == 0 and not job.metrics.exists()


def test_a_delete_refused_for_someone_elses_evaluation_does_not_name_it(scene):
    """alice may not delete her adapter while carol's evaluation of it is queued (adapter_busy), but carol's run is
    not named to her (its own routes answer her 404); staff, who may see it, are given its id."""
    queued = call(scene.api("carol"), "POST", "/v1/evals/runs", {"adapter": scene.name, "suite": f"{scene.name}-carol"})
    assert queued.status_code == 201, queued.content
    assert call(scene.api("alice"), "POST", f"/v1/adapters/{scene.name}/unload").status_code == 200
    refused = call(scene.api("alice"), "DELETE", f"/v1/adapters/{scene.name}")
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "adapter_busy"
    assert queued.json()["id"] not in refused.content.decode(), refused.content
    staff = call(scene.api("root"), "DELETE", f"/v1/adapters/{scene.name}")
    assert staff.status_code == 409 and staff.json()["error"]["evaluation_id"] == queued.json()["id"]


def test_a_delete_refused_for_someone_elses_evaluation_against_it_does_not_name_it(scene, settings):
    """carol evaluates her own adapter with alice's (shared with her) as the baseline: alice may not delete hers
    while the run waits (adapter_busy: without its snapshot the run would fail), but carol's run is not named to her;
    staff are given its id."""
    own = f"{scene.name}-c"
    publish_adapter(settings.KILN_HOME, settings.KILN_ADAPTERS_DIR, own, seed=2)
    Adapter.objects.create(name=own, owner=scene.people["carol"])
    queued = call(scene.api("carol"), "POST", "/v1/evals/runs",
                  {"adapter": own, "suite": f"{scene.name}-carol", "baseline": scene.name})
    assert queued.status_code == 201, queued.content
    assert call(scene.api("alice"), "POST", f"/v1/adapters/{scene.name}/unload").status_code == 200
    refused = call(scene.api("alice"), "DELETE", f"/v1/adapters/{scene.name}")
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "adapter_busy", refused.content
    assert queued.json()["id"] not in refused.content.decode(), refused.content
    assert "evaluation_id" not in refused.json()["error"]
    staff = call(scene.api("root"), "DELETE", f"/v1/adapters/{scene.name}")
    assert staff.status_code == 409 and staff.json()["error"]["evaluation_id"] == queued.json()["id"]


def test_a_submission_refused_for_staffs_job_on_the_adapter_does_not_name_it(scene):
    """Staff may train alice's adapter; while that job waits, alice's own submission is refused adapter_busy without
    the job's id (staff's job answers her 404), and staff's own second submission is given it."""
    queued = _api_call(scene, "submit_sft", "root")
    assert queued.status_code == 201, queued.content
    refused = _api_call(scene, "submit_sft", "alice")
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "adapter_busy", refused.content
    assert queued.json()["id"] not in refused.content.decode() and "job_id" not in refused.json()["error"]
    again = _api_call(scene, "submit_sft", "root")
    assert again.status_code == 409 and again.json()["error"]["job_id"] == queued.json()["id"]
