"""The `kiln` command: train sft/status/cancel/list through a live server, token create and checkpoint
verify/show locally."""

import json

import pytest

from kiln_web.cli import main
from kiln_web.jobs.models import TrainingJob
from kiln_web.jobs.worker import EmbeddedWorker

from .conftest import sft_body


@pytest.fixture
def cli(live_server, fake_runner, monkeypatch, capsys, ada, tmp_path):
    """Run `kiln ...` in-process against the live test server as ada; returns (exit code, stdout, stderr)."""
    monkeypatch.setenv("KILN_URL", live_server.url)
    monkeypatch.setenv("KILN_TOKEN", ada.token)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))

    def run(*argv):
        capsys.readouterr()
        code = main(list(argv))
        out, err = capsys.readouterr()
        return code, out, err

    return run


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


@pytest.mark.django_db
def test_checkpoint_verify_and_show(fake_runner, api, adapter_name, capsys, settings):
    response = api.post("/v1/train/sft", sft_body(adapter_name, records=2, checkpoint_interval=1))
    assert EmbeddedWorker().run_once()
    path = settings.KILN_ADAPTERS_DIR / f"{adapter_name}-checkpoint-step-00000002.kiln-checkpoint"
    assert main(["checkpoint", "verify", str(path)]) == 0
    out, _ = capsys.readouterr()
    assert out.startswith(f"valid: {path.name} (sft, adapter {adapter_name}, step 2")
    assert main(["checkpoint", "show", str(path)]) == 0
    out, _ = capsys.readouterr()
    assert f"resume_checkpoint {path.name}" in out and "complete          True" in out
    assert main(["checkpoint", "show", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr()[0])["step"] == 2
    (path / "state.json").write_text('{"step": 7}')
    assert main(["checkpoint", "show", str(path)]) == 0  # metadata only: sizes agree
    capsys.readouterr()
    assert main(["checkpoint", "verify", str(path)]) == 1
    assert "checksum_mismatch" in capsys.readouterr()[1]
    assert main(["checkpoint", "verify", str(path.parent / "nothing-checkpoint-step-00000001.kiln-checkpoint")]) == 1
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
