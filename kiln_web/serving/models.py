"""What every web process should serve (ServedAdapter) and the audit trail of promotions.

The database, not a process, says which adapters are loaded and which are active:
each web process reconciles its own serving pool with these rows before it serves a
request (kiln_web.serving.runtime), so a Celery worker can promote an adapter that the
web processes then load. Activation is per owner scope: at most one row is active for each
user (`active_for`, a partial unique constraint), and it answers only that user's requests
that name no model (kiln_web.serving.views).
"""

from django.conf import settings
from django.db import models
from django.db.models import Q
from django.utils import timezone

from kiln_web.core.models import OwnedQuerySet


class ServedAdapter(models.Model):
    adapter = models.OneToOneField("adapters.Adapter", on_delete=models.PROTECT, related_name="serving")
    base = models.CharField(max_length=100, help_text="the base model the PEFT snapshot is loaded over")
    adapter_sha256 = models.CharField(max_length=64, help_text="the snapshot's adapter_model.safetensors when "
                                                              "loaded; a process refuses a snapshot that changed")
    generation = models.PositiveIntegerField(default=1, help_text="raised by every load, so processes reload")
    active = models.BooleanField(default=False, help_text="served to active_for when their request names no model")
    active_for = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.CASCADE,
                                   related_name="active_adapters", help_text="whose scope it is active in: the "
                                   "person who activated it, or the training job's owner for a promotion")
    loaded_by = models.CharField(max_length=150, help_text="a username, 'gate' or 'auto_load'")
    loaded_at = models.DateTimeField(default=timezone.now)
    activated_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["adapter__name"]
        verbose_name = "served adapter"
        constraints = [
            models.UniqueConstraint(fields=["active_for"], condition=Q(active=True),
                                    name="serving_one_active_adapter_per_owner"),
            models.CheckConstraint(condition=Q(active=False) | Q(active_for__isnull=False),
                                   name="serving_active_has_a_scope"),
        ]

    def __str__(self) -> str:
        return f"{self.adapter.name} over {self.base}{f' (active for {self.active_for})' if self.active else ''}"

    def to_dict(self) -> dict:
        return {"adapter": self.adapter.name, "base": self.base, "adapter_sha256": self.adapter_sha256,
                "generation": self.generation, "active": self.active,
                "active_for": self.active_for.get_username() if self.active and self.active_for_id else None,
                "loaded_by": self.loaded_by,
                "loaded_at": self.loaded_at, "activated_at": self.activated_at}


class PromotionOutcome(models.TextChoices):
    PROMOTED = "promoted"  # activated
    GATE_FAILED = "gate_failed"  # the evaluation ran and the candidate missed a threshold
    INCONCLUSIVE = "inconclusive"  # too few examples, or no comparable baseline
    UNAVAILABLE = "unavailable"  # the evaluation could not be enqueued or did not finish
    CANARY_FAILED = "canary_failed"  # it did not load, generate, or score with finite log-probabilities
    NOT_REQUESTED = "not_requested"  # (shown on jobs without auto_load; never recorded)


GATE = "gate"
AUTO_LOAD = "auto_load"


class PromotionQuerySet(OwnedQuerySet):
    owner_field = "adapter__owner"  # a decision belongs to the adapter's owner


class PromotionRecord(models.Model):
    """One promotion decision: which adapter, which evaluation, the outcome, when, and who or what decided."""

    adapter = models.ForeignKey("adapters.Adapter", on_delete=models.PROTECT, related_name="promotions")
    job = models.ForeignKey("jobs.TrainingJob", null=True, blank=True, on_delete=models.SET_NULL,
                            related_name="promotions")
    evaluation = models.ForeignKey("evals.EvalRun", null=True, blank=True, on_delete=models.SET_NULL,
                                   related_name="promotions")
    outcome = models.CharField(max_length=16, choices=PromotionOutcome.choices)
    reason = models.TextField()
    decided_by = models.CharField(max_length=150, help_text="'gate', 'auto_load' (the canary alone) or a username")
    user = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL,
                             related_name="promotions", help_text="the person, when a person decided")
    adapter_sha256 = models.CharField(max_length=64, blank=True)
    previous_active = models.CharField(max_length=100, blank=True, help_text="the adapter active before")
    decided_at = models.DateTimeField(default=timezone.now)

    objects = PromotionQuerySet.as_manager()  # .visible_to(user): decisions on the user's adapters

    class Meta:
        ordering = ["-decided_at", "-id"]
        verbose_name = "promotion"
        indexes = [models.Index(fields=["decided_at", "id"], name="promotion_decided"),
                   models.Index(fields=["adapter", "decided_at", "id"], name="promotion_adapter_decided")]

    def __str__(self) -> str:
        return f"{self.adapter.name}: {self.outcome} by {self.decided_by}"

    def to_dict(self) -> dict:
        return {"id": self.pk, "adapter": self.adapter.name, "job": str(self.job_id) if self.job_id else None,
                "evaluation": str(self.evaluation_id) if self.evaluation_id else None, "outcome": self.outcome,
                "reason": self.reason, "decided_by": self.decided_by, "adapter_sha256": self.adapter_sha256 or None,
                "previous_active": self.previous_active or None, "decided_at": self.decided_at}
