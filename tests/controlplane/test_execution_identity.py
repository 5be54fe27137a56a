"""The execution identity is computed by the process that trains (trainer.runs.execution): its fields, its
stability, what changes it; a worker registers it (WorkerRecord), a claim binds it to the job, checkpoints
record it, and a resume dequeued by a worker of another identity ends `execution_drift` with the table."""

import json
from importlib import metadata

import pytest
from threadpoolctl import threadpool_limits

from kiln_web.jobs import actions, runtime
from kiln_web.jobs.models import JobStatus, TrainingJob, WorkerRecord
from kiln_web.jobs.worker import EmbeddedWorker
from trainer.runs import checkpoint_dir, execution, sft

from .conftest import sft_body


# -- the identity function (no database) --


def test_the_identity_names_every_field_with_the_installed_kiln_version():
    identity = execution.compute_execution_identity("cpu")
    assert set(identity) == {"backend", "device", "python", "numpy", "libraries", "blas", "native_builds", "kiln",
                             "code", "precision", "kernel_contract"}
    # tokenisation, chat templates and the adapter files: an upgrade of one alone can change a run's bytes
    assert identity["libraries"] == {name: metadata.version(name) for name in ("tokenizers", "jinja2", "safetensors")}
    assert identity["backend"] == "cpu"
    assert identity["kiln"] == metadata.version("kiln") and identity["kiln"] != "0"
    assert set(identity["device"]) == {"machine", "cpu_model", "cpu_flags", "cpu_flags_sha256"}
    if execution.CPUINFO.exists():
        assert identity["device"]["cpu_model"] and len(identity["device"]["cpu_flags_sha256"]) == 64
    assert identity["blas"]["library"] and isinstance(identity["blas"]["threads"], int)
    assert identity["native_builds"] and all(len(v) == 64 for v in identity["native_builds"].values())
    assert len(identity["code"]["sha256"]) == 64 and identity["code"]["files"] > 20
    json.dumps(identity, allow_nan=False)  # it goes into manifests and the job row as JSON


def test_the_identity_is_stable_and_cached_per_process():
    first, second = execution.compute_execution_identity("cpu"), execution.compute_execution_identity("cpu")
    assert first == second
    cached = execution.execution_identity("cpu")
    snapshot = json.loads(json.dumps(cached))
    cached["backend"] = "changed by the caller"  # a copy: the process's identity cannot be altered
    assert execution.execution_identity("cpu") == snapshot
    assert execution.execution_identity("cuda")["backend"] == "cuda"


def test_the_identity_changes_with_the_blas_thread_count():
    # every pool: numpy's OpenBLAS, and the OpenMP oneDNN computes on where it computes the float32 products
    with threadpool_limits(limits=1):
        one = execution.compute_execution_identity("cpu")
    with threadpool_limits(limits=2):
        two = execution.compute_execution_identity("cpu")
    assert one["blas"]["threads"] == 1 and two["blas"]["threads"] == 2
    assert one != two and {k: v for k, v in one.items() if k != "blas"} == {k: v for k, v in two.items()
                                                                            if k != "blas"}


def test_the_code_digest_covers_sources_and_libraries_in_a_fixed_order(tmp_path):
    root = tmp_path / "trainer"
    (root / "runs").mkdir(parents=True)
    (root / "__pycache__").mkdir()
    (root / "runs" / "b.py").write_text("B = 1\n")
    (root / "a.py").write_text("A = 1\n")
    (root / "_k.so").write_bytes(b"\x7fELF built")
    (root / "notes.txt").write_text("not code")
    before = execution.code_digest([root])
    assert before["files"] == 3
    (root / "__pycache__" / "a.cpython-311.pyc").write_bytes(b"cache")
    (root / "notes.txt").write_text("still not code")
    assert execution.code_digest([root]) == before
    (root / "runs" / "b.py").write_text("B = 2\n")
    assert execution.code_digest([root])["sha256"] != before["sha256"]
    (root / "runs" / "b.py").write_text("B = 1\n")
    (root / "_k.so").write_bytes(b"\x7fELF rebuilt")
    assert execution.code_digest([root])["sha256"] != before["sha256"]


def test_the_device_evidence_comes_from_cpuinfo(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: Example CPU 9000\nflags\t\t: fpu sse4_2 avx2 avx fma\n\n"
                       "processor\t: 1\nmodel name\t: Example CPU 9000\nflags\t\t: fpu sse4_2 avx2 avx fma\n")
    device = execution.device_identity(cpuinfo)
    assert device["cpu_model"] == "Example CPU 9000"
    assert device["cpu_flags"] == ["sse4_2", "avx", "avx2", "fma"]
    cpuinfo.write_text("model name\t: Example CPU 9000\nflags\t\t: fpu sse4_2 avx2 avx fma avx512f\n")
    other = execution.device_identity(cpuinfo)
    assert other["cpu_flags_sha256"] != device["cpu_flags_sha256"] and "avx512f" in other["cpu_flags"]
    missing = execution.device_identity(tmp_path / "absent")
    assert missing["machine"] and missing["cpu_model"] is None and missing["cpu_flags"] is None


# -- the worker registry and the claim --


@pytest.mark.django_db
def test_a_worker_registers_its_identity_beats_and_stops(fake_runner):
    worker = EmbeddedWorker(poll_seconds=0.01)
    worker._register()
    record = WorkerRecord.objects.get(worker_id=worker.worker_id)
    assert record.identity == runtime.execution_identity() == worker.identity
    assert record.identity_sha256 == actions.identity_sha256(record.identity)
    assert worker.worker_id in set(actions.live_workers().values_list("worker_id", flat=True))
    assert actions.do_worker_heartbeat(worker.worker_id) and not actions.do_worker_heartbeat("never-registered")
    actions.do_worker_stopped(worker.worker_id)
    assert worker.worker_id not in set(actions.live_workers().values_list("worker_id", flat=True))


@pytest.mark.django_db
def test_the_claim_binds_the_workers_identity_to_the_job(fake_runner, api, adapter_name):
    response = api.post("/v1/train/sft", sft_body(adapter_name))
    assert response.status_code == 201, response.content
    job_id = response.json()["id"]
    worker_identity = {"backend": "cpu", "blas": {"threads": 7}, "kiln": "9.9.9"}
    assert actions.do_claim_job(job_id, "worker-x", execution=worker_identity)
    job = TrainingJob.objects.get(pk=job_id)
    assert job.identities["execution"] == worker_identity
    assert job.admission["identities"]["execution"] == worker_identity
    assert api.get(f"/v1/train/jobs/{job_id}").json()["identities"]["execution"] == worker_identity


# -- a resume dequeued by a worker of another identity (the real SFT run) --


@pytest.fixture
def real_runner(settings):
    settings.KILN_SFT_RUNNER = "trainer.runs.sft"
    settings.KILN_HEARTBEAT_SECONDS = 3600
    settings.KILN_CANCEL_POLL_SECONDS = 0  # the run reads the status at every boundary
    return settings


def _run_next(monkeypatch, identity=None, cancel_at_step=None) -> None:
    """Run the next queued job in a worker whose identity is IDENTITY (default: this process's), cancelled
    (as `kiln train cancel` does) once it has committed CANCEL_AT_STEP."""
    with monkeypatch.context() as patch:
        if identity is not None:
            patch.setattr(runtime, "execution_identity", lambda: identity)
        if cancel_at_step is not None:
            record = actions.do_record_step

            def record_then_cancel(job_id, worker_id, metrics):
                recorded = record(job_id, worker_id, metrics)
                if metrics["step"] == cancel_at_step:
                    actions.do_cancel_job(job_id, reason="cancelled by the test")
                return recorded

            patch.setattr(actions, "do_record_step", record_then_cancel)
        assert EmbeddedWorker().run_once()


@pytest.mark.slow
@pytest.mark.django_db
def test_a_checkpoint_resumes_only_under_the_identity_that_wrote_it(real_runner, api, adapter_name, monkeypatch):
    body = sft_body(adapter_name, records=4, epochs=1, batch_size=1, checkpoint_interval=2, seed=5)
    response = api.post("/v1/train/sft", body)
    assert response.status_code == 201, response.content
    _run_next(monkeypatch, cancel_at_step=2)
    first = api.get(f"/v1/train/jobs/{response.json()['id']}").json()
    assert first["status"] == "cancelled", first["error"]
    own = runtime.execution_identity()
    assert first["identities"]["execution"] == own
    basename = f"{adapter_name}-checkpoint-step-00000002.kiln-checkpoint"
    manifest = checkpoint_dir.load_checkpoint(real_runner.KILN_ADAPTERS_DIR / basename, full=False,
                                              allowed_manifest_fields=sft.MANIFEST_FIELDS).manifest
    assert manifest["execution"] == own  # the worker's identity, with the installed Kiln version
    assert manifest["execution"]["kiln"] == metadata.version("kiln")

    resume = {**body, "config": {**body["config"], "resume_checkpoint": basename}}
    other = {**own, "blas": {**own["blas"], "threads": own["blas"]["threads"] + 1}}
    refused = api.post("/v1/train/sft", resume)
    assert refused.status_code == 201, refused.content  # admission leaves the identity to the worker
    _run_next(monkeypatch, identity=other)
    job = TrainingJob.objects.get(pk=refused.json()["id"])
    assert job.status == JobStatus.FAILED and job.error_code == "execution_drift", job.error_message
    assert job.error_details["differences"] == [{"field": "execution.blas.threads",
                                                 "checkpoint": own["blas"]["threads"],
                                                 "request": own["blas"]["threads"] + 1}]
    assert "execution.blas.threads" in job.error_message
    assert job.committed_step == 2 and not job.metrics.exists()  # refused before any step
    assert job.identities["execution"] == other
    shown = api.get(f"/v1/train/jobs/{job.pk}").json()["error"]
    assert shown["code"] == "execution_drift" and shown["details"]["differences"][0]["field"] == \
        "execution.blas.threads"

    admitted = api.post("/v1/train/sft", resume)
    assert admitted.status_code == 201, admitted.content
    _run_next(monkeypatch)
    resumed = api.get(f"/v1/train/jobs/{admitted.json()['id']}").json()
    assert resumed["status"] == "succeeded", resumed["error"]
    assert resumed["progress"]["committed_step"] == 4


def test_a_checkpoint_from_another_tokenizers_release_is_execution_drift():
    """Upgrading tokenizers (or jinja2, safetensors) alone can change the token ids a run trains on: a checkpoint
    whose identity names another release is refused, the field named, as any other drift."""
    from trainer.runs import admission

    identity = execution.compute_execution_identity("cpu")
    older = {**identity, "libraries": {**identity["libraries"], "tokenizers": "0.0.1"}}
    with pytest.raises(admission.AdmissionError) as refused:
        admission.refuse_execution_drift(older, identity)
    assert refused.value.code == "execution_drift"
    assert refused.value.differences == [{"field": "execution.libraries.tokenizers", "checkpoint": "0.0.1",
                                          "request": identity["libraries"]["tokenizers"]}]
