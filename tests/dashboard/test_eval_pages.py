"""The evaluation and promotion pages: signed-in only, and a person sees only their own runs (staff see all)."""

import uuid

import pytest
from django.urls import reverse

pytestmark = pytest.mark.django_db


def test_the_pages_need_sign_in(client):
    for url in (reverse("dashboard:eval_runs"), reverse("dashboard:promotions"),
                reverse("dashboard:eval_run", args=[uuid.uuid4()])):
        response = client.get(url)
        assert response.status_code == 302 and "login" in response["Location"]


def test_the_lists_render_and_an_unknown_run_is_404(signed_in):
    assert signed_in.get(reverse("dashboard:eval_runs")).status_code == 200
    assert signed_in.get(reverse("dashboard:promotions")).status_code == 200
    assert signed_in.get(reverse("dashboard:eval_run", args=[uuid.uuid4()])).status_code == 404
