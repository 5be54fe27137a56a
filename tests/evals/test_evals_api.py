"""Suites and evaluation runs through the API; the run as the embedded worker and as the Celery task
execute it (the same code); per-example results; ownership."""

import json

import pytest

from kiln_web.evals.models import EvalRun
from kiln_web.jobs.worker import EmbeddedWorker
from serving.helpers import greedy_answer

from .conftest import ApiClient

pytestmark = pytest.mark.django_db


def jsonl(*lines) -> str:
    return "".join(json.dumps(line) + "\n" for line in lines)


def test_suites_are_parsed_immutable_and_private(api, bob):
    content = jsonl({"prompt": "2+2?", "expected": "4", "metric": "numeric"},
                    {"messages": [{"role": "user", "content": "Name a clay."}], "expected": "kaolin",
                     "metric": "contains"},
                    {"prompt": "Say hi", "expected": "^hi"})
    created = api.post("/v1/evals/suites", {"name": "smoke", "content": content, "default_metric": "regex"})
    assert created.status_code == 201, created.content
    assert created.json()["example_count"] == 3 and len(created.json()["digest"]) == 64
    again = api.post("/v1/evals/suites", {"name": "smoke", "content": content})
    assert again.status_code == 409 and again.json()["error"]["code"] == "suite_exists"
    bad = api.post("/v1/evals/suites", {"name": "bad", "content": '{"prompt": "x"}\n'})
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_suite"
    assert "line 1" in bad.json()["error"]["message"]
    metric = api.post("/v1/evals/suites", {"name": "bad", "content": content, "default_metric": "bleu"})
    assert metric.status_code == 400
    assert [suite["name"] for suite in api.get("/v1/evals/suites").json()["items"]] == ["smoke"]
    assert api.get("/v1/evals/suites/smoke").json()["content"] == content
    theirs = ApiClient(bob.token)
    assert theirs.get("/v1/evals/suites/smoke").status_code == 404
    assert theirs.get("/v1/evals/suites").json()["items"] == []


def test_a_run_compares_the_candidate_with_the_base_when_nothing_is_active(api, publish, settings, adapter_name,
                                                                         django_capture_on_commit_callbacks):
    publish(adapter_name, seed=4)
    expected = greedy_answer(settings.KILN_HOME, 4, "Say glaze.")
    api.post("/v1/evals/suites", {"name": "glaze", "content": jsonl(
        {"prompt": "Say glaze.", "expected": expected}, {"prompt": "Say fire.", "expected": "never this"})})
    with django_capture_on_commit_callbacks(execute=True):
        response = api.post("/v1/evals/runs", {"adapter": adapter_name, "suite": "glaze"})
    assert response.status_code == 201, response.content
    run = response.json()
    assert run["status"] == "queued" and run["purpose"] == "manual" and run["training_job"] is None
    assert run["baseline"]["kind"] == "base" and run["baseline"]["name"] == "kiln-tiny"
    assert "no adapter is active" in run["baseline"]["note"]
    assert EmbeddedWorker().run_once()
    run = api.get(f"/v1/evals/runs/{run['id']}").json()
    assert run["status"] == "succeeded", run["error"]
    assert run["candidate"]["summary"] == {"suite": "glaze", "suite_digest": run["suite_digest"], "correct": 1,
                                           "total": 2, "accuracy": 0.5}
    assert run["baseline"]["summary"]["total"] == 2
    assert [example["candidate"]["correct"] for example in run["examples"]] == [True, False]
    assert run["candidate"]["adapter_sha256"] and run["worker_id"].startswith("embedded:")
    listing = api.get("/v1/evals/runs", adapter=adapter_name).json()
    assert listing["count"] == 1 and listing["items"][0]["id"] == run["id"]


def test_an_active_adapter_evaluated_itself_is_compared_with_its_base_saying_why(api, publish, adapter_name):
    """Evaluating the adapter that is active for you, with no baseline named: it is not compared with itself but
    with its base, and the note says so (it spoke of a new run having replaced its snapshot, though none had)."""
    publish(adapter_name, seed=4)
    assert api.post(f"/v1/adapters/{adapter_name}/load").status_code == 200
    assert api.post(f"/v1/adapters/{adapter_name}/activate").status_code == 200
    api.post("/v1/evals/suites", {"name": "self", "content": jsonl({"prompt": "Say glaze.", "expected": "x"})})
    run = api.post("/v1/evals/runs", {"adapter": adapter_name, "suite": "self"})
    assert run.status_code == 201, run.content
    baseline = run.json()["baseline"]
    assert (baseline["kind"], baseline["name"]) == ("base", "kiln-tiny")
    assert baseline["note"] == (f"your active adapter is {adapter_name!r} itself, which is not compared with itself: "
                                "compared with the base 'kiln-tiny'"), baseline["note"]


def test_the_celery_task_runs_the_same_code(api, publish, adapter_name, settings):
    from kiln_web.evals.tasks import run_evaluation

    publish(adapter_name)
    api.post("/v1/evals/suites", {"name": "one", "content": jsonl({"prompt": "a", "expected": ".*"}),
                                  "default_metric": "regex"})
    run_id = api.post("/v1/evals/runs", {"adapter": adapter_name, "suite": "one"}).json()["id"]
    assert run_evaluation.apply(args=[run_id]).get() == "succeeded"
    assert run_evaluation.apply(args=[run_id]).get() == "not_claimed"  # a second delivery changes nothing
    run = EvalRun.objects.get(pk=run_id)
    assert run.worker_id.startswith("celery:") and run.candidate_summary["accuracy"] == 1.0


def test_runs_are_refused_for_what_cannot_be_evaluated(api, bob, publish, adapter_name):
    api.post("/v1/evals/suites", {"name": "s", "content": jsonl({"prompt": "a", "expected": "b"})})
    missing = api.post("/v1/evals/runs", {"adapter": "never-trained", "suite": "s"})
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "adapter_not_found"
    publish(adapter_name)
    assert api.post("/v1/evals/runs", {"adapter": adapter_name, "suite": "nope"}).status_code == 404
    theirs = ApiClient(bob.token).post("/v1/evals/runs", {"adapter": adapter_name, "suite": "s"})
    assert theirs.status_code == 404 and theirs.json()["error"]["code"] == "adapter_not_found"  # as never-trained
    run = api.post("/v1/evals/runs", {"adapter": adapter_name, "suite": "s"}).json()
    assert ApiClient(bob.token).get(f"/v1/evals/runs/{run['id']}").status_code == 404
    busy = api.client.delete(f"/v1/adapters/{adapter_name}")  # queued evaluation: not idle
    assert busy.status_code == 409 and busy.json()["error"]["code"] == "adapter_busy"


def test_a_running_evaluation_is_lost_only_after_its_heartbeats_stop(api, publish, adapter_name, settings):
    """A running evaluation beats like a training job; one whose worker stopped beating fails `worker_lost`."""
    from datetime import timedelta

    from django.utils import timezone

    from kiln_web.evals import actions as evals_actions
    from kiln_web.jobs import actions as jobs_actions

    publish(adapter_name)
    api.post("/v1/evals/suites", {"name": "one", "content": jsonl({"prompt": "a", "expected": ".*"}),
                                  "default_metric": "regex"})
    run_id = api.post("/v1/evals/runs", {"adapter": adapter_name, "suite": "one"}).json()["id"]
    assert evals_actions.do_claim_evaluation(run_id, "worker-a")
    later = timezone.now() + timedelta(seconds=settings.KILN_LOST_AFTER_SECONDS + 2)
    EvalRun.objects.filter(pk=run_id).update(heartbeat_at=later - timedelta(seconds=1))
    assert evals_actions.do_evaluation_heartbeat(run_id, "worker-b") is False  # not its run
    jobs_actions.do_mark_lost(now=later)
    assert EvalRun.objects.get(pk=run_id).status == "running"  # it beat a second before
    assert evals_actions.do_evaluation_heartbeat(run_id, "worker-a") is True
    jobs_actions.do_mark_lost(now=timezone.now() + timedelta(seconds=settings.KILN_LOST_AFTER_SECONDS + 2))
    run = api.get(f"/v1/evals/runs/{run_id}").json()
    assert run["status"] == "failed" and run["error"]["code"] == "worker_lost"
    assert "worker-a" in run["error"]["message"] and "run the evaluation again" in run["error"]["message"]
    # one claimed before evaluations beat (a row from before the upgrade) counts from its start
    older = api.post("/v1/evals/runs", {"adapter": adapter_name, "suite": "one"}).json()["id"]
    assert evals_actions.do_claim_evaluation(older, "worker-old")
    EvalRun.objects.filter(pk=older).update(heartbeat_at=None)
    jobs_actions.do_mark_lost()
    assert EvalRun.objects.get(pk=older).status == "running"
    jobs_actions.do_mark_lost(now=timezone.now() + timedelta(seconds=settings.KILN_LOST_AFTER_SECONDS + 2))
    assert EvalRun.objects.get(pk=older).error_code == "worker_lost"


def test_an_evaluation_beats_while_it_runs(api, publish, adapter_name, settings, monkeypatch):
    """execute_evaluation keeps the run's heartbeat fresh while it compares (its thread, as a job's)."""
    import threading

    from kiln_web.evals import actions as evals_actions, execution, runtime as evals_runtime

    publish(adapter_name)
    api.post("/v1/evals/suites", {"name": "one", "content": jsonl({"prompt": "a", "expected": ".*"}),
                                  "default_metric": "regex"})
    run_id = api.post("/v1/evals/runs", {"adapter": adapter_name, "suite": "one"}).json()["id"]
    beats, real_compare = [], evals_runtime.compare
    beat = threading.Event()

    def counting(run, worker_id):
        beats.append((str(run), worker_id))
        beat.set()
        return True

    def slow_compare(*args, **kwargs):
        assert beat.wait(60), "no heartbeat while the evaluation ran"
        return real_compare(*args, **kwargs)

    settings.KILN_HEARTBEAT_SECONDS = 0.01
    monkeypatch.setattr(evals_actions, "do_evaluation_heartbeat", counting)
    monkeypatch.setattr(evals_runtime, "compare", slow_compare)
    assert execution.execute_evaluation(run_id, "worker-a") == "succeeded"
    assert beats[0] == (run_id, "worker-a")
