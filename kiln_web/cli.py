"""The `kiln` command's entry point: one table of subcommands, each run by a function in cli_server (this
machine's server), cli_local (local files), cli_remote or cli_serving (the HTTP API)."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

from kiln_web import cli_serving
from kiln_web.cli_local import add_base, add_checkpoint, add_qualify, cmd_base, cmd_checkpoint, cmd_qualify
from kiln_web.cli_remote import add_teacher, add_train, cmd_teacher, cmd_train
from kiln_web.cli_server import (NotReady, add_doctor, add_token, add_up, add_worker, cmd_doctor, cmd_token, cmd_up,
                                 cmd_version, cmd_worker)


# name, help, add arguments, run. A new subcommand is one more row.
SUBCOMMANDS: list[tuple[str, str, Callable[[argparse.ArgumentParser], None] | None, Callable[[argparse.Namespace], int]]] = [
    ("up", "migrate, ensure an admin user and API token, serve Kiln with its worker", add_up, cmd_up),
    ("worker", "run queued training jobs from the database (no Redis needed)", add_worker, cmd_worker),
    ("train", "submit, follow and cancel training jobs (through the API: KILN_URL, KILN_TOKEN)", add_train,
     cmd_train),
    ("teacher", "register, list, show and delete teacher aliases for OPD (through the API)", add_teacher, cmd_teacher),
    ("adapter", "list, load, unload, activate, share and delete adapters; promotions (through the API)",
     cli_serving.add_adapter, cli_serving.cmd_adapter),
    ("eval", "evaluation suites and runs (through the API)", cli_serving.add_eval, cli_serving.cmd_eval),
    ("checkpoint", "verify, show or prune .kiln-checkpoint directories (locally)", add_checkpoint, cmd_checkpoint),
    ("token", "create, list and revoke API tokens (in the local database)", add_token, cmd_token),
    ("doctor", "show the Python, numpy, BLAS, native kernels, CUDA backend and configuration in use",
     add_doctor, cmd_doctor),
    ("version", "print the Kiln version", None, cmd_version),
    ("base", "import, list and show base models ($KILN_HOME/bases)", add_base, cmd_base),
    ("qualify", "prove fresh-repeat and cancel-then-resume equivalence on this backend; write a receipt",
     add_qualify, cmd_qualify),
]


EPILOG = """\
train, teacher, adapter and eval talk to a Kiln server: KILN_URL (default http://127.0.0.1:8000) and KILN_TOKEN,
else "url" and "token" in $XDG_CONFIG_HOME/kiln/cli.json (~/.config/kiln/cli.json); `kiln token create --user NAME`
makes a token. The other commands work on this machine (KILN_HOME, DATABASE_URL, ...; `kiln doctor` checks them).

exit status: 0 success; 1 a refusal or failure (its code and message on stderr); 2 a usage error, a malformed
setting or a database not yet migrated; 130 Ctrl-C (during --wait the job goes on on the server)."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kiln", description="Kiln: self-hosted LLM fine-tuning.", epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
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
        status = args.run(args)
        sys.stdout.flush()  # a reader that has gone shows here, not in the interpreter's last flush
        return status
    except BrokenPipeError:
        # stdout's reader has gone (`kiln train list | head -3`): stop quietly, as Python's signal docs advise:
        # stdout to devnull, so that the interpreter's last flush does not fail again, and exit 1
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
    except ImproperlyConfigured as exc:
        print(f"kiln: configuration error: {exc}", file=sys.stderr)
        return 2
    except NotReady as exc:
        print(f"kiln {args.command}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
