"""ApiToken: a bearer token for the /v1/ API, kept only as the SHA-256 of its text."""

import hashlib

from django.conf import settings
from django.db import models

TOKEN_PREFIX = "kiln_"  # makes a leaked token recognisable to secret scanners and to people
DISPLAY_CHARACTERS = 12  # how much of the token the admin and `kiln token` lists show


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


class ApiToken(models.Model):
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="api_tokens")
    name = models.CharField(max_length=100, help_text="what the token is for, e.g. 'laptop CLI'")
    token_hash = models.CharField(max_length=64, unique=True, editable=False,
                                  help_text="SHA-256 of the token; the token itself is never stored")
    prefix = models.CharField(max_length=DISPLAY_CHARACTERS, editable=False,
                              help_text="the token's first characters, to tell tokens apart")
    created_at = models.DateTimeField(auto_now_add=True)
    last_used_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]
        verbose_name = "API token"

    def __str__(self) -> str:
        return f"{self.prefix}... ({self.name}, {self.user})"

    def to_dict(self) -> dict:
        return {"id": self.pk, "user": self.user.get_username(), "name": self.name, "prefix": self.prefix,
                "created_at": self.created_at, "last_used_at": self.last_used_at}
