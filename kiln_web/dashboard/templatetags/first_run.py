"""The jobs page's first-run card: the default base, a sample dataset and the command that trains on it."""

import re

from django import template
from django.templatetags.static import static

from kiln_web.jobs import runtime

register = template.Library()

SAMPLE = "samples/arithmetic.jsonl"  # static/samples/: 36 "What is a times b?" prompts with their completions


def first_adapter(username: str) -> str:
    """The sample run's adapter name for USERNAME: adapter names are global, so each person's first run needs its
    own (a username's characters that an adapter name cannot hold become '-')."""
    return ("first-" + re.sub(r"[^A-Za-z0-9_.\-]", "-", username))[:100]


@register.inclusion_tag("dashboard/first_run_card.html", takes_context=True)
def first_run_card(context) -> dict:
    request = context["request"]
    username = request.user.get_username()
    return {"base": runtime.default_base(), "sample_url": static(SAMPLE), "username": username,
            "adapter": first_adapter(username), "server": f"{request.scheme}://{request.get_host()}"}
