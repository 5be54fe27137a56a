"""config.precision through the run logic: a bfloat16 SFT run (the frozen base's products on oneDNN) resumes
byte-identically, binds its precision into the effective configuration and the execution identity, and is
refused where it cannot run or with a resume that asks for another precision (the cuda backend's bfloat16 and
tfloat32 runs: test_sft_cuda.py). Runs that multiply skip with
the loader's reason on a CPU without BF16 dot-product instructions or without the oneDNN library."""

import pytest

from native_ext import onednn
from test_opd import bases  # noqa: F401  (the fixture: kiln-tiny, a teacher base and its adapter)
from test_sft import StopAt, final_files, make_settings, request, write_dataset
from trainer.runs.admission import AdmissionError, RequestError
from trainer.runs.sft import admit_sft, revalidate_sft, run_sft

UNAVAILABLE = onednn.unavailable_reason()
needs_bf16 = pytest.mark.skipif(UNAVAILABLE is not None, reason=f"no bfloat16 route here: {UNAVAILABLE}")


def bf16_request(home, **more):
    return request(write_dataset(home), precision="bfloat16", **more)


@needs_bf16
def test_bf16_run_cancel_then_resume_is_byte_identical_and_binds_its_precision(tmp_path):
    whole_settings = make_settings(tmp_path / "whole")
    whole = run_sft(admit_sft(bf16_request(tmp_path / "whole"), whole_settings), whole_settings, StopAt(None))
    assert whole.status == "succeeded" and whole.steps_completed == 8

    settings = make_settings(tmp_path / "parts")
    admitted = admit_sft(bf16_request(tmp_path / "parts"), settings)
    assert admitted.effective_config["precision"] == "bfloat16"
    execution = admitted.identities["execution"]
    assert execution["precision"] == "bfloat16"
    assert set(execution["onednn"]) == {"version", "library_sha256", "cpu_isa", "threads"}
    assert execution["onednn"]["threads"] and execution["onednn"]["cpu_isa"]
    first = run_sft(admitted, settings, StopAt(3))
    assert first.status == "cancelled" and first.steps_completed == 3
    basename = first.latest_checkpoint["resume_checkpoint"]

    # a float32 request for the bfloat16 checkpoint is drift, named field by field
    with pytest.raises(AdmissionError) as info:
        admit_sft(request(write_dataset(tmp_path / "parts"), resume_checkpoint=basename), settings)
    assert info.value.code == "resume_drift"
    assert "config.precision" in {d["field"] for d in info.value.differences}

    resumed = admit_sft(bf16_request(tmp_path / "parts", resume_checkpoint=basename), settings)
    revalidate_sft(resumed, settings)
    resumed.identities["execution"] = {**execution, "onednn": {**execution["onednn"], "threads": 99}}
    with pytest.raises(AdmissionError) as drift:  # another oneDNN thread count is another arithmetic
        revalidate_sft(resumed, settings)
    assert drift.value.code == "execution_drift"
    assert "execution.onednn.threads" in {d["field"] for d in drift.value.differences}

    resumed = admit_sft(bf16_request(tmp_path / "parts", resume_checkpoint=basename), settings)
    second = run_sft(resumed, settings, StopAt(None))
    assert second.status == "succeeded"
    assert second.loss_history == whole.loss_history
    assert final_files(settings) == final_files(whole_settings)

    # and it is another arithmetic than float32's: the same run in float32 ends elsewhere
    exact_settings = make_settings(tmp_path / "exact")
    exact = run_sft(admit_sft(request(write_dataset(tmp_path / "exact")), exact_settings), exact_settings,
                    StopAt(None))
    assert exact.loss_history != whole.loss_history
    assert abs(exact.loss_history[-1] - whole.loss_history[-1]) < 0.05 * exact.loss_history[-1]


def test_a_float32_request_keeps_the_effective_configuration_it_had(tmp_path):
    settings = make_settings(tmp_path)
    for asked in ({}, {"precision": "float32"}, {"precision": None}):
        admitted = admit_sft(request(write_dataset(tmp_path), **asked), settings)
        assert "precision" not in admitted.effective_config  # checkpoints written before the field still resume
        assert admitted.identities["execution"]["precision"] == "float32"
        assert "onednn" not in admitted.identities["execution"]


@pytest.mark.parametrize("change,match", [
    ({"precision": "float16"}, "must be one of float32, bfloat16, tfloat32"),
    ({"precision": "bfloat16", "quantization": {"type": "nf4"}}, "quantized"),
    ({"precision": "tfloat32", "quantization": {"type": "nf4"}}, "quantized"),
])
def test_precision_request_errors(tmp_path, change, match):
    settings = make_settings(tmp_path)
    with pytest.raises(RequestError, match=match) as info:
        admit_sft(request(write_dataset(tmp_path), **change), settings)
    assert info.value.field == "config.precision"


def test_bf16_without_the_cpu_route_and_tf32_without_a_device_are_backend_unavailable(tmp_path, monkeypatch):
    """bfloat16 on the cpu backend needs oneDNN's route; tfloat32 exists on cuda only, so auto asks for the device
    and cpu (asked for, or the server's default) is refused; without a device cuda is refused with the loader's
    reason (a faked probe's here)."""
    from trainer.runs import backend

    settings = make_settings(tmp_path)
    monkeypatch.setattr(onednn, "cpu_bf16_flags", lambda: ())
    with pytest.raises(AdmissionError, match="no BF16 dot-product instructions") as info:
        admit_sft(bf16_request(tmp_path), settings)
    assert info.value.code == "backend_unavailable" and info.value.field == "config.precision"
    for asked in ({"backend": "cpu"}, {}):  # {}: this server's default backend, cpu
        with pytest.raises(AdmissionError, match="tensor-core precision; the cpu backend") as info:
            admit_sft(request(write_dataset(tmp_path), precision="tfloat32", **asked), settings)
        assert info.value.code == "backend_unavailable" and info.value.field == "config.precision"
    monkeypatch.setattr(backend, "probe_cuda", lambda: {"available": False, "code": "no_device", "devices": [],
                                                        "reason": "the CUDA driver sees no GPU"})
    for asked in ({"backend": "auto"}, {"backend": "cuda"}):
        with pytest.raises(AdmissionError, match="the CUDA driver sees no GPU; precision tfloat32 needs a CUDA "
                                                 "device") as info:
            admit_sft(request(write_dataset(tmp_path), precision="tfloat32", **asked), settings)
        assert info.value.code == "backend_unavailable" and info.value.field == "config.precision"
    with pytest.raises(AdmissionError, match="the CUDA driver sees no GPU; ask for backend cpu or auto") as info:
        admit_sft(bf16_request(tmp_path, backend="cuda"), settings)
    assert info.value.code == "backend_unavailable"


@needs_bf16
def test_grpo_bf16_cancel_then_resume_is_byte_identical(tmp_path):
    """GRPO's rollouts (cached generation), old and reference log-probabilities and weighted backward all run in
    the bfloat16 scope; a cancelled run resumes to the bytes of an uninterrupted one."""
    import test_grpo as g

    whole_settings = g.make_settings(tmp_path / "whole")
    whole, _ = g.run(whole_settings, g.inline_request(precision="bfloat16"))
    assert whole.status == "succeeded"
    settings = g.make_settings(tmp_path / "parts")
    first, _ = g.run(settings, g.inline_request(precision="bfloat16"), stop=3)
    basename = first.latest_checkpoint["resume_checkpoint"]
    second, _ = g.run(settings, g.inline_request(precision="bfloat16", resume_checkpoint=basename))
    assert second.status == "succeeded" and second.loss_history == whole.loss_history
    assert g.final_files(settings, "reward-bot") == g.final_files(whole_settings, "reward-bot")
    exact, _ = g.run(g.make_settings(tmp_path / "exact"), g.inline_request())
    assert exact.loss_history != whole.loss_history  # another arithmetic


@needs_bf16
def test_opd_bf16_student_cancel_then_resume_is_byte_identical(bases, tmp_path):  # noqa: F811 (the fixture)
    """OPD's student computes in bfloat16 (its native teacher stays float32); cancel-then-resume gives the bytes
    of an uninterrupted run."""
    import test_opd as o

    teacher = o.native_teacher(bases)
    whole_settings = o.make_settings(tmp_path / "whole", bases)
    whole, _ = o.run(whole_settings, o.request(teacher, precision="bfloat16"))
    assert whole.status == "succeeded"
    settings = o.make_settings(tmp_path / "parts", bases)
    first, _ = o.run(settings, o.request(teacher, precision="bfloat16"), stop=3)
    basename = first.latest_checkpoint["resume_checkpoint"]
    second, _ = o.run(settings, o.request(teacher, precision="bfloat16", resume_checkpoint=basename))
    assert second.status == "succeeded" and second.loss_history == whole.loss_history
    assert o.final_files(settings) == o.final_files(whole_settings)
