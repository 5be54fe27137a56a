"""The WebSocket consumers on the real ASGI app (session auth, origin check, routing): each job event
reaches the right groups after the commit, nothing reaches anyone else, and a socket without a
signed-in session (or for someone else's job) is refused."""

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

pytestmark = pytest.mark.django_db(transaction=True)  # the consumers read the session and jobs from other threads

ORIGIN = (b"origin", b"http://localhost")
QUIET = 0.2  # seconds a socket must stay silent to count as "received nothing"


def session_cookie(user) -> bytes:
    client = Client()
    client.force_login(user)
    return f"{settings.SESSION_COOKIE_NAME}={client.cookies[settings.SESSION_COOKIE_NAME].value}".encode()


def socket(path: str, cookie: bytes | None = None, origin=ORIGIN) -> WebsocketCommunicator:
    headers = [origin] if origin else []
    if cookie is not None:
        headers.append((b"cookie", cookie))
    return WebsocketCommunicator(application, path, headers=headers)


def job_of(user, name: str) -> TrainingJob:
    """A running job, created directly: these tests are about delivery, not admission."""
    adapter = Adapter.objects.create(name=name, owner=user)
    return TrainingJob.objects.create(owner=user, kind=JobKind.SFT, adapter=adapter, request={}, admission={},
                                      status=JobStatus.RUNNING, worker_id="w", total_steps=10)


async def connected(communicator: WebsocketCommunicator) -> WebsocketCommunicator:
    ok, code = await communicator.connect(timeout=30)
    assert ok, code
    return communicator


def test_events_reach_the_owner_and_staff_and_no_one_else(ada, bob, make_user):
    root = make_user("root", staff=True)
    mine, theirs = job_of(ada, "ada-bot"), job_of(bob, "bob-bot")
    ada_cookie, bob_cookie, root_cookie = session_cookie(ada), session_cookie(bob), session_cookie(root)

    async def scenario():
        ada_list = await connected(socket("/ws/jobs/", ada_cookie))
        ada_job = await connected(socket(f"/ws/jobs/{mine.pk}/", ada_cookie))
        bob_list = await connected(socket("/ws/jobs/", bob_cookie))
        bob_job = await connected(socket(f"/ws/jobs/{theirs.pk}/", bob_cookie))
        staff_list = await connected(socket("/ws/jobs/", root_cookie))

        await database_sync_to_async(actions.do_record_step)(mine.pk, "w", {"step": 3, "loss": 0.5})
        for communicator in (ada_list, ada_job, staff_list):
            message = await communicator.receive_json_from(timeout=30)
            assert message == {"type": "job.step", "job_id": str(mine.pk), "metrics": {"step": 3, "loss": 0.5}}
        for communicator in (bob_list, bob_job):
            assert await communicator.receive_nothing(timeout=QUIET)

        await database_sync_to_async(actions.do_add_event)(theirs.pk, "warning", "bob's run is slow")
        for communicator in (bob_list, bob_job, staff_list):
            message = await communicator.receive_json_from(timeout=30)
            assert message["type"] == "job.event" and message["job_id"] == str(theirs.pk)
            assert message["level"] == "warning" and message["message"] == "bob's run is slow"
        for communicator in (ada_list, ada_job):
            assert await communicator.receive_nothing(timeout=QUIET)

        await database_sync_to_async(actions.do_cancel_job)(mine.pk, "stop and save")
        kinds = [(await ada_job.receive_json_from(timeout=30))["type"] for _ in range(2)]
        assert kinds == ["job.event", "job.status"]  # the log line, then the status, in commit order
        assert [(await ada_list.receive_json_from(timeout=30))["type"] for _ in range(2)] == kinds
        assert await bob_list.receive_nothing(timeout=QUIET)

        summary = {"resume_checkpoint": "ada-bot-checkpoint-step-00000003.kiln-checkpoint", "step": 3}
        await database_sync_to_async(actions.do_record_checkpoint)(mine.pk, "w", summary)
        message = await ada_job.receive_json_from(timeout=30)
        assert message == {"type": "job.checkpoint", "job_id": str(mine.pk), "checkpoint": summary}
        assert await bob_job.receive_nothing(timeout=QUIET)

        for communicator in (ada_list, ada_job, bob_list, bob_job, staff_list):
            await communicator.disconnect(timeout=30)

    async_to_sync(scenario)()


def test_nothing_is_sent_before_the_commit_or_after_a_rollback(ada):
    job = job_of(ada, "ada-bot")
    cookie = session_cookie(ada)

    def add_event_then_roll_back():
        from django.db import transaction

        try:
            with transaction.atomic():
                actions.do_add_event(job.pk, "info", "never committed")
                raise RuntimeError("roll back")
        except RuntimeError:
            pass

    async def scenario():
        listener = await connected(socket(f"/ws/jobs/{job.pk}/", cookie))
        await database_sync_to_async(add_event_then_roll_back)()
        assert await listener.receive_nothing(timeout=QUIET)
        await listener.disconnect(timeout=30)

    async_to_sync(scenario)()


def test_a_socket_without_a_session_is_refused(ada):
    job = job_of(ada, "ada-bot")

    async def scenario():
        for path in ("/ws/jobs/", f"/ws/jobs/{job.pk}/"):
            ok, code = await socket(path).connect(timeout=30)
            assert not ok and code == 4401, (path, code)

    async_to_sync(scenario)()


def test_someone_elses_job_socket_is_refused(ada, bob):
    theirs = job_of(bob, "bob-bot")
    cookie = session_cookie(ada)

    async def scenario():
        ok, code = await socket(f"/ws/jobs/{theirs.pk}/", cookie).connect(timeout=30)
        assert not ok and code == 4404

    async_to_sync(scenario)()


def test_a_foreign_origin_is_refused(ada):
    cookie = session_cookie(ada)

    async def scenario():
        ok, _ = await socket("/ws/jobs/", cookie, origin=(b"origin", b"http://evil.example")).connect(timeout=30)
        assert not ok

    async_to_sync(scenario)()


def test_the_socket_ignores_what_the_page_sends(ada):
    cookie = session_cookie(ada)

    async def scenario():
        listener = await connected(socket("/ws/jobs/", cookie))
        await listener.send_json_to({"type": "job.status", "status": "succeeded"})
        assert await listener.receive_nothing(timeout=QUIET)
        await listener.disconnect(timeout=30)

    async_to_sync(scenario)()


def test_a_gate_evaluation_tells_the_job_page_when_it_runs_and_ends(ada):
    """The job page redraws its promotion panel on job events: a gate evaluation's start and end are job
    events, sent in commit order, the evaluation's end before the promotion decision it sets off."""
    from kiln_web.evals.execution import execute_evaluation
    from kiln_web.evals.models import EvalRun, EvalSuite

    job = job_of(ada, "ada-gated")
    TrainingJob.objects.filter(pk=job.pk).update(status=JobStatus.SUCCEEDED,
                                                 request={"auto_load": True, "gate": {"suite": "held-out",
                                                                                      "min_accuracy": 0.5}})
    content = '{"prompt": "Say kiln.", "expected": "."}\n'
    suite = EvalSuite.objects.create(name="held-out", owner=ada, content=content, digest="d" * 64, example_count=1)
    # a digest the suite no longer has: the run fails at once (suite_changed), with no model involved
    run = EvalRun.objects.create(owner=ada, suite=suite, suite_digest="e" * 64, candidate=job.adapter,
                                 candidate_base="kiln-tiny", baseline_kind="base", baseline="kiln-tiny",
                                 baseline_base="kiln-tiny", training_job=job, purpose="gate")
    cookie = session_cookie(ada)

    async def scenario():
        listener = await connected(socket(f"/ws/jobs/{job.pk}/", cookie))
        assert await database_sync_to_async(execute_evaluation)(run.pk, "w") == "failed"
        messages = [await listener.receive_json_from(timeout=30) for _ in range(3)]
        assert [m["type"] for m in messages] == ["job.event"] * 3
        texts = [m["message"] for m in messages]
        assert texts[0] == f"evaluation {run.pk} (gate, suite 'held-out'): running on w"
        assert texts[1].startswith(f"evaluation {run.pk} (gate, suite 'held-out'): failed: suite_changed: ")
        assert texts[2].startswith("promotion: unavailable: ")
        assert await listener.receive_nothing(timeout=QUIET)
        await listener.disconnect(timeout=30)

    async_to_sync(scenario)()
    stored = list(job.events.order_by("time", "id").values_list("message", flat=True))
    assert [text.split(":")[0] for text in stored[-3:]] == [f"evaluation {run.pk} (gate, suite 'held-out')"] * 2 + [
        "promotion"]


def test_an_evaluation_linked_to_no_job_writes_no_job_event(ada):
    from kiln_web.evals.execution import execute_evaluation
    from kiln_web.evals.models import EvalRun, EvalSuite
    from kiln_web.jobs.models import JobEvent

    adapter = Adapter.objects.create(name="ada-manual", owner=ada)
    suite = EvalSuite.objects.create(name="manual", owner=ada, content='{"prompt": "a", "expected": "b"}\n',
                                     digest="d" * 64, example_count=1)
    run = EvalRun.objects.create(owner=ada, suite=suite, suite_digest="e" * 64, candidate=adapter,
                                 candidate_base="kiln-tiny", baseline_kind="base", baseline="kiln-tiny",
                                 baseline_base="kiln-tiny")
    assert execute_evaluation(run.pk, "w") == "failed"
    assert not JobEvent.objects.exists()


def test_a_frame_that_is_not_json_leaves_the_socket_relaying(ada):
    """The page only listens: a text frame that is not JSON, or a binary frame, is ignored like any other message.
    Both used to raise in the consumer (JSONDecodeError; ValueError 'No text section'), which closed the socket."""
    job = job_of(ada, "ada-bot")
    cookie = session_cookie(ada)

    async def scenario():
        listener = await connected(socket(f"/ws/jobs/{job.pk}/", cookie))
        await listener.send_to(text_data="{not json")
        await listener.send_to(bytes_data=b"\xff\x00")
        await database_sync_to_async(actions.do_record_step)(job.pk, "w", {"step": 1, "loss": 0.5})
        assert (await listener.receive_json_from(timeout=30))["type"] == "job.step"
        await listener.disconnect(timeout=30)

    async_to_sync(scenario)()


@pytest.mark.parametrize("path", ["/ws/jobs/not-a-job-id/", "/ws/nope/", "/ws/jobs/%00/"])
def test_a_socket_path_no_route_has_is_refused_with_not_found(ada, path):
    cookie = session_cookie(ada)

    async def scenario():
        ok, code = await socket(path, cookie).connect(timeout=30)
        assert not ok and code == 4404, code

    async_to_sync(scenario)()
