"""State changes owned by the core app, shared by the CLI and any view."""

import secrets

from django.contrib.auth import get_user_model
from django.db import transaction

ADMIN_USERNAME = "admin"


def do_ensure_admin() -> str | None:
    """Create the superuser "admin" when no superuser exists; return its password only then."""
    User = get_user_model()
    with transaction.atomic():
        if User.objects.filter(is_superuser=True).exists():
            return None
        password = secrets.token_urlsafe(12)
        User.objects.create_superuser(username=ADMIN_USERNAME, email="", password=password)  # stored hashed
    return password


def first_superuser():
    """The superuser `kiln up` gives an API token: the first one created (normally "admin")."""
    return get_user_model().objects.filter(is_superuser=True, is_active=True).order_by("pk").first()
