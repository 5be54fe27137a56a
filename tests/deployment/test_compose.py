"""docker-compose.yml and the Dockerfile, parsed: every service's command exists in the project (console
scripts declared in pyproject.toml, subcommands that parse, the Celery app and its tasks), every file and
volume they reference exists, web and workers share the data root, and every setting passes through the
environment and is documented in docs/deployment.md."""

import os
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
SETTING = re.compile(r"\benv_(?:str|bool|int|path|float|choice|paths|list|secret)\(\s*\"([A-Z][A-Z0-9_]*)\"")
INTERPOLATION = re.compile(r"\$\{([A-Z_][A-Z0-9_]*)(?::?-([^}]*))?\}")


def interpolate(value):
    """Compose's ${NAME:-default} with nothing set in the environment: the default (or empty)."""
    if isinstance(value, str):
        return INTERPOLATION.sub(lambda match: match.group(2) or "", value)
    if isinstance(value, list):
        return [interpolate(item) for item in value]
    if isinstance(value, dict):
        return {key: interpolate(item) for key, item in value.items()}
    return value


@pytest.fixture(scope="module")
def compose() -> dict:
    return interpolate(yaml.safe_load((ROOT / "docker-compose.yml").read_text()))


@pytest.fixture(scope="module")
def scripts() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]


def settings_variables() -> set:
    """Every environment variable kiln_web/settings.py reads (secrets also read NAME_FILE)."""
    return set(SETTING.findall((ROOT / "kiln_web" / "settings.py").read_text()))


def dockerfile() -> list[tuple[str, str]]:
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    return [tuple(line.split(None, 1)) for line in text.splitlines() if line.strip() and not line.startswith("#")]


def check_kiln_command(argv, scripts):
    from kiln_web import cli

    assert argv[0] in scripts, f"{argv[0]} is not a console script in pyproject.toml"
    assert scripts[argv[0]] == "kiln_web.cli:main"
    args = cli.build_parser().parse_args(argv[1:])  # exits (SystemExit) on an unknown subcommand or option
    return args


def test_the_services_and_what_they_share(compose):
    services = compose["services"]
    assert set(services) == {"web", "worker", "redis", "postgres"}
    for name, service in services.items():
        for dependency in service.get("depends_on", {}):
            assert dependency in services, f"{name} depends on unknown {dependency}"
        for mount in service.get("volumes", []):
            source = mount.split(":", 1)[0]
            assert source in compose["volumes"], f"{name} mounts undeclared volume {source}"
    for name in ("redis", "postgres", "web"):
        assert services[name]["healthcheck"]["test"], f"{name} has no healthcheck"
    web, worker = services["web"], services["worker"]
    assert web["build"] == "." and worker["build"] == "." and (ROOT / "Dockerfile").is_file()
    home = web["environment"]["KILN_HOME"]
    assert web["environment"] == worker["environment"]  # one setting, one value, everywhere
    assert [m for m in web["volumes"] if m.endswith(f":{home}")] == [m for m in worker["volumes"]
                                                                      if m.endswith(f":{home}")] != []
    # scalable: nothing a second replica would collide on
    assert "container_name" not in worker and "ports" not in worker and "hostname" not in worker
    environment = web["environment"]
    assert environment["DATABASE_URL"].startswith("postgres://") and "@postgres:5432/" in environment["DATABASE_URL"]
    assert environment["REDIS_URL"].startswith("redis://redis:6379/")


def test_the_web_command_is_kiln_up(compose, scripts):
    from kiln_web import cli

    args = check_kiln_command(compose["services"]["web"]["command"], scripts)
    assert args.run is cli.cmd_up and args.host == "0.0.0.0" and args.port == 8000
    healthcheck = " ".join(compose["services"]["web"]["healthcheck"]["test"])
    assert f":{args.port}/healthz" in healthcheck


def test_the_worker_command_is_the_projects_celery_app_on_the_training_queue(compose):
    from django.conf import settings

    from kiln_web.celery import app

    argv = compose["services"]["worker"]["command"]
    assert argv[:4] == ["celery", "-A", "kiln_web", "worker"]
    queue = argv[argv.index("-Q") + 1]
    assert queue == compose["services"]["worker"]["environment"]["KILN_TRAINING_QUEUE"] == "training"
    app.loader.import_default_modules()
    assert {"kiln.run_training_job", "kiln.mark_lost_jobs"} <= set(app.tasks)
    assert settings.CELERY_TASK_ROUTES["kiln.run_training_job"]["queue"] == settings.KILN_TRAINING_QUEUE
    # celery itself loads `-A kiln_web` and parses every option (an unknown one fails before --help)
    env = {k: v for k, v in os.environ.items() if k not in {"DATABASE_URL", "REDIS_URL", "DJANGO_SETTINGS_MODULE"}}
    result = subprocess.run([sys.executable, "-m", *argv, "--help"], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0 and "Usage:" in result.stdout, result.stdout[-2000:] + result.stderr[-2000:]


def test_the_dockerfile_builds_from_files_that_exist_and_starts_kiln(scripts):
    instructions = dockerfile()
    copies = [rest.split() for op, rest in instructions if op == "COPY"]
    for *sources, _ in copies:
        for source in sources:
            assert (ROOT / source).exists(), source
    environment = " ".join(rest for op, rest in instructions if op == "ENV")
    assets = re.search(r"KILN_ASSETS_DIR=(\S+)", environment).group(1)
    workdir = [rest for op, rest in instructions if op == "WORKDIR"][-1]
    assert assets == workdir and (ROOT / "templates").is_dir() and (ROOT / "static").is_dir()
    cmd = [rest for op, rest in instructions if op == "CMD"][-1]
    argv = yaml.safe_load(cmd) if cmd.startswith("[") else shlex.split(cmd)
    check_kiln_command(argv, scripts)
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert ".venv/" in ignored and ".git/" in ignored


def test_every_console_script_in_pyproject_imports(scripts):
    import importlib

    assert {"kiln", "kiln-replay"} <= set(scripts)
    for name, target in scripts.items():
        module, function = target.split(":")
        assert callable(getattr(importlib.import_module(module), function)), name


def test_every_setting_passes_through_the_environment_and_is_documented(compose, tmp_path):
    variables = settings_variables()
    assert {"DATABASE_URL", "REDIS_URL", "SECRET_KEY", "KILN_HOME", "KILN_TRAINING_QUEUE"} <= variables
    environment = compose["services"]["web"]["environment"]
    test_only = {name for name in variables if name.startswith("KILN_TEST_")}  # never in a deployment
    assert not test_only & set(environment), f"docker-compose.yml passes test-only {sorted(test_only)}"
    missing = sorted(variables - test_only - set(environment))
    assert not missing, f"docker-compose.yml does not pass {missing} (add them to x-kiln-environment)"
    documentation = (ROOT / "docs" / "deployment.md").read_text()
    undocumented = sorted(name for name in variables | {"KILN_URL", "KILN_TOKEN"} if f"`{name}`" not in documentation)
    assert not undocumented, f"docs/deployment.md does not document {undocumented}"
    # the values compose passes (defaults, empties) are settings Django accepts
    env = {k: v for k, v in os.environ.items() if k not in variables and k != "DJANGO_SETTINGS_MODULE"}
    env |= {key: str(value) for key, value in environment.items()}
    env["KILN_HOME"] = str(tmp_path)
    env["KILN_ASSETS_DIR"] = str(ROOT)
    result = subprocess.run([sys.executable, "-c", "import django, os; os.environ['DJANGO_SETTINGS_MODULE'] = "
                             "'kiln_web.settings'; django.setup(); from django.conf import settings; "
                             "print(settings.KILN_TRAINING_QUEUE, settings.DATABASES['default']['HOST'])"],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["training", "postgres"]
