"""The jobs page's first-run card: the default base, a sample dataset and the command that trains on it."""

from django import template
from django.templatetags.static import static

from kiln_web.jobs import runtime

register = template.Library()

SAMPLE = "samples/arithmetic.jsonl"  # static/samples/: 36 "What is a times b?" prompts with their completions


@register.inclusion_tag("dashboard/first_run_card.html", takes_context=True)
def first_run_card(context) -> dict:
    request = context["request"]
    return {"base": runtime.default_base(), "sample_url": static(SAMPLE),
            "server": f"{request.scheme}://{request.get_host()}"}
