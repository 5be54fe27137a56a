"""The commands that read or write local files only: `base` (the base model registry), `checkpoint` (verify,
show, clean-orphans) and `qualify`."""

from __future__ import annotations

import argparse
import os
import sys

from kiln_web.cli_server import add_subcommand, readable, setup_database, setup_django, subcommands


def add_base(parser: argparse.ArgumentParser) -> None:
    commands = subcommands(parser, "base")
    imports = add_subcommand(commands, "import", "import a GGUF file or Hugging Face directory", "path",
                             operand_help="a .gguf file or a directory with config.json",
                             description="import a GGUF file (Llama architecture) or a Hugging "
                             "Face Llama directory into $KILN_HOME/bases/NAME")
    imports.add_argument("--name", required=True, help="the name to register it under")
    commands.add_parser("list", help="list the registered bases (and the built-in kiln-tiny)")
    add_subcommand(commands, "show", "show one base: configuration, identity, shards, tokenizer", "name",
                   json="print the full record as JSON")


def _import_progress(done: int, total: int, name: str) -> None:
    """One line rewritten in place on a terminal; only the final count otherwise (logs, pipes)."""
    if sys.stderr.isatty():
        end = "\n" if done == total else ""
        print(f"\r  {done}/{total} tensors  {name:<48.48}", end=end, file=sys.stderr, flush=True)
    elif done == total:
        print(f"  {done}/{total} tensors", file=sys.stderr, flush=True)


def _size(count: float, unit: str = "B") -> str:
    for prefix in ("", "Ki", "Mi", "Gi"):
        if count < 1024 or prefix == "Gi":
            return f"{count:.0f} {prefix}{unit}" if prefix == "" else f"{count:.1f} {prefix}{unit}"
        count /= 1024
    return f"{count} {unit}"


def cmd_base(args: argparse.Namespace) -> int:
    import json
    import time

    from trainer import bases

    try:
        if args.base_command == "import":
            print(f"importing {args.path} as {args.name!r}", file=sys.stderr)
            start = time.perf_counter()
            info = bases.import_base(args.path, args.name, progress=_import_progress)
            print(f"imported {info.name}: {info.config.get('family', 'llama')}, {info.parameter_count:,} parameters, "
                  f"{len(info.shards)} shard(s), {_size(info.total_bytes)} in "
                  f"{time.perf_counter() - start:.1f} s")
            print(f"identity {info.identity}")
            print(f"path     {info.path}")
        elif args.base_command == "list":
            setup_django()
            from kiln_web.jobs.runtime import default_base

            default = default_base()
            rows = [(i.name + (" (default)" if i.name == default else ""), f"{i.parameter_count:,}", i.identity[:16],
                     i.source.get("format", "?") + ("" if i.materialised else " (not yet written)"))
                    for i in bases.list_bases()]
            header = ("NAME", "PARAMETERS", "IDENTITY", "SOURCE")
            widths = [max(len(r[c]) for r in rows + [header]) for c in range(3)]
            for row in [header] + rows:
                print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)) + "  " + row[3])
        else:
            info = bases.show_base(args.name)
            if args.json:
                print(json.dumps(info.to_dict(), indent=2, sort_keys=True))
                return 0
            print(f"name        {info.name}{' (built in)' if info.builtin else ''}")
            print(f"identity    {info.identity}")
            print(f"path        {info.path}{'' if info.materialised else ' (written on first use)'}")
            print(f"parameters  {info.parameter_count:,} in {len(info.shards)} shard(s), "
                  f"{_size(info.total_bytes)}")
            print(f"source      {json.dumps(info.source, sort_keys=True)}")
            for key, value in info.config.items():
                print(f"  {key:<20}{value}")
            for shard in info.shards:
                print(f"  shard {shard['sha256'][:16]}  {shard['size']:>12,}  {shard['file']}")
            special = info.tokenizer["special_tokens"]
            print("tokenizer   " + ", ".join(f"{k}={v!r}" for k, v in special.items()))
            print(f"            tokenizer.json sha256 {info.tokenizer['tokenizer_json_sha256']}")
    except BrokenPipeError:
        raise  # stdout's reader has gone: not a failure of the base (kiln_web.cli.main)
    except (ValueError, LookupError, OSError, ImportError) as exc:
        print(f"kiln base {args.base_command}: {exc}", file=sys.stderr)
        return 1
    return 0



# -- checkpoints, read locally --


def add_checkpoint(parser: argparse.ArgumentParser) -> None:
    commands = subcommands(parser, "checkpoint")
    add_subcommand(commands, "verify", "fully validate a .kiln-checkpoint (every file's size and SHA-256, and "
                   "that its state is one its run could have written)", "path")
    add_subcommand(commands, "show", "show a checkpoint's summary and identities (bounded validation)", "path",
                   json="print the manifest as JSON")
    clean = commands.add_parser("clean-orphans", help="remove hidden staging directories that interrupted "
                                "publications left in the adapter registry")
    clean.add_argument("--older-than", type=float, default=3600.0, metavar="SECONDS",
                       help="only those untouched this long (default 3600; a live publication is younger)")
    clean.add_argument("--registry", default=None, metavar="DIR",
                       help="the adapter registry (default: KILN_HOME's, as the server uses)")
    prune = commands.add_parser("prune", help="delete all but an adapter's newest N valid checkpoints",
                                description="list (and with --yes delete) an adapter's checkpoints beyond its newest "
                                "N valid ones, on this machine's registry and database. Never deleted: the newest "
                                "valid checkpoint, a checkpoint of a queued, running or cancelling job or one such a "
                                "job resumes from, one that cannot be read. Nothing is pruned on a timer.")
    prune.add_argument("--adapter", required=True, help="the adapter whose checkpoints to prune")
    prune.add_argument("--keep", type=int, required=True, metavar="N", help="valid checkpoints to keep, newest "
                       "first (1 or more)")
    prune.add_argument("--yes", action="store_true", help="delete; without it the plan is only listed (dry run)")


def _manifest_fields(checkpoint_dir, path) -> set | None:
    """The top-level manifest fields the run module of this checkpoint's kind writes (unknown ones are refused)."""
    light = checkpoint_dir.load_checkpoint(path, full=False)
    if light.checkpoint_type in ("sft", "grpo", "opd"):  # GRPO and OPD write SFT's manifest fields
        from trainer.runs.sft import MANIFEST_FIELDS

        return MANIFEST_FIELDS
    return None


def cmd_checkpoint(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from trainer.runs import checkpoint_dir

    if args.checkpoint_command == "clean-orphans":
        return _clean_orphans(checkpoint_dir, args)
    if args.checkpoint_command == "prune":
        return _prune(args)
    path = Path(args.path).expanduser()
    if not os.path.lexists(path):  # before the name's rules: a mistyped path is missing, not misnamed
        print(f"invalid: {path.name}: not_found: no checkpoint at {path}", file=sys.stderr)
        return 1
    try:
        fields = _manifest_fields(checkpoint_dir, path)
        loaded = checkpoint_dir.load_checkpoint(path, full=args.checkpoint_command == "verify",
                                                allowed_manifest_fields=fields)
    except checkpoint_dir.CheckpointError as exc:
        print(f"invalid: {path.name}: {exc.code}: {exc.message}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"invalid: {path}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    summary = checkpoint_dir.checkpoint_summary(loaded)
    if args.checkpoint_command == "verify":
        size = sum(entry["size"] for entry in loaded.manifest["files"].values())
        print(f"valid: {path.name} ({summary['training_kind']}, adapter {summary['adapter']}, step {summary['step']}, "
              f"{len(loaded.manifest['files'])} files, {_size(size)}, checkpoint_id {loaded.checkpoint_id})")
        from trainer.runs.state_check import state_rules_apply

        if not state_rules_apply(summary["training_kind"], loaded.manifest):
            planning = (loaded.manifest.get("planning") or {}).get("schema")
            print(f"note: only its files and checksums were checked, not its state: it was planned under "
                  f"{planning or 'no planning identity'}, not the current schema of {summary['training_kind']} "
                  "runs, so no run resumes from it (admission refuses it: planning_schema)")
        return 0
    if args.json:
        print(json.dumps(loaded.manifest, indent=2, sort_keys=True))
        return 0
    for key in ("resume_checkpoint", "training_kind", "adapter", "step", "checkpoint_id", "data_source_kind",
                "committed_step", "total_steps", "next_cursor", "complete"):
        print(f"{key:<18}{readable(summary.get(key))}")
    print(f"{'manifest_digest':<18}{loaded.manifest_digest}")
    for key in ("seed", "base", "planning"):
        if key in loaded.manifest:
            value = loaded.manifest[key]
            print(f"{key:<18}{json.dumps(value, sort_keys=True) if isinstance(value, dict) else readable(value)}")
    print("(metadata only; `kiln checkpoint verify` checks every file's SHA-256)")
    return 0


def _clean_orphans(checkpoint_dir, args: argparse.Namespace) -> int:
    from pathlib import Path

    if args.registry is None:
        setup_django()
        from django.conf import settings

        registry = Path(settings.KILN_ADAPTERS_DIR)
    else:
        registry = Path(args.registry).expanduser()
    if not args.older_than >= 0:
        print("--older-than must be 0 or more seconds", file=sys.stderr)
        return 2
    try:
        removed = checkpoint_dir.remove_staging_orphans(registry, args.older_than)
    except OSError as exc:
        print(f"cannot clean {registry}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    for path in removed:
        print(f"removed {path.name}")
    print(f"{len(removed)} staging orphan(s) removed from {registry}", file=sys.stderr)
    return 0



def _prune(args: argparse.Namespace) -> int:
    setup_database()
    from kiln_web.adapters.actions import do_prune_checkpoints
    from kiln_web.core.http import ActionRefused

    try:
        plan = do_prune_checkpoints(None, args.adapter, args.keep, apply=args.yes)
    except ActionRefused as exc:
        print(f"kiln checkpoint prune: {exc.code}: {exc.message}", file=sys.stderr)
        return 1
    verbs = {"keep": "keep", "delete": "deleted" if args.yes else "would delete", "failed": "FAILED"}
    for item in plan:
        print(f"{verbs[item['action']]:<12}  {item['basename']}  ({item['state']}: {item['reason']})")
    deleted = sum(item["action"] == "delete" for item in plan)
    failed = sum(item["action"] == "failed" for item in plan)
    kept = len(plan) - deleted - failed
    if not plan:
        print(f"{args.adapter} has no checkpoints in the registry", file=sys.stderr)
    elif args.yes:
        print(f"{deleted} checkpoint(s) deleted, {kept} kept" + (f", {failed} failed" if failed else ""),
              file=sys.stderr)
    else:
        print(f"dry run: {deleted} checkpoint(s) would be deleted, {kept} kept; run again with --yes to delete",
              file=sys.stderr)
    return 1 if failed else 0


def add_qualify(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", default="cpu", choices=["cpu", "cuda"],
                        help="the backend to qualify (default: cpu)")
    parser.add_argument("--precision", default="float32", choices=["float32", "bfloat16", "tfloat32"],
                        help="the precision to qualify (default: float32); each precision has its own receipt, "
                             "and auto computes a precision on cuda only once it is qualified there")
    parser.add_argument("--output", help="receipt path (default: $KILN_HOME/qualification/latest-BACKEND.json, "
                                         "latest-BACKEND-PRECISION.json for bfloat16 and tfloat32)")
    parser.add_argument("--route", action="append", choices=["sft", "grpo_inline", "grpo_streamed", "opd"],
                        help="qualify only this route (repeatable; default: every route, on either backend)")


def cmd_qualify(args: argparse.Namespace) -> int:
    """Fresh-repeat and cancel-then-resume equivalence for SFT, GRPO (inline, streamed) and OPD, every run in a
    fresh process."""
    import json
    from pathlib import Path

    from trainer.qualify import qualify
    from trainer.runs.backend import receipt_stem

    home = Path(os.environ.get("KILN_HOME") or Path.home() / ".kiln")
    stem = receipt_stem(args.backend, args.precision)
    output = Path(args.output) if args.output else home / "qualification" / f"latest-{stem}.json"
    try:
        receipt = qualify(backend=args.backend, output=output, routes=args.route, precision=args.precision)
    except (RuntimeError, ValueError) as error:  # BackendUnavailable, or routes cuda does not run: none ran
        print(f"kiln qualify: {error}", file=sys.stderr)
        if getattr(error, "code", None) == "backend_unavailable" or isinstance(error, ValueError):
            print(f"kiln qualify: no receipt written; {output} is left as it was", file=sys.stderr)
        return 2
    stamped = output.with_name(f"receipt-{stem}-{receipt['created'].replace(':', '')}.json")
    stamped.write_text(json.dumps(receipt, indent=1, sort_keys=True) + "\n")
    for failure in receipt["failures"]:
        print(f"  mismatch: {failure}")
    print(f"{'PASSED' if receipt['passed'] else 'FAILED'}: receipt written to {output}")
    return 0 if receipt["passed"] else 1
