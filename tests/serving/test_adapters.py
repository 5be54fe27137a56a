"""The adapter lifecycle through the API: load, activate, unload, and the deletion rules (an idle adapter
only; exactly its own checkpoint prefix and its PEFT snapshot; never a neighbour's files)."""

import json

import pytest

from kiln_web.serving import runtime
from kiln_web.serving.models import PromotionRecord, ServedAdapter
from trainer.runs import checkpoint_dir

from .conftest import ApiClient

pytestmark = pytest.mark.django_db


def checkpoint(settings, adapter: str, step: int) -> str:
    manifest = {"training": {"kind": "sft"}, "config": {}, "seed": 1,
                "progress": {"data_source_kind": "inline", "committed_step": step, "total_steps": 10,
                             "next_cursor": {"epoch": 0, "example": step}, "complete": False}}
    path = checkpoint_dir.publish_checkpoint(settings.KILN_ADAPTERS_DIR, adapter, step, checkpoint_type="sft",
                                             files={"state.json": json.dumps({"step": step}).encode()},
                                             manifest=manifest)
    return path.name


def test_load_activate_unload(api, publish, adapter_name):
    publish(adapter_name, seed=1)
    loaded = api.post(f"/v1/adapters/{adapter_name}/load")
    assert loaded.status_code == 200, loaded.content
    assert loaded.json()["base"] == "kiln-tiny" and loaded.json()["generation"] == 1
    assert adapter_name in runtime.serving().loaded_here()  # loaded in this process before it was recorded
    listing = api.get("/v1/adapters").json()
    assert listing["active"] is None
    item = next(item for item in listing["items"] if item["name"] == adapter_name)
    assert item["loaded"] and not item["active"] and item["snapshot"] and item["loaded_here"]
    assert item["owner"] == "ada"  # a snapshot no run claimed belongs to the first person to act on it

    activated = api.post(f"/v1/adapters/{adapter_name}/activate")
    assert activated.status_code == 200
    assert (activated.json()["outcome"], activated.json()["decided_by"]) == ("promoted", "ada")
    assert api.get("/v1/adapters").json()["active"] == adapter_name
    assert ServedAdapter.objects.get(adapter__name=adapter_name).active_for.username == "ada"  # ada's scope
    assert runtime.serving().pool.active is None  # activation is per person: the view resolves it, not the pool

    assert api.post(f"/v1/adapters/{adapter_name}/load").json()["generation"] == 2  # a reload
    assert api.post(f"/v1/adapters/{adapter_name}/unload").json() == {"adapter": adapter_name, "was_active": True}
    assert api.get("/v1/adapters").json()["active"] is None
    assert adapter_name not in runtime.serving().loaded_here() and runtime.serving().pool.active is None
    again = api.post(f"/v1/adapters/{adapter_name}/unload")
    assert again.status_code == 409 and again.json()["error"]["code"] == "adapter_not_loaded"


def test_activation_needs_a_load_and_loading_needs_a_fitting_snapshot(api, publish, adapter_name):
    publish(adapter_name)
    refused = api.post(f"/v1/adapters/{adapter_name}/activate")
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "adapter_not_loaded"
    missing = api.post("/v1/adapters/nobody-trained-this/load")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "adapter_not_found"
    base = api.post(f"/v1/adapters/{adapter_name}/load", {"base": "no-such-base"})
    assert base.status_code == 400 and base.json()["error"]["code"] == "base_not_found"
    assert api.post("/v1/adapters/..%2Fetc/load").status_code in (400, 404)
    assert not ServedAdapter.objects.exists()


def test_someone_elses_adapter_cannot_be_changed(api, bob, publish, adapter_name):
    publish(adapter_name)
    assert api.post(f"/v1/adapters/{adapter_name}/load").status_code == 200
    theirs = ApiClient(bob.token)
    for path in ("load", "unload", "activate"):
        response = theirs.post(f"/v1/adapters/{adapter_name}/{path}")
        assert response.status_code == 404 and response.json()["error"]["code"] == "adapter_not_found"
    assert theirs.client.delete(f"/v1/adapters/{adapter_name}").status_code == 404
    assert adapter_name not in [item["name"] for item in theirs.get("/v1/adapters").json()["items"]]


def test_delete_refuses_an_active_or_loaded_adapter(api, publish, settings, adapter_name):
    publish(adapter_name)
    checkpoint(settings, adapter_name, 5)
    api.post(f"/v1/adapters/{adapter_name}/load")
    api.post(f"/v1/adapters/{adapter_name}/activate")
    response = api.client.delete(f"/v1/adapters/{adapter_name}")
    assert response.status_code == 409 and response.json()["error"]["code"] == "adapter_active"
    assert "unload it first" in response.json()["error"]["message"]
    api.post(f"/v1/adapters/{adapter_name}/load")
    ServedAdapter.objects.filter(adapter__name=adapter_name).update(active=False)
    response = api.client.delete(f"/v1/adapters/{adapter_name}")
    assert response.status_code == 409 and response.json()["error"]["code"] == "adapter_loaded"
    assert runtime.has_snapshot(adapter_name)
    assert (settings.KILN_ADAPTERS_DIR / checkpoint_dir.checkpoint_basename(adapter_name, 5)).is_dir()


def test_delete_removes_exactly_the_idle_adapters_files(api, publish, settings, adapter_name):
    neighbour = f"{adapter_name}-2"  # shares the prefix "<adapter>-" but is another adapter
    publish(adapter_name)
    publish(neighbour)
    mine = [checkpoint(settings, adapter_name, step) for step in (5, 10)]
    theirs = checkpoint(settings, neighbour, 5)
    orphan = settings.KILN_ADAPTERS_DIR / f".staging-final-{adapter_name}-0123456789ab"
    orphan.mkdir()
    api.post(f"/v1/adapters/{adapter_name}/load")
    api.post(f"/v1/adapters/{adapter_name}/unload")

    response = api.client.delete(f"/v1/adapters/{adapter_name}")
    assert response.status_code == 200, response.content
    assert sorted(response.json()["checkpoints_removed"]) == sorted(mine)
    assert sorted(response.json()["snapshot_removed"]) == sorted([adapter_name, orphan.name])
    registry = settings.KILN_ADAPTERS_DIR
    assert not (registry / adapter_name).exists() and not orphan.exists()
    assert not any((registry / name).exists() for name in mine)
    assert (registry / theirs).is_dir() and runtime.has_snapshot(neighbour)  # the neighbour is untouched
    assert PromotionRecord.objects.count() == 0
    item = next(item for item in api.get("/v1/adapters").json()["items"] if item["name"] == adapter_name)
    assert not item["snapshot"] and not item["loaded"]  # the row stays: its jobs refer to it


def test_delete_refuses_an_adapter_being_trained(api, publish, adapter_name, settings):
    from controlplane.conftest import sft_body

    settings.KILN_SFT_RUNNER = "controlplane.fake_sft"
    publish(adapter_name)
    assert api.post("/v1/train/sft", sft_body(adapter_name)).status_code == 201  # queued
    response = api.client.delete(f"/v1/adapters/{adapter_name}")
    assert response.status_code == 409 and response.json()["error"]["code"] == "adapter_busy"
    assert runtime.has_snapshot(adapter_name)


def test_delete_refuses_the_baseline_of_a_queued_evaluation(api, publish, adapter_name):
    """An adapter named as an evaluation's baseline is evaluated too: deleting it while the run waits would fail
    the run (and a gate waiting on it would decide unavailable)."""
    from kiln_web.evals.models import EvalRun
    from kiln_web.jobs.worker import EmbeddedWorker

    baseline = f"{adapter_name}-base"
    publish(adapter_name, seed=4)
    publish(baseline, seed=5)
    api.post("/v1/evals/suites", {"name": f"{adapter_name}-suite", "content": '{"prompt": "a", "expected": "x"}\n'})
    run = api.post("/v1/evals/runs", {"adapter": adapter_name, "suite": f"{adapter_name}-suite",
                                      "baseline": baseline})
    assert run.status_code == 201, run.content
    response = api.client.delete(f"/v1/adapters/{baseline}")
    assert response.status_code == 409, response.content
    error = response.json()["error"]
    assert error["code"] == "adapter_busy" and error["evaluation_id"] == run.json()["id"] and "baseline" in \
        error["message"]
    assert runtime.has_snapshot(baseline)
    assert EmbeddedWorker().run_once()
    assert EvalRun.objects.get(pk=run.json()["id"]).status == "succeeded"
    assert api.client.delete(f"/v1/adapters/{baseline}").status_code == 200  # idle again


def test_reconcile_follows_the_database_and_refuses_a_changed_snapshot(api, publish, adapter_name):
    """Another process (a worker promoting, another web process) changes the rows; this one follows."""
    publish(adapter_name, seed=1)
    api.post(f"/v1/adapters/{adapter_name}/load")
    serving = runtime.serving()
    publish(adapter_name, seed=2)  # a newer run published over the loaded snapshot
    ada = ServedAdapter.objects.get(adapter__name=adapter_name).adapter.owner
    ServedAdapter.objects.filter(adapter__name=adapter_name).update(generation=7, active=True, active_for=ada)
    serving.reconcile(runtime.wanted_adapters())
    assert adapter_name not in serving.loaded_here()  # never served in place of what was loaded
    assert serving.refusal(adapter_name).code == "adapter_changed"
    assert serving.pool.active is None
    assert api.post(f"/v1/adapters/{adapter_name}/load").status_code == 200  # loading again accepts it
    ServedAdapter.objects.filter(adapter__name=adapter_name).update(active=True, active_for=ada)
    serving.reconcile(runtime.wanted_adapters())
    assert adapter_name in serving.loaded_here() and serving.refusal(adapter_name) is None
    assert next(w for w in runtime.wanted_adapters() if w.name == adapter_name).scope == ada.pk
    ServedAdapter.objects.all().delete()
    serving.reconcile(runtime.wanted_adapters())
    assert serving.loaded_here() == {} and serving.pool.active is None
