"""/v1/teachers: register, list, show, change and delete teacher aliases for on-policy distillation.

Each view parses (the schema), authorises (the token; the action checks ownership), calls one
action and responds. Every person with a token sees every alias; only its owner or staff change it.
"""

from django.http import Http404, HttpRequest
from ninja import Router

from kiln_web.core.http import ActionRefused, error_response
from kiln_web.jobs.api import REFUSALS, Status
from kiln_web.jobs.runtime import RunnerUnavailable
from kiln_web.jobs.schemas import ErrorOut
from kiln_web.teachers import actions
from kiln_web.teachers.models import TeacherAlias
from kiln_web.teachers.schemas import TeacherConfig, TeacherIn, TeacherListOut, TeacherOut

router = Router(tags=["teachers"])
CHANGE_REFUSALS = {**REFUSALS, 503: ErrorOut}


def _alias(name: str) -> TeacherAlias:
    alias = TeacherAlias.objects.select_related("owner").filter(name=name).first()
    if alias is None:
        raise Http404(f"no teacher alias {name!r} (GET /v1/teachers lists them)")
    return alias


def _refused(exc: Exception):
    if isinstance(exc, ActionRefused):
        return error_response(exc.status, exc.code, exc.message, **exc.extra)
    if isinstance(exc, RunnerUnavailable):
        return error_response(503, exc.code, str(exc))
    raise exc


@router.get("", response={200: TeacherListOut, **REFUSALS}, summary="List teacher aliases",
            operation_id="list_teachers")
def list_teachers(request: HttpRequest):
    return {"items": [alias.to_dict() for alias in TeacherAlias.objects.select_related("owner")]}


@router.post("", response={201: TeacherOut, **CHANGE_REFUSALS}, summary="Register a teacher alias",
             operation_id="create_teacher")
def create_teacher(request: HttpRequest, payload: TeacherIn):
    """The route is the part of the name after '@'. A native teacher's base must be registered and its
    adapter must lie in the adapter registry or a data root. 409 teacher_exists when the name is taken."""
    fields = payload.model_dump(exclude={"name"})
    try:
        alias = actions.do_create_teacher(request.auth, payload.name, fields)
    except Exception as exc:  # noqa: BLE001 (mapped, or re-raised by _refused)
        return _refused(exc)
    return Status(201, alias.to_dict())


@router.get("/{name}", response={200: TeacherOut, **REFUSALS}, summary="One teacher alias",
            operation_id="get_teacher")
def get_teacher(request: HttpRequest, name: str):
    return _alias(name).to_dict()


@router.put("/{name}", response={200: TeacherOut, **CHANGE_REFUSALS}, summary="Change a teacher alias",
            operation_id="update_teacher")
def update_teacher(request: HttpRequest, name: str, payload: TeacherConfig):
    """Replaces the configuration. A different configuration has a different identity revision: OPD
    checkpoints made with the old one are refused on resume (409 teacher_changed) until it is restored.
    Refused while an active OPD job names the alias (409 teacher_in_use)."""
    try:
        alias = actions.do_update_teacher(request.auth, name, payload.model_dump())
    except Exception as exc:  # noqa: BLE001
        return _refused(exc)
    return alias.to_dict()


@router.delete("/{name}", response={204: None, **REFUSALS}, summary="Delete a teacher alias",
               operation_id="delete_teacher")
def delete_teacher(request: HttpRequest, name: str):
    try:
        actions.do_delete_teacher(request.auth, name)
    except Exception as exc:  # noqa: BLE001
        return _refused(exc)
    return Status(204, None)
