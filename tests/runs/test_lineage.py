"""replay.jsonl hash chain, lineage.json, and kiln-replay verify."""

import json
import subprocess
import sys

import pytest

from trainer.lineage import (LineageError, append_replay, lineage_path, main, record_lineage, verify_lineage,
                             verify_replay)


@pytest.fixture
def replay(tmp_path):
    path = tmp_path / "replay.jsonl"
    for i in range(5):
        append_replay(path, "sft", {"request": {"i": i}, "job": f"job-{i}"})
    return path


def lines(path):
    return path.read_bytes().splitlines(keepends=True)


def test_intact_chain(replay):
    assert verify_replay(replay) == 5
    records = [json.loads(l) for l in lines(replay)]
    assert [r["sequence"] for r in records] == [1, 2, 3, 4, 5]
    assert all(records[i]["previous"] == records[i - 1]["hash"] for i in range(1, 5))


@pytest.mark.parametrize("tamper,line", [
    (lambda ls: ls[:2] + [ls[2].replace(b'"i":2', b'"i":9')] + ls[3:], 3),  # edited
    (lambda ls: ls[:1] + ls[2:], 2),  # deleted
    (lambda ls: [ls[0], ls[2], ls[1]] + ls[3:], 2),  # reordered
    (lambda ls: ls[:4] + [b"{not json\n"], 5),  # garbage
])
def test_first_break_is_reported_with_its_line(replay, tamper, line):
    replay.write_bytes(b"".join(tamper(lines(replay))))
    with pytest.raises(LineageError) as info:
        verify_replay(replay)
    assert info.value.line == line
    assert f"line {line}" in str(info.value)


def test_lineage_document(tmp_path, replay):
    registry = tmp_path / "adapters"
    first = json.loads(lines(replay)[0])
    record_lineage(registry, "bot", "request", {"replay_hash": first["hash"]})
    record_lineage(registry, "bot", "job", {"job_id": "job-0"})
    record_lineage(registry, "bot", "checkpoint", {"resume_checkpoint": "bot-checkpoint-step-00000002.kiln-checkpoint"})
    record_lineage(registry, "bot", "final_adapter", {"adapter_sha256": "ab" * 32})
    record_lineage(registry, "bot", "evaluation", {"evaluation_id": "e1", "accuracy": 0.5})
    record_lineage(registry, "bot", "promotion", {"outcome": "promoted"})
    assert verify_lineage(registry, "bot", replay) == 6
    document = json.loads(lineage_path(registry, "bot").read_text())
    document["entries"][3]["adapter_sha256"] = "cd" * 32
    lineage_path(registry, "bot").write_text(json.dumps(document))
    with pytest.raises(LineageError, match="entry 4 was edited"):
        verify_lineage(registry, "bot", replay)
    with pytest.raises(ValueError, match="stage"):
        record_lineage(registry, "bot", "deploy", {})


def test_request_missing_from_replay_is_refused(tmp_path, replay):
    registry = tmp_path / "adapters"
    record_lineage(registry, "bot", "request", {"replay_hash": "f" * 64})
    with pytest.raises(LineageError, match="missing from the replay log"):
        verify_lineage(registry, "bot", replay)


def test_cli(replay, capsys):
    assert main(["verify", "--replay", str(replay)]) == 0
    assert "5 records, chain intact" in capsys.readouterr().out
    replay.write_bytes(b"".join(lines(replay)[:1] + lines(replay)[2:]))
    result = subprocess.run([sys.executable, "-m", "trainer.lineage", "verify", "--replay", str(replay)],
                            capture_output=True, text=True)
    assert result.returncode == 1 and "line 2" in result.stdout
    help_text = subprocess.run([sys.executable, "-m", "trainer.lineage", "--help"], capture_output=True,
                               text=True).stdout
    assert "does NOT rerun training" in help_text


def test_append_reads_only_the_tail_and_continues_the_chain(tmp_path, monkeypatch):
    from trainer import lineage

    monkeypatch.setattr(lineage, "TAIL_BLOCK", 7)  # records span many blocks
    path = tmp_path / "replay.jsonl"
    for i in range(4):
        append_replay(path, "sft", {"request": {"text": "x" * (50 * i)}, "job": f"job-{i}"})
    assert verify_replay(path) == 4
    assert [json.loads(l)["sequence"] for l in lines(path)] == [1, 2, 3, 4]


def test_a_torn_last_line_refuses_further_appends(replay):
    replay.write_bytes(b"".join(lines(replay)) + b'{"schema":"kiln.replay.v1","seq')
    with pytest.raises(LineageError, match="the last line is not a replay record"):
        append_replay(replay, "sft", {"job": "job-5"})
    with pytest.raises(LineageError, match="line 6"):
        verify_replay(replay)


def test_checkpoints_must_follow_their_job(tmp_path, replay):
    registry = tmp_path / "adapters"
    first = json.loads(lines(replay)[0])
    record_lineage(registry, "bot", "request", {"replay_hash": first["hash"], "job_id": "job-0"})
    record_lineage(registry, "bot", "checkpoint", {"job_id": "job-0", "step": 2})
    with pytest.raises(LineageError, match="entry 2 \\(checkpoint\\) names job job-0"):
        verify_lineage(registry, "bot", replay)
