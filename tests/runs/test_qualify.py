"""kiln qualify: fresh-repeat and cancel-then-resume equivalence with a receipt."""

import itertools
import json

from trainer import qualify as qualification
from trainer.runs import sft


def test_every_route_qualifies_and_the_receipt_records_the_envelope(tmp_path):
    output = tmp_path / "receipt.json"
    receipt = qualification.qualify(output=output, progress=lambda line: None)
    assert receipt["passed"] is True
    assert [r["route"] for r in receipt["routes"]] == ["sft", "grpo_inline", "grpo_streamed", "opd"]
    for route in receipt["routes"]:
        assert route["mismatches"] == [] and route["outcome"]["status"] == "succeeded"
        assert route["outcome"]["checkpoint_files"] and route["outcome"]["final_adapter"]
    envelope = receipt["envelope"]
    assert {"model", "execution", "tokenizer", "data"} <= set(envelope)
    assert {"backend", "precision", "kernel_contract", "native_builds", "blas"} <= set(envelope["execution"])
    assert json.loads(output.read_text()) == receipt


def test_a_nondeterministic_run_fails_qualification(monkeypatch):
    counter = itertools.count()
    real = sft.epoch_order
    monkeypatch.setattr(sft, "epoch_order", lambda seed, epoch, count: real(seed + next(counter), epoch, count))
    receipt = qualification.qualify(routes=["sft"], progress=lambda line: None)
    assert receipt["passed"] is False
    assert "repeat.loss_history_sha256" in receipt["routes"][0]["mismatches"]


def test_cli_writes_latest_and_stamped_receipts(tmp_path, monkeypatch):
    from kiln_web import cli

    monkeypatch.setenv("KILN_HOME", str(tmp_path))
    monkeypatch.setattr(qualification, "_routes", lambda home: {
        k: v for k, v in real_routes(home).items() if k == "sft"})
    assert cli.main(["qualify"]) == 0
    latest = json.loads((tmp_path / "qualification" / "latest-cpu.json").read_text())
    assert latest["passed"] and [r["route"] for r in latest["routes"]] == ["sft"]
    assert len(list((tmp_path / "qualification").glob("receipt-cpu-*.json"))) == 1


real_routes = qualification._routes
