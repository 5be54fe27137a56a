"""The first admin is created once, with a password that is stored hashed."""

import pytest

from kiln_web.core.actions import do_ensure_admin


@pytest.mark.django_db
def test_admin_created_once(django_user_model):
    password = do_ensure_admin()
    assert password
    admin = django_user_model.objects.get(username="admin")
    assert admin.is_superuser and admin.is_staff
    assert admin.password != password and admin.check_password(password)
    assert do_ensure_admin() is None
    assert django_user_model.objects.count() == 1
