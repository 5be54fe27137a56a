"""/v1/train/: submit SFT, GRPO and OPD, list and inspect jobs, cancel, checkpoints, metrics, events.

Each view parses (the schema), authorises (the token, then ownership), calls one action
and responds. A person sees their own jobs; staff see everyone's. Someone else's job
answers 404, the same as a job that does not exist.
"""

import json

from django.http import HttpRequest
from ninja import Path, Query, Router, Schema
from pydantic import Field

from kiln_web.adapters.models import CheckpointRecord
from kiln_web.core.http import Status, refusals
from kiln_web.jobs import actions, ids, resume, runtime
from kiln_web.serving.promotion import job_evaluation_ids, job_promotion
from kiln_web.jobs.models import JobKind, JobMetric, JobStatus, TrainingJob
from kiln_web.jobs.schemas import (CheckpointListOut, EventListOut, GRPORequest, JobListOut, JobOut, MetricListOut,
                                   OPDRequest, ResumeIn, SFTRequest)

router = Router(tags=["training"])

REFUSALS = refusals()
SUBMIT_REFUSALS = refusals(413, 503)


def _visible_jobs(request: HttpRequest):
    return TrainingJob.objects.visible_to(request.auth).select_related("owner", "adapter")


JobId = Path(..., description=ids.DESCRIPTION)


def _job(request: HttpRequest, job_id: str, bodies: bool = True) -> TrainingJob:
    """The job JOB_ID (a full id or a unique prefix) names among those the caller may see (kiln_web.jobs.ids);
    without its request and admission (TrainingJob.BODIES) unless BODIES."""
    jobs = _visible_jobs(request)
    return ids.visible_job(request.auth, job_id, jobs if bodies else jobs.defer(*TrainingJob.BODIES))


def _latest_checkpoint(job: TrainingJob) -> tuple[dict | None, dict | None]:
    """(latest_checkpoint, latest_checkpoint_error): the newest checkpoint the job published, else the one it
    resumed from. While the job is active the summary is the one recorded in the database when the checkpoint
    was published (no filesystem read: this is what pollers ask for); once the job has ended, the directory
    is checked again (light validation, and its manifest must have the digest recorded at publication), so a
    moved, deleted or altered checkpoint answers (None, error). A resume checkpoint the database never indexed
    (copied into the registry by hand) is always read from its directory."""
    basename = (job.latest_checkpoint or {}).get("resume_checkpoint") or job.resume_from
    if not basename:
        return None, None
    if job.is_active and job.latest_checkpoint:
        return job.latest_checkpoint, None
    record = CheckpointRecord.objects.filter(basename=basename).values("summary", "manifest_digest", "job_id").first() \
        or {}
    if job.is_active and record.get("summary"):
        return record["summary"], None
    digest = resume.published_digest(job, basename, record)
    try:
        return runtime.read_checkpoint_summary(basename, job.kind, job.adapter.name, manifest_digest=digest)
    except runtime.RunnerUnavailable as exc:
        return None, {"code": exc.code, "message": str(exc)}


def _detail(job: TrainingJob) -> dict:
    """The job, with its latest checkpoint (_latest_checkpoint) and its promotion."""
    out = job.to_dict()
    out["latest_checkpoint"], out["latest_checkpoint_error"] = _latest_checkpoint(job)
    out["promotion"], out["evaluation_ids"] = job_promotion(job), job_evaluation_ids(job)
    return out


def _submit(request: HttpRequest, payload, kind: str):
    body = json.loads(request.body)  # kept as submitted
    job = actions.do_submit_job(request.auth, body, payload.model_dump(exclude_unset=True), kind=kind)
    return Status(201, _detail(job))


@router.post("/sft", response={201: JobOut, **SUBMIT_REFUSALS}, summary="Submit an SFT run",
             operation_id="submit_sft")
def submit_sft(request: HttpRequest, payload: SFTRequest):
    """Admission validates the request, resolves the effective configuration and seed, and fully
    validates a resume checkpoint (refusing any drift field by field) before the job exists."""
    return _submit(request, payload, JobKind.SFT)


@router.post("/grpo", response={201: JobOut, **SUBMIT_REFUSALS}, summary="Submit a GRPO run",
             operation_id="submit_grpo")
def submit_grpo(request: HttpRequest, payload: GRPORequest):
    """GRPO over scored groups, inline or from a JSONL file (streamed with config.streaming). Admission
    tokenizes every group and, for a resume, proves the checkpoint and (streamed) re-hashes the lines
    it consumed: a changed file is refused with 409 source_changed."""
    return _submit(request, payload, JobKind.GRPO)


@router.post("/opd", response={201: JobOut, **SUBMIT_REFUSALS}, summary="Submit an on-policy distillation run",
             operation_id="submit_opd")
def submit_opd(request: HttpRequest, payload: OPDRequest):
    """config.teacher names a teacher alias; the server resolves it and admission reconstructs its content
    revision. A resume needs the alias to keep the checkpoint's identity and content revisions (409
    teacher_changed, with differences, otherwise)."""
    return _submit(request, payload, JobKind.OPD)


class JobFilter(Schema):
    status: JobStatus | None = Field(None, description="only jobs in this status")
    adapter: str | None = Field(None, description="only jobs training this adapter")
    limit: int = Field(50, ge=1, le=500)
    offset: int = Field(0, ge=0, le=2**31 - 1)  # bounded: the database refuses (500) a larger OFFSET


@router.get("/jobs", response={200: JobListOut, **REFUSALS}, summary="List training jobs", operation_id="list_jobs")
def list_jobs(request: HttpRequest, filters: Query[JobFilter]):
    jobs = _visible_jobs(request).defer(*TrainingJob.BODIES)
    if filters.status:
        jobs = jobs.filter(status=filters.status)
    if filters.adapter:
        jobs = jobs.filter(adapter__name=filters.adapter)
    items = []
    for job in jobs[filters.offset:filters.offset + filters.limit]:
        out = job.to_dict(summary=True)
        out["latest_checkpoint"] = (job.latest_checkpoint or {}).get("resume_checkpoint")
        items.append(out)
    return {"items": items, "count": jobs.count()}


@router.get("/jobs/{job_id}", response={200: JobOut, **REFUSALS}, summary="One training job",
            operation_id="get_job")
def get_job(request: HttpRequest, job_id: str = JobId):
    return _detail(_job(request, job_id))


@router.post("/jobs/{job_id}/cancel", response={200: JobOut, **REFUSALS}, summary="Cancel a training job",
             operation_id="cancel_job")
def cancel_job(request: HttpRequest, job_id: str = JobId):
    """A queued job is cancelled at once; a running one becomes `cancelling`, publishes a checkpoint at its
    next safe boundary (when checkpointing is on) and ends `cancelled`. A finished job answers 409."""
    job = _job(request, job_id)
    job = actions.do_cancel_job(job.pk, reason=f"cancelled by {request.auth.get_username()}")
    return _detail(job)


@router.post("/jobs/{job_id}/resume", response={201: JobOut, **SUBMIT_REFUSALS},
             summary="Resume an ended job from its latest checkpoint", operation_id="resume_job")
def resume_job(request: HttpRequest, job_id: str = JobId, payload: ResumeIn = None):
    """Submits the job's effective configuration and seed with `resume_checkpoint` set to its latest checkpoint
    (what the dashboard's "Prepare resume" fills in). The job's dataset_path is kept unless the body names the
    data again; a job that trained on inline data needs it again (400 source_required). 409 not_resumable when
    the job is active, its run completed, or it has no valid checkpoint; admission then refuses drift as for
    any submission."""
    source = payload.model_dump(exclude_unset=True) if payload is not None else {}
    job = resume.do_resume_job(request.auth, _job(request, job_id), source)
    return Status(201, _detail(job))


@router.get("/jobs/{job_id}/checkpoints", response={200: CheckpointListOut, **REFUSALS},
            summary="Checkpoints a job published", operation_id="list_job_checkpoints")
def list_checkpoints(request: HttpRequest, job_id: str = JobId):
    job = _job(request, job_id, bodies=False)
    items = []
    for record in job.checkpoints.select_related("adapter").order_by("step"):
        out = record.to_dict()
        out["present"] = runtime.checkpoint_path(record.basename).is_dir()
        items.append(out)
    return {"items": items}


class MetricPage(Schema):
    after_step: int = Field(0, ge=0, description="only steps after this one")
    limit: int = Field(1000, ge=1, le=10000)


@router.get("/jobs/{job_id}/metrics", response={200: MetricListOut, **REFUSALS},
            summary="Per-step metrics of a job", operation_id="list_job_metrics", exclude_unset=True)
def list_metrics(request: HttpRequest, page: Query[MetricPage], job_id: str = JobId):
    """loss, learning rate, gradient norm, clipped and loss-spike flags, tokens, epoch, elapsed seconds.
    GRPO adds the policy audit (clip_low/high/region_fraction, kl_mean, ratio_mean/min/max, reward_mean/std,
    advantage_mean/std, groups, completions); OPD adds kl, entropy, repetition_rate, empty_candidates,
    candidates_consumed."""
    job = _job(request, job_id, bodies=False)
    rows = list(JobMetric.objects.filter(job=job, step__gt=page.after_step).order_by("step")[:page.limit + 1])
    more = len(rows) > page.limit
    rows = rows[:page.limit]
    return {"items": [row.to_dict() for row in rows], "next_after_step": rows[-1].step if more else None}


class EventPage(Schema):
    offset: int = Field(0, ge=0, le=2**31 - 1, description="skip this many of the job's events (oldest first)")
    limit: int = Field(1000, ge=1, le=10000)


@router.get("/jobs/{job_id}/events", response={200: EventListOut, **REFUSALS},
            summary="The job's log: claims, checkpoints with their timings, warnings, errors",
            operation_id="list_job_events")
def list_events(request: HttpRequest, page: Query[EventPage], job_id: str = JobId):
    """Oldest first, a page of `limit` events from `offset`; next_offset asks for the next page."""
    job = _job(request, job_id, bodies=False)
    rows = list(job.events.order_by("time", "id")[page.offset:page.offset + page.limit + 1])
    more = len(rows) > page.limit
    rows = rows[:page.limit]
    return {"items": [event.to_dict() for event in rows], "next_offset": page.offset + len(rows) if more else None}
