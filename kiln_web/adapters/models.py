"""Adapter names and owners, and an index of published `.kiln-checkpoint` directories.

The adapter registry on disk ($KILN_HOME/adapters) stays the authority: a CheckpointRecord
says a job published a checkpoint under that basename, never that it is still there or valid.
"""

from django.conf import settings
from django.db import models

from kiln_web.core.models import Owned, OwnedQuerySet


class Adapter(Owned, models.Model):
    name = models.CharField(max_length=100, unique=True, help_text="the output_name runs publish under")
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="adapters")
    created_at = models.DateTimeField(auto_now_add=True)

    objects = OwnedQuerySet.as_manager()  # .visible_to(user): the owner's rows, or all for staff

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


class CheckpointRecord(models.Model):
    job = models.ForeignKey("jobs.TrainingJob", on_delete=models.CASCADE, related_name="checkpoints")
    adapter = models.ForeignKey(Adapter, on_delete=models.CASCADE, related_name="checkpoints")
    basename = models.CharField(max_length=255, unique=True, help_text="the directory name beneath the registry")
    step = models.PositiveIntegerField()
    checkpoint_id = models.CharField(max_length=128)
    manifest_digest = models.CharField(max_length=128, blank=True)
    summary = models.JSONField(default=dict, help_text="the checkpoint summary as published")
    timing = models.JSONField(default=dict, help_text="seconds: lock wait, snapshot, publication")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["job", "step"]
        verbose_name = "checkpoint"

    def __str__(self) -> str:
        return self.basename

    def to_dict(self) -> dict:
        return {"basename": self.basename, "adapter": self.adapter.name, "step": self.step,
                "checkpoint_id": self.checkpoint_id, "manifest_digest": self.manifest_digest,
                "summary": self.summary, "timing": self.timing, "created_at": self.created_at}
