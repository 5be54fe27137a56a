"""Every change to what is served, one function each, shared by the API, the CLI, the dashboard and promotion.

The ServedAdapter rows are the authority (kiln_web.serving.models); a change is written in a
transaction on locked rows, then this process's pool is brought in step. Loading through
the API loads in this process first, so an adapter that does not fit its base is refused
before any row says it is served.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

from django.contrib.auth import get_user_model
from django.db import transaction
from django.db.models import OuterRef, Subquery
from django.utils import timezone

from kiln_web.adapters.models import Adapter, AdapterShare
from kiln_web.core.http import STATUS, ActionRefused
from kiln_web.serving import runtime
from kiln_web.serving.models import PromotionOutcome, PromotionRecord, ServedAdapter
from kiln_web.serving.runtime import ServingError
from trainer.peft import ADAPTER_FILES

logger = logging.getLogger("kiln.serving")

ADAPTER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,99}$")


def _refusal(error: ServingError) -> ActionRefused:
    """A pool's refusal to load: its model_not_found names the base here, so it is base_not_found (400)."""
    code = "base_not_found" if error.code == "model_not_found" else error.code
    return ActionRefused(STATUS.get(code, 400), code, error.message)


def _not_found(name: str) -> ActionRefused:
    """The one answer for an adapter that does not exist and for one the person may not see (names do not leak)."""
    return ActionRefused(404, "adapter_not_found", f"no adapter named {name!r}; GET /v1/adapters lists yours and "
                                                   "those shared with you")


def adapter_for(user, name: str, *, manage: bool = True, field: str = "name") -> Adapter:
    """The adapter USER may use (MANAGE False: their own, one shared with them, anyone's for staff) or change
    (MANAGE: their own, anyone's for staff). One they may not see is refused exactly like a name that does not
    exist (404 adapter_not_found); one shared with them that they ask to change is 403 adapter_not_yours. A PEFT
    snapshot in the registry that no run has claimed is registered to the first person who acts on it. FIELD is
    what a malformed NAME is refused as (the path parameter, or a body's field)."""
    if not isinstance(name, str) or not ADAPTER_NAME.match(name):
        raise ActionRefused(400, "invalid_request", f"{name!r} is not an adapter name (letters, digits, '.', '_', "
                                                    "'-'; at most 100)", field=field)
    adapter = Adapter.objects.select_related("owner").filter(name=name).first()
    if adapter is None:
        if not runtime.has_snapshot(name):
            raise _not_found(name)
        adapter, _ = Adapter.objects.get_or_create(name=name, defaults={"owner": user})
    if not adapter.is_owner_or_staff(user):
        if not adapter.is_visible_to(user):
            raise _not_found(name)
        if manage:
            raise ActionRefused(403, "adapter_not_yours", f"the adapter {name!r} is shared with you for serving and "
                                                          "evaluation; only its owner (or staff) can load, unload, "
                                                          "activate, delete or share it")
    return adapter


def registry_adapter_hidden(user, path_text) -> bool:
    """Whether PATH_TEXT (a teacher's adapter directory, a warm start's base_adapter), or a PEFT file in it through
    a link, lies in the adapter registry under an adapter USER may not see (its PEFT snapshot `NAME` or a checkpoint
    `NAME-checkpoint-step-...`) or in one of the registry's hidden staging or retired copies. Reading those weights
    (distilling from them, starting from them) is using the adapter, so the caller refuses it as if the directory
    did not exist. A path that does not resolve, or lies elsewhere, is left to the caller."""
    return registry_adapters_hidden(user, [path_text])[0]


def registry_adapters_hidden(user, paths: list) -> list[bool]:
    """registry_adapter_hidden for each of PATHS, with two queries whatever their number."""
    try:
        registry = runtime.registry().resolve()
    except (OSError, RuntimeError, ValueError):
        return [False] * len(paths)
    entries = [_registry_entries(registry, path_text) for path_text in paths]
    names = {entry.split("-checkpoint-step-")[0] for found in entries for entry in found if not entry.startswith(".")}
    hidden = set()
    if names:
        hidden = (set(Adapter.objects.filter(name__in=names).values_list("name", flat=True))
                  - set(Adapter.objects.visible_to(user).filter(name__in=names).values_list("name", flat=True)))
    # a staging or retired copy (a name starting with '.') is nobody's to read
    return [any(entry.startswith(".") or entry.split("-checkpoint-step-")[0] in hidden for entry in found)
            for found in entries]


def _registry_entries(registry: Path, path_text) -> list[str]:
    """The registry entries (top-level names) that PATH_TEXT and the PEFT files in it resolve into; none for a
    path that does not resolve, or lies elsewhere."""
    if not isinstance(path_text, str) or not path_text:
        return []
    try:
        directory = Path(path_text)
        places = [directory.resolve(), *((directory / name).resolve() for name in ADAPTER_FILES)]
    except (OSError, RuntimeError, ValueError):
        return []
    return [place.relative_to(registry).parts[0] for place in places
            if place != registry and place.is_relative_to(registry)]


def job_base(job) -> str | None:
    """The base a training job ran over: its effective base_model, else what the adapter's snapshot names,
    else the base identity's name."""
    config = job.effective_config if isinstance(job.effective_config, dict) else {}
    identity = (job.identities or {}).get("base") if isinstance(job.identities, dict) else None
    for base in (config.get("base_model"), runtime.snapshot_base(job.adapter.name), (identity or {}).get("name")):
        if isinstance(base, str) and base:
            return base
    return None


NEWEST_SUCCEEDED = ("-finished_at",)  # which of an adapter's succeeded jobs says its base


def _succeeded_jobs():
    from kiln_web.jobs.models import JobStatus, TrainingJob

    # what job_base reads, and nothing of the (possibly large) request and admission bodies
    return TrainingJob.objects.filter(status=JobStatus.SUCCEEDED).only("pk", "adapter_id", "effective_config",
                                                                       "identities")


def adapter_base(adapter: Adapter, newest_job=None, *, known: bool = False) -> str | None:
    """The base an adapter was trained over: its newest succeeded job's, else what its snapshot names. KNOWN: the
    caller read that job already (NEWEST_JOB, None when there is none)."""
    job = newest_job if known else _succeeded_jobs().filter(adapter=adapter).order_by(*NEWEST_SUCCEEDED).first()
    if job is not None:
        job.adapter = adapter
        return job_base(job)
    return runtime.snapshot_base(adapter.name)


def _base_for(adapter: Adapter, base: str | None) -> str:
    base = base or adapter_base(adapter)
    if base is None:
        raise ActionRefused(400, "base_required", f"cannot tell which base {adapter.name!r} was trained over; "
                                                  "name it (base)")
    if not runtime.is_base(base):
        raise ActionRefused(400, "base_not_found", f"no registered base named {base!r}; kiln base list shows them")
    return base


def _in_step() -> None:
    """Bring this process's pool in step with the rows, if this process serves at all."""
    serving = runtime.started()
    if serving is not None:
        serving.reconcile(runtime.wanted_adapters())


def _record_load(adapter: Adapter, base: str, sha: str, loaded_by: str) -> ServedAdapter:
    """Create or renew the adapter's row (a new generation makes every process reload it)."""
    row = ServedAdapter.objects.select_for_update().filter(adapter=adapter).first()
    if row is None:
        return ServedAdapter.objects.create(adapter=adapter, base=base, adapter_sha256=sha, loaded_by=loaded_by)
    row.base, row.adapter_sha256, row.loaded_by, row.loaded_at = base, sha, loaded_by, timezone.now()
    row.generation += 1
    row.save(update_fields=["base", "adapter_sha256", "loaded_by", "loaded_at", "generation"])
    return row


def do_load_adapter(user, name: str, base: str | None = None) -> ServedAdapter:
    """Load the adapter's PEFT snapshot over its base here, then record that every process serves it."""
    adapter = adapter_for(user, name)
    if not runtime.has_snapshot(name):  # before the base: without a snapshot there is nothing to load over it
        raise ActionRefused(409, "no_snapshot", f"adapter {name!r} has no PEFT snapshot: its run has not finished "
                                                "(a run publishes the snapshot when it succeeds); wait for it, or "
                                                "resume a stopped run (kiln train resume --job-id ID) to finish it")
    base = _base_for(adapter, base)
    serving = runtime.serving()
    with serving.exclusive():
        try:
            sha = serving.load_now(name, base)
        except ServingError as error:
            raise _refusal(error) from None
        try:
            with transaction.atomic():
                adapter = Adapter.objects.select_for_update().get(pk=adapter.pk)
                if runtime.snapshot_sha256(name) != sha:
                    raise ActionRefused(409, "adapter_changed", f"the snapshot of {name!r} changed while it loaded; "
                                                                "load it again")
                row = _record_load(adapter, base, sha, user.get_username())
            serving.mark_loaded(name, row.generation, sha)
        except BaseException:
            serving.reconcile(runtime.wanted_adapters())  # drop what was loaded but not recorded
            raise
    return row


def do_unload_adapter(user, name: str) -> bool:
    """Stop serving the adapter everywhere; returns whether it was active (its scope then has none: requests
    there that name no model get the default base)."""
    adapter = adapter_for(user, name)
    with transaction.atomic():
        row = ServedAdapter.objects.select_for_update().filter(adapter=adapter).first()
        if row is None:
            raise ActionRefused(409, "adapter_not_loaded", f"the adapter {name!r} is not loaded")
        was_active = row.active
        row.delete()
    _in_step()
    return was_active


def active_in(scope) -> ServedAdapter | None:
    """SCOPE's active adapter (the row answering their requests that name no model), or None."""
    if scope is None:
        return None
    return ServedAdapter.objects.filter(active=True, active_for=scope).select_related("adapter").first()


def _lock_scope(scope) -> None:
    """Take SCOPE's activation lock (its user row) for the rest of the caller's transaction: activations in one
    scope then run one after another, each seeing the one before as the active adapter it replaces. Without it two
    activations both found no previous one and the second broke serving_one_active_adapter_per_owner (a 500).
    Taken before any ServedAdapter row is locked, so activations and promotions lock in one order."""
    # FOR NO KEY UPDATE: rows that merely refer to the user (a token, a job) are still written meanwhile
    list(get_user_model().objects.select_for_update(no_key=True).filter(pk=scope.pk).values_list("pk", flat=True))


def _activate(row: ServedAdapter, scope, *, decided_by: str, reason: str, user=None, job=None,
              evaluation=None) -> PromotionRecord:
    """Make ROW SCOPE's active adapter (the one before in that scope stops being active) and record the promotion
    (inside the caller's transaction, which holds _lock_scope(SCOPE)). Other people's active adapters are
    untouched."""
    previous = (ServedAdapter.objects.select_for_update().filter(active=True, active_for=scope)
                .exclude(pk=row.pk).first())
    if previous is not None:
        previous.active, previous.active_for = False, None
        previous.save(update_fields=["active", "active_for"])
    row.active, row.active_for, row.activated_at = True, scope, timezone.now()
    row.save(update_fields=["active", "active_for", "activated_at"])
    return PromotionRecord.objects.create(
        adapter=row.adapter, job=job, evaluation=evaluation, outcome=PromotionOutcome.PROMOTED, reason=reason,
        decided_by=decided_by, user=user, adapter_sha256=row.adapter_sha256,
        previous_active=previous.adapter.name if previous is not None else "")


def do_activate_adapter(user, name: str) -> PromotionRecord:
    """Serve this loaded adapter to USER when their request names no model (USER's scope: staff activating
    someone else's adapter make it their own default, not its owner's); a person's promotion, recorded."""
    adapter = adapter_for(user, name)
    with transaction.atomic():
        _lock_scope(user)
        row = ServedAdapter.objects.select_for_update().select_related("adapter").filter(adapter=adapter).first()
        if row is None:
            raise ActionRefused(409, "adapter_not_loaded", f"load the adapter {name!r} before activating it "
                                                           f"(POST /v1/adapters/{name}/load)")
        record = _activate(row, user, decided_by=user.get_username(), user=user,
                           reason=f"activated by {user.get_username()}")
    _in_step()
    return record


def _scope(adapter: Adapter, job):
    """Whose scope a promotion acts in: the training job's owner, else the adapter's."""
    return job.owner if job is not None else adapter.owner


def do_promote(adapter: Adapter, base: str, sha: str, *, decided_by: str, reason: str, job=None,
               evaluation=None) -> PromotionRecord:
    """Load and activate, in the job owner's scope, an adapter whose canary passed (promotion by a gate or
    auto_load). The web processes load it when they next serve; the snapshot must still be the one the canary
    ran."""
    with transaction.atomic():
        adapter = Adapter.objects.select_for_update().get(pk=adapter.pk)
        scope = _scope(adapter, job)
        _lock_scope(scope)
        if runtime.snapshot_sha256(adapter.name) != sha:
            raise ServingError("adapter_changed", f"the snapshot of {adapter.name!r} changed after its canary ran")
        row = _record_load(adapter, base, sha, decided_by)
        record = _activate(row, scope, decided_by=decided_by, reason=reason, job=job, evaluation=evaluation)
    return record


def do_record_promotion(adapter: Adapter, outcome: str, reason: str, *, decided_by: str, job=None,
                        evaluation=None, sha: str = "") -> PromotionRecord:
    """Record a decision that left the adapter unpromoted (the job owner's active adapter is unchanged)."""
    active = active_in(_scope(adapter, job))
    return PromotionRecord.objects.create(adapter=adapter, job=job, evaluation=evaluation, outcome=outcome,
                                          reason=reason, decided_by=decided_by, adapter_sha256=sha,
                                          previous_active=active.adapter.name if active is not None else "")


def do_delete_adapter(user, name: str) -> dict:
    """Delete an idle adapter's files: its checkpoint directories (its exact prefix only) and its PEFT
    snapshot. Refused while it is loaded or active, trained, or evaluated (as a candidate or a baseline). The
    Adapter row stays as the history its jobs refer to."""
    from kiln_web.evals.models import BaselineKind, EvalRun, EvalStatus
    from kiln_web.jobs.models import ACTIVE_STATUSES

    adapter = adapter_for(user, name)
    _in_step()
    with transaction.atomic():
        adapter = Adapter.objects.select_for_update().get(pk=adapter.pk)
        row = ServedAdapter.objects.filter(adapter=adapter).first()
        if row is not None:
            state = "active" if row.active else "loaded"
            raise ActionRefused(409, f"adapter_{state}", f"the adapter {name!r} is {state}; unload it first "
                                                         f"(POST /v1/adapters/{name}/unload), then delete it")
        serving = runtime.started()
        if serving is not None and name in serving.loaded_here():
            raise ActionRefused(409, "adapter_loaded", f"the adapter {name!r} is still loaded in this process; "
                                                       "try again in a moment")
        job = adapter.jobs.filter(status__in=ACTIVE_STATUSES).first()
        if job is not None:
            if not job.is_owner_or_staff(user):  # someone else's job is not named to them (it is 404 to them)
                raise ActionRefused(409, "adapter_busy", f"the adapter {name!r} has a {job.status} training job of "
                                                         "another person; wait for it to end")
            raise ActionRefused(409, "adapter_busy", f"the adapter {name!r} has a {job.status} training job "
                                                     f"({job.pk}); wait for it or cancel it first", job_id=str(job.pk))
        evaluating = EvalRun.objects.filter(status__in=(EvalStatus.QUEUED, EvalStatus.RUNNING))
        busy = evaluating.filter(candidate=adapter).first()
        if busy is not None:
            if not busy.is_owner_or_staff(user):
                raise ActionRefused(409, "adapter_busy", f"the adapter {name!r} is being evaluated by another person; "
                                                         "wait for the evaluation to end")
            raise ActionRefused(409, "adapter_busy", f"the adapter {name!r} is being evaluated ({busy.pk}); "
                                                     "wait for the evaluation to end", evaluation_id=str(busy.pk))
        busy = evaluating.filter(baseline_kind=BaselineKind.ADAPTER, baseline=name).first()
        if busy is not None:  # the baseline is evaluated too: without its snapshot the run fails
            if not busy.is_owner_or_staff(user):
                raise ActionRefused(409, "adapter_busy", f"the adapter {name!r} is the baseline of another person's "
                                                         "evaluation; wait for the evaluation to end")
            raise ActionRefused(409, "adapter_busy", f"the adapter {name!r} is the baseline of evaluation {busy.pk}; "
                                                     "wait for the evaluation to end", evaluation_id=str(busy.pk))
        checkpoints = runtime.delete_checkpoints(name)
        snapshot = runtime.remove_snapshot(name)
    logger.info("deleted adapter %s: %d checkpoint(s), snapshot %s", name, len(checkpoints), snapshot or "absent")
    return {"adapter": name, "checkpoints_removed": checkpoints, "snapshot_removed": snapshot}


# -- sharing --

SHARE_KINDS = ("user", "group")


def _share_target(kind: str, target: str):
    """The User or Group a share names; an unknown one is 404 (user_not_found, group_not_found)."""
    from django.contrib.auth import get_user_model
    from django.contrib.auth.models import Group

    if kind not in SHARE_KINDS:
        raise ActionRefused(400, "invalid_request", f"share with a user or a group, not {kind!r}", field="kind")
    if not isinstance(target, str) or not target:
        raise ActionRefused(400, "invalid_request", f"name the {kind} to share with", field=kind)
    if kind == "user":
        found = get_user_model().objects.filter(**{get_user_model().USERNAME_FIELD: target}).first()
    else:
        found = Group.objects.filter(name=target).first()
    if found is None:
        raise ActionRefused(404, f"{kind}_not_found", f"no {kind} named {target!r}", field=kind)
    return found


def do_share_adapter(user, name: str, *, kind: str, target: str) -> AdapterShare:
    """Let the user or group TARGET use the adapter (serve it, evaluate with it); only its owner or staff share.
    Visibility is read from the database on every request, so the share holds in every process at once."""
    adapter = adapter_for(user, name)
    found = _share_target(kind, target)
    if kind == "user" and found.pk == adapter.owner_id:
        raise ActionRefused(400, "invalid_request", f"{target!r} owns {name!r} already", field="user")
    with transaction.atomic():
        adapter = Adapter.objects.select_for_update().get(pk=adapter.pk)
        if adapter.shares.filter(**{kind: found}).exists():
            raise ActionRefused(409, "share_exists", f"{name!r} is already shared with the {kind} {target!r}")
        share = AdapterShare.objects.create(adapter=adapter, created_by=user, **{kind: found})
    logger.info("%s shared adapter %s with %s %s", user.get_username(), name, kind, target)
    return share


def do_unshare_adapter(user, name: str, *, kind: str, target: str) -> None:
    """Stop sharing the adapter with the user or group TARGET; their next request is refused (404)."""
    adapter = adapter_for(user, name)
    found = _share_target(kind, target)
    deleted, _ = AdapterShare.objects.filter(adapter=adapter, **{kind: found}).delete()
    if not deleted:
        raise ActionRefused(404, "share_not_found", f"{name!r} is not shared with the {kind} {target!r}")
    logger.info("%s stopped sharing adapter %s with %s %s", user.get_username(), name, kind, target)


# -- reading --


def _newest_per_adapter(rows, ids: list, order: tuple) -> dict:
    """{adapter id: its newest row of ROWS (a queryset with an `adapter` foreign key) by ORDER} for the adapters
    IDS, in one query whatever their number (each adapter's pick is a subquery on its own rows)."""
    pick = rows.filter(adapter=OuterRef("pk")).order_by(*order).values("pk")[:1]
    picks = Adapter.objects.filter(pk__in=ids).annotate(pick=Subquery(pick)).values("pick")
    return {row.adapter_id: row for row in rows.filter(pk__in=picks)}


def adapter_views(adapters, rows: dict, user=None) -> list[dict]:
    """Each of ADAPTERS as the API shows it to USER; its shares only to those who may change them. Their latest
    promotions, shares, newest succeeded jobs and checkpoint counts are read in one query each, whatever the
    number of adapters."""
    from django.db.models import Count

    from kiln_web.adapters.models import CheckpointRecord

    adapters = list(adapters)
    ids = [adapter.pk for adapter in adapters]
    managed = [adapter.pk for adapter in adapters if user is not None and adapter.is_owner_or_staff(user)]
    latest = _newest_per_adapter(PromotionRecord.objects.all(), managed, ("-decided_at", "-id")) if managed else {}
    shares: dict = {pk: [] for pk in managed}
    if managed:
        for share in AdapterShare.objects.filter(adapter_id__in=managed).select_related("user", "group",
                                                                                      "created_by"):
            shares[share.adapter_id].append(share.to_dict())
    jobs = _newest_per_adapter(_succeeded_jobs(), ids, NEWEST_SUCCEEDED) if ids else {}
    checkpoints = dict(CheckpointRecord.objects.filter(adapter_id__in=ids).order_by().values("adapter")
                       .annotate(count=Count("pk")).values_list("adapter", "count")) if ids else {}
    serving = runtime.started()
    loaded_here = serving.loaded_here() if serving else ()
    views = []
    for adapter in adapters:
        row = rows.get(adapter.pk)
        manages = adapter.pk in shares
        promotion = latest.get(adapter.pk)
        if promotion is not None:
            promotion.adapter = adapter
        views.append({
            "name": adapter.name, "owner": adapter.owner.get_username(),
            "base": adapter_base(adapter, jobs.get(adapter.pk), known=True),
            "snapshot": runtime.has_snapshot(adapter.name), "loaded": row is not None,
            "active": bool(row and row.active and user is not None and row.active_for_id == user.pk),
            "serving": row.to_dict() if row is not None else None, "loaded_here": adapter.name in loaded_here,
            "checkpoint_records": checkpoints.get(adapter.pk, 0) if manages else None,  # the owner's training
            "latest_promotion": promotion.to_dict() if promotion is not None else None,
            "created_at": adapter.created_at, "can_manage": manages, "shares": shares.get(adapter.pk)})
    return views


def adapter_view(adapter: Adapter, rows: dict, user=None) -> dict:
    """One adapter as the API shows it to USER (adapter_views)."""
    return adapter_views([adapter], rows, user)[0]


def visible_adapters(user):
    return Adapter.objects.visible_to(user).select_related("owner").order_by("name")
