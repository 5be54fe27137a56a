"""Template tags for the adapters pages: checkpoint counts that tell "not checked" from invalid, and an
adapter's recent evaluation runs and promotion decisions (what the person may see)."""

from __future__ import annotations

from django import template
from django.conf import settings

from kiln_web.dashboard import eval_readers, readers
from kiln_web.jobs import runtime

register = template.Library()

RECENT = 5  # evaluation runs and promotions shown on an adapter's page; the lists link to the rest


def _unchecked_on_disk(adapter_name: str) -> int:
    """How many checkpoint directories the page left unvalidated (all but the newest VALIDATE_LIMIT)."""
    try:
        module = runtime.checkpoint_module()
        paths = module.list_checkpoints(settings.KILN_ADAPTERS_DIR, adapter_name)
    except Exception:  # noqa: BLE001 (the row already says when the registry cannot be read)
        return 0
    return max(0, len(paths) - readers.VALIDATE_LIMIT)


@register.filter
def checkpoint_counts(value) -> dict:
    """{valid, unchecked, bad} for an adapters-page row (valid and "invalid", which counts everything not valid)
    or for a list of CheckpointStates. Unchecked checkpoints are not faults: validation stops after the newest
    VALIDATE_LIMIT on each page view."""
    if isinstance(value, dict):
        unchecked = value.get("unchecked")
        if unchecked is None:
            unchecked = _unchecked_on_disk(value["adapter"].name) if value.get("invalid") else 0
        unchecked = min(unchecked, value.get("invalid") or 0)
        return {"valid": value.get("valid") or 0, "unchecked": unchecked,
                "bad": (value.get("invalid") or 0) - unchecked, "limit": readers.VALIDATE_LIMIT}
    states = [getattr(state, "state", None) for state in value or []]
    unchecked = states.count("unchecked")
    return {"valid": states.count("valid"), "unchecked": unchecked,
            "bad": len(states) - states.count("valid") - unchecked, "limit": readers.VALIDATE_LIMIT}


@register.simple_tag(takes_context=True)
def adapter_evaluations(context, adapter) -> dict:
    """The newest evaluation runs of ADAPTER and promotion decisions on it that the signed-in person may see."""
    user = context["request"].user
    runs = eval_readers.visible_runs(user).filter(candidate=adapter)
    promotions = eval_readers.visible_promotions(user).filter(adapter=adapter)
    return {"runs": [eval_readers.run_row(run) for run in runs[:RECENT]], "run_count": runs.count(),
            "promotions": list(promotions[:RECENT]), "promotion_count": promotions.count()}
