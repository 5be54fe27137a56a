"""Dashboard pages. Each view parses, authorises (sign-in, then the job or adapter must be visible to the
person), calls at most one do_* action (the same ones the API and the CLI call) and responds; what the
pages show comes from readers."""

from __future__ import annotations

from functools import wraps

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.http import Http404, HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import redirect, render
from django.template.loader import render_to_string
from django.views.decorators.http import require_GET, require_http_methods, require_POST

from kiln_web.core.http import ActionRefused, refusal_for
from kiln_web.dashboard import readers
from kiln_web.dashboard.forms import JOB_FORMS, TeacherForm
from kiln_web.jobs import actions, resume
from kiln_web.jobs.models import InvalidTransition, JobKind, JobStatus, TrainingJob

# The parts of job detail the page swaps in from the snapshot view: [data-panel=NAME] <- template.
PANELS = {"actions": "dashboard/_job_actions.html", "facts": "dashboard/_job_facts.html",
          "checkpoint": "dashboard/_checkpoint_panel.html", "stop": "dashboard/_stop_panel.html",
          "outcome": "dashboard/_outcome_panel.html", "checkpoints": "dashboard/_checkpoint_list.html",
          "error": "dashboard/_job_error.html", "events": "dashboard/_events.html"}


def job_view(view):
    """Sign-in required, and the job in the URL must be the person's own (or they are staff); else 404."""

    @login_required
    @wraps(view)
    def wrapper(request: HttpRequest, job_id, *args, **kwargs):
        job = readers.visible_jobs(request.user).filter(pk=job_id).first()
        if job is None:
            raise Http404("no such job (or it belongs to someone else)")
        return view(request, job, *args, **kwargs)

    return wrapper


# -- jobs list --


def _filtered_jobs(request: HttpRequest):
    jobs = readers.listed_jobs(request.user)
    status, kind = request.GET.get("status", ""), request.GET.get("kind", "")
    if status in JobStatus.values:
        jobs = jobs.filter(status=status)
    if kind in JobKind.values:
        jobs = jobs.filter(kind=kind)
    return jobs, status, kind


@require_GET
@login_required
def jobs(request: HttpRequest) -> HttpResponse:
    rows, status, kind = _filtered_jobs(request)
    return render(request, "dashboard/jobs.html", {
        "rows": [readers.job_row(job) for job in rows[:200]], "status": status, "kind": kind,
        "statuses": JobStatus.choices, "kinds": JobKind.choices, "show_owner": request.user.is_staff,
        "query": request.GET.urlencode(), "qualification": readers.qualification_receipts(), "nav": "jobs"})


@require_GET
@login_required
def job_rows(request: HttpRequest) -> HttpResponse:
    """The jobs table body, for the page to resynchronise after a reconnect or a job it has not seen."""
    rows, _, _ = _filtered_jobs(request)
    return render(request, "dashboard/_job_rows.html", {
        "rows": [readers.job_row(job) for job in rows[:200]], "show_owner": request.user.is_staff})


# -- one job --


def _detail_context(request: HttpRequest, job: TrainingJob) -> dict:
    panel = readers.checkpoint_panel(job)
    checkpoints, registry_error = readers.adapter_checkpoints(job.adapter)
    return {"job": job, "adapter": job.adapter, "panel": panel, "stop": readers.stop_outcome(job, panel),
            "outcome": readers.outcome(job, panel), "checkpoints": checkpoints, "registry_error": registry_error,
            "events": readers.events(job), "percent": readers.percent(job),
            "checkpointing": readers.checkpointing(job), "warm_start": readers.accepts_base_adapter(job.kind),
            "terminal": job.status in readers.TERMINAL_STATUSES}


def _panels(request: HttpRequest, context: dict) -> dict:
    return {name: render_to_string(template, context, request=request) for name, template in PANELS.items()}


@require_GET
@job_view
def job_detail(request: HttpRequest, job: TrainingJob) -> HttpResponse:
    context = _detail_context(request, job)
    context |= {"charts": readers.chart_specs(job.kind), "metrics": readers.chart_metrics(job),
                "earlier": readers.earlier_metrics(job, request.user), "config_rows": readers.effective_settings(job),
                "identity_rows": readers.identity_rows(job), "nav": "jobs"}
    return render(request, "dashboard/job_detail.html", context)


def _job_state(job: TrainingJob) -> dict:
    return {"id": str(job.pk), "kind": job.kind, "status": job.status, "status_label": job.get_status_display(),
            "committed_step": job.committed_step, "total_steps": job.total_steps, "percent": readers.percent(job),
            "started_at": job.started_at, "finished_at": job.finished_at}


@require_GET
@job_view
def job_snapshot(request: HttpRequest, job: TrainingJob) -> JsonResponse:
    """Everything the detail page shows, now: state, the steps after ?after_step=N and the panels' HTML.
    The page asks after each (re)connect and when a checkpoint or status event arrives."""
    try:
        after_step = max(0, int(request.GET.get("after_step", "0")))
    except ValueError:
        after_step = 0
    context = _detail_context(request, job)
    return JsonResponse({"job": _job_state(job), "metrics": readers.chart_metrics(job, after_step),
                         "panels": _panels(request, context)})


@require_POST
@job_view
def stop_job(request: HttpRequest, job: TrainingJob) -> HttpResponse:
    """Stop and save: the same cooperative cancel as the API; the run publishes at its next safe boundary.
    A running job without checkpointing loses its progress when stopped, so it stops only on a POST that
    carries confirm=1 (the page's second, explicit button); without it nothing changes."""
    if (job.status == JobStatus.RUNNING and not readers.checkpointing(job)["can_save"]
            and request.POST.get("confirm") != "1"):
        messages.warning(request, "Not stopped: checkpointing is off for this run, so stopping it keeps nothing "
                                  "to resume from. Press 'Stop without saving' to stop it anyway.")
        return redirect("dashboard:job", job_id=job.pk)
    try:
        actions.do_cancel_job(job.pk, reason=f"stopped from the dashboard by {request.user.get_username()}")
    except InvalidTransition:
        messages.info(request, f"The job had already ended ({job.get_status_display().lower()}).")
    return redirect("dashboard:job", job_id=job.pk)


# -- submitting --


def _submit(request: HttpRequest, form) -> TrainingJob | None:
    """do_submit_job with the form's request; a refusal lands on the form and None is returned."""
    try:
        return actions.do_submit_job(request.user, form.body, form.payload, kind=form.kind)
    except Exception as exc:  # noqa: BLE001 (a refusal is shown; anything else propagates)
        refusal = refusal_for(exc)
        if refusal is None:
            raise
        form.add_refusal(refusal)
        return None


def _form_page(request, form, *, kind: str, source_job=None, status: int = 200) -> HttpResponse:
    if form.refusal is not None:
        status = form.refusal["status"]
    elif form.is_bound and form.errors:
        status = 400
    if form.is_bound:
        form.uploads_to_choose_again()
    return render(request, "dashboard/job_form.html", {
        "form": form, "kind": kind, "kinds": [(name, cls.title) for name, cls in JOB_FORMS.items()],
        "source_job": source_job, "nav": "jobs" if source_job else "new"}, status=status)


@require_http_methods(["GET", "POST"])
@login_required
def new_job(request: HttpRequest, kind: str) -> HttpResponse:
    form_class = JOB_FORMS.get(kind)
    if form_class is None:
        raise Http404(f"no new-job form for training kind {kind!r}")
    if request.method == "GET":
        return _form_page(request, form_class(user=request.user), kind=kind)
    form = form_class(request.POST, request.FILES, user=request.user)
    if form.is_valid():
        job = _submit(request, form)
        if job is not None:
            return redirect("dashboard:job", job_id=job.pk)
    return _form_page(request, form, kind=kind)


@require_http_methods(["GET", "POST"])
@job_view
def resume_job(request: HttpRequest, job: TrainingJob) -> HttpResponse:
    """Prepare resume: the job's effective request with resume_checkpoint = its latest checkpoint; inline data
    is left out (the checkpoint cannot reconstruct it), so the form refuses until the source is supplied."""
    form_class = JOB_FORMS.get(job.kind)
    try:
        config = resume.resume_config(job)  # the same configuration `kiln train resume` and the API resubmit
    except ActionRefused as refusal:
        messages.error(request, refusal.message)
        return redirect("dashboard:job", job_id=job.pk)
    basename = config["resume_checkpoint"]
    if request.method == "GET":
        initial = form_class.initial_from(config, job.request if isinstance(job.request, dict) else {}, basename)
        return _form_page(request, form_class(initial=initial, resume_from=basename, user=request.user), kind=job.kind,
                          source_job=job)
    form = form_class(request.POST, request.FILES, resume_from=basename, user=request.user)
    if form.is_valid():
        new = _submit(request, form)
        if new is not None:
            return redirect("dashboard:job", job_id=new.pk)
    return _form_page(request, form, kind=job.kind, source_job=job)


# -- adapters --


@require_GET
@login_required
def adapters(request: HttpRequest) -> HttpResponse:
    rows = readers.adapter_rows(request.user)
    return render(request, "dashboard/adapters.html", {"rows": rows, "show_owner": request.user.is_staff,
                                                       "nav": "adapters"})


@require_GET
@login_required
def adapter_detail(request: HttpRequest, name: str) -> HttpResponse:
    adapter = readers.visible_adapters(request.user).filter(name=name).first()
    if adapter is None:
        raise Http404("no such adapter (or it belongs to someone else)")
    manages = adapter.is_owner_or_staff(request.user)
    # checkpoints are its owner's training state (the API shows them only through the owner's jobs)
    checkpoints, error = readers.adapter_checkpoints(adapter) if manages else ([], None)
    return render(request, "dashboard/adapter_detail.html", {
        "adapter": adapter, "snapshot": readers.peft_snapshot(adapter.name), "checkpoints": checkpoints,
        "served": readers.served(adapter), "can_manage": manages,
        "shares": adapter.shares.select_related("user", "group") if manages else (),
        "registry_error": error,
        "jobs": [readers.job_row(job) for job in readers.listed_jobs(request.user).filter(adapter=adapter)[:50]],
        "show_owner": request.user.is_staff, "nav": "adapters"})


ADAPTER_ACTIONS = {
    "load": ("do_load_adapter", "Loaded {name}: it is served when a request names it."),
    "unload": ("do_unload_adapter", "Unloaded {name}."),
    "activate": ("do_activate_adapter", "Activated {name}: it now serves your requests that name no model."),
    "delete": ("do_delete_adapter", "Deleted the checkpoints and PEFT snapshot of {name}."),
    "share": ("do_share_adapter", "Shared {name} with the {kind} {target}: they may serve and evaluate it."),
    "unshare": ("do_unshare_adapter", "Stopped sharing {name} with the {kind} {target}."),
}


@require_POST
@login_required
def adapter_action(request: HttpRequest, name: str, action: str) -> HttpResponse:
    """Load, unload, activate, delete, share or unshare an adapter through the same actions as the API; an
    adapter the person may not see is 404, as on its page. Sharing reads kind (user or group) and target."""
    from kiln_web.serving import actions as serving_actions

    if action not in ADAPTER_ACTIONS:
        raise Http404("no such adapter action")
    function, done = ADAPTER_ACTIONS[action]
    share = {}
    if action in ("share", "unshare"):
        share = {"kind": request.POST.get("kind", ""), "target": request.POST.get("target", "").strip()}
    try:
        getattr(serving_actions, function)(request.user, name, **share)
    except ActionRefused as exc:
        if exc.code == "adapter_not_found":
            raise Http404("no such adapter (or it belongs to someone else)") from None
        messages.error(request, exc.message)
    else:
        messages.success(request, done.format(name=name, **share))
    return redirect("dashboard:adapter", name=name)


# -- qualification --


@require_GET
@login_required
def qualification(request: HttpRequest) -> HttpResponse:
    """The latest `kiln qualify` receipt per backend: passed or failed, each route, the execution envelope."""
    return render(request, "dashboard/qualification.html", {"receipts": readers.qualification_receipts(),
                                                            "nav": "qualification"})


# -- teachers --


@require_http_methods(["GET", "POST"])
@login_required
def teachers(request: HttpRequest) -> HttpResponse:
    """Teacher aliases (global names an OPD run's config.teacher resolves) and registering one."""
    from kiln_web.teachers.actions import adapters_hidden, do_create_teacher
    from kiln_web.teachers.models import TeacherAlias

    form = TeacherForm(request.POST or None)
    status = 200
    if request.method == "POST":
        if form.is_valid():
            fields = {key: value for key, value in form.cleaned_data.items() if key != "name"}
            try:
                alias = do_create_teacher(request.user, form.cleaned_data["name"].strip(), fields)
            except ActionRefused as exc:
                form.add_refusal(exc)
            else:
                messages.success(request, f"Registered {alias.name} "
                                          f"(identity revision {alias.identity_revision[:12]}).")
                return redirect("dashboard:teachers")
        status = 400
    aliases = list(TeacherAlias.objects.select_related("owner").order_by("name"))
    # a registry adapter the person may not see is left out, as in the API
    for alias, hidden in zip(aliases, adapters_hidden(aliases, request.user)):
        alias.adapter_hidden = hidden
    return render(request, "dashboard/teachers.html", {"aliases": aliases, "form": form, "nav": "teachers"},
                  status=status)


@require_POST
@login_required
def delete_teacher(request: HttpRequest, name: str) -> HttpResponse:
    from kiln_web.teachers.actions import do_delete_teacher

    try:
        do_delete_teacher(request.user, name)
    except ActionRefused as exc:
        messages.error(request, exc.message)
    else:
        messages.success(request, f"Deleted the teacher alias {name}.")
    return redirect("dashboard:teachers")
