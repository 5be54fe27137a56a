"""The control plane's cost as its tables grow: every list and detail endpoint and every dashboard page answers
with a number of SQL queries that does not depend on how many rows there are (no query per adapter, job, run,
share or alias), and the responses that could hold a job's or a suite's every row are paged.

Each test builds the same world at two sizes and compares the query counts; the per-row work is then visible as
the difference.
"""

import itertools

import pytest
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext

from kiln_web.adapters.models import Adapter, AdapterShare, CheckpointRecord
from kiln_web.evals.models import EvalExampleResult, EvalRun, EvalSuite
from kiln_web.jobs.models import JobEvent, JobKind, JobMetric, JobStatus, TrainingJob
from kiln_web.serving.models import PromotionRecord, ServedAdapter
from kiln_web.teachers.models import TeacherAlias

from .conftest import ApiClient

pytestmark = pytest.mark.django_db

SMALL, LARGE = 2, 9
_worlds = itertools.count()


class World:
    """N adapters of ada's, each trained by a succeeded job with a checkpoint, a promotion decision, an
    evaluation and a share with bob (and one of bob's shared with ada); one job with N metrics, events and
    checkpoints; one evaluation with N examples; N teacher aliases; the first adapter loaded and active."""

    def __init__(self, ada, bob, settings, n: int):
        tag = f"w{next(_worlds)}"
        self.n, self.ada, self.bob = n, ada, bob
        self.suite = EvalSuite.objects.create(name=f"{tag}-suite", owner=ada, content="", digest="d" * 64,
                                              example_count=n)
        self.adapters, self.jobs, self.runs = [], [], []
        for i in range(n):
            adapter = Adapter.objects.create(name=f"{tag}-a{i}", owner=ada)
            job = TrainingJob.objects.create(
                owner=ada, kind=JobKind.SFT, adapter=adapter, status=JobStatus.SUCCEEDED,
                request={"auto_load": True}, admission={}, effective_config={"base_model": "kiln-tiny"},
                committed_step=n, total_steps=n, latest_checkpoint={"resume_checkpoint": f"{adapter.name}-ck"})
            CheckpointRecord.objects.create(job=job, adapter=adapter, basename=f"{adapter.name}-ck", step=1,
                                            checkpoint_id="c", summary={"step": 1})
            run = EvalRun.objects.create(
                owner=ada, suite=self.suite, suite_digest="d" * 64, candidate=adapter, candidate_base="kiln-tiny",
                baseline_kind="base", baseline="kiln-tiny", baseline_base="kiln-tiny", training_job=job,
                purpose="gate", status="succeeded", candidate_summary=self.summary(n, n // 2),
                baseline_summary=self.summary(n, n // 4))
            PromotionRecord.objects.create(adapter=adapter, job=job, evaluation=run, outcome="promoted",
                                           reason="passed", decided_by="gate", user=ada)
            AdapterShare.objects.create(adapter=adapter, user=bob, created_by=ada)
            TeacherAlias.objects.create(name=f"{tag}-t{i}@native", route="native", base="kiln-tiny", owner=ada,
                                        adapter=str(settings.KILN_ADAPTERS_DIR / adapter.name),
                                        identity_revision="r" * 64)
            self.adapters.append(adapter)
            self.jobs.append(job)
            self.runs.append(run)
        theirs = Adapter.objects.create(name=f"{tag}-bob", owner=bob)
        AdapterShare.objects.create(adapter=theirs, user=ada, created_by=bob)
        ServedAdapter.objects.create(adapter=self.adapters[0], base="kiln-tiny", adapter_sha256="s" * 64,
                                     active=True, active_for=ada, loaded_by="ada")
        self.job, self.run = self.jobs[0], self.runs[0]
        CheckpointRecord.objects.bulk_create(
            CheckpointRecord(job=self.job, adapter=self.adapters[0], basename=f"{tag}-a0-extra-{i}", step=i + 2,
                             checkpoint_id="c") for i in range(n))
        JobMetric.objects.bulk_create(JobMetric(job=self.job, step=i + 1, metrics={"loss": 1.0, "tokens": 8,
                                                                                    "elapsed_seconds": i})
                                      for i in range(n))
        JobEvent.objects.bulk_create(JobEvent(job=self.job, message=f"event {i}") for i in range(n))
        EvalExampleResult.objects.bulk_create(
            EvalExampleResult(run=self.run, index=i, expected="x", metric="exact", candidate_output="x",
                              candidate_correct=True, baseline_output="y", baseline_correct=False)
            for i in range(n))

    def summary(self, total: int, correct: int) -> dict:
        return {"suite": self.suite.name, "suite_digest": self.suite.digest, "correct": correct, "total": total,
                "accuracy": correct / total}


def _clear():
    for model in (EvalExampleResult, PromotionRecord, EvalRun, EvalSuite, ServedAdapter, AdapterShare,
                  CheckpointRecord, JobMetric, JobEvent, TrainingJob, TeacherAlias, Adapter):
        model.objects.all().delete()


def queries(get) -> int:
    """How many SQL queries GET() (a request) made; it must answer 200."""
    with CaptureQueriesContext(connection) as captured:
        response = get()
    assert response.status_code == 200, response.content[:500]
    return len(captured.captured_queries)


def counts(ada, bob, settings, path_of) -> tuple[int, int]:
    """The queries of PATH_OF(world)'s request (a callable returning a response) in a SMALL and a LARGE world."""
    out = []
    for n in (SMALL, LARGE):
        _clear()
        world = World(ada, bob, settings, n)
        request = path_of(world)
        request()  # warm: a first request may fill per-process caches (the token's user, the registry)
        out.append(queries(request))
    return tuple(out)


@pytest.fixture
def api_get(ada):
    client = ApiClient(ada.token)
    return lambda path: (lambda: client.get(path))


@pytest.fixture
def page_get(ada):
    client = Client()
    client.force_login(ada)
    return lambda path: (lambda: client.get(path))


API_PATHS = {
    "jobs": lambda w: "/v1/train/jobs?limit=500",
    "job": lambda w: f"/v1/train/jobs/{w.job.pk}",
    "metrics": lambda w: f"/v1/train/jobs/{w.job.pk}/metrics",
    "events": lambda w: f"/v1/train/jobs/{w.job.pk}/events",
    "checkpoints": lambda w: f"/v1/train/jobs/{w.job.pk}/checkpoints",
    "adapters": lambda w: "/v1/adapters",
    "adapter": lambda w: f"/v1/adapters/{w.adapters[0].name}",
    "promotions": lambda w: "/v1/promotions?limit=500",
    "eval_runs": lambda w: "/v1/evals/runs?limit=500",
    "eval_run": lambda w: f"/v1/evals/runs/{w.run.pk}",
    "suites": lambda w: "/v1/evals/suites",
    "teachers": lambda w: "/v1/teachers",
    "models": lambda w: "/v1/models",
}

PAGES = {
    "jobs": lambda w: "/",
    "job_rows": lambda w: "/jobs/rows",
    "job": lambda w: f"/jobs/{w.job.pk}/",
    "job_snapshot": lambda w: f"/jobs/{w.job.pk}/snapshot",
    "adapters": lambda w: "/adapters/",
    "adapter": lambda w: f"/adapters/{w.adapters[0].name}/",
    "eval_runs": lambda w: "/evals/",
    "eval_run": lambda w: f"/evals/runs/{w.run.pk}/",
    "promotions": lambda w: "/promotions/",
    "teachers": lambda w: "/teachers/",
}


@pytest.mark.parametrize("name", API_PATHS)
def test_api_queries_do_not_grow_with_rows(ada, bob, settings, api_get, name):
    small, large = counts(ada, bob, settings, lambda w: api_get(API_PATHS[name](w)))
    assert large == small, f"{name}: {small} queries with {SMALL} of each row, {large} with {LARGE}"


@pytest.mark.parametrize("name", PAGES)
def test_dashboard_queries_do_not_grow_with_rows(ada, bob, settings, page_get, name):
    small, large = counts(ada, bob, settings, lambda w: page_get(PAGES[name](w)))
    assert large == small, f"{name}: {small} queries with {SMALL} of each row, {large} with {LARGE}"


def test_the_staff_view_is_bounded_too(make_user, bob, settings):
    """Staff see everyone's rows: the lists they read must not cost a query per row either."""
    root = make_user("root", staff=True)
    client = ApiClient(root.token)
    page = Client()
    page.force_login(root)
    for path in ("/v1/adapters", "/v1/train/jobs?limit=500", "/v1/evals/runs?limit=500", "/v1/teachers"):
        small, large = counts(root, bob, settings, lambda w: (lambda: client.get(path)))
        assert large == small, f"{path}: {small} queries with {SMALL} of each row, {large} with {LARGE}"
    for path in ("/", "/adapters/", "/evals/", "/promotions/", "/teachers/"):
        small, large = counts(root, bob, settings, lambda w: (lambda: page.get(path)))
        assert large == small, f"{path}: {small} queries with {SMALL} of each row, {large} with {LARGE}"



BODY_COLUMNS = ('"jobs_trainingjob"."request"', '"jobs_trainingjob"."admission"', '"evals_evalsuite"."content"')


def test_lists_and_a_jobs_parts_do_not_read_its_submitted_bodies(ada, bob, settings, api_get, page_get):
    """A job's request and admission hold its inline data, and a suite's content its every example (up to
    KILN_UPLOAD_MAX_BYTES each): a list of jobs, runs, suites or promotions, and a job's metrics, events and
    checkpoints (which a follower polls), must not read them. With 50 jobs of 8 MB of inline records each,
    GET /v1/train/jobs took 8.8 s (and the jobs page 6.9 s) to answer 20 kB."""
    world = World(ada, bob, settings, 3)
    job, adapter = world.job.pk, world.adapters[0].name
    gets = [api_get(path) for path in ("/v1/train/jobs", f"/v1/train/jobs/{job}/metrics",
                                       f"/v1/train/jobs/{job}/events", f"/v1/train/jobs/{job}/checkpoints",
                                       f"/v1/train/jobs/{str(job)[:8]}/metrics", "/v1/evals/runs",
                                       f"/v1/evals/runs/{world.run.pk}", "/v1/evals/suites", "/v1/promotions")]
    gets += [page_get(path) for path in ("/", "/jobs/rows", "/adapters/", f"/adapters/{adapter}/", "/evals/",
                                         "/promotions/")]
    for get in gets:
        with CaptureQueriesContext(connection) as captured:
            assert get().status_code == 200
        read = [query["sql"] for query in captured.captured_queries
                if any(column in query["sql"] for column in BODY_COLUMNS)]
        assert not read, read


def test_a_jobs_events_are_paged(ada, bob, settings, api_get):
    """A job's log grows with its checkpoints and warnings: 100k events answered 15.8 MB in 9.3 s, and `kiln train
    ... --wait` fetched them all again at every step. Pages of `limit` (1000 by default) from `offset`, oldest
    first, with next_offset to ask for the next one (null at the end)."""
    world = World(ada, bob, settings, 1)
    JobEvent.objects.all().delete()
    JobEvent.objects.bulk_create(JobEvent(job=world.job, message=f"event {i}") for i in range(2500))
    first = api_get(f"/v1/train/jobs/{world.job.pk}/events")().json()
    assert len(first["items"]) == 1000 and first["next_offset"] == 1000
    messages, offset = [], 0
    while offset is not None:
        page = api_get(f"/v1/train/jobs/{world.job.pk}/events?offset={offset}&limit=700")().json()
        messages += [event["message"] for event in page["items"]]
        offset = page["next_offset"]
    assert messages == [f"event {i}" for i in range(2500)]
    last = api_get(f"/v1/train/jobs/{world.job.pk}/events?offset=2000")().json()
    assert len(last["items"]) == 500 and last["next_offset"] is None
    assert api_get(f"/v1/train/jobs/{world.job.pk}/events?offset=9999")().json() == {"items": [], "next_offset": None}
    refused = api_get(f"/v1/train/jobs/{world.job.pk}/events?limit=10001")()
    assert refused.status_code == 400 and refused.json()["error"]["field"] == "limit"


def test_a_resumed_jobs_page_reads_no_earlier_runs_bodies(ada, bob, settings, page_get):
    """The charts of a resumed run start with the steps its earlier runs committed (up to 20 of them, through
    resume_from): reading those steps read each earlier job's request and admission too (inline data, up to
    KILN_UPLOAD_MAX_BYTES each). Only the job shown is read whole."""
    world = World(ada, bob, settings, 4)
    for earlier, later in zip(world.jobs, world.jobs[1:]):
        TrainingJob.objects.filter(pk=later.pk).update(resume_from=f"{earlier.adapter.name}-ck")
    shown = world.jobs[-1]
    with CaptureQueriesContext(connection) as captured:
        assert page_get(f"/jobs/{shown.pk}/")().status_code == 200
    read = [query["sql"] for query in captured.captured_queries if BODY_COLUMNS[1] in query["sql"]]
    assert len(read) == 1 and (str(shown.pk) in read[0] or shown.pk.hex in read[0]), read


def test_a_runs_events_and_checkpoints_do_not_read_its_bodies(ada, bob, settings):
    """The worker records an event (every checkpoint, warning, loss spike) and indexes every checkpoint while the
    run trains: each read the whole job row, its request and admission (inline data, up to KILN_UPLOAD_MAX_BYTES
    each) with it."""
    from kiln_web.jobs import actions

    world = World(ada, bob, settings, 1)
    job = world.job
    TrainingJob.objects.filter(pk=job.pk).update(status=JobStatus.RUNNING, worker_id="w")
    summary = {"resume_checkpoint": f"{job.adapter.name}-checkpoint-step-00000002.kiln-checkpoint", "step": 2,
               "checkpoint_id": "c2"}
    with CaptureQueriesContext(connection) as captured:
        actions.do_add_event(job.pk, "warning", "step 2: loss spiked")
        assert actions.do_record_checkpoint(job.pk, "w", summary, {"publish": 0.1}, manifest_digest="f" * 64)
        assert actions.do_record_step(job.pk, "w", {"step": 3, "loss": 1.0})
    read = [query["sql"] for query in captured.captured_queries
            if any(column in query["sql"] for column in BODY_COLUMNS)]
    assert not read, read
    assert JobEvent.objects.filter(job=job, message="step 2: loss spiked").exists()
    assert CheckpointRecord.objects.get(basename=summary["resume_checkpoint"]).adapter_id == job.adapter_id
    assert TrainingJob.objects.get(pk=job.pk).latest_checkpoint == summary


def test_a_jobs_page_reads_its_bodies_once_whatever_its_checkpoints(ada, bob, settings, page_get):
    """The job page and its snapshot (asked again after every checkpoint event) list the adapter's checkpoints:
    each index row was read joined to its job, so the job's request and admission came back once per checkpoint."""
    world = World(ada, bob, settings, 6)  # world.job published 7 checkpoints
    for path in (f"/jobs/{world.job.pk}/", f"/jobs/{world.job.pk}/snapshot", f"/adapters/{world.adapters[0].name}/"):
        with CaptureQueriesContext(connection) as captured:
            assert page_get(path)().status_code == 200
        read = [query["sql"] for query in captured.captured_queries if BODY_COLUMNS[1] in query["sql"]]
        assert len(read) == (0 if path.startswith("/adapters/") else 1), (path, read)
