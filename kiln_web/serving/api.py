"""/v1/adapters/: list, load, unload, activate, delete and share adapters; /v1/promotions/: the audit trail.

Each view parses, authorises (the token, then the adapter: one the caller may not see answers 404 like an
unknown name; changing one needs its owner or staff), calls one action and responds. The OpenAI-compatible
completions live in kiln_web.serving.views.
"""

from django.http import HttpRequest
from ninja import Query, Router, Schema
from pydantic import Field

from kiln_web.core.http import Status, refusals
from kiln_web.serving import actions
from kiln_web.serving.models import PromotionRecord, ServedAdapter
from kiln_web.serving.schemas import (AdapterListOut, AdapterOut, DeleteOut, LoadIn, PromotionListOut, PromotionOut,
                                     ServedOut, ShareIn, ShareOut, UnloadOut)

router = Router(tags=["adapters"])
promotions_router = Router(tags=["adapters"])

REFUSALS = refusals()


def _rows() -> dict:
    return {row.adapter_id: row for row in ServedAdapter.objects.select_related("adapter", "active_for")}


@router.get("", response={200: AdapterListOut, **REFUSALS}, summary="Your adapters, those shared with you, and "
            "what is served", operation_id="list_adapters")
def list_adapters(request: HttpRequest):
    rows = _rows()
    active = next((row.adapter.name for row in rows.values() if row.active and row.active_for_id == request.auth.pk),
                  None)
    return {"items": actions.adapter_views(actions.visible_adapters(request.auth), rows, request.auth),
            "active": active}


@router.get("/{name}", response={200: AdapterOut, **REFUSALS}, summary="One adapter", operation_id="get_adapter")
def get_adapter(request: HttpRequest, name: str):
    """Yours, one shared with you, or any for staff; any other answers 404, as an unknown name does."""
    adapter = actions.adapter_for(request.auth, name, manage=False)
    return actions.adapter_view(adapter, _rows(), request.auth)


@router.post("/{name}/shares", response={201: ShareOut, **REFUSALS}, summary="Share an adapter with a user or group",
             operation_id="share_adapter")
def share_adapter(request: HttpRequest, name: str, payload: ShareIn):
    """They may then serve it (/v1/completions, /v1/models) and evaluate with it, never change it. Only its owner
    or staff share (403 adapter_not_yours for someone it is shared with)."""
    kind, target = ("user", payload.user) if payload.user is not None else ("group", payload.group)
    share = actions.do_share_adapter(request.auth, name, kind=kind, target=target)
    return Status(201, share.to_dict())


@router.delete("/{name}/shares/{kind}/{target}", response={204: None, **REFUSALS}, summary="Stop sharing an adapter",
               operation_id="unshare_adapter")
def unshare_adapter(request: HttpRequest, name: str, kind: str, target: str):
    """KIND is user or group; their next request for the adapter answers 404."""
    actions.do_unshare_adapter(request.auth, name, kind=kind, target=target)
    return Status(204, None)


@router.post("/{name}/load", response={200: ServedOut, **REFUSALS}, summary="Load an adapter for serving",
             operation_id="load_adapter")
def load_adapter(request: HttpRequest, name: str, payload: LoadIn = None):
    """Loads the adapter's PEFT snapshot over its base (the one it was trained over, or `base`) in this
    process, then records it so that every web process serves it. Loading again reloads the snapshot."""
    row = actions.do_load_adapter(request.auth, name, base=payload.base if payload else None)
    return row.to_dict()


@router.post("/{name}/unload", response={200: UnloadOut, **REFUSALS}, summary="Stop serving an adapter",
             operation_id="unload_adapter")
def unload_adapter(request: HttpRequest, name: str):
    """Unloading an active adapter leaves its scope without one: requests there that name no model get the
    server's default base."""
    was_active = actions.do_unload_adapter(request.auth, name)
    return {"adapter": name, "was_active": was_active}


@router.post("/{name}/activate", response={200: PromotionOut, **REFUSALS},
             summary="Serve a loaded adapter by default", operation_id="activate_adapter")
def activate_adapter(request: HttpRequest, name: str):
    """The adapter answers your requests that name no model (your scope: each person has at most one active
    adapter, and staff activating someone else's adapter make it their own default); recorded as a promotion."""
    record = actions.do_activate_adapter(request.auth, name)
    return record.to_dict()


@router.delete("/{name}", response={200: DeleteOut, **REFUSALS}, summary="Delete an idle adapter's files",
               operation_id="delete_adapter")
def delete_adapter(request: HttpRequest, name: str):
    """Removes its checkpoint directories (exactly its own prefix) and its PEFT snapshot. Refused (409)
    while it is loaded or active (unload it first), trained or evaluated. Kiln never prunes on a timer."""
    return actions.do_delete_adapter(request.auth, name)


class PromotionFilter(Schema):
    adapter: str | None = Field(None, description="only this adapter's promotions")
    limit: int = Field(50, ge=1, le=500)


@promotions_router.get("", response={200: PromotionListOut, **REFUSALS}, summary="Promotion decisions, newest first",
                       operation_id="list_promotions")
def list_promotions(request: HttpRequest, filters: Query[PromotionFilter]):
    """Which adapter, which evaluation, the outcome and why, when, and who decided (a person, 'gate' or
    'auto_load'). You see your adapters' decisions; staff see all."""
    records = PromotionRecord.objects.visible_to(request.auth).select_related("adapter")
    if filters.adapter:
        records = records.filter(adapter__name=filters.adapter)
    return {"items": [record.to_dict() for record in records[:filters.limit]]}
