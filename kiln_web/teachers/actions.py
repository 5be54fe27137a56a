"""Every change to a teacher alias, one function each, used by the API, the admin and job submission.

An alias name is global: anyone with a token may list it, show it and name it as an OPD teacher;
only its owner (or staff) may change or delete it, and not while an active OPD job names it.
The identity revision is computed here, by the trainer's own function (through
kiln_web.jobs.runtime), on every create and change.
"""

from __future__ import annotations

from pathlib import Path

from django.conf import settings
from django.db import IntegrityError, transaction
from django.utils import timezone

from kiln_web.core.http import ActionRefused
from kiln_web.jobs import runtime
from kiln_web.jobs.models import ACTIVE_STATUSES, JobKind, TrainingJob
from kiln_web.teachers.models import ALIAS_RE, SPEC_FIELDS, TeacherAlias
from trainer.peft import ADAPTER_FILES
from trainer.runs.admission import adapter_files_outside



# -- helpers --


def _adapter_directory(text: str, user=None) -> str:
    """The resolved adapter directory, which must lie in the adapter registry or a data root; one of the registry's
    adapters that USER may not see is refused exactly as a directory without the PEFT files."""
    from kiln_web.serving.actions import registry_adapter_hidden

    path = Path(text)
    if not path.is_absolute():
        raise ActionRefused(400, "invalid_request", f"adapter {text!r} must be an absolute path", field="adapter")
    resolved = path.resolve()
    roots = [Path(settings.KILN_ADAPTERS_DIR), *map(Path, settings.KILN_DATA_ROOTS)]
    if not any(resolved.is_relative_to(root.resolve()) and resolved != root.resolve() for root in roots):
        raise ActionRefused(400, "adapter_outside_roots",
                            f"adapter {text} is outside the adapter registry and the data roots "
                            f"({', '.join(map(str, roots))}); copy it into one of them", field="adapter")
    outside = adapter_files_outside(resolved, roots)
    if outside:
        raise ActionRefused(400, "adapter_outside_roots",
                            f"adapter {text}: {', '.join(outside)} resolves outside the adapter registry and the "
                            "data roots; copy the files into the directory", field="adapter")
    missing = [name for name in ADAPTER_FILES if not (resolved / name).is_file()]
    if user is not None and registry_adapter_hidden(user, str(resolved)):
        missing = list(ADAPTER_FILES)
    if missing:
        raise ActionRefused(400, "adapter_not_found", f"adapter {text} is not a PEFT adapter directory: it lacks "
                                                      f"{', '.join(missing)}", field="adapter")
    return str(resolved)


def validate_teacher(name: str, fields: dict, user=None) -> tuple[str, dict, str]:
    """(route, the stored configuration, its identity revision) for NAME; ActionRefused on a bad value. USER (None:
    the admin, staff) must be able to see an adapter of the registry that the alias names."""
    match = ALIAS_RE.match(name or "")
    if match is None:
        raise ActionRefused(400, "invalid_request", f"teacher alias {name!r} must be NAME@native, NAME@openai or "
                                                    "NAME@vllm (NAME: letters, digits, '.', '_', '-')", field="name")
    values = {key: fields.get(key) or None for key in SPEC_FIELDS}
    if values["adapter"] is not None:
        values["adapter"] = _adapter_directory(values["adapter"], user)
    for key, value in values.items():  # what the row keeps (PostgreSQL refuses a longer value: a 500)
        limit = TeacherAlias._meta.get_field(key).max_length
        if isinstance(value, str) and len(value) > limit:
            raise ActionRefused(400, "invalid_request", f"{key} is {len(value)} characters long; at most {limit}",
                                field=key)
    try:
        spec = runtime.teacher_spec({"alias": name, "route": match.group(1), **values})
    except LookupError as exc:
        raise ActionRefused(400, "base_not_found", f"{exc}; register it with: kiln base import PATH --name NAME",
                            field="base") from None
    except ValueError as exc:  # trainer.teachers.SpecError names the field at fault
        raise ActionRefused(400, "invalid_request", f"teacher {name}: {exc}",
                            field=getattr(exc, "field", None)) from None
    return match.group(1), values, spec["identity_revision"]


def _locked(name: str) -> TeacherAlias:
    alias = TeacherAlias.objects.select_for_update().select_related("owner").filter(name=name).first()
    if alias is None:
        raise ActionRefused(404, "not_found", f"no teacher alias {name!r} (kiln teacher list shows them)")
    return alias


def _check_owner(alias: TeacherAlias, user) -> None:
    if not alias.is_owner_or_staff(user):
        raise ActionRefused(403, "teacher_not_yours", f"the teacher alias {alias.name} belongs to "
                                                      f"{alias.owner.get_username()}; register your own name")


def check_unused(alias: TeacherAlias, user=None) -> None:
    """409 teacher_in_use while an active OPD job names ALIAS; the job's id only when USER (None: the admin) may see
    the job: someone else's job is not named to them, as its own routes answer them as for one that does not exist."""
    jobs = TrainingJob.objects.filter(kind=JobKind.OPD, status__in=ACTIVE_STATUSES, request__config__teacher=alias.name)
    job = jobs.only("pk", "status", "owner").first()
    if job is None:
        return
    if user is not None and not TrainingJob.objects.visible_to(user).filter(pk=job.pk).exists():
        raise ActionRefused(409, "teacher_in_use", f"another person's {job.status} OPD job uses {alias.name}; wait "
                                                   "for it to end (or ask them, or staff, to cancel it)")
    raise ActionRefused(409, "teacher_in_use", f"the {job.status} OPD job {job.pk} uses {alias.name}; wait for "
                                               "it to end or cancel it first", job_id=str(job.pk))


def adapter_hidden(alias: TeacherAlias, user) -> bool:
    """Whether ALIAS names an adapter of the registry that USER may not see."""
    return adapters_hidden([alias], user)[0]


def adapters_hidden(aliases, user) -> list[bool]:
    """adapter_hidden for each of ALIASES, with a fixed number of queries whatever their number."""
    from kiln_web.serving.actions import registry_adapters_hidden

    named = [alias.adapter for alias in aliases if alias.adapter]
    hidden = iter(registry_adapters_hidden(user, named) if named else [])
    return [bool(alias.adapter) and next(hidden) for alias in aliases]


def shown_to(alias: TeacherAlias, user, hidden: bool | None = None) -> dict:
    """ALIAS as USER may see it: aliases are listed to everyone, but an adapter of the registry that USER may not
    see is left out (`adapter` null, `adapter_hidden` true), as the adapter's own routes answer USER as for a name
    that does not exist. The identity revision, which binds the path, is shown to all. HIDDEN: adapter_hidden,
    when the caller read it already (adapters_hidden, for a list)."""
    document = alias.to_dict()
    hidden = adapter_hidden(alias, user) if hidden is None else hidden
    if hidden:
        document["adapter"] = None
    return {**document, "adapter_hidden": hidden}


# -- changes --


def do_create_teacher(user, name: str, fields: dict) -> TeacherAlias:
    """Register NAME (name@route) with its configuration (base, adapter, endpoint, model) for USER."""
    route, values, revision = validate_teacher(name, fields, user)
    try:
        with transaction.atomic():
            return TeacherAlias.objects.create(
                name=name, route=route, owner=user, identity_revision=revision,
                **{key: value or "" for key, value in values.items()})
    except IntegrityError:
        raise ActionRefused(409, "teacher_exists", f"the teacher alias {name} already exists; change it with "
                                                   "PUT /v1/teachers/{name} (kiln teacher add --replace)") from None


def do_update_teacher(user, name: str, fields: dict) -> TeacherAlias:
    """Replace NAME's configuration. A different configuration has a different identity revision, so
    OPD checkpoints made with the old one can no longer be resumed (until the old one is restored)."""
    _, values, revision = validate_teacher(name, fields, user)
    with transaction.atomic():
        alias = _locked(name)
        _check_owner(alias, user)
        check_unused(alias, user)
        for key, value in values.items():
            setattr(alias, key, value or "")
        if alias.identity_revision != revision:
            alias.identity_revision, alias.content_revision, alias.content_checked_at = revision, "", None
        alias.save()
    return alias


def do_delete_teacher(user, name: str) -> None:
    with transaction.atomic():
        alias = _locked(name)
        _check_owner(alias, user)
        check_unused(alias, user)
        alias.delete()


def do_record_teacher_content(teacher: dict) -> None:
    """Inside the transaction that queues an OPD job: lock the alias the admission resolved (TEACHER: its teacher
    identity), refuse (409 teacher_changed) when it was deleted or changed since, and keep the content revision the
    admission reconstructed. The lock orders the submission with do_update_teacher and do_delete_teacher: a change
    before it is refused here, a change after it sees the queued job (teacher_in_use)."""
    alias = TeacherAlias.objects.select_for_update().filter(name=teacher["alias"]).first()
    current = alias.identity_revision if alias is not None else None
    if current != teacher["identity_revision"]:
        what = "was deleted" if alias is None else "changed"
        raise ActionRefused(409, "teacher_changed", f"teacher alias {teacher['alias']} {what} while the job was "
                                                    "admitted; submit the run again",
                            differences=[{"field": "teacher.identity_revision",
                                          "checkpoint": teacher["identity_revision"], "request": current}])
    TeacherAlias.objects.filter(pk=alias.pk).update(content_revision=teacher["content_revision"],
                                                    content_checked_at=timezone.now())  # not a change: updated_at stays


# -- reads used by job submission and the worker --


def resolve_teacher(name) -> dict:
    """The spec the OPD run takes for alias NAME: {alias, route, base, adapter, endpoint, model, identity_revision}."""
    alias = TeacherAlias.objects.filter(name=name).first() if isinstance(name, str) else None
    if alias is None:
        raise ActionRefused(400, "teacher_not_found", f"no teacher alias {name!r}; kiln teacher list shows the "
                                                      "registered ones and kiln teacher add registers one",
                            field="config.teacher")
    return {**alias.spec_fields(), "identity_revision": alias.identity_revision}


def check_teacher_unchanged(spec: dict) -> None:
    """At dequeue: the alias still has the identity revision the job was admitted with."""
    current = TeacherAlias.objects.filter(name=spec["alias"]).values_list("identity_revision", flat=True).first()
    if current != spec["identity_revision"]:
        what = "was deleted" if current is None else "changed"
        raise ActionRefused(409, "teacher_changed", f"teacher alias {spec['alias']} {what} after the job was "
                                                    "admitted; submit the run again",
                            differences=[{"field": "teacher.identity_revision", "checkpoint": spec["identity_revision"],
                                          "request": current}])
