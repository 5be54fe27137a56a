"""State changes for users and tokens, shared by `kiln up`, `kiln token` and the API."""

import secrets
from datetime import timedelta

from django.contrib.auth import get_user_model
from django.db import transaction
from django.utils import timezone

from kiln_web.accounts.models import DISPLAY_CHARACTERS, TOKEN_PREFIX, ApiToken, hash_token
from kiln_web.core import fastpath

LAST_USED_RESOLUTION = timedelta(minutes=1)  # last_used_at is written at most this often per token


def do_create_token(user, name: str) -> tuple[ApiToken, str]:
    """A new token for USER; returns the row and the token text, which exists nowhere else."""
    token = TOKEN_PREFIX + secrets.token_urlsafe(32)
    row = ApiToken.objects.create(user=user, name=name[:100], token_hash=hash_token(token),
                                  prefix=token[:DISPLAY_CHARACTERS])
    return row, token


def do_create_token_for_username(username: str, name: str) -> tuple[ApiToken, str, bool]:
    """`kiln token create --user NAME`: the user is created (without a usable password) if needed."""
    User = get_user_model()
    with transaction.atomic():
        user, created = User.objects.get_or_create(username=username)
        if created:
            user.set_unusable_password()
            user.save(update_fields=["password"])
        row, token = do_create_token(user, name)
    return row, token, created


def do_ensure_token(user, name: str) -> str | None:
    """Give USER a token when it has none; return the token text only then (it is printed once)."""
    with transaction.atomic():
        if ApiToken.objects.filter(user=user).exists():
            return None
        _, token = do_create_token(user, name)
    return token


def authenticate_token(token: str):
    """The active user holding TOKEN, or None. Marks the token used (at most once a minute)."""
    if not token.startswith(TOKEN_PREFIX):
        return None
    row = ApiToken.objects.select_related("user").filter(token_hash=hash_token(token)).first()
    if row is None or not row.user.is_active:
        return None
    now = timezone.now()
    if row.last_used_at is None or now - row.last_used_at > LAST_USED_RESOLUTION:
        ApiToken.objects.filter(pk=row.pk).update(last_used_at=now)
    fastpath.remember_token(row.token_hash, row.user)
    return row.user
