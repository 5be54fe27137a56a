"""Request lineage wired into the control plane: every admitted request in $KILN_HOME/replay.jsonl (inline data
as a digest), each adapter's lineage.json (request -> job -> checkpoints -> final adapter -> evaluations ->
promotion), and `kiln-replay verify` on a real run, intact and tampered."""

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kiln_web.jobs import actions, lineage
from kiln_web.jobs.models import TrainingJob
from kiln_web.jobs.worker import EmbeddedWorker
from trainer.lineage import lineage_path, verify_lineage, verify_replay

from .conftest import sft_body

pytestmark = pytest.mark.django_db

WORDS = ("kiln", "clay", "glaze", "fire")


@pytest.fixture
def real_runner(settings):
    settings.KILN_SFT_RUNNER = "trainer.runs.sft"
    settings.KILN_HEARTBEAT_SECONDS = 3600
    settings.KILN_CANCEL_POLL_SECONDS = 0
    return settings


def request(adapter, **config):
    body = sft_body(adapter, epochs=2, checkpoint_interval=3, seed=17, **config)
    body["data"] = [{"messages": [{"role": "user", "content": f"Say {word}."},
                                  {"role": "assistant", "content": f"{word.upper()}!"}]} for word in WORDS]
    return body


def submit_and_run(api, body, cancel_at_step=None, monkeypatch=None) -> dict:
    response = api.post("/v1/train/sft", body)
    assert response.status_code == 201, response.content
    job_id = response.json()["id"]
    if cancel_at_step is not None:
        record = actions.do_record_step

        def record_then_cancel(job, worker_id, metrics):
            recorded = record(job, worker_id, metrics)
            if metrics["step"] == cancel_at_step:
                actions.do_cancel_job(job, reason="test")
            return recorded

        monkeypatch.setattr(actions, "do_record_step", record_then_cancel)
    assert EmbeddedWorker().run_once()
    if monkeypatch is not None:
        monkeypatch.undo()
    return api.get(f"/v1/train/jobs/{job_id}").json()


def replay_lines(path) -> list:
    return path.read_bytes().splitlines(keepends=True)


def replay_verify(*args, home) -> subprocess.CompletedProcess:
    """`kiln-replay verify ...`: the installed console script (pyproject's kiln-replay = trainer.lineage:main),
    or that entry point through the interpreter where the virtual environment predates the script."""
    script = Path(sys.executable).parent / "kiln-replay"
    argv = [str(script)] if script.exists() else [sys.executable, "-m", "trainer.lineage"]
    return subprocess.run(argv + ["verify", *args], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "KILN_HOME": str(home)})


def test_a_run_is_recorded_and_verifies_and_tampering_names_the_first_broken_line(real_runner, api, adapter_name,
                                                                                   tmp_path):
    job = submit_and_run(api, request(adapter_name))
    assert job["status"] == "succeeded", job["error"]
    home, registry = real_runner.KILN_HOME, real_runner.KILN_ADAPTERS_DIR
    replay = home / "replay.jsonl"

    # the replay record: job, kind, owner, the request as submitted with the inline data as its digest
    lines = replay_lines(replay)
    number, record = next((n, json.loads(line)) for n, line in enumerate(lines, 1)
                          if json.loads(line)["payload"]["job_id"] == job["id"])
    payload = record["payload"]
    assert record["kind"] == "sft" and payload["kind"] == "sft" and payload["owner"] == "ada"
    assert payload["adapter"] == adapter_name and payload["effective_seed"] == 17
    assert payload["request"]["config"] == request(adapter_name)["config"]
    digest = payload["request"]["data"]["inline"]
    assert digest["records"] == 4 and digest["sha256"] == job["identities"]["dataset"]["sha256"]
    assert digest["bytes"] == job["identities"]["dataset"]["bytes"]
    assert b"GLAZE!" not in b"".join(lines)  # the records themselves are not kept
    assert payload["identities_sha256"] == hashlib.sha256(json.dumps(
        job["identities"], sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()).hexdigest()

    # the adapter's lineage: request -> job -> checkpoints -> final adapter
    entries = json.loads(lineage_path(registry, adapter_name).read_text())["entries"]
    assert [e["stage"] for e in entries] == ["request", "job", "checkpoint", "checkpoint", "checkpoint",
                                             "final_adapter"]
    assert entries[0]["replay_hash"] == record["hash"] and entries[0]["replay_sequence"] == record["sequence"]
    assert {e["job_id"] for e in entries} == {job["id"]}
    assert [e["step"] for e in entries[2:5]] == [3, 6, 8]
    assert entries[4]["resume_checkpoint"] == job["latest_checkpoint"]["resume_checkpoint"]
    snapshot = registry / adapter_name / "adapter_model.safetensors"
    assert entries[5]["adapter_sha256"] == hashlib.sha256(snapshot.read_bytes()).hexdigest()

    result = replay_verify("--adapter", adapter_name, home=home)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("chain intact") == 2 and "6 entries" in result.stdout

    # tampering with a copy: an edited replay line is named by its line number ...
    copy = tmp_path / "replay.jsonl"
    copy.write_bytes(b"".join(lines[:number - 1] + [lines[number - 1].replace(b'"owner":"ada"', b'"owner":"eve"')]
                              + lines[number:]))
    result = replay_verify("--replay", str(copy), "--registry", str(registry), "--adapter", adapter_name, home=home)
    assert result.returncode == 1 and f"line {number}:" in result.stdout and "edited" in result.stdout

    # ... and so is a deleted one (the newest record leaves no gap in the chain, but the adapter's lineage
    # names it); an edited lineage entry is named by its index
    copy.write_bytes(b"".join(lines[:number - 1] + lines[number:]))
    result = replay_verify("--replay", str(copy), "--registry", str(registry), "--adapter", adapter_name, home=home)
    assert result.returncode == 1
    assert (f"line {number}:" in result.stdout if number < len(lines) else
            "entry 1 names a request missing from the replay log" in result.stdout), result.stdout
    copied_registry = tmp_path / "adapters"
    copied_registry.mkdir()
    document = json.loads(lineage_path(registry, adapter_name).read_text())
    document["entries"][3]["step"] = 5
    lineage_path(copied_registry, adapter_name).write_text(json.dumps(document))
    result = replay_verify("--registry", str(copied_registry), "--adapter", adapter_name, home=home)
    assert result.returncode == 1 and "entry 4 was edited" in result.stdout
    assert "does NOT rerun training" in replay_verify("--help", home=home).stdout


def test_a_resumed_run_continues_the_same_lineage(real_runner, api, adapter_name, monkeypatch):
    body = request(adapter_name)
    cancelled = submit_and_run(api, body, cancel_at_step=4, monkeypatch=monkeypatch)
    assert cancelled["status"] == "cancelled"
    basename = cancelled["latest_checkpoint"]["resume_checkpoint"]
    body["config"]["resume_checkpoint"] = basename
    resumed = submit_and_run(api, body)
    assert resumed["status"] == "succeeded", resumed["error"]

    entries = json.loads(lineage_path(real_runner.KILN_ADAPTERS_DIR, adapter_name).read_text())["entries"]
    assert [(e["stage"], e["job_id"]) for e in entries] == [
        ("request", cancelled["id"]), ("job", cancelled["id"]), ("checkpoint", cancelled["id"]),
        ("checkpoint", cancelled["id"]),  # step 3, then step 4 published at the cancel
        ("request", resumed["id"]), ("job", resumed["id"]), ("checkpoint", resumed["id"]),
        ("checkpoint", resumed["id"]), ("final_adapter", resumed["id"])]
    assert entries[5]["resume_from"] == basename
    assert verify_lineage(real_runner.KILN_ADAPTERS_DIR, adapter_name,
                          real_runner.KILN_HOME / "replay.jsonl") == len(entries)


def test_every_kind_replays_its_inline_data_as_a_digest():
    groups = [{"prompt": "p", "completions": [{"text": "a", "reward": 1.0}]}]
    body = {"groups": groups, "config": {"output_name": "g"}, "auto_load": True}
    replayed = lineage.replayed_request(body)
    raw = json.dumps(groups[0], sort_keys=True, separators=(",", ":")).encode() + b"\n"
    assert replayed == {"groups": {"inline": {"sha256": hashlib.sha256(raw).hexdigest(), "bytes": len(raw),
                                              "records": 1}},
                        "config": {"output_name": "g"}, "auto_load": True}
    assert lineage.replayed_request({"prompts": ["hi", {"prompt": "yo"}], "config": {}})["prompts"]["inline"][
        "records"] == 2
    by_path = {"dataset_path": "/data/train.jsonl", "config": {"output_name": "x"}}
    assert lineage.replayed_request(by_path) == by_path
    assert body["groups"] is groups  # the job's own request is untouched


def test_an_unwritable_replay_log_refuses_the_submission(fake_runner, api, adapter_name, tmp_path, monkeypatch):
    monkeypatch.setattr(lineage, "replay_path", lambda: tmp_path)  # a directory: appending fails
    before = TrainingJob.objects.count()
    response = api.post("/v1/train/sft", sft_body(adapter_name))
    assert response.status_code == 503, response.content
    error = response.json()["error"]
    assert error["code"] == "replay_unwritable" and "KILN_HOME" in error["message"]
    assert TrainingJob.objects.count() == before  # nothing was admitted


def test_evaluation_and_promotion_entries_extend_the_chain(fake_runner, api, adapter_name):
    response = api.post("/v1/train/sft", sft_body(adapter_name))
    assert response.status_code == 201
    job_id = response.json()["id"]
    lineage.record_evaluation_lineage(adapter_name, "eval-1", suite="arith", summary={"accuracy": 0.75},
                                      candidate_sha256="ab" * 32, job_id=job_id)
    lineage.record_promotion_lineage(adapter_name, "promoted", reason="the gate passed", decided_by="gate",
                                     adapter_sha256="ab" * 32, job_id=job_id, evaluation_id="eval-1")
    registry = fake_runner.KILN_ADAPTERS_DIR
    entries = json.loads(lineage_path(registry, adapter_name).read_text())["entries"]
    assert [e["stage"] for e in entries] == ["request", "job", "evaluation", "promotion"]
    assert entries[3]["evaluation_id"] == "eval-1" and entries[3]["outcome"] == "promoted"
    assert verify_lineage(registry, adapter_name, fake_runner.KILN_HOME / "replay.jsonl") == 4
    assert verify_replay(fake_runner.KILN_HOME / "replay.jsonl") >= 1


def test_a_later_stage_that_cannot_be_written_is_reported_not_raised(fake_runner, api, adapter_name, tmp_path):
    response = api.post("/v1/train/sft", sft_body(adapter_name))
    job_id = response.json()["id"]
    fake_runner.KILN_ADAPTERS_DIR = tmp_path / "a-file"
    fake_runner.KILN_ADAPTERS_DIR.write_text("not a directory")
    recorded = lineage.record_promotion_lineage(adapter_name, "canary_failed", job_id=job_id)
    assert recorded.entry is None and recorded.warning.startswith("lineage: the promotion entry")
    job = TrainingJob.objects.get(pk=job_id)
    actions.do_claim_job(job.pk, "w")
    summary = {"resume_checkpoint": f"{adapter_name}-step-2.kiln-checkpoint", "step": 2, "checkpoint_id": "c"}
    assert actions.do_record_checkpoint(job.pk, "w", summary)  # the checkpoint is recorded; its lineage is not
    events = api.get(f"/v1/train/jobs/{job_id}/events").json()["items"]
    assert any("lineage: the checkpoint entry" in e["message"] for e in events)
    shutil.rmtree(tmp_path, ignore_errors=True)
