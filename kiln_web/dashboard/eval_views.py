"""Dashboard pages for evaluation runs and the promotion audit trail. Read only: sign-in required, and a
person sees only the runs and decisions `visible_to` them (their own; staff see all); someone else's run
answers 404, like one that does not exist."""

from __future__ import annotations

from django.contrib.auth.decorators import login_required
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import render
from django.views.decorators.http import require_GET

from kiln_web.dashboard import eval_readers
from kiln_web.evals.models import EvalPurpose, EvalStatus


@require_GET
@login_required
def eval_runs(request: HttpRequest) -> HttpResponse:
    runs = eval_readers.visible_runs(request.user)
    adapter, status, purpose = (request.GET.get(key, "") for key in ("adapter", "status", "purpose"))
    if adapter:
        runs = runs.filter(candidate__name=adapter)
    if status in EvalStatus.values:
        runs = runs.filter(status=status)
    if purpose in EvalPurpose.values:
        runs = runs.filter(purpose=purpose)
    return render(request, "dashboard/eval_runs.html", {
        "rows": [eval_readers.run_row(run) for run in runs[:eval_readers.LIST_LIMIT]], "adapter": adapter,
        "status": status, "purpose": purpose, "statuses": EvalStatus.choices, "purposes": EvalPurpose.choices,
        "show_owner": request.user.is_staff, "nav": "evals"})


@require_GET
@login_required
def eval_run(request: HttpRequest, run_id) -> HttpResponse:
    run = eval_readers.visible_run(request.user, run_id)
    if run is None:
        raise Http404("no such evaluation run (or it belongs to someone else)")
    return render(request, "dashboard/eval_run.html", eval_readers.run_detail(run, request.GET.get("page")) | {
        "show_owner": request.user.is_staff, "nav": "evals"})


@require_GET
@login_required
def promotions(request: HttpRequest) -> HttpResponse:
    records = eval_readers.visible_promotions(request.user)
    adapter = request.GET.get("adapter", "")
    if adapter:
        records = records.filter(adapter__name=adapter)
    return render(request, "dashboard/promotions.html", {
        "records": records[:eval_readers.LIST_LIMIT], "adapter": adapter, "show_owner": request.user.is_staff,
        "nav": "promotions"})
