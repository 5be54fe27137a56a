"""Template filters for the dashboard."""

import json

from django import template

register = template.Library()


@register.filter
def value_text(value) -> str:
    """A request or checkpoint value as a person reads it: JSON spelling (null, true, [..], {..})."""
    if isinstance(value, str):
        return value
    return json.dumps(value, sort_keys=True, default=str)


@register.filter
def short_id(value, length: int = 12) -> str:
    text = str(value or "")
    return text if len(text) <= length else text[:length] + "…"


@register.filter
def filesize(value) -> str:
    if value is None:
        return "–"
    size = float(value)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return str(value)


@register.filter
def percent(value) -> str:
    """0.8125 -> "81.2%"."""
    try:
        return f"{100 * float(value):.1f}%"
    except (TypeError, ValueError):
        return "–"


@register.filter
def fields_with_errors(form) -> list:
    """The form's visible bound fields that have errors, in form order (the error summary above a form)."""
    return [field for field in form.visible_fields() if field.errors]
