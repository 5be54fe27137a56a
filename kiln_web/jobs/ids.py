"""Job ids as people type them: a full UUID, or a unique prefix of at least MIN_PREFIX hex digits, resolved
among the jobs the caller may see (their own; staff: everyone's). The API's job paths, and through them every
`kiln train ... --job-id`, use `visible_job`."""

from __future__ import annotations

import re
import uuid

from kiln_web.core.http import ActionRefused
from kiln_web.jobs.models import TrainingJob

MIN_PREFIX = 8  # hex digits: the first group of the UUID, the length `kiln train list` users copy
MATCHES_SHOWN = 10  # full ids listed when a prefix is ambiguous
HEX = re.compile(r"[0-9a-f]+")
DESCRIPTION = f"the job's id, or a unique prefix of at least {MIN_PREFIX} hex digits of it"


def _canonical_prefix(digits: str) -> str:
    """'0123456789ab' -> '01234567-89ab': hyphens where the UUID's text form has them, so the prefix compares
    the same way on PostgreSQL (uuid cast to text) and SQLite (32 hex digits)."""
    out = []
    for position, digit in enumerate(digits):
        if position in (8, 12, 16, 20):
            out.append("-")
        out.append(digit)
    return "".join(out)


def visible_job(user, text: str, queryset=None) -> TrainingJob:
    """The job TEXT names among those USER may see (QUERYSET narrows or annotates them). Refusals: 400
    invalid_job_id (not hex, or shorter than MIN_PREFIX digits), 404 not_found (no such job, or someone
    else's), 409 ambiguous_job_id (several match; `matches` lists their full ids)."""
    jobs = queryset if queryset is not None else TrainingJob.objects.visible_to(user)
    text = (text or "").strip()
    try:
        job_id = uuid.UUID(text)
    except ValueError:
        job_id = None
    if job_id is not None:
        job = jobs.filter(pk=job_id).first()
        if job is None:
            raise ActionRefused(404, "not_found", f"no training job {job_id} (or it belongs to someone else)")
        return job
    digits = text.lower().replace("-", "")
    if not HEX.fullmatch(digits) or len(digits) < MIN_PREFIX or len(digits) > 32:
        raise ActionRefused(400, "invalid_job_id", f"{text!r} is not a job id: give the full id or a prefix of at "
                                                   f"least {MIN_PREFIX} hex digits (kiln train list shows them)")
    matches = list(jobs.filter(pk__startswith=_canonical_prefix(digits)).order_by("-created_at")
                   [:MATCHES_SHOWN + 1])
    if not matches:
        raise ActionRefused(404, "not_found", f"no training job starts with {text} (or it belongs to someone else)")
    if len(matches) > 1:
        ids = [str(job.pk) for job in matches[:MATCHES_SHOWN]]
        more = " and more" if len(matches) > MATCHES_SHOWN else ""
        raise ActionRefused(409, "ambiguous_job_id", f"{text} is the start of several jobs ({', '.join(ids)}{more}); "
                                                     "give more of the id", matches=ids)
    return matches[0]
