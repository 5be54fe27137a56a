"""kiln qualify: fresh-repeat and cancel-then-resume equivalence, every run in its own process, with a receipt."""

import json
import os

import pytest

from tests.engine.conftest import cuda_environment, emulated_library  # noqa: F401  (fixtures used here)
from trainer import qualify as qualification
from trainer import qualify_child


@pytest.fixture(scope="module")
def receipt(tmp_path_factory):
    output = tmp_path_factory.mktemp("receipt") / "receipt.json"
    document = qualification.qualify(output=output, progress=lambda line: None)
    assert json.loads(output.read_text()) == document
    return document


def test_every_route_qualifies_in_fresh_processes(receipt):
    assert receipt["passed"] is True, [(r["route"], r["mismatches"], r.get("error")) for r in receipt["routes"]]
    assert receipt["failures"] == []
    assert [r["route"] for r in receipt["routes"]] == ["sft", "grpo_inline", "grpo_streamed", "opd"]
    for route in receipt["routes"]:
        assert route["mismatches"] == [] and route["first_mismatch"] is None
        assert route["outcome"]["status"] == "succeeded"
        assert route["outcome"]["checkpoint_files"] and route["outcome"]["final_adapter"]
        pids = route["processes"]
        assert sorted(pids) == ["cancelled", "first", "repeat", "resumed"]
        assert len(set(pids.values())) == 4 and os.getpid() not in pids.values()
        # the resume loaded the checkpoint the cancelled process published last, at the step it stopped
        assert route["resumed_from"]["step"] == route["cancelled_at"]
        assert route["resumed_from"]["checkpoint_id"] == route["checkpoints"][route["cancelled_at"] - 1]


def test_the_envelope_records_dataset_digests_and_the_execution(receipt):
    envelope = receipt["envelope"]
    assert {"model", "execution", "tokenizer", "data"} <= set(envelope)
    assert {"backend", "precision", "kernel_contract", "native_builds", "blas"} <= set(envelope["execution"])
    data = envelope["data"]
    assert sorted(data) == ["grpo_inline", "grpo_streamed", "opd", "sft"]
    assert [data[r]["records"] for r in ("sft", "grpo_inline", "grpo_streamed", "opd")] == [
        len(qualification.SFT_RECORDS), len(qualification.GROUPS), len(qualification.GROUPS),
        len(qualification.PROMPTS)]
    # the streamed route trains on the file's exact bytes: the digest is theirs, not a loss history's
    import hashlib
    stream = "".join(json.dumps(g) + "\n" for g in qualification.GROUPS).encode()
    assert data["grpo_streamed"]["sha256"] == hashlib.sha256(stream).hexdigest()
    assert data["grpo_streamed"]["bytes"] == len(stream) and data["grpo_streamed"]["source"] == "streamed_jsonl"
    for route in receipt["routes"]:
        assert data[route["route"]]["sha256"] != route["outcome"]["loss_history_sha256"]
        assert route["dataset"] == data[route["route"]]


def test_a_difference_only_in_a_resumed_process_memory_fails_qualification(monkeypatch):
    monkeypatch.setenv(qualify_child.PLANT_ENV, "sft:resumed")
    lines = []
    receipt = qualification.qualify(routes=["sft"], progress=lines.append)
    assert receipt["passed"] is False
    route = receipt["routes"][0]
    assert route["route"] == "sft" and route["passed"] is False
    assert route["mismatches"] and all(m.startswith("resumed.") for m in route["mismatches"]), route["mismatches"]
    assert "resumed.outcome.adapter_sha256" in route["mismatches"]
    assert receipt["failures"] == [f"sft: {route['first_mismatch']}"]
    assert any(line.startswith(f"  sft: FAILED at {route['first_mismatch']}") for line in lines), lines


def test_a_nondeterministic_repeat_fails_qualification_naming_the_route(monkeypatch):
    monkeypatch.setenv(qualify_child.PLANT_ENV, "opd:repeat")
    receipt = qualification.qualify(routes=["sft", "opd"], progress=lambda line: None)
    assert receipt["passed"] is False
    sft, opd = receipt["routes"]
    assert sft["passed"] is True, (sft["mismatches"], sft.get("error"))
    assert opd["passed"] is False and opd["first_mismatch"].startswith("repeat.")
    assert receipt["failures"] == [f"opd: {opd['first_mismatch']}"]


def test_the_first_differing_field_is_named():
    found = []
    qualification._differences("resumed", {"loss_history": [1.0, 2.0, 3.0], "seed": 3},
                                {"loss_history": [1.0, 2.5, 3.5], "seed": 3.0}, found)
    assert found == ["resumed.loss_history[1]", "resumed.loss_history[2]", "resumed.seed"]
    assert qualification._first_per_field(found) == ["resumed.loss_history[1]", "resumed.seed"]


def test_a_child_that_fails_is_reported_with_its_error(monkeypatch):
    real = qualification._routes

    def broken(home):
        kind, cancel_at, request = real(home)["sft"]
        return {"sft": (kind, cancel_at, {**request, "config": {**request["config"], "epochs": -1}})}

    monkeypatch.setattr(qualification, "_routes", broken)
    receipt = qualification.qualify(progress=lambda line: None)
    route = receipt["routes"][0]
    assert receipt["passed"] is False and route["mismatches"] == ["first.process"]
    assert route["error"].startswith("first: exit status 1:") and "epochs" in route["error"], route["error"]


def test_cli_writes_latest_and_stamped_receipts(tmp_path, monkeypatch):
    from kiln_web import cli

    monkeypatch.setenv("KILN_HOME", str(tmp_path))
    monkeypatch.setattr(qualification, "_routes", lambda home: {
        k: v for k, v in real_routes(home).items() if k == "sft"})
    assert cli.main(["qualify"]) == 0
    latest = json.loads((tmp_path / "qualification" / "latest-cpu.json").read_text())
    assert latest["passed"], [(r["mismatches"], r.get("error")) for r in latest["routes"]]
    assert [r["route"] for r in latest["routes"]] == ["sft"]
    assert len(list((tmp_path / "qualification").glob("receipt-cpu-*.json"))) == 1


def test_cli_fails_and_names_the_route_when_a_route_fails(tmp_path, monkeypatch, capsys):
    from kiln_web import cli

    monkeypatch.setenv("KILN_HOME", str(tmp_path))
    monkeypatch.setenv(qualify_child.PLANT_ENV, "sft:resumed")
    monkeypatch.setattr(qualification, "_routes", lambda home: {
        k: v for k, v in real_routes(home).items() if k == "sft"})
    assert cli.main(["qualify", "--route", "sft"]) == 1
    out = capsys.readouterr().out
    assert "FAILED" in out and "sft: resumed." in out
    assert json.loads((tmp_path / "qualification" / "latest-cpu.json").read_text())["passed"] is False


real_routes = qualification._routes


def test_routes_are_selected_by_name():
    """Every route by default (on either backend: every training kind computes on cuda too), the named ones in the
    table's order, and an unknown name refused with the list of routes."""
    from trainer.qualify import selected_routes

    table = {"sft": ("sft", 3, {}), "grpo_inline": ("grpo", 2, {}), "opd": ("opd", 2, {})}
    assert selected_routes(table) == ["sft", "grpo_inline", "opd"]
    assert selected_routes(table, ["opd", "sft"]) == ["sft", "opd"]
    with pytest.raises(ValueError, match=r"unknown routes \['nope'\]; the routes are sft, grpo_inline, opd"):
        selected_routes(table, ["nope"])


def test_every_route_qualifies_on_cuda_in_fresh_processes(cuda_environment, tmp_path):  # noqa: F811
    """kiln qualify --backend cuda on a device (a GPU, or the host emulation the loader finds through
    KILN_CUDA_LIBRARY in every fresh process): each route's repeat and cancel-then-resume equal its first run, on
    the device, and the receipt's envelope is the cuda identity."""
    output = tmp_path / "latest-cuda.json"
    document = qualification.qualify(backend="cuda", output=output, progress=lambda line: None)
    assert document["passed"] is True, [(r["route"], r["mismatches"], r.get("error")) for r in document["routes"]]
    assert [r["route"] for r in document["routes"]] == ["sft", "grpo_inline", "grpo_streamed", "opd"]
    execution = document["envelope"]["execution"]
    assert document["backend"] == "cuda" and execution["backend"] == "cuda"
    assert execution["kernel_contract"] == "kiln-cuda-kernels-v1" and execution["gpu"]["name"]
    if cuda_environment is not None:
        assert execution["gpu"]["name"] == "kiln host emulation"


def test_a_difference_in_a_resumed_process_on_cuda_fails_qualification(cuda_environment, monkeypatch):  # noqa: F811
    """The planted difference (one adapter value of the resumed process's device model) fails the cuda route."""
    monkeypatch.setenv(qualify_child.PLANT_ENV, "sft:resumed")
    receipt = qualification.qualify(backend="cuda", routes=["sft"], progress=lambda line: None)
    route = receipt["routes"][0]
    assert receipt["passed"] is False and route["passed"] is False
    assert route["mismatches"] and all(m.startswith("resumed.") for m in route["mismatches"]), route["mismatches"]
    assert "resumed.outcome.adapter_sha256" in route["mismatches"]


def test_a_precision_is_qualified_as_its_own_envelope_and_receipt(cuda_environment, tmp_path, monkeypatch):  # noqa: F811
    """`kiln qualify --backend cuda --precision bfloat16` runs the routes at that precision (the children's
    execution identity records it) and writes latest-cuda-bfloat16.json beside, not over, float32's receipt;
    that receipt is what auto needs for a bfloat16 run, and float32's is not."""
    from kiln_web import cli
    from trainer.runs import backend
    from trainer.runs.execution import execution_identity

    monkeypatch.setenv("KILN_HOME", str(tmp_path))
    monkeypatch.setattr(qualification, "_routes", lambda home: {
        k: v for k, v in real_routes(home).items() if k == "sft"})
    float32 = backend.receipt_path(tmp_path)
    float32.parent.mkdir(parents=True)
    float32.write_text("float32's receipt, left as it is\n")
    assert cli.main(["qualify", "--backend", "cuda", "--precision", "bfloat16"]) == 0
    path = tmp_path / "qualification" / "latest-cuda-bfloat16.json"
    assert path == backend.receipt_path(tmp_path, "bfloat16")
    receipt = json.loads(path.read_text())
    assert receipt["passed"] is True and receipt["precision"] == "bfloat16"
    assert receipt["envelope"]["execution"]["precision"] == "bfloat16"
    assert float32.read_text() == "float32's receipt, left as it is\n"
    assert [p.name[:len("receipt-cuda-bfloat16-")] for p in path.parent.glob("receipt-*.json")] == [
        "receipt-cuda-bfloat16-"]
    assert backend.unqualified(tmp_path, execution_identity("cuda", "bfloat16")) is None
    float32.write_text(path.read_text())  # a bfloat16 receipt where float32's belongs holds for another envelope
    reason = backend.unqualified(tmp_path, execution_identity("cuda"))
    assert "execution.precision" in reason and reason.endswith("run: kiln qualify --backend cuda"), reason


def test_a_precision_that_cannot_run_on_cpu_writes_no_receipt(tmp_path, monkeypatch, capsys):
    from kiln_web import cli

    monkeypatch.setenv("KILN_HOME", str(tmp_path))
    assert cli.main(["qualify", "--precision", "tfloat32"]) == 2
    err = capsys.readouterr().err
    assert "precision tfloat32 is a CUDA tensor-core precision: qualify it with --backend cuda" in err
    assert "no receipt written" in err and not (tmp_path / "qualification" / "latest-cpu-tfloat32.json").exists()
    with pytest.raises(ValueError, match="precision must be one of float32, bfloat16, tfloat32, got 'float16'"):
        qualification.qualify(precision="float16")
