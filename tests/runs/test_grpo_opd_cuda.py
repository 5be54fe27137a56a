"""GRPO and OPD runs on the cuda backend: their loops compute on trainer.cuda_model.CudaModel (trainer.runs.device),
OPD samples on it (trainer.cuda_decode) and a native teacher scores on one of its own, while checkpoints, resume
and the final PEFT snapshot stay those of the CPU loop.

Each test runs on a GPU where the loader finds one (skipped without) and on the host emulation of the CUDA library
(test_sft_cuda's `device` fixture); the list it yields holds one entry per library load, i.e. per CudaModel built.

Tolerance across backends: a relative difference of 1e-4 (TOLERANCE) for the loss history (scaled by its largest
value: a GRPO loss can sit near zero) and each step's gradient norm; clip decisions, learning rates and token counts
are equal. The final adapter's values agree within 1e-3 (ADAPTER_TOLERANCE): Adam divides an element's first moment
by sqrt(second moment) + 1e-8, so an element whose gradient cancels to ~1e-9 (four orders below the median), and so
differs by ~1% across backends, still takes a sizeable, equally different step (measured: 2.2e-4 on an o_proj lora_A
in a 4-step EMA run, first moments 3.097e-9 on cpu and 3.133e-9 on cuda after step 2, while every loss and gradient
norm agreed within 1e-4; the runs here stay under 7e-5); a missed, doubled or mis-scaled step moves values by about
the learning rate (2e-2), far beyond it. OPD samples at temperature 1 from the student's logits, which differ across
backends in the last bits only, so every candidate's sampled tokens are compared with `==` (a draw would have to
land within ~1e-6 of a cumulative-probability boundary to flip; these tiny models and fixed seeds do not). On one
backend an interrupted and resumed run ends with the same bytes as an uninterrupted one, compared with `==`.
"""

import json

import pytest
from safetensors.numpy import load as safetensors_load

from tests.engine.conftest import cuda_environment, cuda_loads, emulated_library  # noqa: F401  (fixtures)
from test_grpo import GROUPS, INLINE
from test_grpo import final_files as grpo_final_files
from test_grpo import make_settings as grpo_settings
from test_grpo import run as grpo_run
from test_opd import bases  # noqa: F401  (a module fixture: kiln-sharp and the teacher adapter)
from test_opd import final_files as opd_final_files
from test_opd import make_settings as opd_settings
from test_opd import native_teacher
from test_opd import request as opd_request
from test_opd import run as opd_run
from test_sft_cuda import ADAPTER_TOLERANCE, TOLERANCE, device, gpu_name, relative  # noqa: F401  (device fixture)
from trainer import teachers
from trainer.cuda_model import CudaModel
from trainer.runs import checkpoint_dir, opd
from trainer.runs.admission import MANIFEST_FIELDS
from trainer.runs.state import STATE_FILE

REWARD, DISTILLED = "reward-bot", "distilled-bot"
# two groups with the shortest prompts and beta > 0, so the reference scores on the computing model. A device step
# costs seconds in the emulation (the gradient norm's fixed reduction tree runs as host fibers), hence so few steps.
GRPO_CASES = {
    # one batch of both groups, 2 iterations: 2 steps scored against the base with the adapter switched off
    "frozen": {"groups_per_step": 2, "num_iterations": 2, "reference": {"type": "frozen"}},
    # two batches of one group: 2 steps; the second batch is scored against the reference refreshed (mixed with
    # the device's adapter) after step 1
    "ema": {"groups_per_step": 1, "num_iterations": 1,
            "reference": {"type": "ema", "refresh_steps": 1, "mixup_alpha": 0.5}},
}
GRPO_STEPS = 2
OPD_STEPS = 2  # two candidates a step, up to 8 new tokens each


def grpo_request(backend, case, **config):
    return {"groups": [GROUPS[0], GROUPS[2]],
            "config": {**INLINE, "epochs": 1, "backend": backend, **GRPO_CASES[case], **config}}


def snapshot_files(settings, adapter):
    return {p.name: p.read_bytes() for p in sorted((settings.registry / adapter).iterdir())}


def adapter_values(settings, adapter):
    return safetensors_load((settings.registry / adapter / "adapter_model.safetensors").read_bytes())


def assert_follows(gpu, gpu_hooks, cpu, cpu_hooks):
    """The cuda run's steps against the cpu run's, within TOLERANCE (see the module docstring)."""
    assert gpu.status == cpu.status == "succeeded" and gpu.steps_completed == cpu.steps_completed
    assert relative(gpu.loss_history, cpu.loss_history) <= TOLERANCE
    assert len(gpu_hooks.metrics) == len(cpu_hooks.metrics) == cpu.steps_completed
    for step, (on_gpu, on_cpu) in enumerate(zip(gpu_hooks.metrics, cpu_hooks.metrics)):
        assert on_gpu["clipped"] == on_cpu["clipped"], step
        assert abs(on_gpu["grad_norm"] - on_cpu["grad_norm"]) <= TOLERANCE * on_cpu["grad_norm"], step
        assert on_gpu["learning_rate"] == on_cpu["learning_rate"] and on_gpu["tokens"] == on_cpu["tokens"], step


def assert_same_adapter(gpu_settings, cpu_settings, adapter):
    expected = adapter_values(cpu_settings, adapter)
    actual = adapter_values(gpu_settings, adapter)
    assert set(actual) == set(expected)
    for name, value in actual.items():
        assert relative(value, expected[name]) <= ADAPTER_TOLERANCE, name


def assert_recorded_cuda(settings, adapter):
    path = checkpoint_dir.latest_checkpoint(settings.registry, adapter)
    held = checkpoint_dir.load_checkpoint(path, full=False, allowed_manifest_fields=MANIFEST_FIELDS).manifest
    assert held["execution"]["backend"] == "cuda" and held["execution"]["gpu"]["name"] == gpu_name()


# -- GRPO ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", list(GRPO_CASES))
def test_a_cuda_grpo_run_follows_the_cpu_run(device, tmp_path, case):  # noqa: F811
    """The same GRPO request on cpu and cuda: per-step loss, gradient norm, clip decision and learning rate and the
    final adapter within TOLERANCE; the cuda run trained on one CudaModel and recorded cuda."""
    cpu_settings = grpo_settings(tmp_path / "cpu")
    cpu, cpu_hooks = grpo_run(cpu_settings, grpo_request("cpu", case))
    assert not device  # the cpu run never opened the library
    gpu_settings = grpo_settings(tmp_path / "cuda")
    gpu, gpu_hooks = grpo_run(gpu_settings, grpo_request("cuda", case))
    assert len(device) == 1, "the cuda run did not train on a CudaModel"
    assert gpu.steps_completed == GRPO_STEPS
    assert_follows(gpu, gpu_hooks, cpu, cpu_hooks)
    assert cpu_hooks.metrics[1]["kl_mean"] > 0  # the reference was scored and differs from the policy
    for on_gpu, on_cpu in zip(gpu_hooks.metrics, cpu_hooks.metrics):
        assert abs(on_gpu["kl_mean"] - on_cpu["kl_mean"]) <= TOLERANCE * max(abs(on_cpu["kl_mean"]), 1e-3)
    assert_same_adapter(gpu_settings, cpu_settings, REWARD)
    assert_recorded_cuda(gpu_settings, REWARD)
    if case == "ema":
        held = checkpoint_dir.load_checkpoint(checkpoint_dir.latest_checkpoint(gpu_settings.registry, REWARD),
                                              allowed_manifest_fields=MANIFEST_FIELDS)
        assert json.loads(held.read(STATE_FILE))["reference"]["refreshes"] == [1, 2]


def test_grpo_cancel_then_resume_on_cuda_is_byte_identical(device, tmp_path):  # noqa: F811
    """Cancelled after step 1 (mid-batch: the old and reference log-probabilities are checkpointed) and resumed in
    a fresh CudaModel, the run ends with the same checkpoint and PEFT bytes as an uninterrupted cuda run."""
    req = grpo_request("cuda", "frozen")
    whole_settings = grpo_settings(tmp_path / "whole")
    whole, whole_hooks = grpo_run(whole_settings, req)
    settings = grpo_settings(tmp_path / "resumed")
    first, first_hooks = grpo_run(settings, req, stop=1)
    assert first.status == "cancelled" and first.steps_completed == 1
    assert first.latest_checkpoint["next_cursor"]["iteration"] == 1
    opened = len(device)
    basename = first.latest_checkpoint["resume_checkpoint"]
    second, second_hooks = grpo_run(settings, grpo_request("cuda", "frozen", resume_checkpoint=basename))
    assert len(device) == opened + 1  # a fresh CudaModel for the resumed run
    assert second.status == "succeeded" and second.loss_history == whole.loss_history
    assert first_hooks.metrics + second_hooks.metrics == whole_hooks.metrics
    assert grpo_final_files(settings, REWARD) == grpo_final_files(whole_settings, REWARD)
    assert snapshot_files(settings, REWARD) == snapshot_files(whole_settings, REWARD)


# -- OPD -------------------------------------------------------------------------------------------


@pytest.fixture
def spies(monkeypatch):
    """The teachers the runs open and the tokens each candidate sampled, in order."""
    seen = {"teachers": [], "tokens": []}
    open_teacher, sample = teachers.open_teacher, opd._sample

    def opening(*args, **kwargs):
        teacher = open_teacher(*args, **kwargs)
        seen["teachers"].append(teacher)
        return teacher

    def sampling(*args, **kwargs):
        tokens, teacher_logp, stats = sample(*args, **kwargs)
        seen["tokens"].append(list(tokens))
        return tokens, teacher_logp, stats

    monkeypatch.setattr(teachers, "open_teacher", opening)
    monkeypatch.setattr(opd, "_sample", sampling)
    return seen


def test_a_cuda_opd_run_follows_the_cpu_run(device, spies, bases, tmp_path):  # noqa: F811
    """The same OPD request with a native teacher on cpu and cuda: every candidate samples the same tokens, the
    steps and the final adapter agree within TOLERANCE; on cuda the student and the teacher are CudaModels."""
    cpu_settings = opd_settings(tmp_path / "cpu", bases)
    cpu, cpu_hooks = opd_run(cpu_settings, opd_request(native_teacher(bases), steps=OPD_STEPS, backend="cpu"))
    assert not device and not isinstance(spies["teachers"][0].model, CudaModel)
    cpu_tokens, spies["tokens"] = spies["tokens"], []
    gpu_settings = opd_settings(tmp_path / "cuda", bases)
    gpu, gpu_hooks = opd_run(gpu_settings, opd_request(native_teacher(bases), steps=OPD_STEPS, backend="cuda"))
    assert len(device) == 2, "the cuda run did not build a CudaModel for the student and one for the teacher"
    assert isinstance(spies["teachers"][1].model, CudaModel)  # the native teacher scored on the device
    assert spies["tokens"] == cpu_tokens and any(cpu_tokens)
    assert gpu.steps_completed == OPD_STEPS
    assert_follows(gpu, gpu_hooks, cpu, cpu_hooks)
    assert all(m["kl"] > 0.5 for m in gpu_hooks.metrics)  # a real distillation signal
    assert_same_adapter(gpu_settings, cpu_settings, DISTILLED)
    assert_recorded_cuda(gpu_settings, DISTILLED)


def test_opd_cancel_then_resume_on_cuda_is_byte_identical(device, bases, tmp_path):  # noqa: F811
    """Cancelled after step 1 and resumed (a fresh student and teacher on the device, the sampler's state
    restored), the run ends with the same losses, checkpoint and PEFT bytes as an uninterrupted cuda run."""
    whole_settings = opd_settings(tmp_path / "whole", bases)
    whole, whole_hooks = opd_run(whole_settings, opd_request(native_teacher(bases), steps=OPD_STEPS, backend="cuda"))
    settings = opd_settings(tmp_path / "resumed", bases)
    first, first_hooks = opd_run(settings, opd_request(native_teacher(bases), steps=OPD_STEPS, backend="cuda"),
                                 stop=1)
    assert first.status == "cancelled" and first.steps_completed == 1
    opened = len(device)
    basename = first.latest_checkpoint["resume_checkpoint"]
    second, second_hooks = opd_run(settings, opd_request(native_teacher(bases), steps=OPD_STEPS, backend="cuda",
                                                         resume_checkpoint=basename))
    assert len(device) == opened + 2  # a fresh student and teacher on the device
    assert second.status == "succeeded" and second.loss_history == whole.loss_history
    assert first_hooks.metrics + second_hooks.metrics == whole_hooks.metrics
    assert opd_final_files(settings) == opd_final_files(whole_settings)
    assert snapshot_files(settings, DISTILLED) == snapshot_files(whole_settings, DISTILLED)
