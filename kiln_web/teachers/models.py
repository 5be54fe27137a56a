"""TeacherAlias: a name@route an OPD request names as its teacher, resolved by the server to a spec.

The identity revision is the SHA-256 of the alias's configuration (trainer.teachers.identity_revision),
written by kiln_web.teachers.actions on every change and never edited directly: an OPD checkpoint
binds it, so changing an alias refuses resuming the runs made with its old configuration. The
content revision (the digest of what the teacher scores with) is reconstructed by every OPD
admission; the alias keeps the last one seen.
"""

import re

from django.conf import settings
from django.db import models

from kiln_web.core.models import Owned, OwnedQuerySet

ALIAS_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._\-]{0,99}@(native|openai|vllm)$"
ALIAS_RE = re.compile(ALIAS_PATTERN)
SPEC_FIELDS = ("base", "adapter", "endpoint", "model")  # the configuration beside the name


class TeacherRoute(models.TextChoices):
    NATIVE = "native", "native"  # a registered base, optionally with a PEFT adapter, run in the worker
    OPENAI = "openai", "OpenAI-compatible"  # a /v1/completions endpoint returning prompt log-probabilities
    VLLM = "vllm", "vLLM"  # a vLLM server: the same OpenAI-compatible protocol


class TeacherAlias(Owned, models.Model):
    name = models.CharField(max_length=120, unique=True, help_text="name@route, e.g. tutor@native")
    route = models.CharField(max_length=16, choices=TeacherRoute.choices, help_text="the part after '@'")
    base = models.CharField(max_length=100, blank=True, help_text="native: a registered base (kiln base list)")
    adapter = models.CharField(max_length=1000, blank=True,
                               help_text="native, optional: a PEFT adapter directory in the adapter registry or a "
                                         "data root (absolute)")
    endpoint = models.CharField(max_length=1000, blank=True, help_text="openai, vllm: the server root, e.g. "
                                                                      "http://gpu-1:8000")
    model = models.CharField(max_length=200, blank=True, help_text="openai, vllm: the served model id")
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="teacher_aliases")
    identity_revision = models.CharField(max_length=64, help_text="SHA-256 of the configuration; set by Kiln")
    content_revision = models.CharField(max_length=64, blank=True,
                                        help_text="the content revision the latest OPD admission reconstructed")
    content_checked_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    objects = OwnedQuerySet.as_manager()  # .visible_to(user): the owner's rows, or all for staff

    class Meta:
        ordering = ["name"]
        verbose_name = "teacher alias"
        verbose_name_plural = "teacher aliases"

    def __str__(self) -> str:
        return self.name

    def spec_fields(self) -> dict:
        """The configuration as trainer.teachers takes it (absent values None)."""
        return {"alias": self.name, "route": self.route,
                **{key: getattr(self, key) or None for key in SPEC_FIELDS}}

    def to_dict(self) -> dict:
        return {**self.spec_fields(), "name": self.name, "owner": self.owner.get_username(),
                "identity_revision": self.identity_revision, "content_revision": self.content_revision or None,
                "content_checked_at": self.content_checked_at, "created_at": self.created_at,
                "updated_at": self.updated_at}
