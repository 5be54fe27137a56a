"""Backend selection (issue #17): `auto`, `cpu` or `cuda` resolved from capabilities (the CUDA loader's probe and a
cuda qualification receipt), never from names; the resolved backend and why on the job; `cuda` without a device
refused (backend_unavailable, the loader's reason) through the API, the CLI and the dashboard form, and at dequeue;
a resume on another backend refused with the drift table; the cuda execution identity's GPU fields; the cpu
identity unchanged.

No test needs a GPU: native_ext.cuda.probe is replaced where a device must seem present (or absent with a known
reason), a checkpoint written on cuda comes from the host emulation of the CUDA library (tests/engine/conftest.py's
cuda_environment), and one refusal carries the real loader's reason on this machine."""

import copy
import hashlib
import json
import re
import sys
import types

import pytest

import native_ext
from kiln_web.cli import main
from kiln_web.jobs import runtime
from kiln_web.jobs.models import JobStatus, TrainingJob
from kiln_web.jobs.worker import EmbeddedWorker
from tests.engine.conftest import cuda_environment, emulated_library  # noqa: F401  (fixtures used here)
from trainer.runs import admission, backend, checkpoint_dir, execution
from trainer.runs.defaults import DEFAULTS

from .conftest import cli_runner, sft_body
from .rl_data import PROMPTS, grpo_inline, opd_request

NO_DRIVER = "libcuda.so.1 cannot be opened (no NVIDIA driver in this test)"
DEVICE = {"index": 0, "name": "Test Accelerator", "compute_capability": "9.0", "total_memory": 80 << 30,
          "free_memory": 79 << 30, "shared_memory_per_block": 227 << 10}
AVAILABLE = {"library": "/opt/kiln/libkiln_cuda.so", "library_sha256": "ab" * 32,
             "symbols": {"declared": 12, "resolved": 12, "missing": []}, "available": True, "reason": None,
             "code": None, "devices": [DEVICE], "driver_version": "12040", "runtime_version": "12020",
             "cublas_version": "120201"}
UNAVAILABLE = {"library": None, "library_sha256": None, "symbols": {"declared": 12, "resolved": 0, "missing": []},
               "available": False, "reason": NO_DRIVER, "code": "driver_missing", "devices": [],
               "driver_version": None, "runtime_version": None, "cublas_version": None}
# the cpu execution identity's fields, as every checkpoint written before backend selection records them
CPU_FIELDS = {"backend", "device", "python", "numpy", "libraries", "blas", "native_builds", "kiln", "code",
              "precision", "kernel_contract"}
GPU_FIELDS = {"name", "compute_capability", "total_memory", "shared_memory_per_block", "tf32_override",
              "driver_version", "runtime_version", "cublas_version", "library_sha256"}


@pytest.fixture
def probe(monkeypatch):
    """set(result): native_ext.cuda.probe answers RESULT (a fake loader module when the real one is absent).
    The per-process caches (the identity, a static absence) are emptied before and after, so no fake device (or
    fake absence) outlives the test."""
    try:
        from native_ext import cuda as module
    except ImportError:
        module = types.ModuleType("native_ext.cuda")
        monkeypatch.setitem(sys.modules, "native_ext.cuda", module)
        monkeypatch.setattr(native_ext, "cuda", module, raising=False)
    calls = []

    caches = (execution._cached, backend._absent_for_this_process)

    def set_result(result):
        def fake_probe(min_capability=(8, 0), isolated=False):
            calls.append(min_capability)
            return copy.deepcopy(result)
        monkeypatch.setattr(module, "probe", fake_probe, raising=False)
        for cache in caches:  # a new answer of the loader, as a fresh process would see it
            cache.cache_clear()

    set_result.calls = calls
    for cache in caches:
        cache.cache_clear()
    yield set_result
    for cache in caches:
        cache.cache_clear()


def write_receipt(home, precision=None, **changes):
    """A cuda qualification receipt for this process's cuda envelope at PRECISION (as `kiln qualify --backend cuda
    [--precision P]` writes)."""
    identity = execution.with_precision(execution.compute_execution_identity("cuda"), precision)
    receipt = {"schema": backend.RECEIPT_SCHEMA, "passed": True, "backend": "cuda", "failures": [],
               "envelope": {"execution": identity}, "routes": [], "created": "2026-12-01T00:00:00Z"}
    receipt.update(changes)
    path = backend.receipt_path(home, precision)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(receipt))
    return path


def resolve(requested, home, default="auto", need_bytes=None):
    return admission.choose_backend(requested, default, home, need_bytes)


# -- resolution (no database) --


def test_every_workload_resolves_to_cuda_with_a_device(probe, tmp_path):
    """Training runs, evaluations and serving all compute on cuda in this build: with a device (and, for auto, a
    receipt) each resolves to cuda and a run's recheck passes; the device alone decides."""
    probe(AVAILABLE)
    write_receipt(tmp_path)
    assert admission.choose_backend("cuda", "auto", tmp_path).resolved == "cuda"
    assert admission.choose_backend("auto", "auto", tmp_path).resolved == "cuda"
    assert admission.select_loss_route("cuda", AVAILABLE) == "kt_tape_flce"
    admission.require_loss_route("kt_tape_flce", "cuda")  # a run's own recheck before it allocates
    backend.require_cuda()  # a worker's dequeue check


def test_auto_picks_cpu_on_this_machine_and_says_why(tmp_path):
    choice = resolve(None, tmp_path)
    assert choice.requested == "auto" and choice.resolved == "cpu"
    # here: the loader finds no device (or, on a machine with one, no receipt qualifies it in this fresh home)
    assert re.match(r"auto: cuda (unavailable|not qualified): \S", choice.reason), choice.reason


def test_auto_picks_cuda_with_a_device_and_a_passing_receipt_for_this_envelope(probe, tmp_path):
    probe(AVAILABLE)
    write_receipt(tmp_path)
    choice = resolve(None, tmp_path)
    assert (choice.requested, choice.resolved) == ("auto", "cuda"), choice.reason
    assert probe.calls and probe.calls[0] == (8, 0)  # the loader is asked for the kernels' capability floor
    assert resolve("cpu", tmp_path).resolved == "cpu"  # asked for: no probe decides it


def test_auto_stays_on_cpu_without_a_receipt_for_this_exact_envelope(probe, tmp_path):
    probe(AVAILABLE)
    choice = resolve("auto", tmp_path)
    assert choice.resolved == "cpu" and "no qualification receipt" in choice.reason
    assert "kiln qualify --backend cuda" in choice.reason
    write_receipt(tmp_path, passed=False)
    assert "failed" in resolve("auto", tmp_path).reason
    other = execution.compute_execution_identity("cuda")
    other["gpu"]["driver_version"] = "11080"
    write_receipt(tmp_path, envelope={"execution": other})
    choice = resolve("auto", tmp_path)
    assert choice.resolved == "cpu" and "execution.gpu.driver_version" in choice.reason
    write_receipt(tmp_path)
    assert resolve("auto", tmp_path).resolved == "cuda"


def test_auto_decides_on_capabilities_never_on_names(probe, tmp_path):
    old = {**AVAILABLE, "devices": [{**DEVICE, "name": "Test Accelerator H200", "compute_capability": "7.5"}]}
    probe(old)
    choice = resolve("auto", tmp_path)
    assert choice.resolved == "cpu" and "compute capability >= 8.0" in choice.reason
    probe({**AVAILABLE, "devices": [{**DEVICE, "name": "anything at all"}]})
    write_receipt(tmp_path)
    assert resolve("auto", tmp_path).resolved == "cuda"
    small = resolve("auto", tmp_path, need_bytes=(79 << 30) + 1)  # more than the device has free
    assert small.resolved == "cpu" and "bytes free" in small.reason


def test_cuda_without_a_device_is_refused_with_the_loaders_reason(probe, tmp_path):
    probe(UNAVAILABLE)
    with pytest.raises(backend.BackendUnavailable) as refused:
        resolve("cuda", tmp_path)
    assert refused.value.code == "backend_unavailable" and NO_DRIVER in str(refused.value)
    with pytest.raises(backend.BackendUnavailable):
        resolve(None, tmp_path, default="cuda")  # the server's KILN_TRAINING_BACKEND=cuda likewise
    assert resolve(None, tmp_path).reason == f"auto: cuda unavailable: {NO_DRIVER}"
    with pytest.raises(ValueError):
        resolve("tpu", tmp_path)


def test_a_static_absence_is_probed_once_per_process_and_a_library_is_probed_in_a_fresh_interpreter(
        probe, monkeypatch, tmp_path):
    from native_ext import cuda

    seen = []
    monkeypatch.setattr(cuda, "probe", lambda min_capability=(8, 0), isolated=False: seen.append(isolated) or
                        copy.deepcopy(UNAVAILABLE))
    monkeypatch.setattr(cuda, "library_path", lambda: None)
    assert backend.probe_cuda()["code"] == backend.probe_cuda()["code"] == "driver_missing"
    assert seen == [False]  # no driver: it cannot appear while this process lives; nothing to load: in process
    backend._absent_for_this_process.cache_clear()
    library = tmp_path / "libkiln_cuda.so"
    library.write_bytes(b"\x7fELF")
    monkeypatch.setattr(cuda, "library_path", lambda: library)
    monkeypatch.setattr(cuda, "probe", lambda min_capability=(8, 0), isolated=False: seen.append(isolated) or
                        {**UNAVAILABLE, "code": "no_device", "reason": "no GPU visible"})
    assert backend.probe_cuda()["reason"] == backend.probe_cuda()["reason"] == "no GPU visible"
    assert seen[1:] == [True] * 3  # probed again each time, never initialising CUDA in this process


def test_the_loss_route_follows_backend_and_capabilities(probe):
    assert admission.select_loss_route("cpu") == "kt_tape_flce"  # as before backend selection
    assert admission.BACKEND_LOSS_ROUTES["cpu"] == ("kt_tape_flce", "full_logits")
    assert admission.select_loss_route("cuda", AVAILABLE) == "kt_tape_flce"  # the chunked fused route
    with pytest.raises(admission.AdmissionError) as refused:
        admission.select_loss_route("cuda", UNAVAILABLE)
    assert refused.value.code == "backend_unavailable" and NO_DRIVER in refused.value.message
    probe(UNAVAILABLE)
    with pytest.raises(admission.AdmissionError):
        admission.require_loss_route("kt_tape_flce", "cuda")  # the trainer's recheck before allocation
    admission.require_loss_route("full_logits", "cpu")


def test_backend_is_a_request_field_of_every_kind_bound_by_the_execution_identity():
    assert all(DEFAULTS[kind]["backend"] is None for kind in ("sft", "grpo", "opd"))
    config = {"output_name": "x", "backend": "cpu", "seed": 3, "resume_checkpoint": "c", "epochs": 1}
    assert admission.comparable_config(config) == {"output_name": "x", "epochs": 1}  # manifests as before


# -- the execution identity --


def test_the_cuda_identity_carries_the_gpu_fields(probe, monkeypatch):
    monkeypatch.delenv("NVIDIA_TF32_OVERRIDE", raising=False)
    probe(AVAILABLE)
    identity = execution.compute_execution_identity("cuda")
    assert set(identity) == CPU_FIELDS | {"gpu"}
    assert identity["backend"] == "cuda" and identity["kernel_contract"] == "kiln-cuda-kernels-v1"
    assert identity["gpu"] == {"name": "Test Accelerator", "compute_capability": "9.0", "total_memory": 80 << 30,
                               "shared_memory_per_block": 227 << 10, "tf32_override": None, "driver_version": "12040",
                               "runtime_version": "12020", "cublas_version": "120201", "library_sha256": "ab" * 32}
    assert execution.execution_identity("cuda") == identity  # kept once the device is found
    monkeypatch.setenv("NVIDIA_TF32_OVERRIDE", "0")  # cuBLAS then computes a tfloat32 run's products in FP32
    assert execution.compute_execution_identity("cuda")["gpu"] == {**identity["gpu"], "tf32_override": "0"}
    probe(UNAVAILABLE)
    assert execution.compute_execution_identity("cuda")["gpu"] == dict.fromkeys(GPU_FIELDS)


def test_the_cpu_identity_is_unchanged_whatever_the_loader_finds(probe):
    before = execution.compute_execution_identity("cpu")
    assert set(before) == CPU_FIELDS and before["kernel_contract"] == "kiln-cpu-kernels-v1"
    probe(AVAILABLE)
    assert execution.compute_execution_identity("cpu") == before
    assert execution.execution_identity("cpu") == before


# -- through the API, the worker, the CLI and the dashboard (the real SFT admission) --


@pytest.fixture
def real_sft(settings):
    settings.KILN_SFT_RUNNER = "trainer.runs.sft"
    settings.KILN_HEARTBEAT_SECONDS = 3600
    settings.KILN_CANCEL_POLL_SECONDS = 0
    return settings


@pytest.mark.django_db
def test_the_api_records_the_resolved_backend_and_why(real_sft, api, adapter_name, probe):
    probe(UNAVAILABLE)
    response = api.post("/v1/train/sft", sft_body(adapter_name, records=2, seed=1))
    assert response.status_code == 201, response.content
    job = response.json()
    assert job["effective_config"]["backend"] == "cpu"
    assert job["identities"]["backend"] == {"requested": "auto", "resolved": "cpu",
                                            "reason": f"auto: cuda unavailable: {NO_DRIVER}"}
    assert job["identities"]["execution"]["backend"] == "cpu" and "gpu" not in job["identities"]["execution"]
    events = api.get(f"/v1/train/jobs/{job['id']}/events").json()["items"]
    assert any(f"backend cpu (auto: cuda unavailable: {NO_DRIVER})" in e["message"] for e in events)


@pytest.mark.django_db
def test_the_api_refuses_cuda_without_a_device(real_sft, api, adapter_name, probe):
    probe(UNAVAILABLE)
    response = api.post("/v1/train/sft", sft_body(adapter_name, records=2, backend="cuda"))
    assert response.status_code == 400, response.content
    error = response.json()["error"]
    assert error["code"] == "backend_unavailable" and NO_DRIVER in error["message"]
    assert not TrainingJob.objects.exists()
    real_sft.KILN_TRAINING_BACKEND = "cuda"  # the server's default, when the request does not say
    refused = api.post("/v1/train/sft", sft_body(adapter_name, records=2))
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "backend_unavailable"
    bad = api.post("/v1/train/sft", sft_body(adapter_name, records=2, backend="gpu"))
    assert bad.status_code in (400, 422)
    evaluation = api.post("/v1/evals/runs", {"adapter": adapter_name, "suite": "any", "backend": "cuda"})
    assert evaluation.status_code == 400, evaluation.content
    assert evaluation.json()["error"]["code"] == "backend_unavailable"
    assert NO_DRIVER in evaluation.json()["error"]["message"]


def rl_body(api, kind, adapter, **config) -> dict:
    """A GRPO request (inline groups) or an OPD one (with a native teacher alias over kiln-tiny) for ADAPTER."""
    if kind == "grpo":
        return grpo_inline(adapter, **config)
    teacher = api.post("/v1/teachers", {"name": "tutor@native", "base": "kiln-tiny"})
    assert teacher.status_code == 201, teacher.content
    return opd_request(adapter, "tutor@native", **config)


@pytest.mark.django_db
@pytest.mark.parametrize("kind", ["grpo", "opd"])
def test_the_api_refuses_grpo_and_opd_on_cuda_without_a_device(api, adapter_name, probe, kind):
    probe(UNAVAILABLE)
    body = rl_body(api, kind, adapter_name, backend="cuda")
    response = api.post(f"/v1/train/{kind}", body)
    assert response.status_code == 400, response.content
    error = response.json()["error"]
    assert error["code"] == "backend_unavailable" and NO_DRIVER in error["message"]
    assert "ask for backend cpu or auto" in error["message"]
    assert not TrainingJob.objects.exists()
    cpu = api.post(f"/v1/train/{kind}", {**body, "config": {**body["config"], "backend": "cpu"}})
    assert cpu.status_code == 201, cpu.content  # the same request is otherwise admissible
    assert cpu.json()["effective_config"]["backend"] == "cpu"


@pytest.mark.django_db
def test_the_api_refusal_carries_the_real_loaders_reason_on_this_machine(api, adapter_name, monkeypatch):
    """No fake: whatever the CUDA loader reports here is what a cuda GRPO or OPD request is refused with."""
    from native_ext import cuda

    monkeypatch.delenv(cuda.ENVIRONMENT_VARIABLE, raising=False)
    caches = (execution._cached, backend._absent_for_this_process)
    for cache in caches:
        cache.cache_clear()
    try:
        real = cuda.probe(min_capability=backend.MIN_CAPABILITY, isolated=True)  # CUDA stays out of this process
        if real["available"]:
            pytest.skip("the loader finds a usable GPU here: nothing to refuse")
        assert real["reason"] and real["code"] in cuda.CODES
        for kind in ("grpo", "opd"):
            response = api.post(f"/v1/train/{kind}", rl_body(api, kind, f"{adapter_name}-{kind}", backend="cuda"))
            assert response.status_code == 400, response.content
            error = response.json()["error"]
            assert error["code"] == "backend_unavailable", error
            assert f"backend cuda is unavailable here: {real['reason']}" in error["message"], (real, error)
        assert not TrainingJob.objects.exists()
    finally:
        for cache in caches:
            cache.cache_clear()


ARCHITECTURE = dict(vocabulary_size=512, maximum_context=256, model_width=64, head_count=4, kv_head_count=2,
                    block_count=2, feed_forward_width=128)
LORA = {"rank": 8, "alpha": 16, "targets": ["q_proj", "v_proj"], "use_rslora": False}


def test_the_planned_need_is_what_the_device_models_allocate_plus_the_cuda_context():
    """admission.planned_device_bytes maps the request onto trainer.cuda_model.planned_device_bytes (which
    tests/engine/test_cuda_model.py holds to the device model's real allocations) and adds the CUDA context's
    allowance once: SFT's micro-batch of batch_size sequences of max_sequence_length tokens, capped by the base's
    context; GRPO's whole group (a row a completion, the prompt and the longest completion) as its admission reads
    it, growing with the group's size and its prompt; OPD's sampling (KV cache and prefill), its scoring logits and
    its step over the longest prompt and max_new_tokens, the prompt at its bound when unknown, and a native
    teacher's own device model (its weights and the gradient buffers a dense device model holds, its forward and
    logits); the adapters and the NF4 base as the request shapes them."""
    from trainer import DecoderOnlyTransformer, LoraConfig, TransformerConfig
    from trainer.cuda_model import planned_device_bytes
    from trainer.runs import device_plan

    context = device_plan.CUDA_CONTEXT_BYTES
    assert 256 << 20 <= context <= 1 << 30  # the CUDA context and cuBLAS's own memory: a few hundred MiB
    base = types.SimpleNamespace(name="described", config=ARCHITECTURE, parameter_count=1)
    model = TransformerConfig(**ARCHITECTURE, loss_route="kt_tape_flce", loss_chunk_tokens=max(64, (64 << 20) // 2048))
    shaped = LoraConfig(rank=8, alpha=16, targets=("q_proj", "v_proj"))
    nf4 = {"type": "nf4", "block_size": 64, "double_quantization": False}
    sft = {"batch_size": 4, "max_sequence_length": 100, "lora": LORA}
    assert admission.planned_device_bytes(sft, base) == context + planned_device_bytes(model, 4, 100, shaped)
    assert admission.planned_device_bytes({**sft, "max_sequence_length": 4096}, base) == \
        context + planned_device_bytes(model, 4, 256, shaped)  # no sequence is longer than the base's context
    assert admission.planned_device_bytes({**sft, "quantization": nf4}, base) == \
        context + planned_device_bytes(model, 4, 100, shaped, nf4) != admission.planned_device_bytes(sft, base)
    assert admission.planned_device_bytes({**sft, "batch_size": 8}, base) > admission.planned_device_bytes(sft, base)

    grpo = {"max_completion_length": 60, "lora": LORA}
    unknown = admission.planned_device_bytes(grpo, base)  # no configuration field bounds a group's size
    assert isinstance(unknown, device_plan.Unplannable) and "whole group" in unknown.reason
    group = device_plan.grpo_bytes(grpo, base, (3, 70))  # three completions after a prompt: 70 positions
    assert group == context + planned_device_bytes(model, 3, 70, shaped) > \
        context + planned_device_bytes(model, 1, 60, shaped)  # the old floor: one completion, no prompt
    assert device_plan.grpo_bytes(grpo, base, (6, 70)) > group < device_plan.grpo_bytes(grpo, base, (3, 120))
    assert device_plan.grpo_bytes(grpo, base, (3, 4096)) == context + planned_device_bytes(model, 3, 256, shaped)

    opd = {"max_new_tokens": 30, "lora": LORA, "teacher": {"route": "openai"}}  # an endpoint holds nothing here
    student = device_plan.opd_bytes(opd, base, 20)
    assert student == context + planned_device_bytes(model, 1, 49, shaped, logits=True, sampling=(20, 50))
    assert admission.planned_device_bytes(opd, base) == device_plan.opd_bytes(opd, base, 255) == \
        context + planned_device_bytes(model, 1, 255, shaped, logits=True, sampling=(255, 256))  # the bound
    assert student > context + planned_device_bytes(model, 1, 30, shaped)  # the old floor: max_new_tokens only
    native = {**opd, "teacher": {"route": "native"}}
    teacher_architecture = {**ARCHITECTURE, "model_width": 128, "feed_forward_width": 256}
    teacher = types.SimpleNamespace(name="teacher", config=teacher_architecture)
    with_teacher = device_plan.opd_bytes(native, base, 20, (teacher, None))
    teacher_model = TransformerConfig(**teacher_architecture)
    assert with_teacher - student == planned_device_bytes(teacher_model, 1, 49, training=False, logits=True)
    weights = DecoderOnlyTransformer(teacher_model)
    try:
        teacher_bytes = 4 * sum(value.size for value in weights.fp32_state_dict().values())
    finally:
        weights.close()
    assert with_teacher - student > 2 * teacher_bytes  # its weights and a dense device model's gradient buffers
    assert device_plan.opd_bytes(native, base, 20, (teacher, shaped)) < with_teacher  # an adapter: no dense grads
    assert isinstance(device_plan.opd_bytes(native, base, 20), device_plan.Unplannable)  # the teacher not given


def test_a_run_whose_device_memory_cannot_be_planned_is_never_sent_to_cuda(probe, tmp_path):
    """Fail closed: a base that does not describe its architecture plans an Unplannable need, so an explicit cuda
    request is refused (backend_unavailable, saying why) and auto resolves to cpu with that reason, on a device
    that would take the same request over a described base."""
    probe(AVAILABLE)
    write_receipt(tmp_path)
    settings = admission.RunSettings(home=tmp_path, registry=tmp_path / "adapters", bases_root=tmp_path,
                                     backend="auto")
    request = {"batch_size": 1, "max_sequence_length": 64, "lora": LORA}
    undescribed = types.SimpleNamespace(name="opaque-gguf", config={}, parameter_count=1000)
    why = "base opaque-gguf does not describe its architecture, so its device memory cannot be planned"
    with pytest.raises(admission.AdmissionError) as refused:
        admission.admit_backend({**request, "backend": "cuda"}, settings, undescribed)
    assert refused.value.code == "backend_unavailable" and why in refused.value.message, refused.value.message
    config = dict(request)
    choice = admission.admit_backend(config, settings, undescribed)  # the server's default: auto
    assert (choice.requested, choice.resolved) == ("auto", "cpu") and why in choice.reason, choice.reason
    assert config["backend"] == "cpu"
    described = types.SimpleNamespace(name="described", config=ARCHITECTURE, parameter_count=1)
    assert admission.admit_backend(dict(request), settings, described).resolved == "cuda"
    assert admission.admit_backend({**request, "backend": "cuda"}, settings, described).resolved == "cuda"
    from trainer.runs import device_plan
    assert device_plan.record(admission.planned_device_bytes(request, undescribed)) == \
        {"bytes": None, "unplannable": why}
    unknown_free = copy.deepcopy(AVAILABLE)  # a device whose free memory the probe could not read
    for device in unknown_free["devices"]:
        device.pop("free_memory", None)
    probe(unknown_free)
    assert backend.cuda_unavailable(backend.probe_cuda(), admission.planned_device_bytes(request, undescribed)) == \
        f"the run's device memory cannot be planned: {why}"
    assert backend.cuda_unavailable(backend.probe_cuda(), admission.planned_device_bytes(request, described)) is None


def _free(nbytes: int) -> dict:
    """The loader's probe with a device that has NBYTES free."""
    return {**AVAILABLE, "devices": [{**DEVICE, "free_memory": nbytes}]}


@pytest.mark.django_db
def test_grpo_plans_its_largest_group_and_cuda_is_refused_when_that_does_not_fit(api, adapter_name, probe,
                                                                                  settings):
    """GRPO's micro-batch is a whole group: the admitted plan (identities.device_plan) is a training step over
    the largest group's rows (its completions) of prompt and longest completion, grows with the group's size and
    its prompt, and a device with a byte less free than it refuses an explicit cuda request."""
    from trainer.bases import show_base
    from trainer.runs import device_plan, grpo
    from trainer.runs.tokenizers import load_tokenizer

    def admitted(groups, name):
        body = grpo_inline(f"{adapter_name}-{name}", backend="cpu")
        response = api.post("/v1/train/grpo", {**body, "groups": groups})
        assert response.status_code == 201, response.content
        return response.json()

    groups = grpo_inline("x")["groups"]
    job = admitted(groups, "three")
    need, config = job["identities"]["device_plan"]["bytes"], job["effective_config"]
    tokenizer = load_tokenizer("kiln-tiny", settings.KILN_HOME)
    shapes = [grpo.group_shape(*grpo.tokenize_group(group, tokenizer, config, 512, "g")) for group in groups]
    assert {rows for rows, _ in shapes} == {3}
    largest = max(shapes, key=lambda shape: shape[0] * shape[1])
    assert need == device_plan.grpo_bytes(config, show_base("kiln-tiny", settings.KILN_HOME), largest)
    doubled = [{**group, "completions": group["completions"] * 2} for group in groups]
    assert admitted(doubled, "six")["identities"]["device_plan"]["bytes"] > need  # twice the rows
    longer = [{**group, "prompt": "Q: " + "a long preamble, " * 8 + "what is it?"} if "prompt" in group else group
              for group in groups]
    assert admitted(longer, "long-prompt")["identities"]["device_plan"]["bytes"] > need  # longer rows

    probe(_free(need - 1))
    refused = api.post("/v1/train/grpo", grpo_inline(f"{adapter_name}-cuda", backend="cuda"))
    assert refused.status_code == 400, refused.content
    error = refused.json()["error"]
    assert error["code"] == "backend_unavailable"
    assert f"has {need - 1} bytes free; the run plans {need}" in error["message"], error["message"]
    probe(_free(need))
    admitted_on_cuda = api.post("/v1/train/grpo", grpo_inline(f"{adapter_name}-cuda", backend="cuda"))
    assert admitted_on_cuda.status_code == 201, admitted_on_cuda.content
    assert admitted_on_cuda.json()["effective_config"]["backend"] == "cuda"


@pytest.mark.django_db
def test_opd_plans_its_native_teachers_device_model_beside_the_students(api, adapter_name, settings):
    """OPD's admitted plan: the student's sampling, scoring and step over the longest prompt and max_new_tokens,
    plus the native teacher's own device model (kiln-tiny here: its weights and gradient buffers, its forward and
    logits over the same tokens), plus the CUDA context once."""
    from trainer.bases import show_base
    from trainer.cuda_model import planned_device_bytes
    from trainer.runs import device_plan, opd
    from trainer.runs.tokenizers import load_tokenizer

    response = api.post("/v1/train/opd", rl_body(api, "opd", adapter_name, backend="cpu"))
    assert response.status_code == 201, response.content
    job = response.json()
    need, config = job["identities"]["device_plan"]["bytes"], job["effective_config"]
    assert config["teacher"]["route"] == "native" and config["teacher"]["adapter"] is None
    tiny = show_base("kiln-tiny", settings.KILN_HOME)
    tokenizer = load_tokenizer("kiln-tiny", settings.KILN_HOME)
    longest = max(len(opd.prompt_ids(p if isinstance(p, dict) else {"prompt": p}, tokenizer, 512, "p"))
                  for p in PROMPTS)
    student = device_plan.opd_bytes({**config, "teacher": {"route": "openai"}}, tiny, longest)
    cached = min(longest + config["max_new_tokens"], 512)
    teacher = planned_device_bytes(device_plan.architecture(tiny, None), 1, cached - 1, training=False, logits=True)
    assert need == device_plan.opd_bytes(config, tiny, longest, (tiny, None)) == student + teacher
    assert teacher > 2 * 4 * tiny.parameter_count  # the teacher's weights and its dense gradient buffers


@pytest.mark.django_db
def test_an_evaluation_is_refused_on_cuda_when_the_device_has_less_free_memory_than_it_plans(api, adapter_name,
                                                                                              probe, settings):
    """An evaluation's plan (greedy generation by the candidate or by the base alone: the weights, the gradient
    buffers a device model holds, the KV cache and decoding scratch, no step; plus the CUDA context) is checked
    against the device's free memory when it is queued: explicit cuda refused with a byte too few, auto on cpu
    with the reason, cuda admitted with enough."""
    from kiln_web.evals import runtime as eval_runtime
    from kiln_web.evals.actions import MAX_NEW_TOKENS
    from tests.serving.helpers import publish_adapter
    from trainer.bases import show_base
    from trainer.peft import read_adapter_config
    from trainer.runs import device_plan

    publish_adapter(settings.KILN_HOME, settings.KILN_ADAPTERS_DIR, adapter_name)
    suite = json.dumps({"prompt": "Say kiln.", "expected": "kiln", "metric": "contains"})
    assert api.post("/v1/evals/suites", {"name": f"{adapter_name}-words", "content": suite}).status_code == 201
    tiny = show_base("kiln-tiny", settings.KILN_HOME)
    need = device_plan.evaluation_bytes(tiny, read_adapter_config(settings.KILN_ADAPTERS_DIR / adapter_name),
                                        MAX_NEW_TOKENS)
    assert need == eval_runtime.planned_bytes(adapter_name, "kiln-tiny", MAX_NEW_TOKENS)
    body = {"adapter": adapter_name, "suite": f"{adapter_name}-words", "baseline": "kiln-tiny"}
    probe(_free(need - 1))
    refused = api.post("/v1/evals/runs", {**body, "backend": "cuda"})
    assert refused.status_code == 400, refused.content
    error = refused.json()["error"]
    assert error["code"] == "backend_unavailable"
    assert f"has {need - 1} bytes free; the run plans {need}" in error["message"], error["message"]
    auto = api.post("/v1/evals/runs", {**body, "backend": "auto"})
    assert auto.status_code == 201, auto.content
    assert auto.json()["backend"]["resolved"] == "cpu" and "bytes free" in auto.json()["backend"]["reason"]
    probe(_free(need))
    admitted = api.post("/v1/evals/runs", {**body, "backend": "cuda"})
    assert admitted.status_code == 201, admitted.content
    assert admitted.json()["backend"]["resolved"] == "cuda"


@pytest.mark.django_db
def test_a_worker_rechecks_the_jobs_planned_memory_at_dequeue(real_sft, api, adapter_name, probe):
    """The plan admission recorded (identities.device_plan) is checked again when a worker dequeues a cuda job: a
    device whose free memory fell below it refuses the job (backend_unavailable, with both figures) before anything
    is loaded."""
    from trainer.runs import device_plan

    probe(_free(79 << 30))
    response = api.post("/v1/train/sft", sft_body(adapter_name, records=2, backend="cuda"))
    assert response.status_code == 201, response.content
    job = response.json()
    need = job["identities"]["device_plan"]["bytes"]
    assert need > device_plan.CUDA_CONTEXT_BYTES
    probe(_free(need - 1))  # another process took memory meanwhile
    assert EmbeddedWorker().run_once()
    failed = TrainingJob.objects.get(pk=job["id"])
    assert failed.status == JobStatus.FAILED and failed.error_code == "backend_unavailable"
    assert f"has {need - 1} bytes free; the run plans {need}" in failed.error_message, failed.error_message
    assert failed.committed_step == 0


@pytest.mark.django_db
def test_cuda_is_refused_when_the_device_has_less_free_memory_than_the_run_plans(real_sft, api, adapter_name,
                                                                                probe):
    probe({**AVAILABLE, "devices": [{**DEVICE, "free_memory": 1024}]})  # kiln-tiny's weights need more
    response = api.post("/v1/train/sft", sft_body(adapter_name, records=2, backend="cuda"))
    assert response.status_code == 400, response.content
    error = response.json()["error"]
    assert error["code"] == "backend_unavailable" and "1024 bytes free" in error["message"]


def set_aside_later_checkpoints(registry, adapter: str, step: int) -> None:
    """Move ADAPTER's checkpoints after STEP out of the registry (as the runbook says before resuming an older one),
    so that the one at STEP can be resumed."""
    aside = registry.parent / f"aside-{adapter}"
    aside.mkdir()
    for path in checkpoint_dir.later_checkpoints(registry, adapter, step):
        path.rename(aside / path.name)


@pytest.mark.slow
@pytest.mark.django_db
def test_a_resume_on_another_backend_is_refused_and_a_warm_start_across_backends_is_admitted(
        real_sft, api, adapter_name, probe):
    body = sft_body(adapter_name, records=4, epochs=1, batch_size=1, checkpoint_interval=2, seed=5)
    first = api.post("/v1/train/sft", {**body, "config": {**body["config"], "backend": "cpu"}})
    assert first.status_code == 201, first.content
    assert EmbeddedWorker().run_once()
    done = TrainingJob.objects.get(pk=first.json()["id"])
    assert done.status == JobStatus.SUCCEEDED, done.error_message
    basename = f"{adapter_name}-checkpoint-step-00000002.kiln-checkpoint"
    set_aside_later_checkpoints(real_sft.KILN_ADAPTERS_DIR, adapter_name, 2)

    probe(AVAILABLE)  # a device is found: cuda may be asked for
    resume = {**body, "config": {**body["config"], "resume_checkpoint": basename, "backend": "cuda"}}
    refused = api.post("/v1/train/sft", resume)
    assert refused.status_code == 409, refused.content
    error = refused.json()["error"]
    assert error["code"] == "resume_drift"
    assert error["differences"] == [{"field": "execution.backend", "checkpoint": "cpu", "request": "cuda"}]
    assert "config.backend cpu" in error["message"] and "base_adapter" in error["message"]
    same = api.post("/v1/train/sft", {**resume, "config": {**resume["config"], "backend": "cpu"}})
    assert same.status_code == 201, same.content  # the checkpoint's own backend continues it
    assert api.post(f"/v1/train/jobs/{same.json()['id']}/cancel").status_code == 200

    snapshot = done.result["final_adapter"]["path"]
    warm = sft_body(f"{adapter_name}-warm", records=4, seed=5, backend="cuda", base_adapter=snapshot)
    admitted = api.post("/v1/train/sft", warm)
    assert admitted.status_code == 201, admitted.content  # weights only: no backend to continue
    job = admitted.json()
    assert job["effective_config"]["backend"] == "cuda" and job["identities"]["base_adapter"]["path"] == snapshot
    assert job["identities"]["execution"]["gpu"]["name"] == "Test Accelerator"

    probe(UNAVAILABLE)  # the worker that dequeues it has no device: refused there, with the loader's reason
    assert EmbeddedWorker().run_once()
    failed = TrainingJob.objects.get(pk=job["id"])
    assert failed.status == JobStatus.FAILED and failed.error_code == "backend_unavailable"
    assert NO_DRIVER in failed.error_message and failed.committed_step == 0


@pytest.mark.slow
@pytest.mark.django_db
def test_a_resume_on_another_gpu_is_refused_naming_the_gpu_field_and_a_warm_start_is_admitted(
        real_sft, api, adapter_name, monkeypatch, cuda_environment):  # noqa: F811
    """A checkpoint written on cuda (a GPU, or the host emulation of the library as the loader's device) records the
    device's gpu fields; admission compares only the backend (the web process does not know the worker's GPU), so a
    resume on the same backend is admitted, and the worker whose GPU differs in one field refuses it at dequeue
    (execution_drift) with the table naming that field. A base_adapter warm start on that worker is admitted and
    runs: weights only, nothing to continue."""
    body = sft_body(adapter_name, records=4, epochs=1, batch_size=1, checkpoint_interval=2, seed=5, backend="cuda")
    first = api.post("/v1/train/sft", body)
    assert first.status_code == 201, first.content
    assert EmbeddedWorker().run_once()
    done = TrainingJob.objects.get(pk=first.json()["id"])
    assert done.status == JobStatus.SUCCEEDED, done.error_message
    basename = f"{adapter_name}-checkpoint-step-00000002.kiln-checkpoint"
    set_aside_later_checkpoints(real_sft.KILN_ADAPTERS_DIR, adapter_name, 2)
    held = checkpoint_dir.load_checkpoint(real_sft.KILN_ADAPTERS_DIR / basename, full=False,
                                          allowed_manifest_fields=admission.MANIFEST_FIELDS).manifest["execution"]
    assert held["backend"] == "cuda" and set(held["gpu"]) == GPU_FIELDS and held["gpu"]["name"]
    if cuda_environment is not None:  # the emulation: the library the loader found is the one the checkpoint binds
        assert held["gpu"]["library_sha256"] == hashlib.sha256(cuda_environment.read_bytes()).hexdigest()
        assert held["gpu"]["compute_capability"] == "8.0"

    resume = {**body, "config": {**body["config"], "resume_checkpoint": basename}}
    for field, value in (("name", "Another Accelerator"), ("library_sha256", "cd" * 32),
                         ("shared_memory_per_block", 99 << 10)):  # the attention's tiles
        other = {**held, "gpu": {**held["gpu"], field: value}}  # the worker's GPU differs in FIELD alone
        admitted = api.post("/v1/train/sft", resume)
        assert admitted.status_code == 201, admitted.content  # same backend: admission leaves the GPU to the worker
        with monkeypatch.context() as patch:
            patch.setattr(runtime, "execution_identity", lambda backend=None, precision=None: other)
            assert EmbeddedWorker().run_once()
        job = TrainingJob.objects.get(pk=admitted.json()["id"])
        assert job.status == JobStatus.FAILED and job.error_code == "execution_drift", job.error_message
        table = [{"field": f"execution.gpu.{field}", "checkpoint": held["gpu"][field], "request": value}]
        assert job.error_details["differences"] == table
        assert f"execution.gpu.{field}" in job.error_message
        assert job.committed_step == 2 and not job.metrics.exists()  # refused before any step
        assert api.get(f"/v1/train/jobs/{job.pk}").json()["error"]["details"]["differences"] == table

    other = {**held, "gpu": {**held["gpu"], "name": "Another Accelerator"}}
    snapshot = done.result["final_adapter"]["path"]
    warm = sft_body(f"{adapter_name}-warm", records=2, seed=5, backend="cuda", base_adapter=snapshot)
    admitted = api.post("/v1/train/sft", warm)
    assert admitted.status_code == 201, admitted.content
    with monkeypatch.context() as patch:
        patch.setattr(runtime, "execution_identity", lambda backend=None, precision=None: other)
        assert EmbeddedWorker().run_once()
    job = TrainingJob.objects.get(pk=admitted.json()["id"])
    assert job.status == JobStatus.SUCCEEDED, (job.error_code, job.error_message)
    assert job.identities["execution"]["gpu"]["name"] == "Another Accelerator"
    assert job.identities["base_adapter"]["path"] == snapshot


@pytest.fixture
def cli(live_server, real_sft, monkeypatch, capsys, ada, tmp_path):
    """`kiln ...` in-process against the live test server as ada: (exit code, stdout, stderr)."""
    return cli_runner(live_server.url, ada.token, monkeypatch, capsys, tmp_path)


@pytest.mark.django_db(transaction=True)
def test_the_cli_refuses_cuda_without_a_device_and_reports_the_backend(cli, tmp_path, adapter_name, probe):
    probe(UNAVAILABLE)
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in sft_body("x", records=2)["data"]))
    code, out, err = cli("train", "sft", "--file", str(data), "--adapter", adapter_name, "--backend", "cuda")
    assert code == 1 and "backend_unavailable" in err and NO_DRIVER in err, (out, err)
    assert not TrainingJob.objects.exists()
    code, out, err = cli("train", "sft", "--file", str(data), "--adapter", adapter_name, "--backend", "auto")
    assert code == 0 and "backend cpu" in out, (out, err)
    job_id = TrainingJob.objects.get().pk
    code, out, _ = cli("train", "status", "--job-id", str(job_id))
    assert code == 0 and f"backend    cpu (auto: cuda unavailable: {NO_DRIVER})" in out
    code, out, err = cli("eval", "run", "--adapter", adapter_name, "--suite", "any", "--backend", "cuda")
    assert code == 1 and "backend_unavailable" in err and NO_DRIVER in err, (out, err)


def test_kiln_qualify_cuda_without_a_device_exits_non_zero_and_writes_no_receipt(probe, monkeypatch, tmp_path,
                                                                                 capsys):
    probe(UNAVAILABLE)
    monkeypatch.setenv("KILN_HOME", str(tmp_path))
    assert main(["qualify", "--backend", "cuda"]) == 2
    err = capsys.readouterr().err
    assert NO_DRIVER in err and "no receipt written" in err
    assert not (tmp_path / "qualification").exists()


@pytest.mark.django_db
def test_the_dashboard_form_shows_backend_unavailable_on_the_backend_field(real_sft, ada, adapter_name, probe):
    from django.test import Client

    from dashboard.conftest import csrf_post, field_errors, upload

    probe(UNAVAILABLE)
    client = Client()
    client.force_login(ada)
    form = client.get("/jobs/new/sft/").content.decode()
    assert 'name="backend"' in form and all(f'value="{b}"' in form for b in ("auto", "cpu", "cuda"))
    response = csrf_post(client, "/jobs/new/sft/", {"output_name": adapter_name, "data": upload(), "backend": "cuda"})
    assert response.status_code == 400
    errors = field_errors(response.content.decode(), "backend")
    assert errors and NO_DRIVER in " ".join(errors), errors
    assert not TrainingJob.objects.exists()


def test_auto_computes_a_precision_on_cuda_only_where_that_precision_is_qualified(probe, tmp_path):
    """Each precision is its own envelope: float32's receipt lets auto put float32 runs on the device, not bfloat16
    ones (they go to cpu, saying which receipt is missing) nor tfloat32 ones, which exist on cuda only and are
    refused rather than sent to cpu; with their own receipts both resolve to cuda as auto, and an explicit cuda
    needs no receipt."""
    probe(AVAILABLE)
    write_receipt(tmp_path)
    assert admission.choose_backend("auto", "auto", tmp_path).resolved == "cuda"
    bf16 = admission.choose_backend("auto", "auto", tmp_path, precision="bfloat16")
    assert (bf16.requested, bf16.resolved) == ("auto", "cpu")
    assert "latest-cuda-bfloat16.json" in bf16.reason and "kiln qualify --backend cuda --precision bfloat16" in \
        bf16.reason, bf16.reason
    with pytest.raises(backend.BackendUnavailable, match=r"precision tfloat32 computes on cuda only, and auto needs a "
                                                         r"passing qualification: no qualification receipt \(.*"
                                                         r"latest-cuda-tfloat32.json\); run: kiln qualify --backend "
                                                         r"cuda --precision tfloat32"):
        admission.choose_backend("auto", "auto", tmp_path, precision="tfloat32")
    assert admission.choose_backend("cuda", "auto", tmp_path, precision="tfloat32").resolved == "cuda"
    write_receipt(tmp_path, "bfloat16")
    write_receipt(tmp_path, "tfloat32")
    for precision in ("bfloat16", "tfloat32"):
        choice = admission.choose_backend("auto", "auto", tmp_path, precision=precision)
        assert (choice.requested, choice.resolved) == ("auto", "cuda"), choice.reason
    assert choice.reason == "auto: cuda available and qualified for this envelope (precision tfloat32 computes on " \
                            "cuda only)"
    write_receipt(tmp_path, "bfloat16", passed=False)
    assert admission.choose_backend("auto", "auto", tmp_path, precision="bfloat16").resolved == "cpu"


# -- the attention kernels' shared memory per block: a device that cannot run the base's head size --

WIDE_HEADS = {**ARCHITECTURE, "head_count": 2, "kv_head_count": 1, "head_size": 128}  # a Llama-3-8B's head size


def emulated_probe(library, monkeypatch, per_block: int) -> dict:
    """The real loader's probe (in a fresh interpreter, as backend.probe_cuda runs it) of the host emulation of the
    CUDA library whose device allows PER_BLOCK bytes of opt-in shared memory per block; its free memory raised to
    79 GiB, so that only the shared memory can refuse a request."""
    from native_ext import cuda

    with monkeypatch.context() as patch:
        patch.setenv(cuda.ENVIRONMENT_VARIABLE, str(library))
        patch.setenv("KILN_EMU_SHARED_OPTIN", str(per_block))
        result = cuda._probe_in_subprocess(backend.MIN_CAPABILITY)  # the real one, even where `probe` replaced it
    assert result["available"], result["reason"]
    (device,) = result["devices"]
    assert device["shared_memory_per_block"] == per_block
    device["free_memory"] = 79 << 30
    return result


def test_a_device_with_too_little_shared_memory_for_the_bases_head_size_is_refused_saying_so(
        probe, monkeypatch, tmp_path, emulated_library):
    """A run over a base of head size 128 on a device that allows less shared memory per block than the kernels'
    smallest tiles need (48 KiB: no device of compute 8.0 or later is that small, so the emulation stands in) is
    refused cuda: explicitly (backend_unavailable naming the head size, the KiB the kernels need and the KiB the
    device allows) and under auto (cpu, with that reason), at admission and at a worker's recheck of the recorded
    plan; a base of head size 16 runs there. An evaluation (cached decoding: the forward kernel alone) is held to the
    forward's figure. The 99 KiB of compute 8.6, 8.9 and 12.0 (RTX 30/40/50-series) and an A100's 163 KiB take head
    size 128, to train and to decode."""
    from trainer.runs import device_plan

    settings = admission.RunSettings(home=tmp_path, registry=tmp_path / "adapters", bases_root=tmp_path,
                                     backend="auto")
    request = {"batch_size": 1, "max_sequence_length": 64, "lora": LORA}
    wide = types.SimpleNamespace(name="wide-heads", config=WIDE_HEADS, parameter_count=1)
    narrow = types.SimpleNamespace(name="described", config=ARCHITECTURE, parameter_count=1)
    need = admission.planned_device_bytes(request, wide)
    assert need.head_size == 128 and need.attention == ((128, True),)
    assert device_plan.recorded({"device_plan": device_plan.record(need)}).attention == need.attention

    probe(emulated_probe(emulated_library, monkeypatch, 48 << 10))
    write_receipt(tmp_path)  # auto is qualified on this device: only the head size keeps it off cuda
    why = ("head size 128: the CUDA attention kernels need 73.25 KiB of shared memory per block for training, and "
           "device 0 allows 48 KiB per block (it takes head sizes up to 64 to train and up to 64 to decode)")
    with pytest.raises(admission.AdmissionError) as refused:
        admission.admit_backend({**request, "backend": "cuda"}, settings, wide)
    assert refused.value.code == "backend_unavailable" and why in refused.value.message, refused.value.message
    config = dict(request)
    choice = admission.admit_backend(config, settings, wide)  # auto
    assert (choice.resolved, config["backend"]) == ("cpu", "cpu") and why in choice.reason, choice.reason
    with pytest.raises(backend.BackendUnavailable) as at_dequeue:
        backend.require_cuda(device_plan.recorded({"device_plan": device_plan.record(need)}))
    assert why in at_dequeue.value.message
    assert admission.admit_backend(dict(request), settings, narrow).resolved == "cuda"  # head size 16 runs here
    evaluation = device_plan.evaluation_bytes(wide, None, 16)
    assert evaluation.attention == ((128, False),)
    assert "need 55.625 KiB of shared memory per block for decoding" in backend.cuda_unavailable(
        backend.probe_cuda(), evaluation)

    probe(emulated_probe(emulated_library, monkeypatch, 64 << 10))  # the forward fits, the backward does not
    assert backend.cuda_unavailable(backend.probe_cuda(), evaluation) is None
    assert "73.25 KiB" in backend.cuda_unavailable(backend.probe_cuda(), need)

    for per_block in (99 << 10, 163 << 10):
        probe(emulated_probe(emulated_library, monkeypatch, per_block))
        assert admission.admit_backend(dict(request), settings, wide).resolved == "cpu"  # another device: unqualified
        write_receipt(tmp_path)
        assert admission.admit_backend({**request, "backend": "cuda"}, settings, wide).resolved == "cuda"
        assert admission.admit_backend(dict(request), settings, wide).resolved == "cuda"  # auto, qualified
        backend.require_cuda(device_plan.recorded({"device_plan": device_plan.record(need)}))
        assert backend.cuda_unavailable(backend.probe_cuda(), evaluation) is None


def test_opd_holds_a_native_teacher_to_the_decoding_figure_and_the_student_to_the_training_one():
    from trainer.runs import device_plan

    student = types.SimpleNamespace(name="described", config=ARCHITECTURE)
    teacher = types.SimpleNamespace(name="wide-heads", config=WIDE_HEADS)
    native = {"max_new_tokens": 30, "lora": LORA, "teacher": {"route": "native"}}
    need = device_plan.opd_bytes(native, student, 20, (teacher, None))
    assert need.attention == ((16, True), (128, False)) and need.head_size == 128
    assert device_plan.opd_bytes({**native, "teacher": {"route": "openai"}}, student, 20).attention == ((16, True),)


def _register_wide_heads_base(home) -> str:
    """A registered base like kiln-tiny but with two heads of size 128 (once per KILN_HOME); its name."""
    import numpy as np

    from trainer import TransformerConfig
    from trainer.bases import TINY_ARCHITECTURE, _publish, bases_directory, is_registered
    from trainer.bases_sources import _TinySource, parameter_shapes

    name = "wide-heads-128"

    class WideHeads(_TinySource):
        def __init__(self):
            self.config = TransformerConfig(**{**TINY_ARCHITECTURE, "head_count": 2, "kv_head_count": 1,
                                               "head_size": 128})
            rng = np.random.default_rng(5)
            self._values = {n: rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02) if len(shape) == 2
                            else np.ones(shape, np.float32) for n, shape in parameter_shapes(self.config).items()}

        def description(self):
            return {"format": "test", "head_size": 128}

    if not is_registered(name, home):
        _publish(WideHeads(), bases_directory(home) / name)
    return name


@pytest.mark.django_db
def test_the_api_refuses_cuda_for_a_head_size_the_device_cannot_run_and_auto_says_why(
        real_sft, api, adapter_name, probe, monkeypatch, emulated_library):
    """Through the API: an SFT run over a base of head size 128 on a device short of shared memory per block (48 KiB,
    emulated: smaller than any of compute 8.0 or later) is refused cuda (backend_unavailable, 400, naming head size,
    needed and allowed KiB), goes to cpu under auto with the reason on the job, and is admitted on cuda on a 99 KiB
    device (an RTX 4090's) and a 163 KiB one (an A100's); a serving pool on cuda refuses to load that base on the
    48 KiB device, with the same reason, before it copies anything to the device."""
    from trainer.serving import ServingError, ServingPool

    base = _register_wide_heads_base(real_sft.KILN_HOME)
    small = emulated_probe(emulated_library, monkeypatch, 48 << 10)
    probe(small)
    write_receipt(real_sft.KILN_HOME)
    why = "head size 128: the CUDA attention kernels need 73.25 KiB of shared memory per block for training, and " \
          "device 0 allows 48 KiB per block"
    response = api.post("/v1/train/sft", sft_body(adapter_name, records=2, base_model=base, backend="cuda"))
    assert response.status_code == 400, response.content
    error = response.json()["error"]
    assert error["code"] == "backend_unavailable" and why in error["message"], error["message"]
    assert not TrainingJob.objects.exists()
    auto = api.post("/v1/train/sft", sft_body(adapter_name, records=2, base_model=base, backend="auto"))
    assert auto.status_code == 201, auto.content
    chosen = auto.json()["identities"]["backend"]
    assert chosen["resolved"] == "cpu" and chosen["reason"].startswith(f"auto: cuda unavailable: {why}"), chosen
    assert auto.json()["identities"]["device_plan"]["attention"] == [{"head_size": 128, "training": True}]

    pool = ServingPool(real_sft.KILN_HOME, real_sft.KILN_ADAPTERS_DIR, "cuda")
    try:
        with pytest.raises(ServingError) as refused:
            pool.base(base)
    finally:
        pool.close()
    assert refused.value.code == "backend_unavailable"
    assert "need 55.625 KiB of shared memory per block for decoding" in refused.value.message, refused.value.message

    for per_block, device in ((99 << 10, "rtx4090"), (163 << 10, "a100")):
        probe(emulated_probe(emulated_library, monkeypatch, per_block))
        admitted = api.post("/v1/train/sft", sft_body(f"{adapter_name}-{device}", records=2, base_model=base,
                                                      backend="cuda"))
        assert admitted.status_code == 201, admitted.content
        assert admitted.json()["effective_config"]["backend"] == "cuda"
