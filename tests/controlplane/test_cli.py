"""The `kiln` command: train sft/status/cancel/list through a live server, token create and checkpoint
verify/show locally."""

import json

import pytest

from kiln_web.cli import main
from kiln_web.jobs.models import TrainingJob
from kiln_web.jobs.worker import EmbeddedWorker

from .conftest import cli_runner, sft_body


@pytest.fixture
def cli(live_server, fake_runner, monkeypatch, capsys, ada, tmp_path):
    """Run `kiln ...` in-process against the live test server as ada; returns (exit code, stdout, stderr)."""
    return cli_runner(live_server.url, ada.token, monkeypatch, capsys, tmp_path)


def jsonl(path, records=3):
    path.write_text("".join(json.dumps(r) + "\n" for r in sft_body("x", records=records)["data"]))
    return path


@pytest.mark.django_db(transaction=True)
def test_train_sft_status_and_resume_basename(cli, tmp_path, adapter_name):
    data = jsonl(tmp_path / "corrections.jsonl")
    code, out, err = cli("train", "sft", "--file", str(data), "--adapter", adapter_name, "--epochs", "2",
                         "--checkpoint-interval", "2", "--seed", "5", "--learning-rate", "0.001")
    assert code == 0, err
    job_id = out.split()[1]
    job = TrainingJob.objects.get(pk=job_id)
    assert job.data_source_kind == "inline"  # outside every data root: uploaded
    assert job.request["config"] == {"output_name": adapter_name, "epochs": 2, "checkpoint_interval": 2, "seed": 5,
                                     "learning_rate": 0.001}
    assert f"kiln train status --job-id {job_id}" in out
    assert EmbeddedWorker().run_once()
    code, out, err = cli("train", "status", "--job-id", job_id)
    assert code == 0, err
    assert "status     succeeded" in out and "progress   6/6 steps" in out
    assert f"resume_checkpoint {adapter_name}-checkpoint-step-00000006.kiln-checkpoint" in out
    code, out, _ = cli("train", "status", "--job-id", job_id, "--json")
    assert json.loads(out)["latest_checkpoint"]["committed_step"] == 6
    code, out, _ = cli("train", "list")
    assert job_id in out and "succeeded" in out


@pytest.mark.django_db(transaction=True)
def test_optimizer_flags_become_config_optimizer(cli, tmp_path, adapter_name):
    data = jsonl(tmp_path / "corrections.jsonl")
    code, out, err = cli("train", "sft", "--file", str(data), "--adapter", adapter_name, "--adam-beta2", "0.95",
                         "--weight-decay", "0.01")
    assert code == 0, err
    job = TrainingJob.objects.get(pk=out.split()[1])
    assert job.request["config"]["optimizer"] == {"beta2": 0.95, "weight_decay": 0.01}


@pytest.mark.django_db(transaction=True)
def test_a_file_inside_a_data_root_is_sent_by_path(cli, settings, adapter_name):
    data = jsonl(settings.KILN_DATASETS_DIR / f"{adapter_name}.jsonl")
    code, out, err = cli("train", "sft", "--file", str(data), "--adapter", adapter_name)
    assert code == 0, err
    job = TrainingJob.objects.get(pk=out.split()[1])
    assert job.data_source_kind == "file" and job.request["dataset_path"] == str(data)
    code, out, err = cli("train", "sft", "--file", str(data), "--adapter", adapter_name + "-up", "--upload")
    assert TrainingJob.objects.get(pk=out.split()[1]).data_source_kind == "inline"


@pytest.mark.django_db(transaction=True)
def test_cancel(cli, tmp_path, adapter_name):
    code, out, _ = cli("train", "sft", "--file", str(jsonl(tmp_path / "d.jsonl")), "--adapter", adapter_name)
    job_id = out.split()[1]
    code, out, err = cli("train", "cancel", "--job-id", job_id, "--wait")
    assert code == 0 and f"job {job_id} cancelled" in out and "status     cancelled" in out
    code, out, err = cli("train", "cancel", "--job-id", job_id)
    assert code == 1 and "job_not_active" in err


@pytest.mark.django_db(transaction=True)
def test_refusals_print_code_field_and_reason(cli, tmp_path, adapter_name):
    data = str(jsonl(tmp_path / "d.jsonl"))
    code, out, err = cli("train", "sft", "--file", data, "--adapter", adapter_name, "--checkpoint-interval", "0")
    assert code == 1
    assert "invalid_request" in err and "field: config.checkpoint_interval" in err
    code, _, err = cli("train", "sft", "--file", str(tmp_path / "missing.jsonl"), "--adapter", adapter_name)
    assert code == 1 and "is not a file" in err
    (tmp_path / "bad.jsonl").write_text('{"prompt": "a"}\nnot json\n')
    code, _, err = cli("train", "sft", "--file", str(tmp_path / "bad.jsonl"), "--adapter", adapter_name)
    assert code == 1 and "bad.jsonl:2 is not JSON" in err
    code, _, err = cli("train", "status", "--job-id", "00000000-0000-0000-0000-000000000000")
    assert code == 1 and "not_found" in err


@pytest.mark.django_db(transaction=True)
def test_token_and_url_problems_say_what_to_do(cli, monkeypatch, tmp_path):
    monkeypatch.setenv("KILN_TOKEN", "kiln_wrong")
    code, _, err = cli("train", "list")
    assert code == 1 and "unauthorized" in err and "kiln token create" in err
    monkeypatch.delenv("KILN_TOKEN")
    code, _, err = cli("train", "list")
    assert code == 1 and "no API token" in err
    monkeypatch.setenv("KILN_TOKEN", "kiln_x")
    monkeypatch.setenv("KILN_URL", "http://127.0.0.1:9")
    code, _, err = cli("train", "list")
    assert code == 1 and "cannot reach Kiln at http://127.0.0.1:9" in err


@pytest.mark.django_db(transaction=True)
def test_url_and_token_from_the_config_file(cli, monkeypatch, tmp_path, live_server, ada):
    monkeypatch.delenv("KILN_URL")
    monkeypatch.delenv("KILN_TOKEN")
    config = tmp_path / "config" / "kiln" / "cli.json"
    config.parent.mkdir(parents=True)
    config.write_text(json.dumps({"url": live_server.url, "token": ada.token}))
    code, out, err = cli("train", "list")
    assert code == 0, err


@pytest.mark.django_db
def test_token_create_prints_the_token_once(capsys, django_user_model):
    from kiln_web.accounts.actions import authenticate_token

    assert main(["token", "create", "--user", "dana"]) == 0
    out, err = capsys.readouterr()
    token = out.strip()
    assert authenticate_token(token).username == "dana"
    assert "created user 'dana'" in err and "shown once" in err and token not in err


@pytest.mark.django_db(transaction=True)  # the caches are cleared when the revocation commits
def test_token_list_and_revoke(capsys):
    """`kiln token list` shows each token's id, user, name and first characters, never the token; `kiln token
    revoke` takes an id or those characters, and the token stops authenticating at once (the authentication cache
    and status fast path included) while the user's other tokens go on; an unknown or ambiguous reference is
    refused, exit 1, saying what to give."""
    from kiln_web.accounts.actions import authenticate_token

    tokens = {}
    for user, name in (("dana", "laptop"), ("dana", "ci"), ("erin", "notebook")):
        assert main(["token", "create", "--user", user, "--name", name]) == 0
        tokens[name] = capsys.readouterr()[0].strip()
        assert authenticate_token(tokens[name]).username == user  # remembered by the cache from here on
    assert main(["token", "list"]) == 0
    out = capsys.readouterr()[0]
    assert all(token not in out and token[:12] in out for token in tokens.values()), out
    assert main(["token", "list", "--user", "dana", "--json"]) == 0
    listed = json.loads(capsys.readouterr()[0])
    assert sorted(item["name"] for item in listed) == ["ci", "laptop"] and {item["user"] for item in listed} == {"dana"}
    assert main(["token", "revoke", tokens["laptop"][:12] + "..."]) == 0
    assert capsys.readouterr()[0] == f"revoked token {tokens['laptop'][:12]}... (laptop) of 'dana'\n"
    assert authenticate_token(tokens["laptop"]) is None
    assert authenticate_token(tokens["ci"]).username == "dana"
    ci = next(item for item in listed if item["name"] == "ci")
    assert main(["token", "revoke", str(ci["id"]), "--user", "erin"]) == 1  # not erin's
    assert "no token" in capsys.readouterr()[1]
    assert main(["token", "revoke", str(ci["id"])]) == 0 and authenticate_token(tokens["ci"]) is None
    capsys.readouterr()
    assert main(["token", "revoke", "kiln_"]) == 1 and "no token 'kiln_'" in capsys.readouterr()[1]
    assert authenticate_token(tokens["notebook"]).username == "erin"


@pytest.mark.django_db
def test_checkpoint_verify_and_show(fake_runner, api, adapter_name, capsys, settings):
    response = api.post("/v1/train/sft", sft_body(adapter_name, records=2, checkpoint_interval=1))
    assert EmbeddedWorker().run_once()
    path = settings.KILN_ADAPTERS_DIR / f"{adapter_name}-checkpoint-step-00000002.kiln-checkpoint"
    assert main(["checkpoint", "verify", str(path)]) == 0
    out, _ = capsys.readouterr()
    assert out.startswith(f"valid: {path.name} (sft, adapter {adapter_name}, step 2")
    # the fake runner writes no planning identity: verify says its state was not checked, and why
    assert "only its files and checksums were checked, not its state" in out and "no planning identity" in out
    assert main(["checkpoint", "show", str(path)]) == 0
    out, _ = capsys.readouterr()
    assert f"resume_checkpoint {path.name}" in out and "complete          yes" in out
    cursor = next(line for line in out.splitlines() if line.startswith("next_cursor"))
    assert "{" not in cursor and "None" not in cursor and "'" not in cursor, cursor
    assert main(["checkpoint", "show", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr()[0])["step"] == 2
    (path / "state.json").write_text('{"step": 7}')
    assert main(["checkpoint", "show", str(path)]) == 0  # metadata only: sizes agree
    capsys.readouterr()
    assert main(["checkpoint", "verify", str(path)]) == 1
    assert "checksum_mismatch" in capsys.readouterr()[1]
    capsys.readouterr()
    for missing in (path.parent / "nothing-checkpoint-step-00000001.kiln-checkpoint", path.parent / "typo"):
        assert main(["checkpoint", "verify", str(missing)]) == 1
        # a missing path is said to be missing, whatever its name (not that "typo" breaks the naming rules)
        assert capsys.readouterr()[1] == f"invalid: {missing.name}: not_found: no checkpoint at {missing}\n"
    assert response.status_code == 201


@pytest.mark.slow
def test_kiln_worker_refuses_an_unmigrated_database_then_polls_and_stops_on_ctrl_c(tmp_path):
    import os
    import signal
    import subprocess
    import sys

    from .services import ROOT, Process

    env = {k: v for k, v in os.environ.items() if k not in {"DATABASE_URL", "REDIS_URL", "DJANGO_SETTINGS_MODULE"}}
    env |= {"KILN_HOME": str(tmp_path), "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, "-m", "kiln_web.cli", "worker", "--poll-seconds", "0.1"]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "unapplied migrations" in result.stderr
    subprocess.run([sys.executable, "manage.py", "migrate", "-v0"], cwd=ROOT, env=env, check=True, timeout=120)
    worker = Process(command, env)
    try:
        worker.wait_for("is polling for queued jobs", 300)
        worker.popen.send_signal(signal.SIGINT)
        assert worker.popen.wait(300) == 0, worker.output[-3000:]  # a bound for a hang, not a window
    finally:
        worker.stop(signal.SIGKILL)


# -- GRPO, OPD and teacher aliases (the real trainer's admission; nothing is run) --


@pytest.mark.django_db(transaction=True)
def test_train_grpo_sends_a_data_root_file_by_path_and_uploads_others(cli, settings, tmp_path, adapter_name):
    from .rl_data import GROUPS, write_groups

    inside = write_groups(settings.KILN_DATASETS_DIR / f"{adapter_name}.jsonl")
    code, out, err = cli("train", "grpo", "--file", inside, "--adapter", adapter_name, "--streaming",
                         "--checkpoint-interval", "3", "--seed", "4", "--loss-type", "bnpo")
    assert code == 0, err
    job = TrainingJob.objects.get(pk=out.split()[1])
    assert job.kind == "grpo" and job.data_source_kind == "streamed_jsonl"
    assert job.request == {"dataset_path": inside, "config": {"output_name": adapter_name, "seed": 4,
                                                              "loss_type": "bnpo", "checkpoint_interval": 3,
                                                              "streaming": True}}
    outside = write_groups(tmp_path / "groups.jsonl")
    code, out, err = cli("train", "grpo", "--file", outside, "--adapter", adapter_name + "-up")
    assert code == 0, err
    assert TrainingJob.objects.get(pk=out.split()[1]).request["groups"] == GROUPS
    code, _, err = cli("train", "grpo", "--file", outside, "--adapter", adapter_name + "-s", "--streaming")
    assert code == 1 and "put it in a data root" in err


@pytest.mark.django_db(transaction=True)
def test_teacher_show_names_an_adapter_or_says_it_is_not_shared(capsys):
    from kiln_web.cli_remote import _print_teacher

    alias = {"name": "tutor@native", "route": "native", "base": "kiln-tiny", "owner": "ada",
             "identity_revision": "ab" * 32, "content_revision": None}
    _print_teacher({**alias, "adapter": "/data/tutor", "adapter_hidden": False})
    assert "teacher   kiln-tiny + adapter /data/tutor\n" in capsys.readouterr().out
    _print_teacher({**alias, "adapter": None, "adapter_hidden": True})
    assert "teacher   kiln-tiny + an adapter not shared with you\n" in capsys.readouterr().out
    _print_teacher({**alias, "adapter": None, "adapter_hidden": False})
    assert "teacher   kiln-tiny\n" in capsys.readouterr().out


def test_teacher_add_list_show_and_train_opd_from_a_request_file(cli, tmp_path, adapter_name):
    from .rl_data import PROMPTS

    code, out, err = cli("teacher", "add", "tutor@native", "--base", "kiln-tiny")
    assert code == 0, err
    assert "name      tutor@native" in out and "not yet reconstructed" in out
    identity = out.split("identity  ")[1].split()[0]
    code, out, _ = cli("teacher", "list")
    assert out.startswith("tutor@native") and identity[:12] in out and "kiln-tiny" in out
    code, _, err = cli("teacher", "add", "tutor@native", "--base", "kiln-tiny")
    assert code == 1 and "teacher_exists" in err and "--replace" in err

    request = tmp_path / "opd-request.json"
    request.write_text(json.dumps({"prompts": PROMPTS, "config": {"steps": 3, "max_new_tokens": 4}}))
    code, out, err = cli("train", "opd", "--file", str(request), "--adapter", adapter_name, "--teacher",
                         "tutor@native", "--checkpoint-interval", "1")
    assert code == 0, err
    job_id = out.split()[1]
    job = TrainingJob.objects.get(pk=job_id)
    assert job.kind == "opd" and job.request["config"] == {
        "steps": 3, "max_new_tokens": 4, "output_name": adapter_name, "teacher": "tutor@native",
        "checkpoint_interval": 1}
    code, out, err = cli("train", "status", "--job-id", job_id)
    assert f"teacher    tutor@native (identity {identity[:16]}, content " in out
    code, out, _ = cli("teacher", "show", "tutor@native", "--json")
    assert json.loads(out)["content_revision"] == job.identities["teacher"]["content_revision"]

    prompts = tmp_path / "prompts.jsonl"  # a prompts file rather than a request: uploaded as prompts
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    code, out, err = cli("train", "opd", "--file", str(prompts), "--adapter", adapter_name + "-b", "--teacher",
                         "tutor@native", "--steps", "2")
    assert code == 0, err
    assert TrainingJob.objects.get(pk=out.split()[1]).request["prompts"] == PROMPTS
    code, _, err = cli("teacher", "delete", "tutor@native")
    assert code == 1 and "teacher_in_use" in err
    code, _, err = cli("train", "opd", "--file", str(request), "--adapter", adapter_name + "-c", "--teacher",
                       "nobody@native")
    assert code == 1 and "teacher_not_found" in err and "field: config.teacher" in err


def test_checkpoint_clean_orphans(tmp_path, capsys):
    registry = tmp_path / "adapters"
    registry.mkdir()
    orphan = registry / ".bot-checkpoint-step-00000002.kiln-checkpoint.staging-0123456789abcdef"
    orphan.mkdir()
    assert main(["checkpoint", "clean-orphans", "--registry", str(registry)]) == 0  # young: kept
    assert orphan.is_dir() and "0 staging orphan(s) removed" in capsys.readouterr()[1]
    assert main(["checkpoint", "clean-orphans", "--registry", str(registry), "--older-than", "0"]) == 0
    out, err = capsys.readouterr()
    assert not orphan.exists() and out == f"removed {orphan.name}\n" and "1 staging orphan(s) removed" in err
    assert main(["checkpoint", "clean-orphans", "--registry", str(registry), "--older-than", "-1"]) == 2


# -- resume, job-id prefixes and small fixes --


@pytest.mark.django_db(transaction=True)
def test_a_job_cancelled_mid_run_resumes_by_prefix_from_its_latest_checkpoint(cli, settings, tmp_path, adapter_name,
                                                                              monkeypatch):
    from .test_resume_and_ids import cancel_at_step

    settings.KILN_CHECKPOINT_INTERVAL = 50  # the server default: the cancellation publishes the only checkpoint
    data = jsonl(tmp_path / "data.jsonl", records=6)
    code, out, err = cli("train", "sft", "--file", str(data), "--adapter", adapter_name)  # no --checkpoint-interval
    assert code == 0, err
    job_id = out.split()[1]
    with monkeypatch.context() as patch:
        cancel_at_step(patch)
        assert EmbeddedWorker().run_once()
    code, out, err = cli("train", "status", "--job-id", job_id[:8])
    basename = f"{adapter_name}-checkpoint-step-00000003.kiln-checkpoint"
    assert code == 0 and "status     cancelled" in out and f"resume_checkpoint {basename}" in out

    code, out, err = cli("train", "resume", "--job-id", job_id[:8])  # trained on inline data: --file needed
    assert code == 1 and "source_required" in err and "--file" in err
    code, out, err = cli("train", "resume", "--job-id", job_id[:8], "--file", str(data))
    assert code == 0, err
    new = TrainingJob.objects.get(pk=out.split()[1])
    assert new.resume_from == basename and new.committed_step == 3 and str(new.pk) != job_id
    assert f"resuming from {basename}" in out
    assert new.request["config"]["resume_checkpoint"] == basename and new.request["data"] == json.loads(
        "[" + ",".join(data.read_text().splitlines()) + "]")
    assert EmbeddedWorker().run_once()
    code, out, _ = cli("train", "status", "--job-id", str(new.pk)[:12])
    assert "status     succeeded" in out and "progress   6/6 steps" in out

    code, out, _ = cli("train", "events", "--job-id", job_id[:8])
    assert code == 0 and "claimed by worker" in out and "cancelled by the test" in out
    code, out, _ = cli("train", "list")
    lines = out.splitlines()
    assert lines[0].split() == ["ID", "STATUS", "KIND", "ADAPTER", "STEPS", "LATEST", "CHECKPOINT"]
    assert lines[1].startswith(str(new.pk)) and lines[2].startswith(job_id)

    code, _, err = cli("train", "status", "--job-id", "abc")
    assert code == 1 and "invalid_job_id" in err and "at least 8 hex digits" in err


@pytest.mark.django_db(transaction=True)
def test_an_ambiguous_prefix_lists_the_matching_jobs(cli, tmp_path, adapter_name, monkeypatch):
    import uuid

    field = TrainingJob._meta.get_field("id")
    ids = iter(["feedf00d-0000-4000-8000-000000000001", "feedf00d-0000-4000-8000-000000000002"])
    data = str(jsonl(tmp_path / "d.jsonl"))
    with monkeypatch.context() as patch:
        patch.setattr(field, "default", lambda: uuid.UUID(next(ids)))
        patch.delitem(field.__dict__, "_get_default", raising=False)  # Django caches the default's callable
        for name in (adapter_name, adapter_name + "-2"):
            assert cli("train", "sft", "--file", data, "--adapter", name)[0] == 0
    field.__dict__.pop("_get_default", None)
    code, _, err = cli("train", "cancel", "--job-id", "feedf00d")
    assert code == 1 and "ambiguous_job_id" in err
    assert "  feedf00d-0000-4000-8000-000000000001" in err and "  feedf00d-0000-4000-8000-000000000002" in err
    code, out, _ = cli("train", "cancel", "--job-id", "feedf00d-0000-4000-8000-00000000000")
    assert code == 1  # still both
    code, out, err = cli("train", "cancel", "--job-id", "feedf00d000040008000000000000002")  # a full id
    assert code == 0 and "job feedf00d-0000-4000-8000-000000000002 cancelled" in out, err


@pytest.mark.django_db(transaction=True)
def test_the_wrong_token_hint_is_given_once(cli, monkeypatch):
    monkeypatch.setenv("KILN_TOKEN", "kiln_wrong")
    code, _, err = cli("train", "list")
    assert code == 1 and err.count("kiln token create") == 1 and "check KILN_TOKEN" in err


@pytest.mark.django_db(transaction=True)
def test_loading_an_adapter_without_a_snapshot_says_so(cli, tmp_path, adapter_name):
    code, out, err = cli("train", "sft", "--file", str(jsonl(tmp_path / "d.jsonl")), "--adapter", adapter_name)
    assert code == 0, err
    code, _, err = cli("adapter", "load", adapter_name)
    assert code == 1 and "no_snapshot" in err and "has no PEFT snapshot" in err and "base_required" not in err


@pytest.mark.django_db(transaction=True)
def test_eval_run_takes_the_baseline_its_api_takes(cli, settings, tmp_path, adapter_name):
    """POST /v1/evals/runs takes `baseline`; `kiln eval run --baseline` sends it (without it the CLI could only
    compare with the active adapter or the base)."""
    from kiln_web.evals.models import EvalRun
    from serving.helpers import publish_adapter

    for name, seed in ((adapter_name, 4), (f"{adapter_name}-old", 5)):
        publish_adapter(settings.KILN_HOME, settings.KILN_ADAPTERS_DIR, name, seed=seed)
    suite = tmp_path / "suite.jsonl"
    suite.write_text(json.dumps({"prompt": "a", "expected": "x"}) + "\n")
    code, _, err = cli("eval", "suite", "create", "--name", f"{adapter_name}-s", "--file", str(suite))
    assert code == 0, err
    code, out, err = cli("eval", "run", "--adapter", adapter_name, "--suite", f"{adapter_name}-s",
                         "--baseline", f"{adapter_name}-old")
    assert code == 0, err
    run = EvalRun.objects.get(pk=out.split()[1])
    assert (run.baseline_kind, run.baseline, run.baseline_note) == ("adapter", f"{adapter_name}-old", "asked for")
    code, _, err = cli("eval", "run", "--adapter", adapter_name, "--suite", f"{adapter_name}-s",
                       "--baseline", adapter_name)
    assert code == 1 and "cannot be its own baseline" in err and "field: baseline" in err


def test_eval_status_marks_pass_and_fail_with_a_header(capsys):
    from kiln_web.cli_serving import _print_run

    side = {"summary": {"correct": 1, "total": 2, "accuracy": 0.5}}
    run = {"id": "e1", "status": "succeeded", "suite": "s", "purpose": "manual",
           "candidate": {"adapter": "a", "base": "b", **side}, "baseline": {"kind": "base", "name": "b", **side},
           "examples": [{"index": 0, "expected": "4", "candidate": {"correct": True, "output": "4"},
                         "baseline": {"correct": False}},
                        {"index": 1, "expected": "5", "candidate": {"correct": False, "output": "6"},
                         "baseline": {"correct": True}}]}
    _print_run(run, examples=True)
    lines = capsys.readouterr()[0].splitlines()
    assert lines[3].split()[:3] == ["#", "CANDIDATE", "BASELINE"]
    assert lines[4].split()[:3] == ["0", "pass", "fail"] and lines[5].split()[:3] == ["1", "fail", "pass"]


def test_the_outside_the_data_roots_refusal_names_each_root_once(tmp_path):
    from trainer.runs.admission import AdmissionError, confined

    root = tmp_path / "datasets"
    root.mkdir()
    with pytest.raises(AdmissionError) as refused:
        confined("/etc/hostname", (root, str(root) + "/", tmp_path / "other"))
    assert refused.value.message.count(str(root)) == 1 and str(tmp_path / "other") in refused.value.message


def test_an_uploaded_jsonl_file_is_read_with_a_byte_order_mark_and_separators_inside_strings(tmp_path):
    """A Windows editor's byte-order mark is not part of the first record, and lines end at "\n" (or "\r\n") only,
    never at U+2028, U+2029 or U+0085 inside a JSON string; a bad line is still named."""
    from kiln_web.client import ApiError, read_jsonl

    records = [{"prompt": f"a{separator}b", "completion": " c"} for separator in ("\u2028", "\u2029", "\u0085")]
    path = tmp_path / "records.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + "".join(json.dumps(r, ensure_ascii=False) + "\r\n"
                                              for r in records).encode("utf-8"))
    assert read_jsonl(path) == records
    path.write_bytes(path.read_bytes() + b"\r\n{oops\r\n")
    with pytest.raises(ApiError) as refused:
        read_jsonl(path)
    assert f"{path}:5 is not JSON" in refused.value.message


@pytest.mark.parametrize("kind, field", [("sft", "data[1]"), ("grpo", "groups[1].completions[0]")])
def test_a_refused_record_of_an_uploaded_file_is_named_by_the_file_and_its_line(monkeypatch, capsys, tmp_path, kind,
                                                                                field):
    """A file outside the data roots is uploaded as records, and admission names a bad one by its index (data[1]),
    not where it is in the file the person edits (blank lines counted): the CLI says that too, as FILE:LINE."""
    from kiln_web.client import ApiError, Client

    def refuse(self, kind, body):
        raise ApiError(400, {"code": "invalid_request", "field": field, "message": "something about it"})

    monkeypatch.setattr(Client, "submit", refuse)
    monkeypatch.setenv("KILN_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("KILN_TOKEN", "token")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    path = tmp_path / "records.jsonl"
    path.write_text('\n{"prompt": "a", "completion": " b"}\n\n\n{"prompt": "c"}\n')
    assert main(["train", kind, "--file", str(path), "--adapter", "bot", "--upload"]) == 1
    err = capsys.readouterr()[1]
    assert f"  field: {field}\n" in err and f"  at: {path}:5\n" in err, err


class RecordedJobs:
    """A client whose job polls answer STATES in turn (the last one from then on), and whose events are EVENTS'
    first as many items as polls so far."""

    def __init__(self, states, timeout=300.0, events=()):
        self.states, self.timeout, self.polls, self.events_seen = list(states), timeout, 0, list(events)
        self.events_sent = 0  # events answered, over every page

    def job(self, job_id):
        self.polls += 1
        state = self.states.pop(0) if len(self.states) > 1 else self.states[0]
        if isinstance(state, Exception):  # the server did not answer this poll
            raise state
        return state

    def events(self, job_id, offset=0, limit=1000):
        """As GET /v1/train/jobs/{id}/events pages them (with a page of at most 2 here)."""
        items = self.events_seen[:self.polls]
        page = items[offset:offset + min(limit, 2)]
        self.events_sent += len(page)
        return {"items": page, "next_offset": offset + len(page) if offset + len(page) < len(items) else None}

    def all_events(self, job_id, offset=0):
        from kiln_web.client import Client

        return Client.all_events(self, job_id, offset)


def test_wait_shows_each_warning_and_error_once_as_it_comes(monkeypatch, capsys):
    from kiln_web import cli_remote

    monkeypatch.setattr("time.sleep", lambda seconds: None)
    events = [{"level": "info", "message": "claimed"},
              {"level": "warning", "message": "2 of 9 examples are longer than max_sequence_length 64"},
              {"level": "info", "message": "checkpoint step 1"},
              {"level": "error", "message": "the run failed: boom"}]
    states = [dict(job_state("running", None), progress={"committed_step": step, "total_steps": 4})
              for step in (0, 1, 2)]
    states.append(dict(job_state("failed", None), progress={"committed_step": 2, "total_steps": 4}))
    assert cli_remote._follow(RecordedJobs(states, events=events), "feedf00d")["status"] == "failed"
    err = capsys.readouterr()[1]
    assert err.count("  warning: 2 of 9 examples are longer than max_sequence_length 64\n") == 1
    assert err.count("  error: the run failed: boom\n") == 1
    assert "claimed" not in err and "checkpoint step 1" not in err
    assert err.index("running 1/4") < err.index("warning:") < err.index("running 2/4")


def test_wait_asks_only_for_the_events_it_has_not_seen(monkeypatch, capsys):
    """Each status change asked for the job's whole log again: quadratic in its events (100k events answered
    15.8 MB in 9.3 s). It asks from the first event it has not seen, page by page."""
    from kiln_web import cli_remote

    monkeypatch.setattr("time.sleep", lambda seconds: None)
    events = [{"level": "info", "message": f"checkpoint step {i}"} for i in range(40)]
    events[37] = {"level": "warning", "message": "late"}
    states = [dict(job_state("running", None), progress={"committed_step": step, "total_steps": 40})
              for step in range(40)] + [dict(job_state("failed", None), progress={"committed_step": 40,
                                                                                  "total_steps": 40})]
    client = RecordedJobs(states, events=events)
    assert cli_remote._follow(client, "feedf00d")["status"] == "failed"
    assert capsys.readouterr()[1].count("  warning: late\n") == 1
    assert client.events_sent == 40  # each event once


def test_wait_follows_a_job_through_a_server_restart(monkeypatch, capsys):
    """The web process restarting (an upgrade, a crash) while `--wait` follows a job: the job goes on with its
    worker, so the following waits for the server to answer again, saying so once, instead of ending with
    'cannot reach Kiln' and exit 1; a refusal (a 404: the job is gone) still ends it at once."""
    from kiln_web import cli_remote
    from kiln_web.client import ApiError

    slept = []
    monkeypatch.setattr("time.sleep", slept.append)
    down = ApiError(None, {"code": "unreachable", "message": "cannot reach Kiln at http://127.0.0.1:8000"})
    gateway = ApiError(502, {"code": "http_502", "message": "a proxy's Bad Gateway"})
    client = RecordedJobs([job_state("running", None), down, down, gateway, job_state("succeeded", None)])
    assert cli_remote._follow(client, "feedf00d")["status"] == "succeeded"
    err = capsys.readouterr()[1]
    assert err.count("the server does not answer") == 1 and "still following" in err, err
    assert "answers again" in err and client.polls == 5
    gone = ApiError(404, {"code": "not_found", "message": "no job feedf00d"})
    with pytest.raises(ApiError):
        cli_remote._follow(RecordedJobs([job_state("running", None), gone]), "feedf00d")
    clock = iter(range(0, 10_000, 100))  # the server never comes back: given up after the client's timeout
    monkeypatch.setattr("time.monotonic", lambda: next(clock))
    with pytest.raises(ApiError) as gave_up:
        cli_remote._follow(RecordedJobs([job_state("running", None), down], timeout=300.0), "feedf00d")
    assert gave_up.value.code == "unreachable"


def job_state(status, outcome, reason=""):
    return {"id": "feedf00d-0000-4000-8000-000000000003", "status": status, "adapter": "ada-first", "kind": "sft",
            "effective_seed": 1, "effective_config": {}, "progress": {"committed_step": 2, "total_steps": 2},
            "promotion": {"auto_load": True, "gate": None, "outcome": outcome, "reason": reason,
                          "decided_by": "auto_load" if outcome == "promoted" else None}}


def test_wait_with_auto_load_returns_once_the_promotion_is_decided(monkeypatch, capsys):
    import argparse

    from kiln_web import cli_remote

    monkeypatch.setattr("time.sleep", lambda seconds: None)
    client = RecordedJobs([job_state("running", None), job_state("succeeded", "pending"),
                           job_state("succeeded", "pending"), job_state("succeeded", "promoted", "the canary passed")])
    submitted = job_state("queued", None)
    assert cli_remote._submitted(client, submitted, argparse.Namespace(json=False, wait=True)) == 0
    out, err = capsys.readouterr()
    assert client.polls == 4  # through both pending polls to the decision
    assert "promotion  promoted by auto_load: the canary passed" in out and "pending" not in out
    assert "waiting for the promotion decision (the serving canary)" in err


def test_wait_gives_up_on_a_pending_promotion_after_the_clients_timeout(monkeypatch, capsys):
    import argparse

    from kiln_web import cli_remote

    monkeypatch.setattr("time.sleep", lambda seconds: None)
    client = RecordedJobs([job_state("succeeded", "pending")], timeout=0.0)
    assert cli_remote._submitted(client, job_state("queued", None), argparse.Namespace(json=False, wait=True)) == 0
    out, err = capsys.readouterr()
    assert "promotion  pending" in out
    assert "the promotion is still pending after 0 s" in err
    assert "kiln train status --job-id feedf00d-0000-4000-8000-000000000003" in err


def test_wait_does_not_wait_for_a_promotion_nobody_asked_for(monkeypatch, capsys):
    import argparse

    from kiln_web import cli_remote

    monkeypatch.setattr("time.sleep", lambda seconds: None)
    client = RecordedJobs([job_state("succeeded", "not_requested", "auto_load was not requested")])
    assert cli_remote._submitted(client, job_state("queued", None), argparse.Namespace(json=False, wait=True)) == 0
    assert client.polls == 1 and "waiting for the promotion" not in capsys.readouterr()[1]


def test_kiln_up_refuses_a_port_in_use_before_starting_or_announcing_anything(tmp_path):
    import os
    import socket
    import subprocess
    import sys

    from .services import ROOT

    env = {k: v for k, v in os.environ.items() if k not in {"DATABASE_URL", "REDIS_URL", "DJANGO_SETTINGS_MODULE"}}
    env |= {"KILN_HOME": str(tmp_path), "KILN_DEFAULT_BASE": "kiln-tiny"}
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "kiln_web.cli", "up", "--port", str(port)], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"kiln up: port {port} on 127.0.0.1 is in use; pass --port" in done.stderr
    assert "serving" not in done.stdout and "worker" not in done.stdout and "Traceback" not in done.stderr


@pytest.mark.django_db(transaction=True)
def test_kiln_up_stops_its_worker_whatever_ends_the_server(monkeypatch, capsys):
    """uvicorn exits with SystemExit when it cannot start (the port taken after the check, say): the embedded
    worker and the housekeeper are stopped then too, not only on Ctrl-C."""
    import signal

    import uvicorn

    from kiln_web import cli_server
    from kiln_web.jobs import worker as jobs_worker

    stopped = []

    class Thread:
        running_job = None

        def start(self):
            return self

        def stop(self, timeout=None):
            stopped.append(type(self).__name__)

    class EmbeddedWorker(Thread):
        pass

    class Housekeeper(Thread):
        pass

    def fail_to_start(*args, **kwargs):
        raise SystemExit(3)

    monkeypatch.setattr(jobs_worker, "EmbeddedWorker", EmbeddedWorker)
    monkeypatch.setattr(jobs_worker, "Housekeeper", Housekeeper)
    monkeypatch.setattr(cli_server, "_register_packaged_bases", lambda: None)
    monkeypatch.setattr(cli_server, "port_refusal", lambda host, port: None, raising=False)
    monkeypatch.setattr(uvicorn, "run", fail_to_start)
    monkeypatch.setattr(signal, "signal", lambda *args: None)  # leave this process's SIGTERM handler alone
    with pytest.raises(SystemExit):
        main(["up", "--port", "8000"])  # never bound: the check and uvicorn are replaced
    assert sorted(stopped) == ["EmbeddedWorker", "Housekeeper"]
    assert "Kiln stopped" in capsys.readouterr()[0]


def into_a_closed_pipe(argv, env):
    """`kiln ARGV | head` once head has exited: stdout is a pipe whose reader is gone before anything is written."""
    import os
    import subprocess
    import sys

    from .services import ROOT

    reader, writer = os.pipe()
    os.close(reader)
    try:
        return subprocess.run([sys.executable, "-m", "kiln_web.cli", *argv], cwd=ROOT, env=env, stdout=writer,
                              stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(writer)


def cli_env(tmp_path, **extra):
    import os

    env = {k: v for k, v in os.environ.items() if k not in {"DATABASE_URL", "REDIS_URL", "DJANGO_SETTINGS_MODULE"}}
    return env | {"KILN_HOME": str(tmp_path), "XDG_CONFIG_HOME": str(tmp_path / "config"), **extra}


def test_a_closed_pipe_ends_a_local_command_quietly(tmp_path):
    done = into_a_closed_pipe(["base", "show", "kiln-tiny"], cli_env(tmp_path))
    assert done.returncode == 1 and done.stderr == ""  # neither "[Errno 32] Broken pipe" nor a traceback


@pytest.mark.django_db(transaction=True)
def test_a_closed_pipe_ends_an_api_command_quietly(live_server, ada, tmp_path):
    done = into_a_closed_pipe(["train", "list"], cli_env(tmp_path, KILN_URL=live_server.url, KILN_TOKEN=ada.token))
    assert done.returncode == 1 and done.stderr == ""


def test_status_shows_a_grpo_cursor_without_python_values(capsys):
    """A complete GRPO checkpoint's cursor has group_sha256 null: it is left out, not printed as None."""
    from kiln_web import cli_remote

    job = job_state("succeeded", "not_requested") | {"kind": "grpo", "latest_checkpoint": {
        "committed_step": 4, "total_steps": 4, "complete": True, "resume_checkpoint": "g-checkpoint-step-00000004",
        "next_cursor": {"epoch": 2, "group": 0, "iteration": 0, "group_sha256": None}}}
    cli_remote._print_job(job)
    out = capsys.readouterr()[0]
    assert "checkpoint step 4 of 4 (complete), next epoch 2, group 0, iteration 0\n" in out
    assert "None" not in out


@pytest.mark.parametrize("kind", ["sft", "grpo", "opd"])
def test_every_kind_takes_base_adapter_as_its_api_does(kind, tmp_path):
    """config.base_adapter is a field of SFT, GRPO and OPD requests alike (docs/api.md), so each `kiln train` kind
    takes --base-adapter (OPD, which had the field first, did not)."""
    from kiln_web import cli, cli_remote

    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps(["Hello"] if kind == "opd" else {"prompt": "a", "completion": "b"}) + "\n")
    argv = ["train", kind, "--file", str(data), "--adapter", "warm", "--base-adapter", "/data/kiln/adapters/cold",
            "--upload"] + (["--teacher", "tutor@native"] if kind == "opd" else [])
    args = cli.build_parser().parse_args(argv)
    assert cli_remote.BODIES[kind](args)["config"]["base_adapter"] == "/data/kiln/adapters/cold"
