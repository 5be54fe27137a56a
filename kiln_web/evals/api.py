"""/v1/evals/: create, list and show suites; queue, list and show evaluation runs.

Each view parses, authorises (the token, then ownership), calls one action and responds.
Someone else's suite or run answers 404, like one that does not exist.
"""

from uuid import UUID

from django.http import Http404, HttpRequest
from ninja import Query, Router, Schema
from pydantic import Field

from kiln_web.core.http import Status, refusals
from kiln_web.evals import actions
from kiln_web.evals.models import EvalStatus
from kiln_web.evals.schemas import RunIn, RunListOut, RunOut, SuiteIn, SuiteListOut, SuiteOut

router = Router(tags=["evaluation"])
REFUSALS = refusals()


@router.post("/suites", response={201: SuiteOut, **REFUSALS}, summary="Create an evaluation suite",
             operation_id="create_suite")
def create_suite(request: HttpRequest, payload: SuiteIn):
    """Held-out JSONL, one example a line: `prompt` (text) or `messages` (chat), `expected`, and optionally
    `metric` (exact, contains, regex, numeric) and `tolerance` (numeric). A suite never changes."""
    suite = actions.do_create_suite(request.auth, payload.name, payload.content, payload.default_metric)
    return Status(201, suite.to_dict())


@router.get("/suites", response={200: SuiteListOut, **REFUSALS}, summary="Your evaluation suites",
            operation_id="list_suites")
def list_suites(request: HttpRequest):
    suites = actions.visible_suites(request.auth).defer("content").order_by("name")  # to_dict() shows no content
    return {"items": [suite.to_dict() for suite in suites]}


@router.get("/suites/{name}", response={200: SuiteOut, **REFUSALS}, summary="One suite, with its content",
            operation_id="get_suite")
def get_suite(request: HttpRequest, name: str):
    return actions.suite_for(request.auth, name).to_dict(content=True)


@router.post("/runs", response={201: RunOut, **REFUSALS}, summary="Evaluate an adapter against a baseline of its base",
             operation_id="create_eval_run")
def create_run(request: HttpRequest, payload: RunIn):
    """Queues an evaluation of the adapter and of the baseline on the suite; a worker runs it. The baseline is the
    one named (yours or shared with you), else your active adapter when it is over the candidate's base, else that
    base itself; a baseline over another base is refused (409 cross_base_comparison, naming both bases)."""
    run = actions.do_enqueue_evaluation(request.auth, payload.adapter, payload.suite, base=payload.base,
                                        baseline=payload.baseline, max_new_tokens=payload.max_new_tokens,
                                        backend=payload.backend)
    return Status(201, run.to_dict())


class RunFilter(Schema):
    status: EvalStatus | None = None
    adapter: str | None = Field(None, description="only runs whose candidate is this adapter")
    limit: int = Field(50, ge=1, le=500)
    offset: int = Field(0, ge=0, le=2**31 - 1)  # bounded: the database refuses (500) a larger OFFSET


@router.get("/runs", response={200: RunListOut, **REFUSALS}, summary="Evaluation runs, newest first",
            operation_id="list_eval_runs")
def list_runs(request: HttpRequest, filters: Query[RunFilter]):
    runs = actions.visible_runs(request.auth)
    if filters.status:
        runs = runs.filter(status=filters.status)
    if filters.adapter:
        runs = runs.filter(candidate__name=filters.adapter)
    return {"items": [run.to_dict() for run in runs[filters.offset:filters.offset + filters.limit]],
            "count": runs.count()}


@router.get("/runs/{run_id}", response={200: RunOut, **REFUSALS}, summary="One evaluation run, per example",
            operation_id="get_eval_run")
def get_run(request: HttpRequest, run_id: UUID):
    run = actions.visible_runs(request.auth).filter(pk=run_id).first()
    if run is None:
        raise Http404(f"no evaluation run {run_id} (or it belongs to someone else)")
    return run.to_dict() | {"examples": [example.to_dict() for example in run.examples.all()]}
