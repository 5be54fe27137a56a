"""Request lineage for the control plane: every admitted request in `$KILN_HOME/replay.jsonl`, and each
adapter's `lineage.json` (request -> job -> checkpoints -> final adapter -> evaluations -> promotion).

The files and their hash chains are trainer.lineage's; this module decides what goes in them. The
replay record is written inside the submission's transaction, so a request that cannot be recorded
is refused (503 replay_unwritable) and no job exists. Later stages describe facts that already hold
(a published checkpoint, a finished adapter, a decision) and never undo them: a write that fails is
logged and reported as a job event. `kiln-replay verify` checks integrity only; it does not rerun
training or compare tensors.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import NamedTuple

from django.conf import settings

from trainer.lineage import LineageError, append_replay, record_lineage

logger = logging.getLogger("kiln.jobs")

# the request fields that carry inline training data, per kind; the replay log keeps their digest only
INLINE_DATA_FIELDS = ("data", "groups", "prompts")


def replay_path() -> Path:
    return settings.KILN_HOME / "replay.jsonl"


def _canonical(value) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def inline_digest(items: list) -> dict:
    """SHA-256 and size of inline records as canonical JSON Lines (one compact, key-sorted record per line;
    for SFT this is the admission's dataset sha256)."""
    raw = b"".join(_canonical(item) + b"\n" for item in items)
    return {"sha256": hashlib.sha256(raw).hexdigest(), "bytes": len(raw), "records": len(items)}


def replayed_request(body: dict) -> dict:
    """BODY as submitted, with each inline data list replaced by its digest."""
    out = dict(body)
    for name in INLINE_DATA_FIELDS:
        if isinstance(out.get(name), list):
            out[name] = {"inline": inline_digest(out[name])}
    return out


def identities_digest(identities) -> str:
    return hashlib.sha256(_canonical(identities)).hexdigest()


# -- stages --


def record_admission(job) -> dict:
    """Append JOB's request to the replay log and start its entries in the adapter's lineage; returns the
    replay record. Raises ActionRefused (503) when either file cannot be written."""
    from kiln_web.core.http import ActionRefused

    payload = {"job_id": str(job.pk), "kind": job.kind, "owner": job.owner.get_username(),
               "adapter": job.adapter.name, "request": replayed_request(job.request),
               "identities_sha256": identities_digest(job.identities), "effective_seed": job.effective_seed,
               "resume_from": job.resume_from or None, "admitted_at": job.created_at.isoformat()}
    try:
        record = append_replay(replay_path(), job.kind, payload)
        record_lineage(settings.KILN_ADAPTERS_DIR, job.adapter.name, "request", {
            "replay_hash": record["hash"], "replay_sequence": record["sequence"], "job_id": str(job.pk)})
        record_lineage(settings.KILN_ADAPTERS_DIR, job.adapter.name, "job", {
            "job_id": str(job.pk), "kind": job.kind, "owner": payload["owner"],
            "identities_sha256": payload["identities_sha256"], "effective_seed": job.effective_seed,
            "total_steps": job.total_steps, "resume_from": job.resume_from or None})
    except (OSError, LineageError) as exc:
        logger.exception("could not record the request lineage of job %s", job.pk)
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ActionRefused(503, "replay_unwritable", f"the request was not admitted: its lineage could not be "
                                                      f"recorded under {settings.KILN_HOME} ({reason}); check "
                                                      "that KILN_HOME is writable, then run kiln-replay verify"
                            ) from None
    return record


class Recorded(NamedTuple):
    """A later-stage entry as written, or why it was not (the caller puts `warning` on the job's events)."""

    entry: dict | None
    warning: str | None


def _record(adapter: str, stage: str, entry: dict, job_id=None) -> Recorded:
    """One later-stage entry; a failure is logged and returned, never raised."""
    try:
        return Recorded(record_lineage(settings.KILN_ADAPTERS_DIR, adapter, stage, entry), None)
    except (OSError, LineageError, ValueError) as exc:
        logger.exception("could not record the %s lineage of adapter %s", stage, adapter)
        return Recorded(None, f"lineage: the {stage} entry of {adapter} was not recorded ({exc}); "
                              "kiln-replay verify cannot vouch for it")


def record_checkpoint(job, summary: dict, manifest_digest: str = "") -> Recorded:
    return _record(job.adapter.name, "checkpoint", {
        "job_id": str(job.pk), "resume_checkpoint": summary.get("resume_checkpoint"),
        "step": summary.get("step"), "checkpoint_id": summary.get("checkpoint_id"),
        "complete": summary.get("complete"), "manifest_digest": manifest_digest or None}, job.pk)


def record_final_adapter(job, final_adapter: dict) -> Recorded:
    """The PEFT snapshot a succeeded job published (RunResult.final_adapter)."""
    return _record(job.adapter.name, "final_adapter", {
        "job_id": str(job.pk), "snapshot": Path(str(final_adapter.get("path") or job.adapter.name)).name,
        "adapter_sha256": final_adapter.get("adapter_sha256"), "config_sha256": final_adapter.get("config_sha256"),
        "committed_step": job.committed_step}, job.pk)


def record_evaluation_lineage(adapter: str, evaluation_id, *, suite: str, summary: dict | None,
                              candidate_sha256: str = "", suite_digest: str = "", baseline: str = "",
                              baseline_summary: dict | None = None, job_id=None) -> Recorded:
    """An evaluation of ADAPTER's snapshot. Call it once the evaluation's result is committed; it never raises."""
    return _record(adapter, "evaluation", {
        "evaluation_id": str(evaluation_id), "suite": suite, "suite_digest": suite_digest or None,
        "candidate_sha256": candidate_sha256 or None, "summary": summary, "baseline": baseline or None,
        "baseline_summary": baseline_summary, "job_id": str(job_id) if job_id is not None else None}, job_id)


def record_promotion_lineage(adapter: str, outcome: str, *, reason: str = "", decided_by: str = "",
                             adapter_sha256: str = "", job_id=None, evaluation_id=None,
                             previous_active: str = "") -> Recorded:
    """A promotion decision about ADAPTER (promoted, or why not). Call it once the decision is committed
    (kiln_web.serving: after PromotionRecord is saved); it never raises."""
    return _record(adapter, "promotion", {
        "outcome": outcome, "reason": reason, "decided_by": decided_by, "adapter_sha256": adapter_sha256 or None,
        "job_id": str(job_id) if job_id is not None else None,
        "evaluation_id": str(evaluation_id) if evaluation_id is not None else None,
        "previous_active": previous_active or None}, job_id)
