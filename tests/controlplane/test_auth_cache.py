"""Bearer tokens remembered per process for KILN_AUTH_CACHE_SECONDS (kiln_web.core.auth_cache): no token
query while remembered, and a token or user change in this process refuses the token on the next request."""

import pytest
from django.db import connection

from kiln_web.accounts.actions import authenticate_token
from kiln_web.accounts.models import ApiToken, hash_token
from kiln_web.core import auth_cache, fastpath
from kiln_web.core.auth_cache import TokenCache

from .conftest import ApiClient

pytestmark = pytest.mark.django_db


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


@pytest.fixture
def tokens(monkeypatch, settings):
    """A fresh cache of the process, on a clock the test moves."""
    settings.KILN_AUTH_CACHE_SECONDS = 5
    clock = Clock()
    cache = TokenCache(clock=clock)
    monkeypatch.setattr(auth_cache, "tokens", cache)
    cache.clock = clock
    return cache


def test_a_remembered_token_costs_no_query(tokens, ada, django_assert_num_queries):
    with django_assert_num_queries(2):  # the token with its user, and last_used_at
        assert authenticate_token(ada.token) == ada
    with django_assert_num_queries(0):
        user = authenticate_token(ada.token)
    assert user == ada and user is not authenticate_token(ada.token)  # each request gets its own instance
    assert ApiClient(ada.token).get("/v1/train/jobs").status_code == 200


@pytest.mark.parametrize("change", ["delete the token", "delete the user's tokens", "deactivate the user"])
def test_a_change_in_this_process_refuses_the_token_at_once(tokens, ada, change):
    client = ApiClient(ada.token)
    assert client.get("/v1/train/jobs").status_code == 200 and len(tokens) == 1
    if change == "delete the token":
        ApiToken.objects.get(user=ada).delete()
    elif change == "delete the user's tokens":
        ApiToken.objects.filter(user=ada).delete()
    else:
        ada.is_active = False
        ada.save()
    assert len(tokens) == 0
    assert client.get("/v1/train/jobs").status_code == 401


def test_a_change_while_the_database_is_asked_is_not_remembered(tokens, ada):
    generation = tokens.generation()
    tokens.clear()  # a revocation committed between the lookup and put()
    tokens.put(hash_token(ada.token), ada, 5, generation)
    assert tokens.get(hash_token(ada.token)) is None


def test_a_change_another_process_made_is_seen_once_the_authentication_expires(tokens, ada):
    client = ApiClient(ada.token)
    assert client.get("/v1/train/jobs").status_code == 200
    with connection.cursor() as cursor:  # as `kiln token` in another process would: no signal reaches this one
        cursor.execute(f"DELETE FROM {ApiToken._meta.db_table} WHERE user_id = %s", [ada.pk])
    tokens.clock.now += 4.9
    assert client.get("/v1/train/jobs").status_code == 200  # the documented window: up to KILN_AUTH_CACHE_SECONDS
    tokens.clock.now += 0.2
    assert client.get("/v1/train/jobs").status_code == 401


def test_a_change_another_process_announced_ends_it_once_heard(tokens, ada):
    client = ApiClient(ada.token)
    assert client.get("/v1/train/jobs").status_code == 200
    with connection.cursor() as cursor:
        cursor.execute(f"DELETE FROM {ApiToken._meta.db_table} WHERE user_id = %s", [ada.pk])
    fastpath._auth_changed_here()  # what the fast path's listener does when Redis carries that process's "auth"
    assert client.get("/v1/train/jobs").status_code == 401


def test_zero_seconds_asks_the_database_every_time(tokens, ada, settings, django_assert_num_queries):
    settings.KILN_AUTH_CACHE_SECONDS = 0
    assert authenticate_token(ada.token) == ada
    with django_assert_num_queries(1):
        assert authenticate_token(ada.token) == ada
    assert len(tokens) == 0


def test_the_cache_stays_bounded(ada):
    clock = Clock()
    cache = TokenCache(max_entries=4, clock=clock)
    for index in range(10):
        cache.put(f"hash-{index}", ada, 5, cache.generation())
    assert len(cache) <= 4 and cache.get("hash-9") == ada and cache.get("hash-0") is None
