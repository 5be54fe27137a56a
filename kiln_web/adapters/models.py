"""Adapter names, owners and shares, and an index of published `.kiln-checkpoint` directories.

Who may use an adapter is one rule, `Adapter.objects.visible_to(user)` (management, serving, evaluation and
the dashboard all ask it): its owner, staff, and the users and groups the owner shared it with (AdapterShare).
Who may change it (load, unload, activate, delete, share) stays owner-or-staff: `managed_by(user)`.

The adapter registry on disk ($KILN_HOME/adapters) stays the authority: a CheckpointRecord
says a job published a checkpoint under that basename, never that it is still there or valid.
"""

from django.conf import settings
from django.db import models
from django.db.models import Q

from kiln_web.core.models import Owned, OwnedQuerySet


class AdapterQuerySet(OwnedQuerySet):
    def shared_with(self, user) -> Q:
        return Q(shares__user=user) | Q(shares__group__in=user.groups.all())


class Adapter(Owned, models.Model):
    name = models.CharField(max_length=100, unique=True, help_text="the output_name runs publish under")
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="adapters")
    created_at = models.DateTimeField(auto_now_add=True)

    objects = AdapterQuerySet.as_manager()  # .visible_to(user): own and shared (all for staff); .managed_by(user)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    def is_visible_to(self, user) -> bool:
        return Adapter.objects.visible_to(user).filter(pk=self.pk).exists()


class AdapterShare(models.Model):
    """The owner let a user, or every member of a group, use (serve, evaluate against) an adapter."""

    adapter = models.ForeignKey(Adapter, on_delete=models.CASCADE, related_name="shares")
    user = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.CASCADE,
                             related_name="adapter_shares")
    group = models.ForeignKey("auth.Group", null=True, blank=True, on_delete=models.CASCADE,
                              related_name="adapter_shares")
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, on_delete=models.SET_NULL,
                                   related_name="+")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["adapter", "created_at", "id"]
        verbose_name = "adapter share"
        constraints = [
            models.CheckConstraint(condition=Q(user__isnull=False, group__isnull=True) |
                                   Q(user__isnull=True, group__isnull=False), name="adapter_share_one_target"),
            models.UniqueConstraint(fields=["adapter", "user"], condition=Q(user__isnull=False),
                                    name="adapter_share_unique_user"),
            models.UniqueConstraint(fields=["adapter", "group"], condition=Q(group__isnull=False),
                                    name="adapter_share_unique_group"),
        ]

    @property
    def kind(self) -> str:
        return "user" if self.user_id else "group"

    @property
    def target(self) -> str:
        return self.user.get_username() if self.user_id else self.group.name

    def __str__(self) -> str:
        return f"{self.adapter.name} shared with {self.kind} {self.target}"

    def to_dict(self) -> dict:
        return {"kind": self.kind, "name": self.target,
                "created_by": self.created_by.get_username() if self.created_by_id else None,
                "created_at": self.created_at}


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
