"""TrainingJob and its per-step metrics and events; a job guards its own status transitions.

Status moves only along TRANSITIONS. Every move happens in kiln_web.jobs.actions inside
transaction.atomic() on a row locked with select_for_update(), except the claim, which is
a conditional UPDATE ... WHERE status = 'queued' that exactly one worker can win.
"""

import uuid

from django.conf import settings
from django.db import models
from django.utils import timezone

from kiln_web.core.models import Owned, OwnedQuerySet


class JobStatus(models.TextChoices):
    QUEUED = "queued"
    RUNNING = "running"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"
    FAILED = "failed"
    SUCCEEDED = "succeeded"
    LOST = "lost"  # its worker stopped sending heartbeats; the last published checkpoint is intact


ACTIVE_STATUSES = (JobStatus.QUEUED, JobStatus.RUNNING, JobStatus.CANCELLING)
RUNNING_STATUSES = (JobStatus.RUNNING, JobStatus.CANCELLING)
TRANSITIONS = {
    JobStatus.QUEUED: {JobStatus.RUNNING, JobStatus.CANCELLED},
    JobStatus.RUNNING: {JobStatus.CANCELLING, JobStatus.SUCCEEDED, JobStatus.CANCELLED, JobStatus.FAILED,
                        JobStatus.LOST},
    JobStatus.CANCELLING: {JobStatus.SUCCEEDED, JobStatus.CANCELLED, JobStatus.FAILED, JobStatus.LOST},
}


class JobKind(models.TextChoices):
    SFT = "sft", "SFT"
    GRPO = "grpo", "GRPO"
    OPD = "opd", "OPD"  # on-policy distillation


class InvalidTransition(Exception):
    code = "job_not_active"

    def __init__(self, job: "TrainingJob", target: str):
        self.message = f"job {job.pk} is {job.status} and cannot become {target}"
        super().__init__(self.message)


class TrainingJob(Owned, models.Model):
    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="training_jobs")
    kind = models.CharField(max_length=16, choices=JobKind.choices)
    status = models.CharField(max_length=16, choices=JobStatus.choices, default=JobStatus.QUEUED)
    adapter = models.ForeignKey("adapters.Adapter", on_delete=models.PROTECT, related_name="jobs")
    request = models.JSONField(help_text="the request body as submitted")
    admission = models.JSONField(help_text="the admitted run, as the worker receives it")
    effective_config = models.JSONField(default=dict)
    effective_seed = models.BigIntegerField(null=True)
    data_source_kind = models.CharField(max_length=16, blank=True)
    identities = models.JSONField(default=dict, help_text="base, dataset, tokenizer, execution, planning")
    resume_from = models.CharField(max_length=255, blank=True, help_text="the checkpoint basename resumed from")
    committed_step = models.PositiveIntegerField(default=0)
    total_steps = models.PositiveIntegerField(null=True, blank=True)
    latest_checkpoint = models.JSONField(null=True, blank=True, help_text="summary of the newest checkpoint published")
    result = models.JSONField(null=True, blank=True)
    error_code = models.CharField(max_length=64, blank=True)
    error_message = models.TextField(blank=True)
    error_details = models.JSONField(null=True, blank=True, help_text="e.g. field-by-field resume differences")
    worker_id = models.CharField(max_length=200, blank=True)
    heartbeat_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(default=timezone.now)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    objects = OwnedQuerySet.as_manager()  # .visible_to(user): the owner's rows, or all for staff

    # the submitted and the admitted body: each holds the inline data (up to KILN_UPLOAD_MAX_BYTES), so lists and
    # a job's metrics, events and checkpoints defer them (to_dict(summary=True) reads neither)
    BODIES = ("request", "admission")

    class Meta:
        ordering = ["-created_at"]
        indexes = [
            models.Index(fields=["status", "created_at"], name="job_status_created"),
            models.Index(fields=["status", "heartbeat_at"], name="job_status_heartbeat"),
            models.Index(fields=["owner", "created_at"], name="job_owner_created"),
            models.Index(fields=["created_at"], name="job_created"),  # staff's newest jobs, everyone's
        ]

    def __str__(self) -> str:
        return f"{self.kind} job {self.pk} ({self.status})"

    @property
    def is_active(self) -> bool:
        return self.status in ACTIVE_STATUSES

    def check_transition(self, target: str) -> None:
        """Raise InvalidTransition unless the job may move from its status to TARGET."""
        if target not in TRANSITIONS.get(self.status, ()):
            raise InvalidTransition(self, target)

    @property
    def teacher(self) -> dict | None:
        """OPD: the teacher alias the run was admitted with and its identity and content revisions."""
        teacher = (self.identities or {}).get("teacher") if isinstance(self.identities, dict) else None
        if not teacher:
            return None
        return {key: teacher.get(key) for key in ("alias", "route", "identity_revision", "content_revision")}

    def to_dict(self, summary: bool = False) -> dict:
        """The job as the API, the CLI and channel events describe it (no request body, no tensors). SUMMARY: as a
        list shows it, without dataset_path, the one field read from the request (which a list defers)."""
        out = {
            "id": str(self.pk),
            "kind": self.kind,
            "status": self.status,
            "owner": self.owner.get_username(),
            "adapter": self.adapter.name,
            "data_source_kind": self.data_source_kind,
            "dataset_path": None if summary else
            self.request.get("dataset_path") if isinstance(self.request, dict) else None,
            "effective_seed": self.effective_seed,
            "effective_config": self.effective_config,
            "identities": self.identities,
            "teacher": self.teacher,
            "resume_from": self.resume_from or None,
            "progress": {"committed_step": self.committed_step, "total_steps": self.total_steps},
            "latest_checkpoint": self.latest_checkpoint,
            "error": ({"code": self.error_code, "message": self.error_message, "details": self.error_details}
                      if self.error_code else None),
            "worker_id": self.worker_id or None,
            "heartbeat_at": self.heartbeat_at,
            "created_at": self.created_at,
            "started_at": self.started_at,
            "finished_at": self.finished_at,
        }
        if summary:
            del out["dataset_path"]
        return out


class JobMetric(models.Model):
    job = models.ForeignKey(TrainingJob, on_delete=models.CASCADE, related_name="metrics")
    step = models.PositiveIntegerField()
    metrics = models.JSONField(help_text="loss, learning_rate, grad_norm, clipped, loss_spike, tokens, epoch, ...")

    class Meta:
        ordering = ["job", "step"]
        constraints = [models.UniqueConstraint(fields=["job", "step"], name="job_metric_unique_step")]

    def __str__(self) -> str:
        return f"step {self.step} of {self.job_id}"

    def to_dict(self) -> dict:
        return {**self.metrics, "step": self.step}


class EventLevel(models.TextChoices):
    DEBUG = "debug"
    INFO = "info"
    WARNING = "warning"
    ERROR = "error"


class JobEvent(models.Model):
    job = models.ForeignKey(TrainingJob, on_delete=models.CASCADE, related_name="events")
    time = models.DateTimeField(default=timezone.now)
    level = models.CharField(max_length=8, choices=EventLevel.choices, default=EventLevel.INFO)
    message = models.TextField()

    class Meta:
        ordering = ["job", "time", "id"]
        indexes = [models.Index(fields=["job", "time", "id"], name="job_event_order")]  # a job's log, in pages

    def __str__(self) -> str:
        return f"{self.time:%H:%M:%S} {self.level} {self.message[:60]}"

    def to_dict(self) -> dict:
        return {"time": self.time, "level": self.level, "message": self.message}


class WorkerRecord(models.Model):
    """One worker process (embedded, `kiln worker` or Celery) and the execution identity it computed at
    start (trainer.runs.execution): what a checkpoint it writes records, and what a resume it dequeues must
    match. Its heartbeat_at shows which workers are live."""

    worker_id = models.CharField(max_length=200, unique=True)
    identity = models.JSONField(help_text="the execution identity this worker trains under")
    identity_sha256 = models.CharField(max_length=64, help_text="SHA-256 of the canonical identity")
    started_at = models.DateTimeField(default=timezone.now)
    heartbeat_at = models.DateTimeField(default=timezone.now)
    stopped_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-heartbeat_at"]
        indexes = [models.Index(fields=["stopped_at", "heartbeat_at"], name="worker_live")]

    def __str__(self) -> str:
        return f"worker {self.worker_id}"

    def to_dict(self) -> dict:
        return {"worker_id": self.worker_id, "identity": self.identity, "identity_sha256": self.identity_sha256,
                "started_at": self.started_at, "heartbeat_at": self.heartbeat_at, "stopped_at": self.stopped_at}
