"""What the evaluation and promotion pages show: evaluation runs and promotion decisions a person may see
(`visible_to(user)`: their own, all for staff), read from the evals and serving models."""

from __future__ import annotations

from kiln_web.evals.models import EvalRun
from kiln_web.serving.models import PromotionRecord


def visible_runs(user):
    return EvalRun.objects.visible_to(user).select_related("suite", "candidate", "owner", "training_job")


def visible_promotions(user):
    return PromotionRecord.objects.visible_to(user).select_related("adapter", "adapter__owner", "job", "evaluation",
                                                                    "user")
