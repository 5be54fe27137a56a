"""`kiln adapter` and `kiln eval`, and the promotion options of `kiln train sft`: all through the HTTP API
(KILN_URL, KILN_TOKEN), each subcommand one small function calling one endpoint."""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.parse

from kiln_web.cli_server import add_subcommand, subcommands

TERMINAL_EVALUATION = {"succeeded", "failed"}


def _quote(name: str) -> str:
    return urllib.parse.quote(name, safe="")


def print_api_error(command: str, exc, at: str | None = None) -> int:
    """Print a refusal from the API (code, message, field, differences) for `kiln COMMAND`, and AT (the FILE:LINE
    the field stands for, an uploaded record's); the exit status 1."""
    print(f"kiln {command}: {exc.code}: {exc.message}", file=sys.stderr)
    if exc.error.get("field"):
        print(f"  field: {exc.error['field']}", file=sys.stderr)
    if at:
        print(f"  at: {at}", file=sys.stderr)
    for difference in exc.error.get("differences") or []:
        print(f"  {difference.get('field')}: checkpoint {difference.get('checkpoint')!r}, "
              f"request {difference.get('request')!r}", file=sys.stderr)
    if exc.status == 401:  # the server's message says how to create a token; say where the CLI found this one
        from kiln_web.client import config_path

        print(f"  check KILN_TOKEN (or \"token\" in {config_path()})"
              + ("" if "kiln token create" in exc.message else "; create one with: kiln token create --user NAME"),
              file=sys.stderr)
    if exc.code == "ambiguous_job_id" and exc.error.get("matches"):
        for job_id in exc.error["matches"]:
            print(f"  {job_id}", file=sys.stderr)
    return 1


def show(document: dict, as_json: bool, print_readable) -> None:
    """DOCUMENT as indented JSON (--json), else as PRINT_READABLE writes it for a person."""
    if as_json:
        print(json.dumps(document, indent=2))
    else:
        print_readable(document)


# -- kiln train sft: promotion --


def add_promotion_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--auto-load", action="store_true", help="after success, activate the adapter once its "
                        "serving canary passes (with a gate: once its evaluation passes too)")
    parser.add_argument("--gate-suite", metavar="SUITE", help="promotion gate: evaluate on this suite first "
                        "(needs --auto-load)")
    parser.add_argument("--gate-min-accuracy", type=float, metavar="A", help="gate: minimum accuracy, 0..1")
    parser.add_argument("--gate-min-examples", type=int, metavar="N",
                        help="gate: decide only on a suite of at least N examples (default: the server's, 20)")
    parser.add_argument("--gate-min-improvement", type=float, metavar="D",
                        help="gate: minimum accuracy gain over your active adapter of the same base (or that base), "
                             "-1..1")


def promotion_fields(args: argparse.Namespace) -> dict:
    fields = {"auto_load": True} if getattr(args, "auto_load", False) else {}
    if getattr(args, "gate_suite", None):
        gate = {"suite": args.gate_suite}
        if args.gate_min_accuracy is not None:
            gate["min_accuracy"] = args.gate_min_accuracy
        if args.gate_min_improvement is not None:
            gate["min_improvement"] = args.gate_min_improvement
        if getattr(args, "gate_min_examples", None) is not None:
            gate["min_examples"] = args.gate_min_examples
        fields["gate"] = gate
    return fields


def with_promotion(body_of):
    """A request builder that also sends the promotion options."""
    return lambda args: {**body_of(args), **promotion_fields(args)}


def print_promotion(job: dict) -> None:
    promotion = job.get("promotion")
    if not promotion:
        return
    if promotion.get("outcome"):
        by = f" by {promotion['decided_by']}" if promotion.get("decided_by") else ""
        print(f"promotion  {promotion['outcome']}{by}: {promotion.get('reason') or ''}")
    elif promotion.get("auto_load"):
        print(f"promotion  auto_load{' with a gate' if promotion.get('gate') else ''}: {promotion.get('reason')}")
    if job.get("evaluation_ids"):
        print(f"evaluations {', '.join(job['evaluation_ids'])}")


# -- kiln adapter --


def add_adapter(parser: argparse.ArgumentParser) -> None:
    commands = subcommands(parser, "adapter")
    add_subcommand(commands, "list", "your adapters and those shared with you: snapshot, loaded, active, latest "
                   "promotion", json="print the listing as JSON")
    load = add_subcommand(commands, "load", "load an adapter's PEFT snapshot for serving", "name")
    load.add_argument("--base", help="the base to load it over (default: the one it was trained over)")
    add_subcommand(commands, "unload", "stop serving an adapter", "name")
    add_subcommand(commands, "activate", "serve a loaded adapter when your requests name no model", "name")
    for verb, help_text in (("share", "let a user or group use (serve, evaluate) your adapter"),
                            ("unshare", "stop sharing your adapter with a user or group")):
        share = add_subcommand(commands, verb, help_text, "name")
        target = share.add_mutually_exclusive_group(required=True)
        target.add_argument("--user", help="a username")
        target.add_argument("--group", help="a group's name")
    delete = add_subcommand(commands, "delete", "delete an idle adapter's checkpoints and PEFT snapshot", "name")
    delete.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    promotions = commands.add_parser("promotions", help="the promotion audit trail, newest first")
    promotions.add_argument("--adapter", help="only this adapter's")
    promotions.add_argument("--limit", type=int, default=20, help="at most this many, 1 to 500 (default: "
                            "%(default)s)")
    promotions.add_argument("--json", action="store_true", help="print the listing as JSON")


def cmd_adapter(args: argparse.Namespace) -> int:
    from kiln_web.client import ApiError, Client

    command = args.adapter_command
    try:
        client = Client()
        if command == "list":
            listing = client.request("GET", "/adapters")
            if args.json:
                print(json.dumps(listing, indent=2))
                return 0
            for item in listing["items"]:
                state = "active" if item["active"] else "loaded" if item["loaded"] else "idle"
                promotion = item.get("latest_promotion") or {}
                print(f"{item['name']:<28} {state:<7} base {item.get('base') or '?':<16} "
                      f"snapshot {'yes' if item['snapshot'] else 'no ':<4} "
                      f"{('last promotion ' + promotion['outcome']) if promotion else ''}")
            return 0
        if command == "promotions":
            records = client.request("GET", "/promotions", query={"adapter": args.adapter, "limit": args.limit})
            if args.json:
                print(json.dumps(records, indent=2))
                return 0
            for record in records["items"]:
                evaluation = f" evaluation {record['evaluation']}" if record.get("evaluation") else ""
                print(f"{record['decided_at']}  {record['adapter']:<24} {record['outcome']:<13} by "
                      f"{record['decided_by']}{evaluation}: {record['reason']}")
            return 0
        path = f"/adapters/{_quote(args.name)}"
        if command == "load":
            body = {"base": args.base} if args.base else {}
            row = client.request("POST", f"{path}/load", body)
            print(f"loaded {row['adapter']} over {row['base']} (generation {row['generation']}, "
                  f"sha256 {row['adapter_sha256'][:12]})")
        elif command == "unload":
            result = client.request("POST", f"{path}/unload")
            print(f"unloaded {args.name}" + ("; it was active: requests in its scope that name no model get the "
                                             "default base now" if result["was_active"] else ""))
        elif command == "share":
            body = {"user": args.user} if args.user else {"group": args.group}
            share = client.request("POST", f"{path}/shares", body)
            print(f"shared {args.name} with the {share['kind']} {share['name']}")
        elif command == "unshare":
            kind, target = ("user", args.user) if args.user else ("group", args.group)
            client.request("DELETE", f"{path}/shares/{kind}/{_quote(target)}")
            print(f"stopped sharing {args.name} with the {kind} {target}")
        elif command == "activate":
            record = client.request("POST", f"{path}/activate")
            previous = f" (was {record['previous_active']})" if record.get("previous_active") else ""
            print(f"activated {record['adapter']}{previous}")
        else:
            if not args.yes:
                if not sys.stdin.isatty():
                    print("kiln adapter delete: pass --yes to delete without a prompt", file=sys.stderr)
                    return 2
                answer = input(f"delete {args.name}'s checkpoints and PEFT snapshot? [y/N] ")
                if answer.strip().lower() not in ("y", "yes"):
                    return 1
            result = client.request("DELETE", path)
            print(f"deleted {result['adapter']}: {len(result['checkpoints_removed'])} checkpoint(s), snapshot "
                  f"{'removed' if result['snapshot_removed'] else 'absent'}")
        return 0
    except ApiError as exc:
        return print_api_error(f"adapter {command}", exc)


# -- kiln eval --


def add_eval(parser: argparse.ArgumentParser) -> None:
    commands = subcommands(parser, "eval")
    suite = commands.add_parser("suite", help="create, list and show evaluation suites")
    suites = subcommands(suite, "suite")
    create = suites.add_parser("create", help="create a suite from held-out JSONL")
    create.add_argument("--name", required=True, help="the suite's name (a suite is immutable: a new name for "
                        "new content)")
    create.add_argument("--file", required=True, help="JSONL: {prompt | messages, expected, metric?, tolerance?}")
    create.add_argument("--metric", default="exact", choices=("exact", "contains", "regex", "numeric"),
                        help="for lines without their own metric (default: %(default)s)")
    add_subcommand(suites, "list", "your suites", json="print the listing as JSON")
    add_subcommand(suites, "show", "one suite, with its content", "name", json="print the suite as JSON")
    run = commands.add_parser("run", help="evaluate an adapter against the active one (or its base)")
    run.add_argument("--adapter", required=True, help="the candidate: an adapter of yours or shared with you")
    run.add_argument("--suite", required=True, help="the suite to evaluate on (kiln eval suite list)")
    run.add_argument("--base", help="the adapter's base (default: the one it was trained over)")
    run.add_argument("--baseline", help="compare with this adapter over the same base, or the base's name (default: "
                     "your active adapter when it is over that base, else the base)")
    run.add_argument("--max-new-tokens", type=int, help="greedy tokens generated per example at most, 1 to "
                     "4096 (default: 64)")
    run.add_argument("--backend", choices=("auto", "cpu", "cuda"), help="auto: cuda when the server's CUDA device "
                     "is found and qualified, else cpu; cuda is refused without a device (default: the server's "
                     "KILN_TRAINING_BACKEND)")
    run.add_argument("--wait", action="store_true", help="follow the run until it ends")
    status = commands.add_parser("status", help="one evaluation run, per example")
    status.add_argument("--id", required=True, help="the evaluation run's id (kiln eval list)")
    status.add_argument("--json", action="store_true", help="print the run as JSON")
    listing = commands.add_parser("list", help="evaluation runs, newest first")
    listing.add_argument("--adapter", help="only this adapter's runs")
    listing.add_argument("--limit", type=int, default=20, help="at most this many, 1 to 500 (default: %(default)s)")
    listing.add_argument("--json", action="store_true", help="print the listing as JSON")


def _summary(side: dict) -> str:
    summary = side.get("summary")
    if not summary:
        return "-"
    return f"{summary['correct']}/{summary['total']} ({summary['accuracy']:.3f})"


def _print_run(run: dict, examples: bool = False) -> None:
    print(f"evaluation {run['id']}  {run['status']}  suite {run['suite']} ({run['purpose']})")
    candidate, baseline = run["candidate"], run["baseline"]
    print(f"candidate  {candidate['adapter']} over {candidate['base']}: {_summary(candidate)}")
    print(f"baseline   {baseline['kind']} {baseline['name']}: {_summary(baseline)}"
          + (f"  ({baseline['note']})" if baseline.get("note") else ""))
    if run.get("training_job"):
        print(f"job        {run['training_job']}")
    if run.get("error"):
        print(f"error      {run['error']['code']}: {run['error']['message']}")
    shown = (run.get("examples") or []) if examples else []
    if shown:
        print(f"  {'#':<5} {'CANDIDATE':<9} {'BASELINE':<8} EXPECTED, CANDIDATE'S OUTPUT")
    for example in shown:
        mark = lambda ok: "pass" if ok else "fail"  # noqa: E731
        print(f"  {example['index']:<5} {mark(example['candidate']['correct']):<9} "
              f"{mark(example['baseline']['correct']):<8} expected {example['expected']!r} "
              f"got {example['candidate']['output']!r}")


def cmd_eval(args: argparse.Namespace) -> int:
    from kiln_web.client import ApiError, Client

    command = args.eval_command if args.eval_command != "suite" else f"suite {args.suite_command}"
    try:
        client = Client()
        if command == "suite create":
            from pathlib import Path

            path = Path(args.file).expanduser()
            if not path.is_file():
                print(f"kiln eval suite create: {args.file} is not a file", file=sys.stderr)
                return 1
            suite = client.request("POST", "/evals/suites", {"name": args.name, "content": path.read_text(),
                                                             "default_metric": args.metric})
            print(f"created suite {suite['name']}: {suite['example_count']} examples, digest {suite['digest'][:16]}")
        elif command == "suite list":
            listing = client.request("GET", "/evals/suites")
            if args.json:
                print(json.dumps(listing, indent=2))
                return 0
            for suite in listing["items"]:
                print(f"{suite['name']:<28} {suite['example_count']:>6} examples  {suite['default_metric']:<8} "
                      f"{suite['digest'][:16]}")
        elif command == "suite show":
            suite = client.request("GET", f"/evals/suites/{_quote(args.name)}")
            if args.json:
                print(json.dumps(suite, indent=2))
            else:
                print(f"suite {suite['name']} ({suite['example_count']} examples, {suite['default_metric']}, "
                      f"digest {suite['digest']})")
                print(suite["content"], end="" if suite["content"].endswith("\n") else "\n")
        elif command == "run":
            body = {"adapter": args.adapter, "suite": args.suite}
            if args.base:
                body["base"] = args.base
            if args.baseline:
                body["baseline"] = args.baseline
            if args.max_new_tokens is not None:
                body["max_new_tokens"] = args.max_new_tokens
            if args.backend:
                body["backend"] = args.backend
            run = client.request("POST", "/evals/runs", body)
            print(f"evaluation {run['id']} {run['status']}", flush=True)
            if args.wait:
                try:
                    while run["status"] not in TERMINAL_EVALUATION:
                        time.sleep(1.0)
                        shown, run = run["status"], client.request("GET", f"/evals/runs/{run['id']}")
                        if run["status"] != shown:  # progress on stderr, as `kiln train ... --wait` shows it
                            print(f"  {run['status']}", file=sys.stderr, flush=True)
                except KeyboardInterrupt:
                    print(f"\nkiln eval run: stopped following evaluation {run['id']}; it goes on on the server. "
                          f"Follow it with: kiln eval status --id {run['id']}", file=sys.stderr, flush=True)
                    return 130
                _print_run(run)
                return 0 if run["status"] == "succeeded" else 1
        elif command == "status":
            show(client.request("GET", f"/evals/runs/{_quote(args.id)}"), args.json,
                 lambda run: _print_run(run, examples=True))
        else:
            listing = client.request("GET", "/evals/runs", query={"adapter": args.adapter, "limit": args.limit})
            if args.json:
                print(json.dumps(listing, indent=2))
                return 0
            for run in listing["items"]:
                print(f"{run['id']}  {run['status']:<9} {run['candidate']['adapter']:<24} {run['suite']:<20} "
                      f"{_summary(run['candidate'])} vs {_summary(run['baseline'])}")
        return 0
    except ApiError as exc:
        return print_api_error(f"eval {command}", exc)
