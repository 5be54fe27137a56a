"""What the evaluation and promotion pages show: evaluation runs and promotion decisions a person may see
(`visible_to(user)`: their own, all for staff), read from the evals and serving models, with each gate's
thresholds and decision."""

from __future__ import annotations

from kiln_web.core.http import ActionRefused
from kiln_web.evals.models import EvalPurpose, EvalRun
from kiln_web.serving.models import PromotionRecord
from kiln_web.serving.promotion import minimum_examples
from kiln_web.serving.promotion_request import requested_promotion

LIST_LIMIT = 200  # rows per list page, newest first
EXAMPLE_PAGE = 500  # per-example results shown at a time on a run's page (a suite may hold tens of thousands)


def visible_runs(user):
    """For lists: a row shows its suite's name and its job's id, never the suite's content or the job's bodies
    (inline data: up to KILN_UPLOAD_MAX_BYTES each); run_detail reads them for one run."""
    return EvalRun.objects.visible_to(user).select_related("suite", "candidate", "owner").defer("suite__content")


def visible_run(user, run_id) -> EvalRun | None:
    return EvalRun.objects.visible_to(user).select_related("suite", "candidate", "owner", "training_job") \
        .filter(pk=run_id).first()


def visible_promotions(user):
    # a row shows its job's and its evaluation's ids only
    return PromotionRecord.objects.visible_to(user).select_related("adapter", "adapter__owner", "user")


def accuracy(summary) -> float | None:
    return summary.get("accuracy") if isinstance(summary, dict) else None


def run_row(run: EvalRun) -> dict:
    """One run as the list shows it."""
    candidate, baseline = accuracy(run.candidate_summary), accuracy(run.baseline_summary)
    return {"run": run, "candidate_accuracy": candidate, "baseline_accuracy": baseline,
            "gain": candidate - baseline if candidate is not None and baseline is not None else None}


def gate(run: EvalRun) -> dict | None:
    """A gate run's thresholds (as its job asked) and the promotion decided on it; None for a manual run."""
    if run.purpose != EvalPurpose.GATE:
        return None
    out = {"suite": None, "min_accuracy": None, "min_improvement": None, "min_examples": None, "error": None,
           "decision": None}
    if run.training_job is not None:
        try:
            wanted = requested_promotion(run.training_job.request)
        except ActionRefused as refused:  # written before the fields were checked
            out["error"] = refused.message
        else:
            out |= {"suite": wanted.suite, "min_accuracy": wanted.min_accuracy,
                    "min_improvement": wanted.min_improvement, "min_examples": minimum_examples(wanted)}
    out["decision"] = run.promotions.order_by("-decided_at", "-id").first()
    return out


def example_page(run: EvalRun, number) -> dict:
    """Page NUMBER (from 1; anything else is the first, past the end the last) of the run's per-example results:
    {number, pages, total, first, last (positions from 1), previous, next (page numbers or None)}."""
    total = run.examples.count()
    pages = max(1, -(-total // EXAMPLE_PAGE))
    try:
        number = min(max(1, int(number)), pages)
    except (TypeError, ValueError):
        number = 1
    start = (number - 1) * EXAMPLE_PAGE
    return {"number": number, "pages": pages, "total": total, "first": start + 1,
            "last": min(total, start + EXAMPLE_PAGE), "previous": number - 1 if number > 1 else None,
            "next": number + 1 if number < pages else None}


def run_detail(run: EvalRun, page=1) -> dict:
    """The run's facts, one page of its per-example results (example_page), and for a gate its thresholds and
    decision."""
    texts = prompts(run)
    shown = example_page(run, page)
    results = run.examples.all()[shown["first"] - 1:shown["last"]]
    examples = [{"result": example, "prompt": texts[example.index] if example.index < len(texts) else None}
                for example in results]
    return run_row(run) | {"examples": examples, "example_page": shown, "gate": gate(run),
                           "promotions": list(run.promotions.select_related("adapter", "job")
                                              .order_by("-decided_at", "-id"))}


def prompts(run: EvalRun) -> list[str]:
    """Each example's prompt as the suite holds it, by index: the text, or a chat's turns as "role: content"
    lines. Empty when the stored suite no longer parses (the per-example results still show)."""
    from kiln_web.evals import runtime

    try:
        suite = runtime.parse(run.suite.name, run.suite.content, run.suite.default_metric)
    except runtime.SuiteError:
        return []
    return [_prompt_text(example.messages) for example in suite.examples]


def _prompt_text(messages: tuple) -> str:
    if len(messages) == 1 and messages[0][0] == "user":
        return messages[0][1]
    return "\n".join(f"{role}: {content}" for role, content in messages)
