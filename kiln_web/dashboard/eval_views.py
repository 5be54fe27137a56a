"""Dashboard pages for evaluation runs and the promotion audit trail. Read only: sign-in required, and a
person sees only the runs and decisions `visible_to` them (their own; staff see all)."""

from __future__ import annotations

from django.contrib.auth.decorators import login_required
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import render
from django.views.decorators.http import require_GET

from kiln_web.dashboard import eval_readers


@require_GET
@login_required
def eval_runs(request: HttpRequest) -> HttpResponse:
    return render(request, "dashboard/eval_runs.html", {
        "runs": eval_readers.visible_runs(request.user)[:200], "show_owner": request.user.is_staff, "nav": "evals"})


@require_GET
@login_required
def eval_run(request: HttpRequest, run_id) -> HttpResponse:
    run = eval_readers.visible_runs(request.user).filter(pk=run_id).first()
    if run is None:
        raise Http404("no such evaluation run (or it belongs to someone else)")
    return render(request, "dashboard/eval_run.html", {"run": run, "nav": "evals"})


@require_GET
@login_required
def promotions(request: HttpRequest) -> HttpResponse:
    return render(request, "dashboard/promotions.html", {
        "records": eval_readers.visible_promotions(request.user)[:200], "show_owner": request.user.is_staff,
        "nav": "promotions"})
