"""State changes for users and tokens, shared by `kiln up`, `kiln token` and the API."""

import secrets
from datetime import timedelta

from django.conf import settings
from django.contrib.auth import get_user_model
from django.db import transaction
from django.utils import timezone

from kiln_web.accounts.models import DISPLAY_CHARACTERS, TOKEN_PREFIX, ApiToken, hash_token
from kiln_web.core import auth_cache, fastpath

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


def tokens_matching(reference: str, username: str | None = None):
    """The tokens REFERENCE names (an id, or the start of a token as `kiln token list` shows it), of USERNAME's
    only when given."""
    rows = ApiToken.objects.select_related("user")
    if username is not None:
        rows = rows.filter(user__username=username)
    if reference.isdigit():
        return list(rows.filter(pk=int(reference)))
    if not reference.startswith(TOKEN_PREFIX) or len(reference) <= len(TOKEN_PREFIX):
        return []
    shown = reference.removesuffix("...")[:DISPLAY_CHARACTERS]
    return list(rows.filter(prefix__startswith=shown))


def do_revoke_token(row: ApiToken) -> None:
    """Delete the token ROW: it stops authenticating at once, in every process (the caches and the status fast
    path are cleared on commit by the post_delete signals)."""
    row.delete()


def do_ensure_token(user, name: str) -> str | None:
    """Give USER a token when it has none; return the token text only then (it is printed once)."""
    with transaction.atomic():
        if ApiToken.objects.filter(user=user).exists():
            return None
        _, token = do_create_token(user, name)
    return token


def authenticate_token(token: str):
    """The active user holding TOKEN, or None. An authentication is remembered for KILN_AUTH_CACHE_SECONDS in
    this process (kiln_web.core.auth_cache); the database is asked, and the token marked used (at most once a
    minute), only when it is not."""
    if not token.startswith(TOKEN_PREFIX):
        return None
    token_hash = hash_token(token)
    heard = _changes_heard_from_elsewhere()
    user = auth_cache.tokens.get(token_hash, heard)
    if user is None:
        generation = auth_cache.tokens.generation()
        row = ApiToken.objects.select_related("user").filter(token_hash=token_hash).first()
        if row is None or not row.user.is_active:
            return None
        now = timezone.now()
        if row.last_used_at is None or now - row.last_used_at > LAST_USED_RESOLUTION:
            ApiToken.objects.filter(pk=row.pk).update(last_used_at=now)
        auth_cache.tokens.put(token_hash, row.user, settings.KILN_AUTH_CACHE_SECONDS, generation, heard)
        user = row.user
    fastpath.remember_token(token_hash, user)
    return user


def _changes_heard_from_elsewhere() -> int:
    """Token and user changes other processes announced on Redis, as far as this process heard them (the
    job-status fast path counts them while its listener runs)."""
    return fastpath.auth_changes_heard()
