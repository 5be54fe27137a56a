"""EvalSuite (held-out JSONL, immutable once created), EvalRun and its per-example results.

An EvalRun compares a candidate adapter with a baseline (the adapter active when the run
was queued, else the candidate's base) on one suite. Its status moves queued -> running
-> succeeded or failed; the claim is a conditional UPDATE that exactly one worker wins,
and the end is written by kiln_web.evals.actions on a locked row.
"""

import uuid

from django.conf import settings
from django.db import models
from django.utils import timezone

from kiln_web.core.models import Owned, OwnedQuerySet


class Metric(models.TextChoices):
    EXACT = "exact"
    CONTAINS = "contains"
    REGEX = "regex"
    NUMERIC = "numeric"


class EvalSuite(Owned, models.Model):
    name = models.CharField(max_length=100, unique=True, help_text="what gates and runs name the suite by")
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="eval_suites")
    content = models.TextField(help_text="JSONL: {prompt | messages, expected, metric?, tolerance?} per line")
    digest = models.CharField(max_length=64, help_text="SHA-256 of the parsed examples (trainer.evals)")
    default_metric = models.CharField(max_length=16, choices=Metric.choices, default=Metric.EXACT)
    example_count = models.PositiveIntegerField()
    created_at = models.DateTimeField(default=timezone.now)

    objects = OwnedQuerySet.as_manager()  # .visible_to(user): the owner's rows, or all for staff

    class Meta:
        ordering = ["name"]
        verbose_name = "evaluation suite"

    def __str__(self) -> str:
        return self.name

    def to_dict(self, content: bool = False) -> dict:
        out = {"name": self.name, "owner": self.owner.get_username(), "digest": self.digest,
               "default_metric": self.default_metric, "example_count": self.example_count,
               "created_at": self.created_at}
        if content:
            out["content"] = self.content
        return out


class EvalStatus(models.TextChoices):
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"


class BaselineKind(models.TextChoices):
    ADAPTER = "adapter"  # the adapter that was active when the run was queued
    BASE = "base"  # no adapter was active (or the active one is the candidate itself): the candidate's base


class EvalPurpose(models.TextChoices):
    MANUAL = "manual"  # asked for through the API or the CLI
    GATE = "gate"  # the promotion gate of a training job


class EvalRun(Owned, models.Model):
    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="eval_runs")
    suite = models.ForeignKey(EvalSuite, on_delete=models.PROTECT, related_name="runs")
    suite_digest = models.CharField(max_length=64)
    candidate = models.ForeignKey("adapters.Adapter", on_delete=models.PROTECT, related_name="evaluations")
    candidate_base = models.CharField(max_length=100)
    candidate_sha256 = models.CharField(max_length=64, blank=True,
                                        help_text="the PEFT snapshot's adapter_model.safetensors, when evaluated")
    baseline_kind = models.CharField(max_length=16, choices=BaselineKind.choices)
    baseline = models.CharField(max_length=100, help_text="the adapter or base compared against")
    baseline_base = models.CharField(max_length=100)
    baseline_sha256 = models.CharField(max_length=64, blank=True, help_text="an adapter baseline's snapshot as it "
                                                                            "was served when the run was queued")
    baseline_note = models.CharField(max_length=300, blank=True, help_text="why this baseline was chosen")
    training_job = models.ForeignKey("jobs.TrainingJob", null=True, blank=True, on_delete=models.SET_NULL,
                                     related_name="evaluations")
    purpose = models.CharField(max_length=16, choices=EvalPurpose.choices, default=EvalPurpose.MANUAL)
    max_new_tokens = models.PositiveIntegerField(default=64)
    backend = models.CharField(max_length=8, default="cpu", help_text="the backend resolved when it was queued")
    backend_reason = models.CharField(max_length=500, blank=True, help_text="why that backend (auto's reasoning)")
    status = models.CharField(max_length=16, choices=EvalStatus.choices, default=EvalStatus.QUEUED)
    candidate_summary = models.JSONField(null=True, blank=True, help_text="{suite, suite_digest, correct, total, "
                                                                          "accuracy}")
    baseline_summary = models.JSONField(null=True, blank=True)
    error_code = models.CharField(max_length=64, blank=True)
    error_message = models.TextField(blank=True)
    worker_id = models.CharField(max_length=200, blank=True)
    created_at = models.DateTimeField(default=timezone.now)
    started_at = models.DateTimeField(null=True, blank=True)
    heartbeat_at = models.DateTimeField(null=True, blank=True, help_text="the running worker's last sign of life")
    finished_at = models.DateTimeField(null=True, blank=True)

    objects = OwnedQuerySet.as_manager()  # .visible_to(user): the owner's rows, or all for staff

    class Meta:
        ordering = ["-created_at"]
        verbose_name = "evaluation run"
        indexes = [models.Index(fields=["status", "created_at"], name="evalrun_status_created"),
                   models.Index(fields=["owner", "created_at"], name="evalrun_owner_created"),
                   models.Index(fields=["created_at"], name="evalrun_created")]

    def __str__(self) -> str:
        return f"evaluation {self.pk} of {self.candidate} on {self.suite} ({self.status})"

    def to_dict(self) -> dict:
        return {
            "id": str(self.pk),
            "owner": self.owner.get_username(),
            "suite": self.suite.name,
            "suite_digest": self.suite_digest,
            "candidate": {"adapter": self.candidate.name, "base": self.candidate_base,
                          "adapter_sha256": self.candidate_sha256 or None, "summary": self.candidate_summary},
            "baseline": {"kind": self.baseline_kind, "name": self.baseline, "base": self.baseline_base,
                         "adapter_sha256": self.baseline_sha256 or None, "note": self.baseline_note or None,
                         "summary": self.baseline_summary},
            "training_job": str(self.training_job_id) if self.training_job_id else None,
            "purpose": self.purpose,
            "max_new_tokens": self.max_new_tokens,
            "backend": {"resolved": self.backend, "reason": self.backend_reason or None},
            "status": self.status,
            "error": {"code": self.error_code, "message": self.error_message} if self.error_code else None,
            "worker_id": self.worker_id or None,
            "created_at": self.created_at,
            "started_at": self.started_at,
            "finished_at": self.finished_at,
        }


class EvalExampleResult(models.Model):
    run = models.ForeignKey(EvalRun, on_delete=models.CASCADE, related_name="examples")
    index = models.PositiveIntegerField(help_text="the example's position in the suite, from 0")
    expected = models.TextField()
    metric = models.CharField(max_length=16, choices=Metric.choices)
    candidate_output = models.TextField()
    candidate_correct = models.BooleanField()
    baseline_output = models.TextField()
    baseline_correct = models.BooleanField()

    class Meta:
        ordering = ["run", "index"]
        constraints = [models.UniqueConstraint(fields=["run", "index"], name="eval_example_unique_index")]

    def __str__(self) -> str:
        return f"example {self.index} of {self.run_id}"

    def to_dict(self) -> dict:
        return {"index": self.index, "expected": self.expected, "metric": self.metric,
                "candidate": {"output": self.candidate_output, "correct": self.candidate_correct},
                "baseline": {"output": self.baseline_output, "correct": self.baseline_correct}}
