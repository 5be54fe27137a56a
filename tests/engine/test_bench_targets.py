"""Issue 19's target verdicts printed by bench/adapter_step.py and bench/engine_step.py (the arithmetic, not the
timing)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import adapter_step  # noqa: E402
import engine_step  # noqa: E402


def run(seconds, **extra):
    return {"seconds": seconds, "best_seconds": seconds, "adjacent_peak": 200e9, "peak_rss_mib": 100.0, **extra}


def test_lora_and_qlora_targets_are_judged_on_median_steps_against_the_start_peak():
    flops = adapter_step.lora_step_flops(256)
    peak = flops / 0.8  # a kiln-lora step of 1 s runs at 80% of it
    results = {"kiln-lora": run(1.0), "peft-lora": run(1.6), "kiln-qlora": run(1.0, quantized_linear_ratio=0.141),
               "peft-qlora": run(1.2)}
    judged = adapter_step.verdicts(results, 256, peak)
    assert [(measured, met) for _, measured, met in judged] == [
        ("1.60x", True), ("80.0%", True), ("1.20x", False), ("0.141x", True)]
    assert [target for target, _, _ in judged] == [
        "LoRA >= 1.5x PyTorch + peft", "LoRA >= 70% of the peak", "QLoRA >= 1.3x peft + bitsandbytes",
        "QLoRA bases resident <= 0.16x FP32"]


def test_a_target_just_missed_is_not_met_and_unmeasured_targets_are_left_out():
    flops = adapter_step.lora_step_flops(1024)
    results = {"kiln-lora": run(1.0), "peft-lora": run(1.49)}
    judged = adapter_step.verdicts(results, 1024, flops / 0.69)
    assert [(measured, met) for _, measured, met in judged] == [("1.49x", False), ("69.0%", False)]
    assert adapter_step.verdicts({"peft-lora": run(1.0)}, 256, 1e11) == []
    resident = adapter_step.verdicts({"kiln-qlora": run(1.0, quantized_linear_ratio=0.17)}, 256, 1e11)
    assert resident == [("QLoRA bases resident <= 0.16x FP32", "0.170x", False)]


def test_the_report_prints_the_verdicts(capsys):
    flops = adapter_step.lora_step_flops(256)
    adapter_step.report({"kiln-lora": run(1.0), "peft-lora": run(1.8)}, 256, False, flops / 0.75)
    out = capsys.readouterr().out
    assert "issue 19's targets at context 256" in out
    assert "LoRA >= 1.5x PyTorch + peft" in out and "1.80x  met" in out and "75.0%  met" in out


@pytest.mark.parametrize("kiln, torch_seconds, expected", [
    (1.0, 2.0, "2.00x, met; PyTorch at 25.0% of the peak, so 2x needs Kiln at 50.0%"),
    (1.0, 1.45, "1.45x, not met; PyTorch at 34.5% of the peak, so 2x needs Kiln at 69.0%"),
])
def test_full_parameter_verdict_says_what_2x_would_need(kiln, torch_seconds, expected):
    flops, peak = 100e9, 200e9  # PyTorch's share of the peak: flops / torch_seconds / peak
    verdict = engine_step.full_parameter_verdict(kiln, torch_seconds, flops, peak)
    assert verdict == "full-parameter >= 2x PyTorch: " + expected
