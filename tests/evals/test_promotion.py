"""Promotion after training, through the API and the embedded worker's own code: a gate that passes
activates the candidate; one that fails, or an evaluation that cannot be queued or crashes, leaves the
previous adapter active and the job succeeded; auto_load without a gate activates after the serving
canary, and a failing canary leaves the candidate unpromoted. auto_load and gate never reach the trainer."""

import json

import pytest

from kiln_web.evals import runtime as evals_runtime
from kiln_web.evals.actions import storable
from kiln_web.evals.models import EvalRun
from kiln_web.jobs.models import TrainingJob
from kiln_web.jobs.worker import EmbeddedWorker
from kiln_web.serving.models import PromotionRecord, ServedAdapter
from serving.helpers import NAN_SEED, greedy_answer

pytestmark = pytest.mark.django_db

PROMPT = "Say kiln."
CANDIDATE_SEED, PREVIOUS_SEED = 11, 12


def body(adapter, seed=CANDIDATE_SEED, **promotion):
    data = [{"prompt": f"q{i}", "completion": f"a{i}"} for i in range(3)]
    return {"data": data, "config": {"output_name": adapter, "seed": seed}, **promotion}


def suite(api, name, lines, metric="exact"):
    content = "".join(json.dumps(line) + "\n" for line in lines)
    response = api.post("/v1/evals/suites", {"name": name, "content": content, "default_metric": metric})
    assert response.status_code == 201, response.content
    return response.json()


def run_worker(capture):
    """One turn of the embedded worker, running the callbacks of every commit (as outside a test)."""
    with capture(execute=True):
        return EmbeddedWorker().run_once()


def train(api, capture, request):
    with capture(execute=True):
        response = api.post("/v1/train/sft", request)
    assert response.status_code == 201, response.content
    assert run_worker(capture)
    return api.get(f"/v1/train/jobs/{response.json()['id']}").json()


def active_name():
    row = ServedAdapter.objects.filter(active=True).select_related("adapter").first()
    return row.adapter.name if row else None


@pytest.fixture
def previous(api, publish, adapter_name):
    """An adapter that is loaded and active before the candidate is trained."""
    name = f"{adapter_name}-previous"
    publish(name, seed=PREVIOUS_SEED)
    assert api.post(f"/v1/adapters/{name}/load").status_code == 200
    assert api.post(f"/v1/adapters/{name}/activate").status_code == 200
    return name


def test_gate_passes_and_the_candidate_is_activated(publishing_runner, api, settings, previous, adapter_name,
                                                    django_capture_on_commit_callbacks):
    expected = greedy_answer(settings.KILN_HOME, CANDIDATE_SEED, PROMPT)
    assert expected != greedy_answer(settings.KILN_HOME, PREVIOUS_SEED, PROMPT)  # the suite tells them apart
    suite(api, "answers", [{"prompt": PROMPT, "expected": expected}])
    gate = {"suite": "answers", "min_accuracy": 1.0, "min_improvement": 0.5}
    job = train(api, django_capture_on_commit_callbacks, body(adapter_name, auto_load=True, gate=gate))
    assert job["status"] == "succeeded"
    assert job["promotion"]["outcome"] == "pending" and job["promotion"]["gate"] == gate
    assert len(job["evaluation_ids"]) == 1
    assert active_name() == previous  # the previous adapter stays active while the gate runs

    assert run_worker(django_capture_on_commit_callbacks)  # the evaluation
    job = api.get(f"/v1/train/jobs/{job['id']}").json()
    assert job["status"] == "succeeded"
    assert job["promotion"]["outcome"] == "promoted" and job["promotion"]["decided_by"] == "gate"
    assert job["promotion"]["evaluation"] == job["evaluation_ids"][0]
    assert active_name() == adapter_name
    run = api.get(f"/v1/evals/runs/{job['evaluation_ids'][0]}").json()
    assert run["status"] == "succeeded" and run["purpose"] == "gate" and run["training_job"] == job["id"]
    assert run["candidate"]["summary"]["accuracy"] == 1.0
    assert run["baseline"]["kind"] == "adapter" and run["baseline"]["name"] == previous
    assert run["baseline"]["summary"]["accuracy"] == 0.0
    shown = storable(expected)  # as stored and shown (a NUL character, which kiln-tiny can generate, escaped)
    assert run["examples"] == [{"index": 0, "expected": shown, "metric": "exact",
                                "candidate": {"output": shown, "correct": True},
                                "baseline": {"output": run["examples"][0]["baseline"]["output"], "correct": False}}]
    record = PromotionRecord.objects.get(job_id=job["id"])
    assert (record.outcome, record.decided_by, str(record.evaluation_id), record.previous_active) == (
        "promoted", "gate", run["id"], previous)
    trail = api.get("/v1/promotions").json()["items"]
    assert [(item["adapter"], item["outcome"], item["decided_by"]) for item in trail] == [
        (adapter_name, "promoted", "gate"), (previous, "promoted", "ada")]
    events = [event["message"] for event in api.get(f"/v1/train/jobs/{job['id']}/events").json()["items"]]
    assert any(message.startswith("promotion: promoted: the gate passed") for message in events)


def test_gate_fails_and_the_previous_adapter_stays_active(publishing_runner, api, previous, adapter_name,
                                                          django_capture_on_commit_callbacks):
    suite(api, "impossible", [{"prompt": PROMPT, "expected": "no model says this"},
                              {"prompt": "2+2?", "expected": "4"}])
    job = train(api, django_capture_on_commit_callbacks,
                body(adapter_name, auto_load=True, gate={"suite": "impossible", "min_accuracy": 0.5}))
    assert run_worker(django_capture_on_commit_callbacks)
    job = api.get(f"/v1/train/jobs/{job['id']}").json()
    assert job["status"] == "succeeded" and job["error"] is None
    assert job["promotion"]["outcome"] == "gate_failed"
    assert "below the minimum 0.5000" in job["promotion"]["reason"]
    assert active_name() == previous
    assert not ServedAdapter.objects.filter(adapter__name=adapter_name).exists()
    adapters = {item["name"]: item for item in api.get("/v1/adapters").json()["items"]}
    assert adapters[adapter_name]["latest_promotion"]["outcome"] == "gate_failed"
    assert not adapters[adapter_name]["active"] and adapters[previous]["active"]


def test_an_evaluation_that_cannot_be_queued_leaves_the_candidate_unpromoted(
        publishing_runner, api, settings, monkeypatch, previous, adapter_name, django_capture_on_commit_callbacks):
    from kiln_web.celery import app as celery_app

    suite(api, "any", [{"prompt": PROMPT, "expected": ".*"}], metric="regex")
    with django_capture_on_commit_callbacks(execute=True):
        response = api.post("/v1/train/sft", body(adapter_name, auto_load=True,
                                                  gate={"suite": "any", "min_accuracy": 0.5}))
    assert response.status_code == 201

    def broker_down(*args, **kwargs):
        raise ConnectionError("Error 111 connecting to localhost:6379. Connection refused.")

    settings.KILN_EMBEDDED_WORKER = False  # the evaluation goes to Celery, whose broker is down
    monkeypatch.setattr(celery_app, "send_task", broker_down)
    assert run_worker(django_capture_on_commit_callbacks)  # the training job, in a worker of its own
    job = api.get(f"/v1/train/jobs/{response.json()['id']}").json()
    assert job["status"] == "succeeded"
    assert job["promotion"]["outcome"] == "unavailable"
    assert "broker_unavailable" in job["promotion"]["reason"]
    run = EvalRun.objects.get(training_job_id=job["id"])
    assert run.status == "failed" and run.error_code == "broker_unavailable"
    assert active_name() == previous


def test_an_evaluation_that_crashes_leaves_the_candidate_unpromoted(
        publishing_runner, api, monkeypatch, previous, adapter_name, django_capture_on_commit_callbacks):
    suite(api, "any", [{"prompt": PROMPT, "expected": ".*"}], metric="regex")

    def crash(*args, **kwargs):
        raise MemoryError("out of memory while loading the candidate")

    monkeypatch.setattr(evals_runtime, "compare", crash)
    job = train(api, django_capture_on_commit_callbacks,
                body(adapter_name, auto_load=True, gate={"suite": "any", "min_accuracy": 0.5}))
    assert run_worker(django_capture_on_commit_callbacks)
    job = api.get(f"/v1/train/jobs/{job['id']}").json()
    assert job["status"] == "succeeded"
    assert job["promotion"]["outcome"] == "unavailable"
    assert "internal_error: MemoryError" in job["promotion"]["reason"]
    assert active_name() == previous


def test_auto_load_without_a_gate_activates_after_the_canary(publishing_runner, api, previous, adapter_name,
                                                             django_capture_on_commit_callbacks):
    job = train(api, django_capture_on_commit_callbacks, body(adapter_name, auto_load=True))
    assert job["promotion"]["outcome"] == "promoted" and job["promotion"]["decided_by"] == "auto_load"
    assert "the serving canary passed" in job["promotion"]["reason"]
    assert job["evaluation_ids"] == []
    assert active_name() == adapter_name
    assert ServedAdapter.objects.filter(adapter__name=previous, active=False).exists()  # still loaded


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning", "ignore:invalid value:RuntimeWarning")
def test_a_failing_canary_leaves_the_candidate_unpromoted(publishing_runner, api, previous, adapter_name,
                                                          django_capture_on_commit_callbacks):
    job = train(api, django_capture_on_commit_callbacks, body(adapter_name, seed=NAN_SEED, auto_load=True))
    assert job["status"] == "succeeded"
    assert job["promotion"]["outcome"] == "canary_failed"
    assert "non-finite log-probabilities" in job["promotion"]["reason"]
    assert active_name() == previous
    assert not ServedAdapter.objects.filter(adapter__name=adapter_name).exists()


def test_without_auto_load_nothing_is_promoted(publishing_runner, api, previous, adapter_name,
                                               django_capture_on_commit_callbacks):
    job = train(api, django_capture_on_commit_callbacks, body(adapter_name))
    assert job["promotion"]["outcome"] == "not_requested" and job["promotion"]["auto_load"] is False
    assert not PromotionRecord.objects.filter(job_id=job["id"]).exists()
    assert active_name() == previous


def test_a_gate_on_too_few_examples_is_inconclusive(publishing_runner, api, settings, previous, adapter_name,
                                                    django_capture_on_commit_callbacks):
    settings.KILN_GATE_MIN_EXAMPLES = 20  # the server's default (the test run lowers it for its small suites)
    expected = greedy_answer(settings.KILN_HOME, CANDIDATE_SEED, PROMPT)
    suite(api, "small", [{"prompt": PROMPT, "expected": expected}, {"prompt": "2+2?", "expected": "4"}])
    job = train(api, django_capture_on_commit_callbacks,
                body(adapter_name, auto_load=True, gate={"suite": "small", "min_accuracy": 0.0}))
    assert run_worker(django_capture_on_commit_callbacks)
    job = api.get(f"/v1/train/jobs/{job['id']}").json()
    assert job["promotion"]["outcome"] == "inconclusive"
    assert "2 examples" in job["promotion"]["reason"] and "at least 20" in job["promotion"]["reason"]
    assert active_name() == previous  # nothing was activated on a suite too small to decide
    refused = api.post("/v1/train/sft", body(f"{adapter_name}-2", auto_load=True,
                                             gate={"suite": "small", "min_accuracy": 0.0, "min_examples": 0}))
    assert refused.status_code == 400 and refused.json()["error"]["field"].endswith("min_examples")
    # the request's own minimum wins over the server's
    job = train(api, django_capture_on_commit_callbacks,
                body(f"{adapter_name}-3", auto_load=True, gate={"suite": "small", "min_accuracy": 0.0,
                                                                 "min_examples": 2}))
    assert job["promotion"]["gate"]["min_examples"] == 2
    assert run_worker(django_capture_on_commit_callbacks)
    assert api.get(f"/v1/train/jobs/{job['id']}").json()["promotion"]["outcome"] == "promoted"


def test_promotion_fields_are_checked_and_never_admitted(publishing_runner, api, adapter_name,
                                                         django_capture_on_commit_callbacks):
    refused = api.post("/v1/train/sft", body(adapter_name, gate={"suite": "missing", "min_accuracy": 0.5}))
    assert refused.status_code == 400 and "auto_load" in refused.json()["error"]["message"]
    refused = api.post("/v1/train/sft", body(adapter_name, auto_load=True, gate={"suite": "missing",
                                                                                  "min_accuracy": 0.5}))
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "suite_not_found"
    assert refused.json()["error"]["field"] == "gate.suite"
    refused = api.post("/v1/train/sft", body(adapter_name, auto_load=True, gate={"suite": "x"}))
    assert refused.status_code == 400 and "min_accuracy" in refused.json()["error"]["message"]
    assert api.post("/v1/train/sft", body(adapter_name, auto_load="yes")).status_code == 400
    suite(api, "s", [{"prompt": "a", "expected": "b"}])
    response = api.post("/v1/train/sft", body(adapter_name, auto_load=True, gate={"suite": "s", "min_accuracy": 0}))
    assert response.status_code == 201, response.content
    job = TrainingJob.objects.get(pk=response.json()["id"])
    assert job.request["auto_load"] is True  # the request as submitted
    assert set(job.admission["request"]) == {"data", "config"}  # what the trainer was given
    assert "auto_load" not in json.dumps(job.effective_config) and "gate" not in job.effective_config


@pytest.mark.slow
def test_the_real_trainer_never_sees_the_promotion_fields(api, settings, adapter_name,
                                                          django_capture_on_commit_callbacks):
    """trainer.runs.sft refuses unknown request fields, so a run that is admitted, resumed with other
    promotion fields, and promoted proves they stayed out of its configuration and checkpoints."""
    settings.KILN_SFT_RUNNER = "trainer.runs.sft"
    settings.KILN_HEARTBEAT_SECONDS = 3600
    settings.KILN_EMBEDDED_WORKER = True
    request = {"data": [{"messages": [{"role": "user", "content": f"Say {w}."},
                                      {"role": "assistant", "content": f"{w.upper()}!"}]} for w in ("kiln", "clay")],
               "config": {"output_name": adapter_name, "epochs": 2, "checkpoint_interval": 2, "seed": 5}}
    first = train(api, django_capture_on_commit_callbacks, {**request, "auto_load": False})
    assert first["status"] == "succeeded", first["error"]
    assert first["promotion"]["outcome"] == "not_requested"
    resumed = {**request, "config": {**request["config"], "resume_checkpoint": first["latest_checkpoint"][
        "resume_checkpoint"]}, "auto_load": True}
    job = train(api, django_capture_on_commit_callbacks, resumed)  # no drift: promotion is not configuration
    assert job["status"] == "succeeded", job["error"]
    assert job["promotion"]["outcome"] == "promoted", job["promotion"]
    assert active_name() == adapter_name



def test_outputs_with_nul_characters_are_stored_readably():
    # a byte-level model (kiln-tiny) can generate U+0000; PostgreSQL text columns refuse it, so it is stored escaped
    assert storable("a\x00b") == "a\\u0000b" and storable("plain") == "plain"


def test_a_suite_with_a_nul_character_is_refused(api):
    response = api.post("/v1/evals/suites", {"name": "nul", "content": '{"prompt": "a\\u0000", "expected": "b"}\n'
                                                                      .replace("\\u0000", "\x00")})
    # refused with the body (kiln_web.core.http.json_body), before the suite's lines are parsed
    assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_request"
    assert response.json()["error"]["field"] == "content" and "NUL" in response.json()["error"]["message"]


def test_a_gate_evaluation_whose_worker_died_is_failed_and_the_candidate_stays_unpromoted(
        publishing_runner, api, settings, previous, adapter_name, django_capture_on_commit_callbacks):
    """A worker killed mid-evaluation (SIGKILL, the machine lost) never finishes its run: the lost-job check fails
    it `worker_lost` once it sent no heartbeat for KILN_LOST_AFTER_SECONDS, so the gate decides (unavailable) and
    the run is never left `running` for ever."""
    from datetime import timedelta

    from django.utils import timezone

    from kiln_web.evals import actions as evals_actions
    from kiln_web.jobs import actions as jobs_actions

    suite(api, "any", [{"prompt": PROMPT, "expected": ".*"}], metric="regex")
    job = train(api, django_capture_on_commit_callbacks,
                body(adapter_name, auto_load=True, gate={"suite": "any", "min_accuracy": 0.5}))
    run = EvalRun.objects.get(training_job_id=job["id"])
    assert evals_actions.do_claim_evaluation(run.pk, "worker-dead")  # claimed, then the worker was killed
    with django_capture_on_commit_callbacks(execute=True):
        jobs_actions.do_mark_lost()
    assert EvalRun.objects.get(pk=run.pk).status == "running"  # its silence is not yet long enough
    later = timezone.now() + timedelta(seconds=settings.KILN_LOST_AFTER_SECONDS + 2)
    with django_capture_on_commit_callbacks(execute=True):
        jobs_actions.do_mark_lost(now=later)
    run = EvalRun.objects.get(pk=run.pk)
    assert (run.status, run.error_code) == ("failed", "worker_lost") and "worker-dead" in run.error_message
    assert run.finished_at is not None
    job = api.get(f"/v1/train/jobs/{job['id']}").json()
    assert job["status"] == "succeeded"
    assert job["promotion"]["outcome"] == "unavailable" and "worker_lost" in job["promotion"]["reason"]
    assert active_name() == previous
    # the worker coming back cannot finish it
    assert evals_actions.do_finish_evaluation(run.pk, "worker-dead", error_code="x", error_message="y") is False
