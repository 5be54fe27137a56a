"""What the dashboard pages show, read from the database and the adapter registry; nothing here changes state.

The registry on disk is the authority for checkpoints: a panel reports a checkpoint as
usable only after the light validation (`load_checkpoint(full=False)`: manifest, file set,
sizes; nothing hashed) passed just now. Resume admission does the full SHA-256 proof.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime, timezone

from django.apps import apps
from django.conf import settings
from django.core.exceptions import ObjectDoesNotExist

from kiln_web.adapters.models import Adapter, CheckpointRecord
from kiln_web.jobs import resume, runtime
from kiln_web.jobs.models import ACTIVE_STATUSES, JobMetric, JobStatus, TrainingJob

PEFT_CONFIG = "adapter_config.json"  # what marks a PEFT snapshot directory (weights only)
PEFT_WEIGHTS = "adapter_model.safetensors"
LINEAGE_DEPTH = 20  # earlier runs followed through resume_from for the charts
EVENT_LIMIT = 300  # newest events shown on job detail
VALIDATE_LIMIT = 50  # newest checkpoint directories light-validated per page; older ones are listed unchecked

# Charts per training kind: (metric key, title, axis floor). A chart is drawn when some step carries the
# key (the first chart of a kind always is). With a floor the y-axis never reaches below it while every
# value is at or above it (a loss axis stops at 0, not at -0.06); None lets the axis follow the data.
# tokens_per_second is not a metric the runs report: the page derives it from each step's `tokens`
# and the `elapsed_seconds` between consecutive steps.
RATE_CHARTS = [("learning_rate", "Learning rate", 0), ("grad_norm", "Gradient norm", 0),
               ("tokens_per_second", "Tokens/s", 0)]
CHARTS = {
    "sft": [("loss", "Loss", 0)] + RATE_CHARTS,
    "grpo": [("loss", "Loss", 0), ("reward_mean", "Reward (mean)", None), ("kl_mean", "KL to reference", 0),
             ("clip_region_fraction", "Clip fraction", 0)] + RATE_CHARTS,
    "opd": [("kl", "Reverse KL to teacher", 0)] + RATE_CHARTS,
}
DERIVED = {"tokens_per_second": ("tokens",)}  # chart key -> the reported metrics it is computed from
STEP_KEYS = ("step", "elapsed_seconds")

TERMINAL_STATUSES = (JobStatus.SUCCEEDED, JobStatus.CANCELLED, JobStatus.FAILED, JobStatus.LOST)


def visible_jobs(user):
    """A person's own jobs; staff see everyone's."""
    return TrainingJob.objects.visible_to(user).select_related("owner", "adapter")


def listed_jobs(user):
    """visible_jobs for a list: without the jobs' request and admission bodies, which a row never shows."""
    return visible_jobs(user).defer(*TrainingJob.BODIES)


def visible_adapters(user):
    return Adapter.objects.visible_to(user).select_related("owner")


def chart_specs(kind: str) -> list[dict]:
    return [{"key": key, "title": title, "floor": floor} for key, title, floor in CHARTS.get(kind, CHARTS["sft"])]


def _chart_keys(kind: str) -> tuple[str, ...]:
    keys = list(STEP_KEYS)
    for spec in chart_specs(kind):
        keys.extend(DERIVED.get(spec["key"], (spec["key"],)))
    return tuple(dict.fromkeys(keys))


def _chart_point(metrics: dict, keys: tuple[str, ...]) -> dict:
    return {key: metrics.get(key) for key in keys if key in metrics}


def chart_metrics(job: TrainingJob, after_step: int = 0) -> list[dict]:
    """This job's committed steps after AFTER_STEP, reduced to what the charts and the ETA need."""
    keys = _chart_keys(job.kind)
    rows = JobMetric.objects.filter(job=job, step__gt=after_step).order_by("step").values_list("step", "metrics")
    return [{**_chart_point(metrics, keys), "step": step} for step, metrics in rows]


def earlier_metrics(job: TrainingJob, user) -> list[dict]:
    """The steps earlier runs committed before this one resumed (through resume_from, as far as the
    checkpoint index and the user's visibility reach), so a resumed run's charts start at step 1."""
    keys = _chart_keys(job.kind)
    points: list[dict] = []
    basename, upto, seen = job.resume_from, None, {job.pk}
    for _ in range(LINEAGE_DEPTH):
        if not basename:
            break
        record = (CheckpointRecord.objects.filter(basename=basename).select_related("job")
                  .defer(*(f"job__{body}" for body in TrainingJob.BODIES)).first())
        if record is None or record.job_id in seen or not visible_jobs(user).filter(pk=record.job_id).exists():
            break
        seen.add(record.job_id)
        limit = record.step if upto is None else min(record.step, upto)
        rows = JobMetric.objects.filter(job_id=record.job_id, step__lte=limit).order_by("step")
        points = [{**_chart_point(row.metrics, keys), "step": row.step} for row in rows
                  if not points or row.step < points[0]["step"]] + points
        basename, upto = record.job.resume_from, limit
    return points


# -- checkpoints --


@dataclass
class CheckpointState:
    """One checkpoint directory as the registry holds it now."""

    basename: str
    state: str  # valid, invalid, missing, incomplete (a staging directory), unchecked
    summary: dict = field(default_factory=dict)
    error: dict | None = None
    record: CheckpointRecord | None = None
    step: int | None = None


def read_checkpoint(basename: str, kind: str, adapter: str, manifest_digest: str = "") -> CheckpointState:
    """BASENAME light-validated now; with MANIFEST_DIGEST, a manifest other than that one is invalid
    (checkpoint_changed)."""
    try:
        summary, error = runtime.read_checkpoint_summary(basename, kind, adapter, manifest_digest=manifest_digest)
    except runtime.RunnerUnavailable as exc:
        return CheckpointState(basename, "invalid", error={"code": exc.code, "message": str(exc)})
    if summary is None:
        state = "missing" if error and error.get("code") == "not_found" else "invalid"
        return CheckpointState(basename, state, error=error)
    return CheckpointState(basename, "valid", summary=summary, step=summary.get("step"))


def adapter_checkpoints(adapter: Adapter, records: list | None = None) -> tuple[list[CheckpointState], str | None]:
    """Every checkpoint of ADAPTER, newest first: each directory in the registry (light-validated now),
    indexed ones that are gone, and hidden staging directories of unfinished publications.
    The second value says why the registry could not be read, if it could not. RECORDS: the adapter's
    CheckpointRecords, when the caller read them already (adapter_rows)."""
    if records is None:
        records = CheckpointRecord.objects.filter(adapter=adapter)
    records = {record.basename: record for record in records}
    try:
        module = runtime.checkpoint_module()
    except runtime.RunnerUnavailable as exc:
        return [], str(exc)
    try:
        paths = module.list_checkpoints(settings.KILN_ADAPTERS_DIR, adapter.name)
        orphans = module.list_staging_orphans(settings.KILN_ADAPTERS_DIR, adapter.name)
    except (OSError, module.CheckpointError) as exc:  # CheckpointError: a name the registry refuses
        return [], f"the adapter registry cannot be read: {exc}"
    states = []
    for position, path in enumerate(reversed(paths)):  # newest first
        step = module.parse_basename(path.name)[1]
        if position >= VALIDATE_LIMIT:
            state = CheckpointState(path.name, "unchecked", step=step)
        else:
            try:
                loaded = module.load_checkpoint(path, full=False, expected_adapter=adapter.name)
                state = CheckpointState(path.name, "valid", summary=module.checkpoint_summary(loaded), step=step)
            except module.CheckpointError as exc:
                state = CheckpointState(path.name, "invalid", step=step, error={
                    "code": getattr(exc, "code", "checkpoint_invalid"),
                    "message": str(getattr(exc, "message", "") or exc)})
            except OSError as exc:
                state = CheckpointState(path.name, "invalid", step=step, error={
                    "code": "checkpoint_unreadable", "message": exc.strerror or str(exc)})
        state.record = records.pop(path.name, None)
        states.append(state)
    for basename, record in records.items():
        states.append(CheckpointState(basename, "missing", record=record, step=record.step, error={
            "code": "not_found", "message": "indexed when published, no longer in the registry"}))
    for path in orphans:
        states.append(CheckpointState(path.name, "incomplete", error={
            "code": "staging", "message": "a publication that never finished (or is finishing now); "
                                          "never loadable as a checkpoint"}))
    states.sort(key=lambda s: (s.step if s.step is not None else -1, s.state == "valid"), reverse=True)
    return states, None


def peft_snapshot(adapter_name: str) -> dict | None:
    """The final PEFT snapshot `registry/<adapter>` (weights only), or None when there is none."""
    path = settings.KILN_ADAPTERS_DIR / adapter_name
    config_path = path / PEFT_CONFIG
    if path.is_symlink() or not config_path.is_file():
        return None
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError):
        config = {}
    weights = path / PEFT_WEIGHTS
    try:
        stat = weights.stat()
        size, modified = stat.st_size, stat.st_mtime
    except OSError:
        size, modified = None, None
    return {"path": str(path), "rank": config.get("r"), "alpha": config.get("lora_alpha"),
            "targets": config.get("target_modules") or [], "base": config.get("base_model_name_or_path"),
            "use_rslora": config.get("use_rslora"), "size": size,
            "modified": datetime.fromtimestamp(modified, timezone.utc) if modified else None}


def cursor_text(cursor) -> str:
    """`{"epoch": 3, "example": 1}` -> "epoch 3, example 1" (SFT); other kinds' cursors likewise."""
    if isinstance(cursor, dict):
        return ", ".join(f"{key.replace('_', ' ')} {value}" for key, value in cursor.items())
    return "" if cursor is None else str(cursor)


def checkpoint_panel(job: TrainingJob) -> dict:
    """The latest checkpoint panel: the newest checkpoint the job published (else the one it resumed
    from), validated now, and which kind of continuation the adapter's artifacts allow."""
    basename = (job.latest_checkpoint or {}).get("resume_checkpoint") or job.resume_from
    checkpoint = read_checkpoint(basename, job.kind, job.adapter.name, resume.published_digest(job, basename)) \
        if basename else None
    snapshot = peft_snapshot(job.adapter.name)
    if checkpoint is not None and checkpoint.state == "valid":
        resume_kind = "exact"
    elif snapshot is not None:
        resume_kind = "warm"
    else:
        resume_kind = None
    summary = checkpoint.summary if checkpoint else {}
    return {"checkpoint": checkpoint, "summary": summary, "cursor": cursor_text(summary.get("next_cursor")),
            "snapshot": snapshot, "resume_kind": resume_kind,
            "resumable": (checkpoint is not None and checkpoint.state == "valid" and not summary.get("complete")
                          and job.status not in ACTIVE_STATUSES)}


def stop_outcome(job: TrainingJob, panel: dict) -> dict | None:
    """What "Stop and save" achieved. Success only when the job ended cancelled AND the checkpoint read
    from the registry just now is valid and holds the step the run stopped at."""
    if job.status == JobStatus.CANCELLING:
        return {"state": "pending", "step": job.committed_step}
    if job.status != JobStatus.CANCELLED:
        return None
    checkpoint, summary = panel["checkpoint"], panel["summary"]
    stopped_at = job.committed_step
    if not job.started_at:
        return {"state": "never_started", "step": 0}
    if checkpoint is None:
        return {"state": "none", "step": stopped_at}
    if checkpoint.state != "valid":
        return {"state": "invalid", "step": stopped_at, "error": checkpoint.error, "basename": checkpoint.basename}
    saved = summary.get("committed_step", summary.get("step"))
    if saved == stopped_at:
        return {"state": "confirmed", "step": saved, "total": summary.get("total_steps"),
                "basename": checkpoint.basename}
    return {"state": "behind", "step": stopped_at, "saved": saved, "basename": checkpoint.basename,
            "lost_steps": stopped_at - (saved or 0)}


PROMOTION_LABELS = {
    "promoted": "Promoted",
    "gate_failed": "Gate failed",
    "inconclusive": "Inconclusive",
    "unavailable": "Unavailable",
    "canary_failed": "Canary failed",
    "pending": "Awaiting the gate",
    "pending_canary": "Awaiting the canary",
    "not_trained": "Not promoted",
    "not_requested": "Not requested",
}


def evaluation_rows(job: TrainingJob) -> list[dict]:
    """The evaluation runs linked to the job (kiln_web.evals), oldest first."""
    if not apps.is_installed("kiln_web.evals"):
        return []
    rows = []
    for run in job.evaluations.select_related("suite").order_by("created_at"):
        candidate, baseline = run.candidate_summary or {}, run.baseline_summary or {}
        rows.append({"id": str(run.pk), "suite": run.suite.name, "status": run.status, "purpose": run.purpose,
                     "candidate": candidate.get("accuracy"), "baseline": baseline.get("accuracy"),
                     "baseline_name": run.baseline, "total": candidate.get("total"),
                     "error": run.error_message if run.error_code else ""})
    return rows


def requested_promotion(job: TrainingJob) -> dict:
    """What the job's request asked of promotion: {"auto_load": bool, "gate": {suite, ...} or None}, and
    "error" when the stored request's promotion fields are malformed (written before they were checked)."""
    from kiln_web.core.http import ActionRefused
    from kiln_web.serving.promotion_request import requested_promotion as parse

    try:
        wanted = parse(job.request)
    except ActionRefused as refused:
        return {"auto_load": False, "gate": None, "error": refused.message}
    return {"auto_load": wanted.auto_load, "gate": wanted.gate, "error": None}


def _gate_text(gate: dict) -> str:
    limits = [f"{name.replace('_', ' ')} {gate[name]:g}" for name in ("min_accuracy", "min_improvement")
              if gate.get(name) is not None]
    return f"suite {gate['suite']}" + (f" ({', '.join(limits)})" if limits else "")


def _undecided(job: TrainingJob, evaluations: list[dict]) -> tuple[str, str]:
    """The promotion state of a job without a recorded decision, from what its request asked."""
    if any(e["purpose"] == "gate" and e["status"] in ("queued", "running") for e in evaluations):
        return "pending", "the gate evaluation has not finished; the previous adapter stays active"
    asked = requested_promotion(job)
    if not asked["auto_load"]:
        return "not_requested", ""
    gate = asked["gate"]
    if job.status in (JobStatus.FAILED, JobStatus.CANCELLED, JobStatus.LOST):
        return "not_trained", "auto_load was requested, but the run did not succeed, so nothing was evaluated or loaded"
    if gate is None:
        if job.status == JobStatus.SUCCEEDED:
            return "pending_canary", "the serving canary has not finished"
        return "pending_canary", "auto_load without a gate: when the run succeeds the serving canary runs, then " \
                                 "the adapter is activated"
    if job.status == JobStatus.SUCCEEDED:
        return "pending", f"the gate evaluation on {_gate_text(gate)} is being queued"
    return "pending", f"when the run succeeds it is evaluated on {_gate_text(gate)}; the previous adapter stays " \
                      "active until it passes"


def outcome(job: TrainingJob, panel: dict) -> dict:
    """"Adapter was trained" and "adapter was promoted" are separate facts: the first is the job's own end
    (and its final PEFT snapshot), the second the newest promotion decision recorded for the job
    (kiln_web.serving), with the evaluation runs linked to it (kiln_web.evals). Without a decision, what
    the job's request asked (auto_load, gate) says what is awaited: a gated auto-load job awaits its gate
    from the moment it is submitted; a job that asked for neither was not asked to promote anything."""
    evaluations = evaluation_rows(job)
    decision = None
    if apps.is_installed("kiln_web.serving"):
        decision = job.promotions.order_by("-decided_at", "-id").first()
    if decision is not None:
        state, reason = decision.outcome, decision.reason
    else:
        state, reason = _undecided(job, evaluations)
    trained = job.status == JobStatus.SUCCEEDED
    return {"trained": trained, "snapshot": panel["snapshot"] if trained else None, "promotion": state,
            "promotion_label": PROMOTION_LABELS.get(state, state.replace("_", " ").capitalize()),
            "reason": reason, "decided_by": decision.decided_by if decision else None,
            "decided_at": decision.decided_at if decision else None, "evaluations": evaluations}


def checkpointing(job: TrainingJob) -> dict:
    """Whether the run publishes checkpoints (its effective checkpoint_interval), and so whether Stop can
    save: a run without an interval ends at Stop with nothing to resume from."""
    interval = (job.effective_config or {}).get("checkpoint_interval")
    return {"interval": interval, "can_save": bool(interval)}


def accepts_base_adapter(kind: str) -> bool:
    """Whether requests of training KIND take `base_adapter` (a weights-only warm start); from the
    kind's request defaults, so the advice follows the trainer."""
    try:
        runtime.request_default(kind, "base_adapter")
    except (KeyError, runtime.RunnerUnavailable):
        return False
    return True


def adapter_rows(user) -> list[dict]:
    """The adapters page: each adapter USER may see with its checkpoints (adapter_checkpoints), its newest job
    and whether it is served; the database is read with a fixed number of queries whatever their number."""
    from django.db.models import OuterRef, Subquery

    adapters = visible_adapters(user)
    if apps.is_installed("kiln_web.serving"):
        adapters = adapters.select_related("serving__active_for")
    adapters = list(adapters)
    ids = [adapter.pk for adapter in adapters]
    records: dict = {pk: [] for pk in ids}
    for record in CheckpointRecord.objects.filter(adapter_id__in=ids):
        records[record.adapter_id].append(record)
    # the newest job the person may see (staff's job on their adapter is not theirs to see)
    newest = visible_jobs(user).filter(adapter=OuterRef("pk")).order_by("-created_at").values("pk")[:1]
    picks = Adapter.objects.filter(pk__in=ids).annotate(pick=Subquery(newest)).values("pick")
    jobs = {job.adapter_id: job for job in TrainingJob.objects.filter(pk__in=picks).only("pk", "status", "adapter_id")}
    rows = []
    for adapter in adapters:
        # an adapter shared with the person: its checkpoints and jobs are its owner's training, shown to them only
        manages = adapter.is_owner_or_staff(user)
        checkpoints, error = adapter_checkpoints(adapter, records[adapter.pk]) if manages else ([], None)
        rows.append({"adapter": adapter, "snapshot": peft_snapshot(adapter.name), "manages": manages,
                     "valid": sum(1 for c in checkpoints if c.state == "valid"),
                     "invalid": sum(1 for c in checkpoints if c.state != "valid"),
                     "latest": next((c for c in checkpoints if c.state == "valid"), None),
                     "latest_job": jobs.get(adapter.pk) if manages else None, "registry_error": error,
                     "served": served(adapter)})
    return rows


def served(adapter: Adapter) -> dict | None:
    """Whether every web process serves the adapter (loaded), whether it is active and for whom."""
    if not apps.is_installed("kiln_web.serving"):
        return None
    try:
        row = adapter.serving  # the reverse one-to-one of ServedAdapter
    except ObjectDoesNotExist:
        return None
    return {"active": row.active, "active_for": row.active_for if row.active else None, "base": row.base,
            "loaded_at": row.loaded_at}


def effective_settings(job: TrainingJob) -> list[tuple[str, str]]:
    """The effective configuration flattened to (dotted name, value) rows for a readable table."""
    rows: list[tuple[str, str]] = []

    def walk(prefix: str, value) -> None:
        if isinstance(value, dict) and value:
            for key in value:
                walk(f"{prefix}.{key}" if prefix else key, value[key])
        elif isinstance(value, list):
            rows.append((prefix, ", ".join(map(str, value)) if all(not isinstance(v, (dict, list)) for v in value)
                         else json.dumps(value)))
        else:
            rows.append((prefix, "null" if value is None else json.dumps(value) if isinstance(value, dict)
                         else str(value).lower() if isinstance(value, bool) else str(value)))

    walk("", job.effective_config or {})
    return rows


def identity_rows(job: TrainingJob) -> list[tuple[str, str]]:
    """A few identities a person checks at a glance; the admin and the API carry all of them."""
    identities = job.identities or {}
    rows = []
    base = identities.get("base") or {}
    if base.get("name"):
        rows.append(("base", base["name"]))
    dataset = identities.get("dataset") or {}
    if dataset.get("sha256"):
        detail = ", ".join(f"{dataset[key]} {key}" for key in ("records", "bytes") if dataset.get(key) is not None)
        rows.append(("dataset sha256", dataset["sha256"][:16] + (f"… ({detail})" if detail else "…")))
    planning = identities.get("planning") or {}
    for key in ("schema", "sft_loss_route"):
        if planning.get(key):
            rows.append((f"planning {key.replace('_', ' ')}", str(planning[key])))
    teacher = job.teacher  # OPD: the alias, and its identity and content revisions, kept apart
    if teacher:
        rows.append(("teacher", f"{teacher.get('alias')} ({teacher.get('route')})"))
        for key in ("identity_revision", "content_revision"):
            if teacher.get(key):
                rows.append((f"teacher {key.replace('_', ' ')}", str(teacher[key])))
    execution = identities.get("execution") or {}
    if execution.get("backend"):
        rows.append(("backend", str(execution["backend"])))
    if isinstance(execution.get("gpu"), dict):
        rows.append(("gpu", gpu_text(execution["gpu"])))
    return rows


def gpu_text(gpu: dict) -> str:
    """A cuda execution identity's device and stack on one line."""
    parts = [str(gpu.get("name") or "no device"),
             *(f"{label} {gpu[key]}" for key, label in (("compute_capability", "compute capability"),
                                                         ("driver_version", "driver"), ("runtime_version", "runtime"),
                                                         ("cublas_version", "cuBLAS")) if gpu.get(key))]
    if gpu.get("shared_memory_per_block"):
        parts.append(f"{gpu['shared_memory_per_block'] / 1024:g} KiB shared memory per block")
    if gpu.get("tf32_override") is not None:
        parts.append(f"NVIDIA_TF32_OVERRIDE={gpu['tf32_override']}")
    if gpu.get("library_sha256"):
        parts.append(f"library sha256 {str(gpu['library_sha256'])[:16]}…")
    return ", ".join(parts)


def job_row(job: TrainingJob) -> dict:
    """One line of the jobs list."""
    latest = job.latest_checkpoint or {}
    return {"job": job, "checkpoint_step": latest.get("committed_step", latest.get("step")),
            "checkpoint_name": latest.get("resume_checkpoint"), "checkpoint_complete": latest.get("complete"),
            "percent": percent(job)}


def percent(job: TrainingJob) -> int:
    if not job.total_steps:
        return 100 if job.status == JobStatus.SUCCEEDED else 0
    return max(0, min(100, round(100 * job.committed_step / job.total_steps)))


def events(job: TrainingJob) -> list:
    rows = list(job.events.order_by("-time", "-id")[:EVENT_LIMIT])
    return [row.to_dict() for row in rows]


# -- qualification receipts --

RECEIPT_SCHEMA = "kiln.qualification-receipt.v1"  # trainer.qualify writes it; `kiln qualify` names the files
EXECUTION_ROWS = ("backend", "device", "blas", "precision", "kernel_contract", "python", "numpy", "libraries", "kiln",
                  "code")


@dataclass
class QualificationReceipt:
    """The latest receipt of one backend ($KILN_HOME/qualification/latest-BACKEND.json), as the page shows it."""

    backend: str
    path: str
    passed: bool | None = None
    created: datetime | None = None
    routes: list = field(default_factory=list)  # [{route, passed, mismatches, seconds, cancelled_at, steps}]
    envelope: list = field(default_factory=list)  # [(label, value)]
    note: str = ""
    earlier: int = 0  # stamped receipts of this backend beside it
    error: str | None = None  # why the file could not be read as a receipt


def _envelope_rows(envelope: dict) -> list[tuple[str, str]]:
    rows = []
    model = envelope.get("model") or {}
    if model.get("name"):
        identity = str(model.get("identity") or "")
        rows.append(("model", f"{model['name']}" + (f" (identity {identity[:16]}…)" if identity else "")))
    execution = envelope.get("execution") or {}
    for key in EXECUTION_ROWS + tuple(sorted(k for k in execution if k not in EXECUTION_ROWS)):
        value = execution.get(key)
        if key == "device" and isinstance(value, dict):
            flags = value.get("cpu_flags") or []
            value = ", ".join(str(part) for part in (value.get("machine"), value.get("cpu_model")) if part) + (
                f" ({' '.join(map(str, flags))})" if flags else "")
        elif key == "blas" and isinstance(value, dict):
            gemm = value.get("float32_gemm")
            value = " ".join(str(value[k]) for k in ("library", "version", "architecture", "threading_layer")
                             if value.get(k)) + f", {value.get('threads')} threads" + (
                f"; float32 products on {gemm}" if gemm else "")
        elif key == "code" and isinstance(value, dict):
            value = (f"sha256 {str(value.get('sha256'))[:16]}… over {value.get('files')} files of trainer/ "
                     "and native_ext/")
        elif key == "blas" and isinstance(value, list):
            value = "; ".join(" ".join(str(part) for part in entry if part not in (None, "None")) + " threads"
                              for entry in value if isinstance(entry, list)) or None
        elif key == "gpu" and isinstance(value, dict):
            value = gpu_text(value)
        elif key == "libraries" and isinstance(value, dict):
            value = ", ".join(f"{name} {version}" for name, version in sorted(value.items()) if version) or "none"
        elif key == "native_builds" and isinstance(value, dict):
            value = ", ".join(f"{name} {str(digest)[:12]}…" for name, digest in sorted(value.items())) or "none"
        elif isinstance(value, (dict, list)):
            value = json.dumps(value, sort_keys=True)
        if value is not None and value != "":
            rows.append((key.replace("_", " "), str(value)))
    tokenizer = envelope.get("tokenizer") or {}
    for key, label in (("tokenizer_json_sha256", "tokenizer.json"), ("chat_template_sha256", "chat template")):
        if tokenizer.get(key):
            rows.append((label, f"sha256 {str(tokenizer[key])[:16]}…"))
    return rows


def _route_rows(routes) -> list[dict]:
    rows = []
    for route in routes if isinstance(routes, list) else []:
        if not isinstance(route, dict):
            continue
        outcome = route.get("outcome") if isinstance(route.get("outcome"), dict) else {}
        rows.append({"route": str(route.get("route", "?")), "passed": route.get("passed") is True,
                     "mismatches": [str(m) for m in route.get("mismatches") or []],
                     "seconds": route.get("seconds"), "cancelled_at": route.get("cancelled_at"),
                     "steps": outcome.get("steps"), "seed": route.get("seed")})
    return rows


def _created(text) -> datetime | None:
    try:
        return datetime.strptime(str(text), "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc)
    except ValueError:
        return None


def read_receipt(path, backend: str) -> QualificationReceipt:
    receipt = QualificationReceipt(backend=backend, path=str(path))
    prefix = f"receipt-{backend}-"  # then the time (receipt-cuda-bfloat16-... is another precision's)
    receipt.earlier = sum(1 for p in path.parent.glob(f"{prefix}*.json") if p.name[len(prefix):][:1].isdigit())
    try:
        document = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        receipt.error = f"unreadable: {getattr(exc, 'strerror', None) or exc}"
        return receipt
    if not isinstance(document, dict) or document.get("schema") != RECEIPT_SCHEMA:
        receipt.error = f"not a {RECEIPT_SCHEMA} receipt"
        return receipt
    receipt.passed = document.get("passed") is True
    receipt.created = _created(document.get("created"))
    receipt.routes = _route_rows(document.get("routes"))
    receipt.envelope = _envelope_rows(document.get("envelope") if isinstance(document.get("envelope"), dict) else {})
    receipt.note = str(document.get("note") or "")
    return receipt


def qualification_receipts() -> list[QualificationReceipt]:
    """The latest receipt per backend, cpu first; none when `kiln qualify` has not run on this KILN_HOME."""
    folder = settings.KILN_HOME / "qualification"
    try:
        paths = sorted(folder.glob("latest-*.json"))
    except OSError:
        return []
    receipts = [read_receipt(path, path.name[len("latest-"):-len(".json")]) for path in paths]
    return sorted(receipts, key=lambda r: (r.backend != "cpu", r.backend))
