"""/v1/teachers: register, list, show, change and delete teacher aliases for on-policy distillation.

Each view parses (the schema), authorises (the token; the action checks ownership), calls one
action and responds. Every person with a token sees every alias; only its owner or staff change it.
"""

from django.http import Http404, HttpRequest
from ninja import Router

from kiln_web.core.http import Status, refusals
from kiln_web.teachers import actions
from kiln_web.teachers.models import TeacherAlias
from kiln_web.teachers.schemas import TeacherConfig, TeacherIn, TeacherListOut, TeacherOut

router = Router(tags=["teachers"])
REFUSALS = refusals()
CHANGE_REFUSALS = refusals(503)


def _alias(name: str) -> TeacherAlias:
    alias = TeacherAlias.objects.select_related("owner").filter(name=name).first()
    if alias is None:
        raise Http404(f"no teacher alias {name!r} (GET /v1/teachers lists them)")
    return alias


@router.get("", response={200: TeacherListOut, **REFUSALS}, summary="List teacher aliases",
            operation_id="list_teachers")
def list_teachers(request: HttpRequest):
    aliases = list(TeacherAlias.objects.select_related("owner"))
    hidden = actions.adapters_hidden(aliases, request.auth)
    return {"items": [actions.shown_to(alias, request.auth, flag) for alias, flag in zip(aliases, hidden)]}


@router.post("", response={201: TeacherOut, **CHANGE_REFUSALS}, summary="Register a teacher alias",
             operation_id="create_teacher")
def create_teacher(request: HttpRequest, payload: TeacherIn):
    """The route is the part of the name after '@'. A native teacher's base must be registered and its
    adapter must lie in the adapter registry or a data root. 409 teacher_exists when the name is taken."""
    fields = payload.model_dump(exclude={"name"})
    alias = actions.do_create_teacher(request.auth, payload.name, fields)
    return Status(201, actions.shown_to(alias, request.auth))


@router.get("/{name}", response={200: TeacherOut, **REFUSALS}, summary="One teacher alias",
            operation_id="get_teacher")
def get_teacher(request: HttpRequest, name: str):
    return actions.shown_to(_alias(name), request.auth)


@router.put("/{name}", response={200: TeacherOut, **CHANGE_REFUSALS}, summary="Change a teacher alias",
            operation_id="update_teacher")
def update_teacher(request: HttpRequest, name: str, payload: TeacherConfig):
    """Replaces the configuration. A different configuration has a different identity revision: OPD
    checkpoints made with the old one are refused on resume (409 teacher_changed) until it is restored.
    Refused while an active OPD job names the alias (409 teacher_in_use)."""
    alias = actions.do_update_teacher(request.auth, name, payload.model_dump())
    return actions.shown_to(alias, request.auth)


@router.delete("/{name}", response={204: None, **REFUSALS}, summary="Delete a teacher alias",
               operation_id="delete_teacher")
def delete_teacher(request: HttpRequest, name: str):
    actions.do_delete_teacher(request.auth, name)
    return Status(204, None)
