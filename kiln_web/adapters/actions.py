"""Changes to an adapter's checkpoints in the registry: pruning old ones (`kiln checkpoint prune`).

The registry on disk is the authority; the CheckpointRecord index follows it. Nothing here runs on a
timer: a person asks for each prune, sees the plan first (a dry run), and only then deletes.
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
from dataclasses import asdict, dataclass
from pathlib import Path

from django.conf import settings
from django.db import transaction

from kiln_web.adapters.models import Adapter, CheckpointRecord
from kiln_web.core.http import ActionRefused
from kiln_web.jobs import runtime
from kiln_web.jobs.models import ACTIVE_STATUSES, TrainingJob

logger = logging.getLogger("kiln.adapters")


@dataclass
class PruneItem:
    """One checkpoint directory of the adapter and what the prune does with it, and why."""

    basename: str
    step: int
    state: str  # valid, invalid (light validation failed), unreadable (an OS error: never deleted)
    action: str  # keep, delete (failed: deletion was attempted and refused or failed)
    reason: str


def _protected(adapter: Adapter) -> tuple[dict[str, str], TrainingJob | None]:
    """{basename: why it must stay} for checkpoints active jobs own or resume from, and the adapter's active job."""
    reasons: dict[str, str] = {}
    active = list(TrainingJob.objects.filter(status__in=ACTIVE_STATUSES, adapter=adapter))
    for job in active:
        if job.resume_from:
            reasons[job.resume_from] = f"the {job.status} job {job.pk} resumes from it"
    for record in CheckpointRecord.objects.filter(job__in=active).select_related("job"):
        reasons.setdefault(record.basename, f"published by the {record.job.status} job {record.job_id}")
    for job in TrainingJob.objects.filter(status__in=ACTIVE_STATUSES).exclude(resume_from="").exclude(adapter=adapter):
        reasons.setdefault(job.resume_from, f"the {job.status} job {job.pk} resumes from it")
    return reasons, (active[0] if active else None)


def _plan(adapter: Adapter, keep: int) -> list[PruneItem]:
    """Every checkpoint directory of ADAPTER, newest first, each with keep or delete and the reason."""
    module = runtime.checkpoint_module()
    registry = settings.KILN_ADAPTERS_DIR
    protected, active_job = _protected(adapter)
    indexed = set(CheckpointRecord.objects.filter(adapter=adapter).values_list("basename", flat=True))
    items, rank = [], 0
    for path in reversed(module.list_checkpoints(registry, adapter.name)):
        step = module.parse_basename(path.name)[1]
        try:
            module.load_checkpoint(path, full=False, expected_adapter=adapter.name)
            state, problem = "valid", ""
        except module.CheckpointError as exc:
            state, problem = "invalid", f"{getattr(exc, 'code', 'checkpoint_invalid')}: {exc}"
        except OSError as exc:
            state, problem = "unreadable", exc.strerror or str(exc)
        rank += state == "valid"
        if state == "valid" and rank <= keep:
            action, reason = "keep", "the newest valid checkpoint" if rank == 1 else f"among the newest {keep} valid"
        elif path.name in protected:
            action, reason = "keep", protected[path.name]
        elif state == "unreadable":
            action, reason = "keep", f"cannot be read now ({problem}); never deleted unread"
        elif active_job is not None and path.name not in indexed:
            action, reason = "keep", f"not indexed yet while the {active_job.status} job {active_job.pk} publishes"
        elif state == "invalid":
            action, reason = "delete", f"invalid ({problem})"
        else:
            action, reason = "delete", f"older than the newest {keep} valid"
        items.append(PruneItem(path.name, step, state, action, reason))
    return items


def _confined(registry: Path, adapter: str, basename: str) -> Path:
    """The checkpoint directory BASENAME, proven to be a real directory directly inside the registry and
    named for ADAPTER; anything else is refused, never followed."""
    module = runtime.checkpoint_module()
    owner, _ = module.parse_basename(basename)
    root = Path(os.path.realpath(registry))
    path = root / basename
    info = os.lstat(path)
    if owner != adapter or basename in ("", ".", "..") or "/" in basename or os.sep in basename:
        raise ActionRefused(400, "outside_registry", f"{basename} is not a checkpoint of {adapter!r}")
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        raise ActionRefused(409, "not_a_checkpoint", f"{path} is not a real directory; left alone")
    if Path(os.path.realpath(path)).parent != root:
        raise ActionRefused(400, "outside_registry", f"{path} resolves outside the adapter registry {root}")
    return path


def do_prune_checkpoints(user, name: str, keep: int, apply: bool = False) -> list[dict]:
    """Plan (and, with APPLY, carry out) deleting all but ADAPTER's newest KEEP valid checkpoints; returns
    the plan, newest first: {basename, step, state, action, reason}. Never deleted: the newest valid
    checkpoint (KEEP >= 1), a checkpoint of a queued, running or cancelling job or one such a job resumes
    from, one that cannot be read. Deleted directories' index rows go with them. USER None is the local
    operator (`kiln checkpoint prune` on the server's machine); a person may prune only their own adapters."""
    if not isinstance(keep, int) or isinstance(keep, bool) or keep < 1:
        raise ActionRefused(400, "invalid_request", f"keep must be 1 or more (it is {keep!r}): the newest valid "
                                                    "checkpoint is never pruned", field="keep")
    adapter = Adapter.objects.select_related("owner").filter(name=name).first()
    if adapter is None or (user is not None and not adapter.is_owner_or_staff(user)):
        raise ActionRefused(404, "adapter_not_found", f"no adapter named {name!r} (or it belongs to someone else)")
    if not apply:
        return [asdict(item) for item in _plan(adapter, keep)]
    registry = settings.KILN_ADAPTERS_DIR
    with transaction.atomic():  # the adapter's lock: no submission for it is admitted meanwhile
        adapter = Adapter.objects.select_for_update().get(pk=adapter.pk)
        plan = _plan(adapter, keep)
        removed = []
        for item in plan:
            if item.action != "delete":
                continue
            try:
                shutil.rmtree(_confined(registry, adapter.name, item.basename))
            except FileNotFoundError:
                item.reason += "; it was already gone"
            except (OSError, ActionRefused) as exc:  # left (partly) in place: said, and its index row stays
                why = getattr(exc, "strerror", None) or getattr(exc, "message", None) or exc
                item.action, item.reason = "failed", f"{item.reason}; not deleted: {why}"
                continue
            removed.append(item.basename)
            logger.info("pruned %s: %s", item.basename, item.reason)
        CheckpointRecord.objects.filter(adapter=adapter, basename__in=removed).delete()
    if removed:
        _fsync_dir(registry)
    return [asdict(item) for item in plan]


def _fsync_dir(directory) -> None:
    """Make the removals durable (the registry's directory entries)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
