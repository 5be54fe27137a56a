"""The `kiln` command: one small function per subcommand, each calling into the project."""

from __future__ import annotations

import argparse
import os
import platform
import sys
from collections.abc import Callable
from urllib.parse import urlsplit, urlunsplit


def _setup_django() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "kiln_web.settings")
    import django

    django.setup()


def _hide_password(url: str) -> str:
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return urlunsplit(parts._replace(netloc=netloc))


# -- subcommands --


def _add_up(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (default: %(default)s)")


def cmd_up(args: argparse.Namespace) -> int:
    _setup_django()
    import uvicorn
    from django.core.management import call_command

    from kiln_web.asgi import application
    from kiln_web.core.actions import ADMIN_USERNAME, do_ensure_admin

    call_command("migrate", interactive=False, verbosity=0)
    password = do_ensure_admin()
    if password is not None:
        print(f"Created the admin user {ADMIN_USERNAME!r} with password: {password}")
        print("  (shown once; change it in the admin)")
    print(f"Kiln is serving at http://{args.host}:{args.port}/  (Ctrl-C stops)", flush=True)
    # lifespan off: the Channels router does not speak the ASGI lifespan protocol.
    uvicorn.run(application, host=args.host, port=args.port, lifespan="off", log_level="info")
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    ok = True

    def line(label: str, value: str) -> None:
        print(f"{label:<11}{value}")

    import kiln_web

    line("kiln", kiln_web.__version__)
    line("python", f"{platform.python_version()} ({sys.executable})")

    import numpy
    from threadpoolctl import threadpool_info

    line("numpy", f"{numpy.__version__} ({os.path.dirname(numpy.__file__)})")
    blas = [pool for pool in threadpool_info() if pool.get("user_api") == "blas"]
    for pool in blas:
        line("blas", f"{pool['internal_api']} {pool.get('version')} "
             f"{pool.get('threading_layer', '')} threads={pool['num_threads']} ({pool['filepath']})")
    if not blas:
        line("blas", "none found by threadpoolctl")

    try:
        from native_ext import _kernels
    except ImportError as exc:
        ok = False
        line("native_ext", f"_kernels does not import ({exc}); build it with: pip install -e .")
    else:
        line("native_ext", f"_kernels imports ({_kernels.__file__})")

    from django.core.exceptions import ImproperlyConfigured

    try:
        _setup_django()
    except ImproperlyConfigured as exc:
        line("settings", f"error: {exc}")
        return 1
    from django.conf import settings

    line("KILN_HOME", str(settings.KILN_HOME))
    database = settings.DATABASES["default"]
    if database["ENGINE"].endswith("sqlite3"):
        line("database", f"sqlite {database['NAME']}")
    else:
        line("database", f"postgresql {database['NAME']} on {database.get('HOST') or 'local socket'}"
             f":{database.get('PORT') or 5432} as {database.get('USER') or '(default user)'}")
    if settings.KILN_EMBEDDED_WORKER:
        line("broker", "memory:// (embedded; set REDIS_URL for separate workers)")
    else:
        line("broker", _hide_password(settings.CELERY_BROKER_URL))
    line("channels", settings.CHANNEL_LAYERS["default"]["BACKEND"].rsplit(".", 1)[-1])
    return 0 if ok else 1


def cmd_version(args: argparse.Namespace) -> int:
    import kiln_web

    print(f"kiln {kiln_web.__version__}")
    return 0


# name, help, add arguments, run. A new subcommand is one more row.
SUBCOMMANDS: list[tuple[str, str, Callable[[argparse.ArgumentParser], None] | None, Callable[[argparse.Namespace], int]]] = [
    ("up", "migrate, ensure an admin user, and serve Kiln", _add_up, cmd_up),
    ("doctor", "show the Python, numpy, BLAS, native kernels and configuration in use", None, cmd_doctor),
    ("version", "print the Kiln version", None, cmd_version),
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kiln", description="Kiln: self-hosted LLM fine-tuning.")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, help_text, add_arguments, run in SUBCOMMANDS:
        subparser = subparsers.add_parser(name, help=help_text, description=help_text)
        if add_arguments is not None:
            add_arguments(subparser)
        subparser.set_defaults(run=run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from django.core.exceptions import ImproperlyConfigured

    try:
        return args.run(args)
    except ImproperlyConfigured as exc:
        print(f"kiln: configuration error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
