"""The commands that run Kiln on this machine: `up` (server and embedded worker), `worker`, `doctor`,
`version` and `token`; and what every command module shares: Django setup and the subcommand shapes."""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from urllib.parse import urlsplit, urlunsplit


def setup_django() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "kiln_web.settings")
    import django

    django.setup()


def subcommands(parser: argparse.ArgumentParser, command: str):
    """The required COMMAND_COMMAND choice under `kiln COMMAND` (base, train, adapter ...); each subcommand's
    --help opens with its one-line help unless it has a description of its own."""
    action = parser.add_subparsers(dest=f"{command}_command", required=True, metavar=f"{command.upper()}_COMMAND")
    add_parser = action.add_parser

    def described(name, **options):
        options.setdefault("description", options.get("help"))
        return add_parser(name, **options)

    action.add_parser = described
    return action


def add_subcommand(commands, name: str, help: str, operand: str | None = None, *, metavar: str | None = None,
                   operand_help: str | None = None, json: bool | str = False, **options) -> argparse.ArgumentParser:
    """`kiln ... NAME`, taking one OPERAND (shown as METAVAR, default OPERAND in capitals) and, where JSON is
    set, a --json flag (JSON, when a string, is its help). OPTIONS go to add_parser (description)."""
    subcommand = commands.add_parser(name, help=help, **options)
    if operand is not None:
        subcommand.add_argument(operand, metavar=metavar or operand.upper(), help=operand_help)
    if json:
        subcommand.add_argument("--json", action="store_true", help=json if isinstance(json, str) else None)
    return subcommand


def readable(value) -> str:
    """VALUE as the CLI's text output shows it to a person, never as Python's repr: a mapping (a checkpoint's
    cursor) as "key value, ..." without its empty entries, a list comma-separated, yes/no, and "-" for none."""
    if isinstance(value, dict):
        return ", ".join(f"{key} {readable(item)}" for key, item in value.items() if item is not None) or "-"
    if isinstance(value, (list, tuple)):
        return ", ".join(readable(item) for item in value) or "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    return "-" if value is None else str(value)


def hide_password(url: str) -> str:
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return urlunsplit(parts._replace(netloc=netloc))



def port_number(text: str) -> int:
    """--port's type: a TCP port, refused by argparse (usage, exit 2) when it is none, before anything binds."""
    try:
        port = int(text)
    except ValueError:
        port = 0
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number (1 to 65535)")
    return port


def add_up(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    parser.add_argument("--port", type=port_number, default=8000, help="port to listen on (default: %(default)s)")
    parser.add_argument("--processes", type=int, default=1,
                        help="web processes sharing the port (default: %(default)s); more than one needs REDIS_URL "
                             "(Celery workers, the Redis channel layer)")


def add_worker(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--poll-seconds", type=float, default=None,
                        help="how often to look for queued jobs (default: KILN_WORKER_POLL_SECONDS, 2)")


def _raise_keyboard_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _stop_worker(worker) -> None:
    """Stop a worker cleanly: a running job is cancelled and publishes a checkpoint at its next safe boundary."""
    job_id = worker.running_job
    if job_id is not None:
        print(f"cancelling job {job_id}: waiting for it to publish a checkpoint at its next step boundary "
              "(Ctrl-C again to quit at once; the job is then marked lost later)", flush=True)
    worker.stop()


def _register_packaged_bases() -> None:
    """Register the real bases installed pip packages ship (once), and say which base is the default. An
    operator who chose the default (KILN_DEFAULT_BASE) gets no automatic import."""
    from django.conf import settings

    from kiln_web.jobs import runtime

    if settings.KILN_DEFAULT_BASE:
        print(f"Default base: {settings.KILN_DEFAULT_BASE} (KILN_DEFAULT_BASE)", flush=True)
        return

    def progress(name: str, done: int, total: int) -> None:
        if done == 1 or done == total or done % 50 == 0:
            print(f"  {name}: {done}/{total} tensors", flush=True)

    try:
        for info in runtime.register_packaged_bases(progress):
            print(f"Registered the base {info.name!r} ({info.parameter_count:,} parameters) from its package",
                  flush=True)
    except (OSError, ValueError) as exc:
        print(f"kiln up: a packaged base could not be registered ({exc}); kiln-tiny stays the default",
              file=sys.stderr)
    print(f"Default base: {runtime.default_base()} (kiln base list; KILN_DEFAULT_BASE chooses another)", flush=True)


def port_refusal(host: str, port: int) -> str | None:
    """Why `kiln up` cannot listen on HOST:PORT, or None: the address is bound the way uvicorn binds it
    (SO_REUSEADDR, so a port left in TIME_WAIT counts as free) and released at once."""
    import errno
    import socket

    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return f"port {port} on {host} is in use; pass --port"
            return f"cannot listen on {host}:{port}: {exc.strerror or exc}"
    return None


def cmd_up(args: argparse.Namespace) -> int:
    import signal

    setup_django()
    import uvicorn
    from django.conf import settings
    from django.core.management import call_command

    if args.processes < 1:
        print("kiln up: --processes must be at least 1", file=sys.stderr)
        return 2
    if args.processes > 1 and settings.KILN_EMBEDDED_WORKER:
        print("kiln up: --processes above 1 needs REDIS_URL: without Redis, jobs run in the one web process's "
              "embedded worker and WebSocket events reach only that process", file=sys.stderr)
        return 2
    refusal = port_refusal(args.host, args.port)  # before anything starts or is announced
    if refusal is not None:
        print(f"kiln up: {refusal}", file=sys.stderr)
        return 2

    from kiln_web.accounts.actions import do_ensure_token
    from kiln_web.asgi import application
    from kiln_web.core.actions import ADMIN_USERNAME, do_ensure_admin, first_superuser
    from kiln_web.jobs.worker import EmbeddedWorker, Housekeeper

    call_command("migrate", interactive=False, verbosity=0)
    _register_packaged_bases()
    password = do_ensure_admin()
    if password is not None:
        print(f"Created the admin user {ADMIN_USERNAME!r} with password: {password}")
        print("  (shown once; change it in the admin)")
    admin = first_superuser()
    token = do_ensure_token(admin, "created by kiln up") if admin is not None else None
    if token is not None:
        print(f"API token for {admin.get_username()!r}: {token}")
        print(f"  (shown once, stored hashed; for the CLI: export KILN_URL=http://{args.host}:{args.port} "
              f"KILN_TOKEN={token})")
    housekeeper = Housekeeper().start()  # the lost-job check, whichever workers run the jobs
    worker = None
    try:  # whatever ends the server (Ctrl-C, SIGTERM, uvicorn's exit on a failed start), the worker stops
        if settings.KILN_EMBEDDED_WORKER:
            worker = EmbeddedWorker().start()
            print("Training jobs run in this process (embedded worker; set REDIS_URL for Celery workers)")
        else:
            print("Training jobs go to Celery: run `celery -A kiln_web worker -Q training` beside this")
        signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)  # `docker stop` stops as cleanly as Ctrl-C
        try:  # the announcement inside: a Ctrl-C the moment it is printed still stops cleanly
            print(f"Kiln is serving at http://{args.host}:{args.port}/  (Ctrl-C stops)", flush=True)
            # lifespan off: the Channels router does not speak the ASGI lifespan protocol.
            # no per-message deflate: job events are a few hundred bytes of JSON, and compressing each one once
            # per open dashboard costs the web process more CPU than the bytes it saves on a local network
            # several processes: uvicorn's supervisor (this process, which keeps the housekeeper) spawns
            # children that each import the application; one process serves in this interpreter
            app = "kiln_web.asgi:application" if args.processes > 1 else application
            uvicorn.run(app, host=args.host, port=args.port, lifespan="off", log_level="info",
                        ws_per_message_deflate=False, workers=args.processes if args.processes > 1 else None)
        except KeyboardInterrupt:
            pass  # uvicorn has shut down the server and re-raised the signal
    finally:
        if worker is not None:
            _stop_worker(worker)
        housekeeper.stop()
        print("Kiln stopped", flush=True)
    return 0


def cmd_worker(args: argparse.Namespace) -> int:
    import signal

    setup_database()
    from kiln_web.jobs.runtime import RunnerUnavailable
    from kiln_web.jobs.worker import EmbeddedWorker

    worker = EmbeddedWorker(poll_seconds=args.poll_seconds)
    try:
        identity = worker.compute_identity()  # at start: what its checkpoints record and its resumes must match
    except RunnerUnavailable as exc:
        print(f"kiln worker: {exc}", file=sys.stderr)
        return 2
    blas, code = identity.get("blas") or {}, (identity.get("code") or {}).get("sha256") or ""
    print(f"worker {worker.worker_id}: backend {identity.get('backend')}, BLAS {blas.get('library')} "
          f"{blas.get('version')} ({blas.get('architecture')}, {blas.get('threads')} threads), float32 products "
          f"on {blas.get('float32_gemm', 'openblas')}, numpy "
          f"{identity.get('numpy')}, kiln {identity.get('kiln')}, code {code[:12]}", flush=True)
    # Ctrl-C stops even when SIGINT arrived ignored (a shell starts background jobs that way, and Python
    # then installs no KeyboardInterrupt handler of its own)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    worker.start()
    try:  # the announcement inside: a Ctrl-C the moment it is printed still stops the worker cleanly
        print(f"worker {worker.worker_id} is polling for queued jobs every {worker.poll_seconds:g} s "
              "(Ctrl-C stops)", flush=True)
        while worker.is_alive():
            worker.join(0.5)
    except KeyboardInterrupt:
        _stop_worker(worker)
    print("worker stopped", flush=True)
    return 0


def add_doctor(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the report as one JSON object")


def _attention_text(device: dict) -> str:
    """A device's opt-in shared memory per block and the head sizes the attention kernels run there (the probe's)."""
    limits = device.get("attention_head_size_limit")
    if not isinstance(limits, dict):
        return ""
    return (f", {device.get('shared_memory_per_block', 0) / 1024:g} KiB shared memory per block: head sizes up to "
            f"{limits.get('training')} to train, {limits.get('decoding')} to decode")


def cuda_doctor_lines(cuda: dict) -> list[str]:
    """The CUDA backend in one or two lines, from native_ext.cuda.probe()."""
    symbols = cuda["symbols"]
    library = f"{cuda['library'] or 'no library'}, {symbols['resolved']}/{symbols['declared']} symbols"
    if symbols["missing"]:
        library += f" (missing {', '.join(symbols['missing'][:3])})"
    if not cuda["available"]:
        return [f"unavailable [{cuda['code']}]: {cuda['reason']}", f"({library})"]
    devices = "; ".join(f"{d['index']}: {d['name']} (compute {d['compute_capability']}, "
                        f"{d['total_memory'] / 2**30:.0f} GiB, {(d['free_memory'] or 0) / 2**30:.0f} GiB free"
                        f"{_attention_text(d)})" for d in cuda["devices"])
    return [f"available: {devices}",
            f"driver {cuda['driver_version']} runtime {cuda['runtime_version']} cuBLAS {cuda['cublas_version']} "
            f"({library})"]


def cmd_doctor(args: argparse.Namespace) -> int:
    ok = True
    as_json = getattr(args, "json", False)
    report: dict = {}

    def line(label: str, value: str) -> None:
        if not as_json:
            print(f"{label:<11}{value}")

    def finish(status: int) -> int:
        if as_json:
            report["ok"] = status == 0
            print(json.dumps(report, indent=2, default=str))
        return status

    import kiln_web

    report.update(kiln=kiln_web.__version__, python={"version": platform.python_version(), "executable": sys.executable})
    line("kiln", kiln_web.__version__)
    line("python", f"{platform.python_version()} ({sys.executable})")

    import numpy
    from threadpoolctl import threadpool_info

    report["numpy"] = {"version": numpy.__version__, "path": os.path.dirname(numpy.__file__)}
    line("numpy", f"{numpy.__version__} ({os.path.dirname(numpy.__file__)})")
    blas = [pool for pool in threadpool_info() if pool.get("user_api") == "blas"]
    report["blas"] = blas
    for pool in blas:
        line("blas", f"{pool['internal_api']} {pool.get('version')} "
             f"{pool.get('threading_layer', '')} threads={pool['num_threads']} ({pool['filepath']})")
    if not blas:
        line("blas", "none found by threadpoolctl")

    try:
        from native_ext import _kernels
    except ImportError as exc:
        ok = False
        report["native_ext"] = {"imports": False, "error": str(exc)}
        line("native_ext", f"_kernels does not import ({exc}); build it with: pip install -e .")
    else:
        report["native_ext"] = {"imports": True, "path": _kernels.__file__}
        line("native_ext", f"_kernels imports ({_kernels.__file__})")
        try:
            from native_ext import blas as kiln_blas
        except ValueError as exc:  # KILN_CPU_GEMM malformed (the settings below name it too)
            ok, kiln_blas = False, None
            report["float32_gemm"] = {"error": str(exc)}
            line("float32", f"error: {exc}")
    if report["native_ext"]["imports"] and kiln_blas is not None:
        # where OpenBLAS's threaded jobs run: Kiln's pool (native_ext/pool.h), which its kernels share
        report["thread_pool"] = {"openblas_jobs": kiln_blas.THREAD_POOL, "threads": kiln_blas.threads(),
                                 "spin_us": os.environ.get("KILN_POOL_SPIN_US", "200")}
        report["float32_gemm"] = {"library": kiln_blas.FLOAT32_GEMM, "why": kiln_blas.GEMM_NOTE}
        line("float32", f"products on {kiln_blas.FLOAT32_GEMM} ({kiln_blas.GEMM_NOTE}; KILN_CPU_GEMM: auto, "
                        "onednn or openblas)")
        kernels_on = "oneDNN's OpenMP threads" if kiln_blas.FLOAT32_GEMM == "onednn" else "Kiln's pool"
        line("threads", f"{kiln_blas.threads()} for products and kernels (kernels on {kernels_on}); OpenBLAS's "
                        f"jobs run on {kiln_blas.THREAD_POOL} (KILN_OPENBLAS_THREADS=own keeps OpenBLAS's pool)")

    from native_ext import cuda

    report["cuda"] = cuda.probe()  # never raises; the CPU backend does not need it
    for index, text in enumerate(cuda_doctor_lines(report["cuda"])):
        line("cuda" if index == 0 else "", text)

    from native_ext import onednn

    reason = onednn.unavailable_reason()  # precision bfloat16's route; float32 runs do not need it
    report["onednn"] = {"library": str(onednn.library_path()), "cpu_bf16_flags": list(onednn.cpu_bf16_flags()),
                        "available": reason is None, "reason": reason,
                        **(onednn.identity() if reason is None else {})}
    line("onednn", f"precision bfloat16 available: oneDNN {report['onednn']['version']}, "
                   f"threads={report['onednn']['threads']} ({report['onednn']['library']})" if reason is None
         else f"precision bfloat16 unavailable: {reason}")

    from django.core.exceptions import ImproperlyConfigured

    try:
        setup_django()
    except ImproperlyConfigured as exc:
        report["settings"] = {"error": str(exc)}
        line("settings", f"error: {exc}")
        return finish(1)
    from django.conf import settings

    report["kiln_home"] = str(settings.KILN_HOME)
    line("KILN_HOME", str(settings.KILN_HOME))
    report["database"] = describe_database(settings.DATABASES["default"])
    line("database", report["database"])
    if settings.KILN_EMBEDDED_WORKER:
        report["broker"] = "memory:// (embedded; set REDIS_URL for separate workers)"
    else:
        report["broker"] = hide_password(settings.CELERY_BROKER_URL)
    line("broker", report["broker"])
    report["channels"] = settings.CHANNEL_LAYERS["default"]["BACKEND"].rsplit(".", 1)[-1]
    line("channels", report["channels"])

    reachable, error, unapplied = database_state()
    report["database_check"] = {"reachable": reachable, "error": error, "unapplied_migrations": unapplied}
    if not reachable:
        ok = False
        line("", f"cannot connect: {error}; check DATABASE_URL and that the server is up")
    elif unapplied:
        line("", f"{unapplied} migrations not yet applied: `kiln up` (or python manage.py migrate) applies them; "
                 "`kiln worker`, `kiln token` and `kiln checkpoint prune` need them")
    else:
        line("", "reachable, migrations applied")
    if not settings.KILN_EMBEDDED_WORKER:
        report["broker_check"] = broker_state(settings.CELERY_BROKER_URL)
        if not report["broker_check"]["reachable"]:
            ok = False
            line("", f"cannot reach the broker: {report['broker_check']['error']}; check REDIS_URL")

    from trainer import bases

    from kiln_web.jobs.runtime import default_base

    name = default_base()
    try:
        bases.show_base(name, settings.KILN_HOME)
        report["default_base"] = {"name": name, "registered": True}
        line("base", f"default base {name}" + (" (KILN_DEFAULT_BASE)" if settings.KILN_DEFAULT_BASE else ""))
    except (LookupError, ValueError, OSError) as exc:
        ok = False
        report["default_base"] = {"name": name, "registered": False, "error": str(exc)}
        line("base", f"KILN_DEFAULT_BASE names {name!r}, which is not registered: requests without base_model are "
                     f"refused; `kiln base import PATH --name {name}`, or `kiln base list` for the names ({exc})")
    return finish(0 if ok else 1)


def database_state() -> tuple[bool, str | None, int | None]:
    """(reachable, why not, how many migrations are unapplied) of the configured database; Django set up."""
    from django.conf import settings
    from django.db import DatabaseError, connection
    from django.db.migrations.executor import MigrationExecutor

    database = settings.DATABASES["default"]
    if not database["ENGINE"].endswith("sqlite3"):  # asked directly: the pool would wait 10 s and hide the reason
        import psycopg

        try:
            psycopg.connect(dbname=database["NAME"], user=database.get("USER") or None,
                            password=database.get("PASSWORD") or None, host=database.get("HOST") or None,
                            port=database.get("PORT") or None, connect_timeout=5).close()
        except psycopg.Error as exc:
            return False, hide_password(" ".join(str(exc).split()))[:300], None
    try:
        executor = MigrationExecutor(connection)
        return True, None, len(executor.migration_plan(executor.loader.graph.leaf_nodes()))
    except DatabaseError as exc:
        return False, hide_password(" ".join(str(exc).split()))[:300], None


def broker_state(url: str) -> dict:
    """Whether the Redis at URL answers a PING within a few seconds (its password never shown)."""
    import redis

    try:
        redis.Redis.from_url(url, socket_connect_timeout=3, socket_timeout=3).ping()
        return {"reachable": True, "error": None}
    except (redis.RedisError, OSError) as exc:
        return {"reachable": False, "error": hide_password(str(exc))[:300]}


class NotReady(Exception):
    """This machine's database cannot serve a local command yet; the message says what to do (exit status 2)."""


def setup_database() -> None:
    """Django set up on a database that answers and is migrated, else NotReady (instead of a traceback such as
    "no such table: auth_user" on a fresh KILN_HOME, or psycopg's on an unreachable server)."""
    setup_django()
    from django.conf import settings

    reachable, error, unapplied = database_state()
    if not reachable:
        database = settings.DATABASES["default"]
        raise NotReady(f"cannot use the database {describe_database(database)}: {error}; check DATABASE_URL "
                       "(kiln doctor checks it)")
    if unapplied:
        raise NotReady(f"the database has {unapplied} unapplied migrations; run `kiln up` or "
                       "`python manage.py migrate` first")


def describe_database(database: dict) -> str:
    if database["ENGINE"].endswith("sqlite3"):
        return f"sqlite {database['NAME']}"
    return (f"postgresql {database['NAME']} on {database.get('HOST') or 'local socket'}"
            f":{database.get('PORT') or 5432} as {database.get('USER') or '(default user)'}")


def cmd_version(args: argparse.Namespace) -> int:
    import kiln_web

    print(f"kiln {kiln_web.__version__}")
    return 0



def add_token(parser: argparse.ArgumentParser) -> None:
    commands = subcommands(parser, "token")
    create = commands.add_parser("create", help="create an API token (printed once) for a user, creating the user "
                                 "if needed")
    create.add_argument("--user", required=True, help="the username")
    create.add_argument("--name", default="created by kiln token create", help="what the token is for")
    listing = commands.add_parser("list", help="list API tokens: id, user, name, the token's first characters, "
                                  "created and last used (never the token)")
    listing.add_argument("--user", help="only this user's tokens")
    listing.add_argument("--json", action="store_true", help="print the tokens as a JSON list")
    revoke = commands.add_parser("revoke", help="revoke an API token: it stops working at once")
    revoke.add_argument("token", help="the token's id, or its first characters as `kiln token list` shows them "
                                      "(kiln_...)")
    revoke.add_argument("--user", help="only among this user's tokens")


def cmd_token(args: argparse.Namespace) -> int:
    setup_database()
    from kiln_web.accounts.actions import do_create_token_for_username

    if args.token_command == "list":
        return _list_tokens(args)
    if args.token_command == "revoke":
        return _revoke_token(args)
    row, token, created = do_create_token_for_username(args.user, args.name)
    if created:
        print(f"created user {args.user!r} (no password; set one in the admin to sign in)", file=sys.stderr)
    print(f"token {row.prefix}... for {args.user!r}; shown once, stored hashed:", file=sys.stderr)
    print(token)
    return 0


def _list_tokens(args: argparse.Namespace) -> int:
    import json

    from kiln_web.accounts.models import ApiToken

    rows = ApiToken.objects.select_related("user").order_by("user__username", "created_at", "pk")
    if args.user:
        rows = rows.filter(user__username=args.user)
    items = [row.to_dict() for row in rows]
    if args.json:
        print(json.dumps(items, default=str, indent=2))
        return 0
    for item in items:
        used = item["last_used_at"].strftime("%Y-%m-%d %H:%M") if item["last_used_at"] else "never used"
        print(f"{item['id']:>5}  {item['prefix']}...  {item['user']:<16} created "
              f"{item['created_at'].strftime('%Y-%m-%d %H:%M')}, {used}  {item['name']}")
    if not items:
        print("no API tokens" + (f" for {args.user!r}" if args.user else ""), file=sys.stderr)
    return 0


def _revoke_token(args: argparse.Namespace) -> int:
    from kiln_web.accounts.actions import do_revoke_token, tokens_matching

    rows = tokens_matching(args.token, args.user)
    if len(rows) != 1:
        why = (f"{len(rows)} tokens start with {args.token!r}; give more characters or the id" if rows else
               f"no token {args.token!r}" + (f" of {args.user!r}" if args.user else "") +
               "; `kiln token list` shows their ids and first characters")
        print(f"kiln token revoke: {why}", file=sys.stderr)
        return 1
    row = rows[0]
    do_revoke_token(row)
    print(f"revoked token {row.prefix}... ({row.name}) of {row.user.get_username()!r}")
    return 0
