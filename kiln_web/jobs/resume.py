"""Resuming a job: the request that continues an ended job from its latest checkpoint, and its submission.

What "Prepare resume" in the dashboard fills in, as one request: the job's effective configuration
(the fields its request schema knows) with its effective seed and `resume_checkpoint` set to the latest
checkpoint; a file source (`dataset_path`) is kept; inline data is not (the checkpoint cannot
reconstruct it), so the caller sends it again. OPD's teacher is the alias the job was submitted with,
never the resolved spec. The new job is admitted by `do_submit_job` like every submission, so resume
admission proves the checkpoint and refuses any drift field by field.
"""

from __future__ import annotations

import typing

import pydantic
from django.conf import settings

from kiln_web.core.http import ActionRefused, error_location
from kiln_web.jobs import actions, runtime
from kiln_web.adapters.models import CheckpointRecord
from kiln_web.jobs.models import JobKind, JobStatus, TrainingJob
from kiln_web.jobs.schemas import GRPORequest, OPDRequest, SFTRequest

REQUESTS = {JobKind.SFT: SFTRequest, JobKind.GRPO: GRPORequest, JobKind.OPD: OPDRequest}
INLINE = {kind: schema.INLINE for kind, schema in REQUESTS.items()}  # data, groups, prompts
KEEP_NULL = {"max_grad_norm"}  # null has a meaning of its own here (no clipping); elsewhere null is "default"


def _refuse(job: TrainingJob, reason: str, **extra) -> ActionRefused:
    return ActionRefused(409, "not_resumable", f"job {job.pk} cannot be resumed: {reason}", **extra)


def published_digest(job: TrainingJob, basename: str, record: dict | None = None) -> str:
    """The SHA-256 of the manifest JOB published or resumed from under BASENAME ("" when unknown), which the
    directory must still have: the index row holds the latest publication under the name, another run's once
    the name was freed (its adapter deleted) and published again. RECORD: the row's values, if read already."""
    if record is None:
        record = CheckpointRecord.objects.filter(basename=basename).values("manifest_digest", "job_id").first() or {}
    if record.get("job_id") == job.pk and record.get("manifest_digest"):
        return record["manifest_digest"]
    if (job.latest_checkpoint or {}).get("resume_checkpoint") == basename \
            and job.latest_checkpoint.get("manifest_sha256"):
        return job.latest_checkpoint["manifest_sha256"]
    resume = (job.admission or {}).get("resume") or {}
    if resume.get("checkpoint") == basename and resume.get("manifest_digest"):
        return resume["manifest_digest"]
    return record.get("manifest_digest") or ""


def resume_checkpoint(job: TrainingJob) -> str:
    """The basename of the checkpoint JOB resumes from: its newest published one (else the one it resumed
    from), light-validated now. ActionRefused 409 not_resumable says why there is none."""
    if job.is_active:
        raise _refuse(job, f"it is {job.status}; cancel it (kiln train cancel --job-id {job.pk}) or wait for it "
                           "to end, then resume")
    basename = (job.latest_checkpoint or {}).get("resume_checkpoint") or job.resume_from
    if not basename:
        raise _refuse(job, "it published no checkpoint (it stopped before its first checkpoint interval, or "
                           "checkpointing was off); submit the run again")
    try:
        summary, error = runtime.read_checkpoint_summary(basename, job.kind, job.adapter.name,
                                                         manifest_digest=published_digest(job, basename))
    except runtime.RunnerUnavailable as exc:
        summary, error = None, {"code": exc.code, "message": str(exc)}
    if summary is None:
        raise _refuse(job, f"its latest checkpoint {basename} is not valid now ({error['code']}: "
                           f"{error['message']})", checkpoint=basename, checkpoint_error=error)
    if summary.get("complete") or job.status == JobStatus.SUCCEEDED:
        raise _refuse(job, f"its run completed ({basename} holds step {summary.get('committed_step')} of "
                           f"{summary.get('total_steps')}); there is nothing left to train", checkpoint=basename)
    _refuse_if_overtaken(job, basename)
    return basename


def _refuse_if_overtaken(job: TrainingJob, basename: str) -> None:
    """not_resumable when the adapter has checkpoints after BASENAME (an earlier resume of this run went on past
    it): resuming from it again would reach their immutable names. Names the job to resume instead."""
    module = runtime.checkpoint_module()
    step = module.parse_basename(basename)[1]
    later = [path.name for path in module.later_checkpoints(settings.KILN_ADAPTERS_DIR, job.adapter.name, step)]
    if not later:
        return
    record = CheckpointRecord.objects.filter(basename=later[-1]).first()
    if record is not None and record.job_id != job.pk:
        instead = (f"job {record.job_id} went on from this run to {later[-1]}; resume that one "
                   f"(kiln train resume --job-id {str(record.job_id)[:8]})")
    else:
        instead = f"the adapter's newest checkpoint is {later[-1]}; resume from it"
    raise _refuse(job, f"{job.adapter.name} already has {len(later)} checkpoint(s) after {basename}, whose names a "
                       f"run resumed from it would reach: {instead}, or move the later checkpoints out of the "
                       "registry first", checkpoint=basename, newer_checkpoint=later[-1],
                  **({"job_id": str(record.job_id)} if record is not None and record.job_id != job.pk else {}))


def _nested(annotation) -> type[pydantic.BaseModel] | None:
    """The schema class inside an annotation such as `LoRAConfig | None`, if any."""
    for candidate in (annotation, *typing.get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, pydantic.BaseModel):
            return candidate
    return None


def _known(values: dict, schema: type[pydantic.BaseModel]) -> dict:
    """VALUES reduced to the fields SCHEMA accepts (recursively); nulls dropped except where null means something."""
    out = {}
    for name, field in schema.model_fields.items():
        if name not in values:
            continue
        value, nested = values[name], _nested(field.annotation)
        if value is None:
            if name in KEEP_NULL:
                out[name] = None
        elif nested is not None and isinstance(value, dict):
            out[name] = _known(value, nested)
        else:
            out[name] = value
    return out


def resume_config(job: TrainingJob) -> dict:
    """The `config` that continues JOB: its effective configuration as the request schema takes it, its effective
    seed, `resume_checkpoint` (resume_checkpoint(job)) and, for OPD, the teacher alias as submitted. The API's
    resume and the dashboard's Prepare resume both start from it."""
    basename = resume_checkpoint(job)
    original = job.request if isinstance(job.request, dict) else {}
    config = _known(dict(job.effective_config or {}), REQUESTS[job.kind].model_fields["config"].annotation)
    config.update(output_name=job.adapter.name, seed=job.effective_seed, resume_checkpoint=basename)
    if job.kind == JobKind.OPD:  # the alias as submitted; the effective configuration holds the resolved spec
        config["teacher"] = (original.get("config") or {}).get("teacher") or (job.teacher or {}).get("alias")
    return config


def resume_request(job: TrainingJob, source: dict | None = None) -> dict:
    """The request body that continues JOB from its latest checkpoint. SOURCE may name the data again:
    {"dataset_path": ...} or the kind's inline field (data, groups, prompts); without it the job's own
    dataset_path is kept, and a job that trained on inline data is refused (400 source_required)."""
    config = resume_config(job)
    inline = INLINE[job.kind]
    source = {key: value for key, value in (source or {}).items() if value is not None}
    wrong = sorted(set(source) - {"dataset_path", inline})
    if wrong:
        raise ActionRefused(400, "invalid_request", f"job {job.pk} is a {job.kind.upper()} run: give dataset_path "
                                                    f"or {inline}, not {', '.join(wrong)}", field=wrong[0])
    if len(source) > 1:
        raise ActionRefused(400, "invalid_request", f"give one of dataset_path and {inline}, not both",
                            field="dataset_path")
    original = job.request if isinstance(job.request, dict) else {}
    if not source:
        if not isinstance(original.get("dataset_path"), str):
            raise ActionRefused(400, "source_required", f"job {job.pk} trained on inline {inline}, which its "
                                f"checkpoint cannot reconstruct: send the same {inline} again (kiln train resume "
                                f"--job-id {str(job.pk)[:8]} --file FILE)", field=inline)
        source = {"dataset_path": original["dataset_path"]}
    return {**source, "config": config}


def do_resume_job(user, job: TrainingJob, source: dict | None = None) -> TrainingJob:
    """Submit the request that resumes JOB (resume_request) as USER, through do_submit_job."""
    body = resume_request(job, source)
    try:
        payload = REQUESTS[job.kind].model_validate(body)
    except pydantic.ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(error_location(first))
        raise ActionRefused(400, "invalid_request", f"the resume request is not valid: {where}: {first.get('msg')}",
                            field=where or None) from None
    return actions.do_submit_job(user, body, payload.model_dump(exclude_unset=True), kind=job.kind)
