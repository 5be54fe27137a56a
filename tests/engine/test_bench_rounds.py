"""bench/adapter_step.py --rounds: how the rounds are ordered and combined (the arithmetic, not the timing)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import adapter_step  # noqa: E402


def run(seconds, best, peak, rss=100.0):
    return {"seconds": seconds, "best_seconds": best, "adjacent_peak": peak, "peak_rss_mib": rss}


def test_rounds_alternate_the_order(monkeypatch):
    orders = []
    monkeypatch.setattr(adapter_step, "measure", lambda variants, *rest: orders.append(list(variants)) or {})
    adapter_step.measure_rounds(["kiln-lora", "peft-lora", "kiln-qlora"], 3, False, 256, 3)
    assert orders == [["kiln-lora", "peft-lora", "kiln-qlora"], ["kiln-qlora", "peft-lora", "kiln-lora"],
                      ["kiln-lora", "peft-lora", "kiln-qlora"]]


def test_combined_rounds_take_the_median_step_and_the_best_steps_own_round():
    per_round = [
        {"kiln-lora": run(1.0, 0.9, 150e9, 900), "peft-lora": run(1.4, 1.3, 150e9)},
        {"kiln-lora": run(1.2, 0.8, 210e9, 950), "peft-lora": run(1.5, 1.45, 200e9)},
        {"kiln-lora": run(1.1, 1.0, 160e9, 920)},  # peft failed in this round
    ]
    combined = adapter_step.combine_rounds(per_round)
    assert combined["kiln-lora"]["seconds"] == 1.1
    assert combined["kiln-lora"]["best_seconds"] == 0.8
    assert combined["kiln-lora"]["adjacent_peak"] == 210e9  # the best step's round, so "best of it" is like with like
    assert combined["kiln-lora"]["peak_rss_mib"] == 950
    assert combined["kiln-lora"]["rounds"] == 3 and combined["peft-lora"]["rounds"] == 2
    assert combined["peft-lora"]["seconds"] == pytest.approx(1.45)
    # a ratio per round that measured both sides, never across rounds
    assert adapter_step.round_ratios(per_round, "kiln-lora", "peft-lora") == [pytest.approx(1.4), pytest.approx(1.25)]


def test_one_round_reports_what_measure_gave():
    results = {"kiln-qlora": run(2.0, 1.9, 170e9, 600), "peft-qlora": run(2.6, 2.5, 175e9, 2000)}
    combined = adapter_step.combine_rounds([results])
    for name, measured in results.items():
        assert {key: combined[name][key] for key in measured} == measured
