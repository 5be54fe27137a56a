"""The evaluation and promotion pages: signed-in only; a person sees only their own runs and decisions (staff
see all; someone else's run is 404); a run's page shows its facts, every example (prompt, expected, both
answers, pass or fail) and, for a gate, its thresholds and decision; the adapters pages say "not checked"
(neutral, explained) for checkpoints past the validation limit instead of counting them as faults."""

import json
import re
import uuid

import pytest
from django.test import Client
from django.urls import reverse
from django.utils.html import escape

from kiln_web.evals import actions as evals_actions
from kiln_web.jobs.worker import EmbeddedWorker
from kiln_web.serving.models import PromotionRecord
from serving.conftest import publish, publishing_runner  # noqa: F401 (fixtures)

from .test_views import cancelled_job

pytestmark = pytest.mark.django_db

EXAMPLES = [{"prompt": "Say kiln.", "expected": ".*", "metric": "regex"},
            {"prompt": "Name a glaze.", "expected": "celadon-never-said"}]


def client_for(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


def make_suite(user, name="held-out"):
    return evals_actions.do_create_suite(user, name, "".join(json.dumps(line) + "\n" for line in EXAMPLES))


@pytest.fixture
def finished_run(ada, publish, adapter_name, django_capture_on_commit_callbacks):  # noqa: F811
    """A manual evaluation of ada's adapter, queued and run by the embedded worker (kiln-tiny, real answers)."""
    publish(adapter_name, seed=4)
    make_suite(ada)
    with django_capture_on_commit_callbacks(execute=True):
        run = evals_actions.do_enqueue_evaluation(ada, adapter_name, "held-out")
    with django_capture_on_commit_callbacks(execute=True):
        assert EmbeddedWorker().run_once()
    run.refresh_from_db()
    assert run.status == "succeeded", run.error_message
    return run


@pytest.fixture
def gate_job(publishing_runner, ada, adapter_name, django_capture_on_commit_callbacks):  # noqa: F811
    """A training job whose gate evaluated and promoted its adapter: (job id, run, promotion record)."""
    from controlplane.conftest import ApiClient

    make_suite(ada, "gate-suite")
    body = {"data": [{"prompt": f"q{i}", "completion": f"a{i}"} for i in range(3)],
            "config": {"output_name": adapter_name, "seed": 11}, "auto_load": True,
            "gate": {"suite": "gate-suite", "min_accuracy": 0.5, "min_improvement": -1.0}}
    with django_capture_on_commit_callbacks(execute=True):
        response = ApiClient(ada.token).post("/v1/train/sft", body)
    assert response.status_code == 201, response.content
    for _ in range(2):  # the training job, then its gate's evaluation and the decision
        with django_capture_on_commit_callbacks(execute=True):
            assert EmbeddedWorker().run_once()
    record = PromotionRecord.objects.select_related("evaluation").get(job_id=response.json()["id"])
    return response.json()["id"], record.evaluation, record


def test_the_pages_need_sign_in(client):
    for url in (reverse("dashboard:eval_runs"), reverse("dashboard:promotions"),
                reverse("dashboard:eval_run", args=[uuid.uuid4()])):
        response = client.get(url)
        assert response.status_code == 302 and "login" in response["Location"]


def test_the_run_page_shows_its_facts_and_every_example(ada, finished_run, adapter_name):
    page = client_for(ada).get(reverse("dashboard:eval_run", args=[finished_run.pk])).content.decode()
    assert str(finished_run.pk) in page and "Succeeded" in page
    assert f'href="{reverse("dashboard:adapter", args=[adapter_name])}"' in page
    assert "the base <span class=\"mono\">kiln-tiny</span>" in page and "no adapter is active" in page
    rows = re.findall(r'<tr data-example="(\d+)">(.*?)</tr>', page, re.S)
    assert [index for index, _ in rows] == ["0", "1"]
    results = list(finished_run.examples.order_by("index"))
    for (_, row), example, result in zip(rows, EXAMPLES, results):
        assert example["prompt"] in row and example["expected"] in row
        for output in (result.candidate_output, result.baseline_output):  # an answer, or a visible "(blank"
            assert (escape(output) if output.strip() else "(blank") in row
    assert "candidate pass" in rows[0][1] and "candidate fail" in rows[1][1]  # regex .* passes; never-said fails
    assert "data-gate" not in page  # a manual run has no gate


def test_someone_elses_run_is_404_and_staff_see_it(finished_run, bob, make_user, adapter_name):
    url = reverse("dashboard:eval_run", args=[finished_run.pk])
    bobs = client_for(bob)
    assert bobs.get(url).status_code == 404
    assert str(finished_run.pk) not in bobs.get(reverse("dashboard:eval_runs")).content.decode()
    staff = client_for(make_user("root", staff=True))
    assert staff.get(url).status_code == 200
    listing = staff.get(reverse("dashboard:eval_runs")).content.decode()
    assert reverse("dashboard:eval_run", args=[finished_run.pk]) in listing and ">ada<" in listing


def test_the_list_links_each_run_and_filters_by_adapter(ada, finished_run, adapter_name):
    me = client_for(ada)
    listing = me.get(reverse("dashboard:eval_runs")).content.decode()
    assert f'href="{reverse("dashboard:eval_run", args=[finished_run.pk])}"' in listing
    assert "manual" in listing and "held-out" in listing and "50.0%" in listing  # 1 of 2 correct
    assert "No evaluation runs match" in me.get(reverse("dashboard:eval_runs"), {"adapter": "nope"}).content.decode()
    assert me.get(reverse("dashboard:eval_runs"), {"adapter": adapter_name}).content.decode().count("data-run=") == 1
    assert me.get(reverse("dashboard:eval_runs"), {"purpose": "gate"}).content.decode().count("data-run=") == 0


def test_a_gate_run_shows_thresholds_and_decision_and_the_trail_links_it(ada, bob, gate_job, adapter_name):
    job_id, run, record = gate_job
    assert record.outcome == "promoted", record.reason
    me = client_for(ada)
    page = me.get(reverse("dashboard:eval_run", args=[run.pk])).content.decode()
    gate = page[page.index("data-gate"):]
    assert "Minimum accuracy" in gate and "50.0%" in gate and "-1.0000" in gate
    assert 'class="badge promotion-promoted"' in gate and escape(record.reason) in gate
    assert f'href="{reverse("dashboard:job", args=[job_id])}"' in page
    trail = me.get(reverse("dashboard:promotions")).content.decode()
    row = re.search(rf'<tr data-promotion="{record.pk}">(.*?)</tr>', trail, re.S).group(1)
    for url in (reverse("dashboard:job", args=[job_id]), reverse("dashboard:adapter", args=[adapter_name]),
                reverse("dashboard:eval_run", args=[run.pk])):
        assert f'href="{url}"' in row
    assert "the gate" in row and "Promoted" in row
    assert f'data-promotion="{record.pk}"' not in client_for(bob).get(reverse("dashboard:promotions")).content.decode()
    listing = me.get(reverse("dashboard:eval_runs"), {"purpose": "gate"}).content.decode()
    assert f'href="{reverse("dashboard:job", args=[job_id])}"' in listing
    detail = me.get(reverse("dashboard:adapter", args=[adapter_name])).content.decode()
    assert f'href="{reverse("dashboard:eval_run", args=[run.pk])}"' in detail
    assert f'{reverse("dashboard:promotions")}?adapter={adapter_name}' in detail


def test_navigation_links_the_new_pages(signed_in):
    page = signed_in.get(reverse("dashboard:adapters")).content.decode()
    for name in ("dashboard:eval_runs", "dashboard:promotions"):
        assert page.count(f'href="{reverse(name)}"') >= 2  # the navigation and the page's own actions


def test_unchecked_checkpoints_are_not_shown_as_faults(fake_runner, signed_in, adapter_name, monkeypatch):
    cancelled_job(signed_in, monkeypatch, adapter_name, at_step=3)  # two valid checkpoints
    monkeypatch.setattr("kiln_web.dashboard.readers.VALIDATE_LIMIT", 1)  # only the newest is checked per view
    listing = signed_in.get(reverse("dashboard:adapters")).content.decode()
    cell = re.search(r'<td data-label="Checkpoints">(.*?)</td>', listing, re.S).group(1)
    assert "1 valid" in cell and "1 not checked" in cell and 'class="not-checked"' in cell
    assert "other" not in cell and "text-bad" not in cell
    assert "validates only the newest 1 checkpoints" in cell  # the tooltip says why
    detail = signed_in.get(reverse("dashboard:adapter", args=[adapter_name])).content.decode()
    counts = re.search(r"<p [^>]*data-checkpoint-counts>(.*?)</p>", detail, re.S).group(1)
    assert "1 not checked" in counts and "text-bad" not in counts


def test_a_large_runs_examples_are_shown_a_page_at_a_time(ada):
    """A suite of 10k examples made the run's page render every result: 8 MB of HTML in 9 s. It shows
    EXAMPLE_PAGE results at a time, with the total and links to the pages before and after."""
    from kiln_web.adapters.models import Adapter
    from kiln_web.dashboard.eval_readers import EXAMPLE_PAGE
    from kiln_web.evals.models import EvalExampleResult, EvalRun, EvalSuite

    total = 2 * EXAMPLE_PAGE + 7
    content = "".join(json.dumps({"prompt": f"question {i}?", "expected": str(i)}) + "\n" for i in range(total))
    suite = EvalSuite.objects.create(name="large", owner=ada, content=content, digest="d" * 64, example_count=total)
    run = EvalRun.objects.create(owner=ada, suite=suite, suite_digest="d" * 64,
                                 candidate=Adapter.objects.create(name="large-bot", owner=ada), candidate_base="b",
                                 baseline_kind="base", baseline="b", baseline_base="b", status="succeeded")
    EvalExampleResult.objects.bulk_create(
        EvalExampleResult(run=run, index=i, expected=str(i), metric="exact", candidate_output=f"answer {i}",
                          candidate_correct=True, baseline_output="", baseline_correct=False) for i in range(total))
    me, url = client_for(ada), reverse("dashboard:eval_run", args=[run.pk])

    def shown(query=None):
        page = me.get(url, query or {}).content.decode()
        return [int(index) for index in re.findall(r'<tr data-example="(\d+)">', page)], page

    rows, page = shown()
    assert rows == list(range(EXAMPLE_PAGE)) and f"{total} results" in page and "question 0?" in page
    assert 'href="?page=2" data-examples-next' in page and "data-examples-previous" not in page
    rows, page = shown({"page": "3"})
    assert rows == list(range(2 * EXAMPLE_PAGE, total)) and f"question {total - 1}?" in page
    assert 'href="?page=2" data-examples-previous' in page and "data-examples-next" not in page
    assert shown({"page": "99"})[0] == rows  # past the end: the last page
    assert shown({"page": "nope"})[0] == list(range(EXAMPLE_PAGE))
