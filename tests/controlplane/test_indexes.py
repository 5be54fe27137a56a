"""The hot reads of a control plane that has run for months are index scans: a job's log (paged, and the newest
events on its page), and the newest jobs, evaluation runs and promotion decisions (a person's own, or staff's
everyone's), and an adapter's latest decision. Each plan must need no sort of the rows it filters: on SQLite no
temporary B-tree for the ORDER BY, on PostgreSQL no Sort node once sequential scans and sorts are discouraged
(which the planner honours only where an index gives the order)."""

import pytest
from django.db import connection

from kiln_web.adapters.models import Adapter
from kiln_web.evals.models import EvalRun
from kiln_web.jobs.models import JobEvent, TrainingJob
from kiln_web.serving.models import PromotionRecord

pytestmark = pytest.mark.django_db


def plan(queryset) -> str:
    sql, params = queryset.query.sql_with_params()
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute("SET LOCAL enable_seqscan = off")
            cursor.execute("SET LOCAL enable_sort = off")
            cursor.execute("SET LOCAL enable_bitmapscan = off")
            cursor.execute("EXPLAIN " + sql, params)
            return "\n".join(row[0] for row in cursor.fetchall())
        cursor.execute("EXPLAIN QUERY PLAN " + sql, params)
        return "\n".join(str(row[-1]) for row in cursor.fetchall())


def sorts(text: str) -> bool:
    return "TEMP B-TREE" in text or any(line.strip().startswith(("Sort", "->  Sort", "Incremental Sort"))
                                        or "Sort  (" in line for line in text.splitlines())


def test_hot_reads_need_no_sort(ada):
    adapter = Adapter.objects.create(name="hot", owner=ada)
    job = TrainingJob.objects.create(owner=ada, kind="sft", adapter=adapter, request={}, admission={})
    reads = {
        "a job's events, oldest first (the API's pages)": JobEvent.objects.filter(job=job).order_by("time", "id")[
            1000:2001],
        "a job's newest events (its page)": JobEvent.objects.filter(job=job).order_by("-time", "-id")[:300],
        "everyone's newest jobs (staff)": TrainingJob.objects.order_by("-created_at")[:200],
        "a person's newest jobs": TrainingJob.objects.filter(owner=ada).order_by("-created_at")[:200],
        "everyone's newest evaluation runs (staff)": EvalRun.objects.order_by("-created_at")[:200],
        "a person's newest evaluation runs": EvalRun.objects.filter(owner=ada).order_by("-created_at")[:200],
        "everyone's newest promotion decisions (staff)": PromotionRecord.objects.order_by("-decided_at", "-id")[:200],
        "an adapter's latest promotion decision": PromotionRecord.objects.filter(adapter=adapter).order_by(
            "-decided_at", "-id")[:1],
    }
    sorting = {name: plan(queryset) for name, queryset in reads.items()}
    sorting = {name: text for name, text in sorting.items() if sorts(text)}
    assert not sorting, "\n\n".join(f"{name}:\n{text}" for name, text in sorting.items())


def test_the_models_and_their_migrations_agree():
    """An index (or any field) added to a model without its migration would never reach a database."""
    from io import StringIO

    from django.core.management import call_command

    out = StringIO()
    call_command("makemigrations", "--check", "--dry-run", stdout=out)
    assert "No changes detected" in out.getvalue()
