"""An evaluation compares answers over one base: the baseline is the active adapter only when it is over the
candidate's base, else that base itself; a baseline a person names over another base is refused
(cross_base_comparison, naming both bases). At the action level, through the API, and for a promotion gate."""

import json

import pytest

from kiln_web.adapters.models import Adapter
from kiln_web.core.http import ActionRefused
from kiln_web.evals import actions
from kiln_web.jobs.worker import EmbeddedWorker
from kiln_web.serving import runtime as serving_runtime
from kiln_web.serving.models import PromotionRecord, ServedAdapter

pytestmark = pytest.mark.django_db

OTHER_BASE = "smollm2-135m-instruct"  # only its name matters here: no test loads it


def suite(api, name="held-out"):
    content = json.dumps({"prompt": "Say kiln.", "expected": "kiln"}) + "\n"
    assert api.post("/v1/evals/suites", {"name": name, "content": content}).status_code == 201
    return name


def over_other_base(name: str) -> None:
    """Make the published snapshot NAME say it was trained over OTHER_BASE, as a SmolLM2 run's does."""
    path = serving_runtime.snapshot_path(name) / serving_runtime.SNAPSHOT_CONFIG
    config = json.loads(path.read_text())
    path.write_text(json.dumps(config | {"base_model_name_or_path": OTHER_BASE}))


def serve(user, name: str, base: str, active: bool = True) -> ServedAdapter:
    """The row a load records, over BASE (the scratch pool of an evaluation never reads it for a base baseline)."""
    adapter, _ = Adapter.objects.get_or_create(name=name, defaults={"owner": user})
    sha = serving_runtime.snapshot_sha256(name)
    return ServedAdapter.objects.create(adapter=adapter, base=base, adapter_sha256=sha, active=active,
                                        active_for=user if active else None, loaded_by=user.username)


@pytest.fixture
def other(ada, publish, adapter_name):
    """An adapter of ada's trained over another base."""
    name = f"{adapter_name}-smol"
    publish(name, seed=5)
    over_other_base(name)
    return name


def test_an_active_adapter_over_another_base_is_not_the_baseline(ada, api, publish, adapter_name, other):
    publish(adapter_name)
    serve(ada, other, OTHER_BASE)
    run = actions.do_enqueue_evaluation(ada, adapter_name, suite(api))
    assert (run.baseline_kind, run.baseline, run.baseline_base) == ("base", "kiln-tiny", "kiln-tiny")
    assert other in run.baseline_note and OTHER_BASE in run.baseline_note


def test_an_active_adapter_over_the_same_base_is_the_baseline(ada, api, publish, adapter_name):
    publish(adapter_name)
    publish(f"{adapter_name}-prev", seed=3)
    serve(ada, f"{adapter_name}-prev", "kiln-tiny")
    run = actions.do_enqueue_evaluation(ada, adapter_name, suite(api))
    assert (run.baseline_kind, run.baseline, run.baseline_base) == ("adapter", f"{adapter_name}-prev", "kiln-tiny")


def test_a_named_baseline_over_another_base_is_refused(ada, api, publish, adapter_name, other):
    publish(adapter_name)
    name = suite(api)
    with pytest.raises(ActionRefused) as refused:
        actions.do_enqueue_evaluation(ada, adapter_name, name, baseline=other)
    assert refused.value.status == 409 and refused.value.code == "cross_base_comparison"
    assert "'kiln-tiny'" in refused.value.message and f"'{OTHER_BASE}'" in refused.value.message
    assert refused.value.extra == {"field": "baseline", "candidate_base": "kiln-tiny", "baseline_base": OTHER_BASE}
    serve(ada, other, OTHER_BASE, active=False)
    with pytest.raises(ActionRefused) as served:  # loaded over another base: refused the same way
        actions.do_enqueue_evaluation(ada, adapter_name, name, baseline=other)
    assert served.value.code == "cross_base_comparison"
    assert not actions.visible_runs(ada).exists()


def test_the_api_refuses_a_comparison_across_bases_and_takes_one_within(api, publish, adapter_name, other,
                                                                        django_capture_on_commit_callbacks):
    publish(adapter_name)
    publish(f"{adapter_name}-peer", seed=2)
    name = suite(api)
    across = api.post("/v1/evals/runs", {"adapter": adapter_name, "suite": name, "baseline": other})
    assert across.status_code == 409, across.content
    error = across.json()["error"]
    assert error["code"] == "cross_base_comparison" and error["field"] == "baseline"
    assert error["candidate_base"] == "kiln-tiny" and error["baseline_base"] == OTHER_BASE
    assert "kiln-tiny" in error["message"] and OTHER_BASE in error["message"] and other in error["message"]
    reverse = api.post("/v1/evals/runs", {"adapter": other, "suite": name, "base": OTHER_BASE,
                                          "baseline": adapter_name})
    assert reverse.status_code == 400 and reverse.json()["error"]["code"] == "base_not_found"  # not registered here

    with django_capture_on_commit_callbacks(execute=True):
        within = api.post("/v1/evals/runs", {"adapter": adapter_name, "suite": name,
                                             "baseline": f"{adapter_name}-peer"})
    assert within.status_code == 201, within.content
    run = within.json()
    assert run["baseline"]["kind"] == "adapter" and run["baseline"]["name"] == f"{adapter_name}-peer"
    assert run["baseline"]["base"] == "kiln-tiny" and run["baseline"]["adapter_sha256"]
    assert EmbeddedWorker().run_once()
    done = api.get(f"/v1/evals/runs/{run['id']}").json()
    assert done["status"] == "succeeded", done["error"]
    base = api.post("/v1/evals/runs", {"adapter": adapter_name, "suite": name, "baseline": "kiln-tiny"}).json()
    assert base["baseline"]["kind"] == "base" and base["baseline"]["name"] == "kiln-tiny"


def test_the_api_baseline_is_the_base_when_the_active_adapter_is_over_another(ada, api, publish, adapter_name,
                                                                              other):
    publish(adapter_name)
    serve(ada, other, OTHER_BASE)
    run = api.post("/v1/evals/runs", {"adapter": adapter_name, "suite": suite(api)}).json()
    assert run["baseline"]["kind"] == "base" and run["baseline"]["name"] == "kiln-tiny"
    assert OTHER_BASE in run["baseline"]["note"]


def test_a_gate_compares_with_its_own_base_not_the_active_adapter_of_another(
        publishing_runner, ada, api, publish, adapter_name, other, django_capture_on_commit_callbacks):
    serve(ada, other, OTHER_BASE)
    content = json.dumps({"prompt": "Say kiln.", "expected": ".*", "metric": "regex"}) + "\n"
    assert api.post("/v1/evals/suites", {"name": "any", "content": content}).status_code == 201
    body = {"data": [{"prompt": f"q{i}", "completion": f"a{i}"} for i in range(3)],
            "config": {"output_name": adapter_name, "seed": 11}, "auto_load": True,
            "gate": {"suite": "any", "min_accuracy": 1.0}}
    with django_capture_on_commit_callbacks(execute=True):
        job = api.post("/v1/train/sft", body).json()
    with django_capture_on_commit_callbacks(execute=True):
        assert EmbeddedWorker().run_once()  # the training job
    job = api.get(f"/v1/train/jobs/{job['id']}").json()
    run = api.get(f"/v1/evals/runs/{job['evaluation_ids'][0]}").json()
    assert run["purpose"] == "gate" and run["baseline"]["kind"] == "base"
    assert run["baseline"]["name"] == "kiln-tiny" and OTHER_BASE in run["baseline"]["note"]
    with django_capture_on_commit_callbacks(execute=True):
        assert EmbeddedWorker().run_once()  # the gate's evaluation, then the decision
    record = PromotionRecord.objects.get(job_id=job["id"])
    assert record.outcome == "promoted", record.reason
    assert "over the base 'kiln-tiny'" in record.reason and other not in record.reason
