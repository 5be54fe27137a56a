"""The `kiln` command as a new user and an operator meet it when something is wrong: a KILN_URL that is not a Kiln
server, Ctrl-C while following a job, malformed settings (TIME_ZONE, the engine's variables), and what `kiln
doctor` checks (the database, the broker, the default base). No traceback reaches the person, and each message
says what to do."""

import json
import os
import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from kiln_web.cli import main

from .services import ROOT


@pytest.fixture
def kiln(monkeypatch, capsys, tmp_path):
    """run(*argv, url=...) -> (exit code, stdout, stderr): `kiln ...` in-process with KILN_URL=URL."""
    monkeypatch.setenv("KILN_TOKEN", "kiln_x")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))

    def run(*argv, url):
        monkeypatch.setenv("KILN_URL", url)
        capsys.readouterr()
        code = main(list(argv))
        out, err = capsys.readouterr()
        return code, out, err

    return run


@pytest.fixture
def not_kiln():
    """A web server that is not Kiln (a proxy's or another app's): /v1/train/jobs answers 200 with an HTML page,
    /v1/502 a proxy's plain-text 502, anything else a 404 HTML page. Yields its root URL."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path.startswith("/v1/train/jobs"):
                status, kind, body = 200, "text/html", b"<!doctype html><html><body>Welcome to nginx!</body></html>"
            elif self.path.startswith("/gateway/v1/"):
                status, kind, body = 502, "text/plain", b"upstream connect error or disconnect/reset before headers"
            else:
                status, kind, body = 404, "text/html", b"<!doctype html><html><title>Not found</title></html>" * 20
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join()


def test_a_server_that_is_not_kiln_is_named_instead_of_a_traceback_or_its_page(kiln, not_kiln):
    code, out, err = kiln("train", "list", url=not_kiln)  # 200 with HTML: json.loads failed with a traceback
    assert code == 1 and out == ""
    assert "Traceback" not in err and "<html" not in err
    assert f"{not_kiln} answered GET /v1/train/jobs with HTTP 200 (text/html), not Kiln's JSON API" in err
    assert "check KILN_URL" in err
    code, out, err = kiln("train", "status", "--job-id", "3f2a9c1e", url=not_kiln + "/static")  # an HTML 404 page
    assert code == 1 and "<html" not in err and "<title" not in err
    assert "HTTP 404 (text/html), not Kiln's JSON API" in err and "check KILN_URL" in err
    code, out, err = kiln("teacher", "list", url=not_kiln + "/gateway")  # a proxy's own refusal: its words kept
    assert code == 1 and "HTTP 502 (text/plain)" in err and "upstream connect error" in err


@pytest.mark.parametrize("url", ["localhost:8000", "127.0.0.1", "ftp://127.0.0.1:8000", "http://127.0.0.1:80x0",
                                 "http://"])
def test_a_kiln_url_that_is_no_http_url_says_so(kiln, url):
    code, out, err = kiln("train", "list", url=url)
    assert code == 1 and "Traceback" not in err
    assert f"KILN_URL={url!r} is not an http:// or https:// URL" in err and "http://127.0.0.1:8000" in err


def test_a_url_that_is_no_http_url_in_the_config_file_names_the_file(monkeypatch, capsys, tmp_path):
    monkeypatch.delenv("KILN_URL", raising=False)
    monkeypatch.delenv("KILN_TOKEN", raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    config = tmp_path / "config" / "kiln" / "cli.json"
    config.parent.mkdir(parents=True)
    config.write_text(json.dumps({"url": "kiln.internal:8000", "token": "kiln_x"}))
    assert main(["train", "list"]) == 1
    err = capsys.readouterr()[1]
    assert f"\"url\" in {config} ('kiln.internal:8000') is not an http:// or https:// URL" in err


def test_a_port_that_does_not_speak_http_is_named(kiln):
    """KILN_URL at Redis' or PostgreSQL's port: the answer is no HTTP status line (http.client.BadStatusLine)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)

    def answer_garbage():
        connection, _ = listener.accept()
        connection.recv(65536)
        connection.sendall(b"-ERR unknown command 'GET'\r\n")
        connection.close()

    thread = threading.Thread(target=answer_garbage, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    try:
        code, out, err = kiln("train", "list", url=url)
    finally:
        thread.join(10)
        listener.close()
    assert code == 1 and "Traceback" not in err
    assert f"{url} did not answer in HTTP" in err and "check KILN_URL" in err


class InterruptedJobs:
    """A client whose submission succeeds and whose first job poll is interrupted by Ctrl-C."""

    timeout = 300.0
    job_id = "feedf00d-0000-4000-8000-000000000009"

    def __init__(self, *args, **kwargs):
        pass

    def submit(self, kind, body):
        return {"id": self.job_id, "status": "queued", "adapter": "a", "progress": {"total_steps": 4},
                "effective_seed": 1, "effective_config": {}}

    def cancel(self, job_id):
        return {"id": self.job_id, "status": "cancelling"}

    def job(self, job_id):
        raise KeyboardInterrupt


@pytest.mark.parametrize("argv, still", [
    (["train", "sft", "--adapter", "a", "--wait"], "it goes on training on the server"),
    (["train", "cancel", "--job-id", "feedf00d", "--wait"], "it goes on cancelling on the server"),
])
def test_ctrl_c_while_following_a_job_says_the_job_goes_on(monkeypatch, capsys, tmp_path, argv, still):
    monkeypatch.setattr("kiln_web.client.Client", InterruptedJobs)
    if argv[1] == "sft":
        data = tmp_path / "d.jsonl"
        data.write_text('{"prompt": "a", "completion": "b"}\n')
        argv = argv + ["--file", str(data)]
    assert main(argv) == 130
    err = capsys.readouterr()[1]
    assert f"stopped following job {InterruptedJobs.job_id}; {still}" in err
    assert f"kiln train status --job-id {InterruptedJobs.job_id}" in err
    assert ("kiln train cancel" in err) == (argv[1] == "sft")


def test_ctrl_c_while_following_an_evaluation_says_it_goes_on(monkeypatch, capsys):
    class Evaluations(InterruptedJobs):
        def request(self, method, path, body=None, query=None):
            if method == "POST":
                return {"id": "e0000000-0000-4000-8000-000000000001", "status": "queued"}
            raise KeyboardInterrupt

    monkeypatch.setattr("kiln_web.client.Client", Evaluations)
    monkeypatch.setattr("time.sleep", lambda seconds: None)
    assert main(["eval", "run", "--adapter", "a", "--suite", "s", "--wait"]) == 130
    err = capsys.readouterr()[1]
    assert "stopped following evaluation e0000000-0000-4000-8000-000000000001" in err
    assert "kiln eval status --id e0000000-0000-4000-8000-000000000001" in err


def clean_env(tmp_path, **extra):
    env = {k: v for k, v in os.environ.items() if k not in {"DATABASE_URL", "REDIS_URL", "DJANGO_SETTINGS_MODULE"}}
    return env | {"KILN_HOME": str(tmp_path / "home"), "XDG_CONFIG_HOME": str(tmp_path / "config"), **extra}


def kiln_process(argv, env):
    return subprocess.run([sys.executable, "-m", "kiln_web.cli", *argv], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize("variable, value, words", [
    ("TIME_ZONE", "Mars/Olympus_Mons", "TIME_ZONE='Mars/Olympus_Mons' is not a time zone"),
    ("KILN_CPU_GEMM", "fast", "KILN_CPU_GEMM='fast' is not one of: auto, onednn, openblas"),
    ("KILN_OPENBLAS_THREADS", "mine", "KILN_OPENBLAS_THREADS='mine' is not one of: kiln, own"),
    ("KILN_POOL_SPIN_US", "-5", "KILN_POOL_SPIN_US=-5 is below the minimum of 0"),
])
def test_a_bad_setting_stops_a_command_with_its_name_not_a_traceback(tmp_path, variable, value, words):
    done = kiln_process(["token", "create", "--user", "ada"], clean_env(tmp_path, **{variable: value}))
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert f"kiln: configuration error: {words}" in done.stderr
    done = kiln_process(["doctor"], clean_env(tmp_path, **{variable: value}))
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert words in done.stdout + done.stderr


@pytest.mark.slow
def test_doctor_checks_the_database_the_default_base_and_the_broker(tmp_path):
    env = clean_env(tmp_path)
    done = kiln_process(["doctor", "--json"], env)  # a fresh KILN_HOME: reachable, not yet migrated
    report = json.loads(done.stdout)
    assert done.returncode == 0, done.stderr
    assert report["database_check"]["reachable"] is True
    assert report["database_check"]["unapplied_migrations"] > 0
    assert report["default_base"] == {"name": "kiln-tiny", "registered": True}
    done = kiln_process(["doctor"], env)
    assert "migrations not yet applied: `kiln up` (or python manage.py migrate) applies them" in done.stdout

    done = kiln_process(["token", "create", "--user", "ada"], env)  # was: OperationalError, no such table
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "unapplied migrations; run `kiln up` or `python manage.py migrate` first" in done.stderr
    done = kiln_process(["doctor"], env | {"KILN_DEFAULT_BASE": "kiln-tiny"})
    assert done.returncode == 0 and "default base kiln-tiny (KILN_DEFAULT_BASE)" in done.stdout
    done = kiln_process(["doctor"], env | {"KILN_DEFAULT_BASE": "llama-9000"})
    assert done.returncode == 1
    assert "KILN_DEFAULT_BASE names 'llama-9000', which is not registered" in done.stdout

    with socket.socket() as closed:  # a port nothing listens on
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    done = kiln_process(["doctor", "--json"], env | {"DATABASE_URL": f"postgres://kiln:secret@127.0.0.1:{port}/kiln",
                                                     "REDIS_URL": f"redis://:secret@127.0.0.1:{port}/0"})
    report = json.loads(done.stdout)
    assert done.returncode == 1
    assert report["database_check"]["reachable"] is False and str(port) in report["database_check"]["error"]
    assert report["broker_check"]["reachable"] is False
    assert "secret" not in done.stdout
    done = kiln_process(["token", "create", "--user", "ada"], env | {
        "DATABASE_URL": f"postgres://kiln:secret@127.0.0.1:{port}/kiln"})
    assert done.returncode == 2 and "Traceback" not in done.stderr and "secret" not in done.stderr
    assert "cannot use the database postgresql kiln on 127.0.0.1" in done.stderr and "check DATABASE_URL" in done.stderr


@pytest.mark.slow
def test_doctor_reaches_a_live_postgresql_and_redis(tmp_path):
    database, broker = os.environ.get("KILN_TEST_DATABASE_URL"), os.environ.get("KILN_TEST_REDIS_URL")
    if not database or not broker:
        pytest.skip("needs the suite's private PostgreSQL and Redis (tests/run_suite.py starts them)")
    done = kiln_process(["doctor", "--json"], clean_env(tmp_path, DATABASE_URL=database, REDIS_URL=broker))
    report = json.loads(done.stdout)
    assert report["database_check"]["reachable"] is True and report["broker_check"] == {"reachable": True,
                                                                                       "error": None}


def leaf_parsers(parser, path=()):
    """(command words, parser) of every `kiln ...` subcommand that takes no further subcommand."""
    import argparse

    choices = [action for action in parser._actions if isinstance(action, argparse._SubParsersAction)]
    if not choices:
        yield path, parser
    for action in choices:
        for name, sub in action.choices.items():
            yield from leaf_parsers(sub, path + (name,))


def test_every_subcommand_describes_itself_and_its_options():
    """`kiln train list --help` printed bare `--status STATUS` and `--limit LIMIT` with no description."""
    from kiln_web.cli import build_parser

    bare = []
    for words, parser in leaf_parsers(build_parser()):
        if not parser.description:
            bare.append(" ".join(words))
        bare += [f"{' '.join(words)} {action.option_strings[-1]}" for action in parser._actions
                 if action.option_strings and action.help is None and action.dest not in ("help",)
                 and action.dest not in NAMED_BY_FLAG]
    assert not bare, f"no description or no option help: {bare}"


# options whose flag says all (their help would repeat it): the config key of the same name is documented in api.md
NAMED_BY_FLAG = {"epochs", "seed", "learning_rate", "lr_schedule", "warmup_steps", "batch_size",
                 "gradient_accumulation_steps", "max_grad_norm", "lora_rank", "lora_alpha", "max_sequence_length",
                 "groups_per_step", "loss_type", "num_iterations", "steps"}


def test_train_list_refuses_an_unknown_status_as_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["train", "list", "--status", "done"])
    assert exited.value.code == 2
    assert "invalid choice: 'done'" in capsys.readouterr()[1]
    # the remote CLI spells the statuses without importing Django's models: held to them here
    from kiln_web.cli import build_parser
    from kiln_web.jobs.models import JobStatus

    train = next(a for a in build_parser()._subparsers._group_actions[0].choices["train"]._subparsers._group_actions)
    status = next(a for a in train.choices["list"]._actions if a.dest == "status")
    assert set(status.choices) == set(JobStatus.values)


def test_kiln_help_names_the_server_settings_and_the_exit_statuses(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr()[0]
    assert "KILN_URL" in out and "KILN_TOKEN" in out and "cli.json" in out
    assert "exit status" in out and "130" in out


class Listings:
    """A client whose every listing answers one item: the API's {"items": [...]} document."""

    timeout = 300.0
    item = {"id": "feedf00d-0000-4000-8000-000000000010", "name": "x@native", "status": "succeeded"}

    def __init__(self, *args, **kwargs):
        pass

    def request(self, method, path, body=None, query=None):
        return {"items": [self.item]}

    def jobs(self, **query):
        return self.request("GET", "/train/jobs")

    def teachers(self):
        return self.request("GET", "/teachers")


@pytest.mark.parametrize("argv", [["train", "list"], ["teacher", "list"], ["adapter", "promotions"],
                                  ["eval", "list"], ["eval", "suite", "list"], ["adapter", "list"]])
def test_every_listing_prints_its_api_document_as_json(monkeypatch, capsys, argv):
    """`kiln adapter list --json` existed; the other listings had no --json, so a script parsed their columns."""
    monkeypatch.setattr("kiln_web.client.Client", Listings)
    assert main(argv + ["--json"]) == 0
    assert json.loads(capsys.readouterr()[0]) == {"items": [Listings.item]}


def test_eval_run_wait_shows_each_status_as_it_comes(monkeypatch, capsys):
    """`kiln eval run --wait` printed nothing between "queued" and the result, for minutes on a real base."""
    run = {"id": "e0000000-0000-4000-8000-000000000002", "suite": "s", "purpose": "manual", "error": None,
           "candidate": {"adapter": "a", "base": "kiln-tiny", "summary": None},
           "baseline": {"kind": "base", "name": "kiln-tiny", "summary": None}}
    answers = [dict(run, status=status) for status in ("queued", "running", "running", "succeeded")]

    class Evaluations(Listings):
        def request(self, method, path, body=None, query=None):
            return answers.pop(0)

    monkeypatch.setattr("kiln_web.client.Client", Evaluations)
    monkeypatch.setattr("time.sleep", lambda seconds: None)
    assert main(["eval", "run", "--adapter", "a", "--suite", "s", "--wait"]) == 0
    out, err = capsys.readouterr()
    assert err == "  running\n  succeeded\n"
    assert "evaluation e0000000-0000-4000-8000-000000000002  succeeded" in out


@pytest.mark.parametrize("port", ["99999", "-1", "http"])
def test_kiln_up_refuses_a_port_that_is_no_port_as_a_usage_error(capsys, port):
    """`kiln up --port 99999` was an OverflowError traceback from the bind check."""
    with pytest.raises(SystemExit) as exited:
        main(["up", "--port", port])
    err = capsys.readouterr()[1]
    assert exited.value.code == 2 and "Traceback" not in err
    assert f"argument --port: {port!r} is not a port number (1 to 65535)" in err
