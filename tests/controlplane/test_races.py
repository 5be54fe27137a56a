"""Check-then-act races between concurrent requests, on real PostgreSQL transactions (tests/controlplane/races.py).

Each test holds both sides at the racy point until the other has reached it or waits on a lock, so a missing lock
or a missing IntegrityError mapping shows every time. SQLite (the embedded mode) takes its write lock when a
transaction begins (transaction_mode IMMEDIATE), so these races cannot happen there; they run in the PostgreSQL
pass of `./dev test` (tests/run_suite.py).
"""

import json

import pytest
from django.db import connection

from kiln_web.adapters.models import Adapter
from kiln_web.core.http import ActionRefused
from kiln_web.evals import actions as evals_actions
from kiln_web.evals.models import EvalSuite
from kiln_web.serving import actions as serving_actions
from kiln_web.serving import runtime as serving_runtime
from kiln_web.serving.models import PromotionRecord, ServedAdapter

from .races import Rendezvous

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def postgresql_only():
    if connection.vendor != "postgresql":
        pytest.skip("a race between concurrent transactions: it runs in the PostgreSQL pass of ./dev test "
                    "(SQLite serialises writers at BEGIN)")


@pytest.fixture
def rendezvous():
    return Rendezvous()


def hold_before(monkeypatch, rendezvous, model, method="save", when=lambda kwargs: True):
    """Hold each side of the race in MODEL.METHOD, its first write after its checks (the first one WHEN accepts,
    given the call's keyword arguments)."""
    original = getattr(model, method)

    def held(self, *args, **kwargs):
        if when(kwargs):
            rendezvous.hold()
        return original(self, *args, **kwargs)

    monkeypatch.setattr(model, method, held)


# -- activation: at most one active adapter per person --


def served(owner, name: str) -> ServedAdapter:
    adapter = Adapter.objects.create(name=name, owner=owner)
    return ServedAdapter.objects.create(adapter=adapter, base="kiln-tiny", adapter_sha256="0" * 64, loaded_by="test")


def activating(kwargs) -> bool:
    """The writes of serving.actions._activate (after its look for the scope's active adapter)."""
    return "active" in (kwargs.get("update_fields") or ())


@pytest.mark.parametrize("before", [None, "c"], ids=["none-active", "another-active"])
def test_two_activations_in_one_scope_both_succeed_and_the_last_is_active(ada, monkeypatch, rendezvous, before):
    """Two activations in one person's scope (two browser tabs, or a promotion beside a person's activation) each
    looked for the scope's previous active adapter before either wrote: both made their own row active, and the
    second broke serving_one_active_adapter_per_owner (IntegrityError, a 500). Now the second waits for the first
    and replaces it, recording it as previous_active."""
    serving_runtime.close_serving()
    served(ada, "race-a"), served(ada, "race-b")
    if before:
        serving_actions.do_activate_adapter(ada, served(ada, f"race-{before}").adapter.name)
    hold_before(monkeypatch, rendezvous, ServedAdapter, when=activating)
    rendezvous.run(a=lambda: serving_actions.do_activate_adapter(ada, "race-a"),
                   b=lambda: serving_actions.do_activate_adapter(ada, "race-b"))
    assert rendezvous.errors == {}
    active = ServedAdapter.objects.filter(active=True, active_for=ada).select_related("adapter").get()
    last, first = ("race-a", "race-b") if active.adapter.name == "race-a" else ("race-b", "race-a")
    records = {record.adapter.name: record for record in PromotionRecord.objects.filter(
        adapter__name__in=["race-a", "race-b"]).select_related("adapter")}
    assert records[first].previous_active == (f"race-{before}" if before else "")
    assert records[last].previous_active == first  # the audit trail says what each replaced


def test_a_promotion_beside_an_activation_in_its_scope(ada, adapter_name, monkeypatch, rendezvous, settings):
    """A gate's (or auto_load's) promotion and the job owner's own activation at the same moment: the same race in
    do_promote, which also locks the adapter (the lock order stays adapter, scope, rows: no deadlock)."""
    from serving.helpers import publish_adapter

    serving_runtime.close_serving()
    publish_adapter(settings.KILN_HOME, settings.KILN_ADAPTERS_DIR, adapter_name, seed=3)  # a fresh name: one registry
    candidate = Adapter.objects.create(name=adapter_name, owner=ada)
    sha = serving_runtime.snapshot_sha256(adapter_name)
    served(ada, "race-chosen")
    hold_before(monkeypatch, rendezvous, ServedAdapter, when=activating)
    rendezvous.run(promote=lambda: serving_actions.do_promote(candidate, "kiln-tiny", sha, decided_by="gate",
                                                              reason="the gate passed"),
                   activate=lambda: serving_actions.do_activate_adapter(ada, "race-chosen"))
    assert rendezvous.errors == {}
    active = ServedAdapter.objects.filter(active=True, active_for=ada).select_related("adapter").get()
    other = "race-chosen" if active.adapter.name == adapter_name else adapter_name
    assert PromotionRecord.objects.get(adapter=active.adapter).previous_active == other


# -- names: a second create of one name is 409, never a 500 --


SUITE = "\n".join(json.dumps({"prompt": f"q{i}", "expected": f"a{i}"}) for i in range(3))


def test_two_suites_created_under_one_name_answer_201_and_409(ada, bob, monkeypatch, rendezvous):
    """Both creates found the name free before either inserted: the second's insert broke the unique name
    (IntegrityError, a 500). Now it is the documented 409 suite_exists."""
    hold_before(monkeypatch, rendezvous, EvalSuite)
    rendezvous.run(ada=lambda: evals_actions.do_create_suite(ada, "race-suite", SUITE),
                   bob=lambda: evals_actions.do_create_suite(bob, "race-suite", SUITE))
    assert len(rendezvous.results) == 1 and len(rendezvous.errors) == 1, rendezvous.errors
    (loser, error), = rendezvous.errors.items()
    assert isinstance(error, ActionRefused), repr(error)
    assert (error.status, error.code) == (409, "suite_exists")
    winner = EvalSuite.objects.get(name="race-suite")
    assert winner.owner.username != loser and winner.owner.username in rendezvous.results


# -- deleting an adapter beside the evaluation of it --


def test_an_adapter_deleted_while_its_evaluation_is_queued(ada, adapter_name, monkeypatch, rendezvous, settings):
    """The delete refuses while an evaluation of the adapter is queued, and the evaluation needs its snapshot; the
    two checks were not ordered, so a delete beside the evaluation's creation found no evaluation, removed the
    snapshot and the checkpoints, and the evaluation was still queued (201), to fail on its worker. The evaluation
    is now created on the candidate's locked row: here the delete waits for it, then answers 409 adapter_busy."""
    from serving.helpers import publish_adapter

    publish_adapter(settings.KILN_HOME, settings.KILN_ADAPTERS_DIR, adapter_name, seed=4)
    evals_actions.do_create_suite(ada, "race-eval-suite", SUITE)
    hold_in = evals_actions._baseline

    def held(*args, **kwargs):
        rendezvous.hold()
        return hold_in(*args, **kwargs)

    monkeypatch.setattr(evals_actions, "_baseline", held)

    def delete():
        rendezvous.wait_arrived("evaluate")
        return serving_actions.do_delete_adapter(ada, adapter_name)

    rendezvous.run(evaluate=lambda: evals_actions.do_enqueue_evaluation(ada, adapter_name, "race-eval-suite"),
                   delete=delete)
    assert "evaluate" in rendezvous.results, rendezvous.errors
    error = rendezvous.errors.get("delete")
    assert isinstance(error, ActionRefused) and error.code == "adapter_busy", (error, rendezvous.results)
    assert serving_runtime.has_snapshot(adapter_name)
