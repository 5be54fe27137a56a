"""Taking access away takes effect at once, everywhere it was granted: an open WebSocket ends (4401) when its
session signs out or its person is deactivated, deleted or given a new password, and a staff socket ends when
its person stops being staff (the jobs list 4409, so the page reconnects to the person's own jobs; another
person's job page 4404); a token revoked or a user deactivated inside a transaction is refused once that
transaction commits, even when a request authenticated it from the database while the change was still
uncommitted (the token cache and the job-status fast path)."""

import pytest
from asgiref.sync import async_to_sync
from channels.db import database_sync_to_async
from channels.testing import WebsocketCommunicator
from django.conf import settings
from django.test import Client

from kiln_web.adapters.models import Adapter
from kiln_web.asgi import application
from kiln_web.jobs import actions
from kiln_web.jobs.models import JobKind, JobStatus, TrainingJob

UNAUTHENTICATED, NOT_FOUND, RECONNECT = 4401, 4404, 4409
ORIGIN = (b"origin", b"http://localhost")


def _browser(user) -> tuple[Client, bytes]:
    client = Client()
    client.force_login(user)
    return client, f"{settings.SESSION_COOKIE_NAME}={client.cookies[settings.SESSION_COOKIE_NAME].value}".encode()


def _job(user, name: str) -> TrainingJob:
    adapter = Adapter.objects.create(name=name, owner=user)
    return TrainingJob.objects.create(owner=user, kind=JobKind.SFT, adapter=adapter, request={}, admission={},
                                      status=JobStatus.RUNNING, worker_id="w", total_steps=10)


async def _open(path: str, cookie: bytes) -> WebsocketCommunicator:
    communicator = WebsocketCommunicator(application, path, headers=[ORIGIN, (b"cookie", cookie)])
    accepted, code = await communicator.connect(timeout=30)
    assert accepted, code
    return communicator


async def _closed_with(communicator: WebsocketCommunicator) -> int | None:
    """The code the server closes the socket with; the job events it relays before that are skipped."""
    while True:
        message = await communicator.receive_output(timeout=30)
        if message["type"] == "websocket.close":
            return message.get("code")


def _deactivate(user):
    user.is_active = False
    user.save()


def _demote(user):
    user.is_staff = False
    user.save()


def _new_password(user):
    """A changed password ends the person's other sessions (Django's session hash), so their sockets too."""
    user.set_password("a different long password 2")
    user.save()


def _sign_out(browser: Client):
    assert browser.post("/accounts/logout/").status_code == 302


@pytest.mark.django_db(transaction=True)  # the consumers read the session and the user from other threads
@pytest.mark.parametrize("change", ["sign out", "deactivate", "delete", "new password"])
def test_open_sockets_end_when_their_person_loses_access(make_user, change):
    ada = make_user("ada")
    paths = ["/ws/jobs/"]
    if change != "delete":  # a person with jobs cannot be deleted (their jobs are history)
        paths.append(f"/ws/jobs/{_job(ada, 'ada-bot').pk}/")
    browser, cookie = _browser(ada)
    how = {"sign out": lambda: _sign_out(browser), "deactivate": lambda: _deactivate(ada),
           "delete": lambda: ada.delete(), "new password": lambda: _new_password(ada)}[change]

    async def scenario():
        sockets = [await _open(path, cookie) for path in paths]
        await database_sync_to_async(how)()
        for communicator in sockets:
            assert await _closed_with(communicator) == UNAUTHENTICATED, change

    async_to_sync(scenario)()


@pytest.mark.django_db(transaction=True)
def test_a_staff_socket_ends_when_its_person_stops_being_staff(make_user):
    root, ada = make_user("root", staff=True), make_user("ada")
    job = _job(ada, "ada-bot")
    _, cookie = _browser(root)

    async def scenario():
        jobs_list, job_page = await _open("/ws/jobs/", cookie), await _open(f"/ws/jobs/{job.pk}/", cookie)
        await database_sync_to_async(_demote)(root)
        assert await _closed_with(jobs_list) == RECONNECT  # still signed in: the page reconnects
        assert await _closed_with(job_page) == NOT_FOUND  # as the page would be refused now
        # reconnecting, the list is the person's own again and ada's job page is refused
        again = await _open("/ws/jobs/", cookie)
        await database_sync_to_async(actions.do_add_event)(job.pk, "info", "ada's run")
        assert await again.receive_nothing(timeout=0.2)
        await again.disconnect(timeout=30)
        refused = WebsocketCommunicator(application, f"/ws/jobs/{job.pk}/", headers=[ORIGIN, (b"cookie", cookie)])
        assert (await refused.connect(timeout=30)) == (False, NOT_FOUND)

    async_to_sync(scenario)()


@pytest.mark.django_db(transaction=True)
def test_a_socket_stays_open_through_changes_that_take_nothing_away(make_user):
    """Another person's change, a sign-in elsewhere (which saves last_login) and a save that keeps the person
    active leave the socket open: it still relays the person's job events."""
    ada, bob = make_user("ada"), make_user("bob")
    job = _job(ada, "ada-bot")
    _, cookie = _browser(ada)

    def unrelated_changes():
        _deactivate(bob)
        _browser(ada)  # signs in again elsewhere
        ada.first_name = "Ada"
        ada.save()
        actions.do_add_event(job.pk, "info", "still here")

    async def scenario():
        listener = await _open(f"/ws/jobs/{job.pk}/", cookie)
        await database_sync_to_async(unrelated_changes)()
        message = await listener.receive_json_from(timeout=30)
        assert message["type"] == "job.event" and message["message"] == "still here"
        await listener.disconnect(timeout=30)

    async_to_sync(scenario)()


# -- tokens: a revocation in a transaction (the admin's delete, a deactivation) --


def _revoke(user, change: str) -> None:
    from kiln_web.accounts.models import ApiToken

    if change == "delete the token":
        ApiToken.objects.get(user=user).delete()
    else:
        _deactivate(user)


@pytest.fixture
def token_cache(monkeypatch, settings):
    from kiln_web.core import auth_cache

    settings.KILN_AUTH_CACHE_SECONDS = 5
    cache = auth_cache.TokenCache()
    monkeypatch.setattr(auth_cache, "tokens", cache)
    return cache


@pytest.mark.django_db
@pytest.mark.parametrize("change", ["delete the token", "deactivate the user"])
def test_a_token_remembered_before_its_revocation_commits_is_refused_after(make_user, token_cache, change,
                                                                          django_capture_on_commit_callbacks):
    """The admin deletes a token inside a transaction: the change's signal clears the cache at once, but until
    the commit a request on another connection still reads the token from the database and remembers it."""
    from kiln_web.accounts.actions import authenticate_token
    from kiln_web.accounts.models import hash_token
    from kiln_web.core import fastpath

    ada = make_user("ada")
    with django_capture_on_commit_callbacks(execute=True):
        _revoke(ada, change)
        # another thread's request, which read the still-committed token, remembers it now
        token_cache.put(hash_token(ada.token), ada, 5, token_cache.generation(), fastpath.auth_changes_heard())
    assert authenticate_token(ada.token) is None


@pytest.mark.django_db
@pytest.mark.parametrize("change", ["delete the token", "deactivate the user"])
def test_the_status_fast_path_forgets_a_token_once_its_revocation_commits(make_user, settings, change,
                                                                         django_capture_on_commit_callbacks):
    """The same for the job-status fast path: an authentication (and an answer) Django gave while the revocation
    was uncommitted is not replayed once it commits."""
    from kiln_web.accounts.models import hash_token
    from kiln_web.core import fastpath

    settings.REDIS_URL = None
    settings.KILN_STATUS_CACHE_SECONDS, settings.KILN_TOKEN_CACHE_SECONDS = 1, 10
    ada = make_user("ada")
    job_id, token_hash = str(_job(ada, "ada-bot").pk), hash_token(ada.token)
    fastpath.forget_everything()
    with django_capture_on_commit_callbacks(execute=True):
        _revoke(ada, change)
        # a poll that went through Django meanwhile (which still saw the committed token) is remembered
        poll = fastpath._Poll(fastpath._generations(job_id))
        token = fastpath._observed.set(poll)
        try:
            fastpath.remember_token(token_hash, ada)
        finally:
            fastpath._observed.reset(token)
        fastpath._remember_answer(job_id, poll, 200, [(b"content-type", b"application/json")],
                                  b'{"id": "%s"}' % job_id.encode())
        assert fastpath._lookup(token_hash, job_id, fastpath._generations(job_id))[0] is not None
    assert fastpath._lookup(token_hash, job_id, fastpath._generations(job_id))[0] is None
