"""The `kiln` command: one small function per subcommand, each calling into the project."""

from __future__ import annotations

import argparse
import os
import platform
import sys
from collections.abc import Callable
from urllib.parse import urlsplit, urlunsplit

from kiln_web import cli_serving


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


def _add_worker(parser: argparse.ArgumentParser) -> None:
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


def cmd_up(args: argparse.Namespace) -> int:
    import signal

    _setup_django()
    import uvicorn
    from django.conf import settings
    from django.core.management import call_command

    from kiln_web.accounts.actions import do_ensure_token
    from kiln_web.asgi import application
    from kiln_web.core.actions import ADMIN_USERNAME, do_ensure_admin, first_superuser
    from kiln_web.jobs.worker import EmbeddedWorker, Housekeeper

    call_command("migrate", interactive=False, verbosity=0)
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
    if settings.KILN_EMBEDDED_WORKER:
        worker = EmbeddedWorker().start()
        print("Training jobs run in this process (embedded worker; set REDIS_URL for Celery workers)")
    else:
        print("Training jobs go to Celery: run `celery -A kiln_web worker -Q training` beside this")
    print(f"Kiln is serving at http://{args.host}:{args.port}/  (Ctrl-C stops)", flush=True)
    signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)  # `docker stop` stops as cleanly as Ctrl-C
    try:
        # lifespan off: the Channels router does not speak the ASGI lifespan protocol.
        # no per-message deflate: job events are a few hundred bytes of JSON, and compressing each one once
        # per open dashboard costs the web process more CPU than the bytes it saves on a local network
        uvicorn.run(application, host=args.host, port=args.port, lifespan="off", log_level="info",
                    ws_per_message_deflate=False)
    except KeyboardInterrupt:
        pass  # uvicorn has shut down the server and re-raised the signal
    if worker is not None:
        _stop_worker(worker)
    housekeeper.stop()
    print("Kiln stopped", flush=True)
    return 0


def cmd_worker(args: argparse.Namespace) -> int:
    import signal

    _setup_django()
    from django.db import connection
    from django.db.migrations.executor import MigrationExecutor

    from kiln_web.jobs.worker import EmbeddedWorker

    executor = MigrationExecutor(connection)
    if executor.migration_plan(executor.loader.graph.leaf_nodes()):
        print("kiln worker: the database has unapplied migrations; run `kiln up` or "
              "`python manage.py migrate` first", file=sys.stderr)
        return 2
    worker = EmbeddedWorker(poll_seconds=args.poll_seconds)
    signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    worker.start()
    print(f"worker {worker.worker_id} is polling for queued jobs every {worker.poll_seconds:g} s "
          "(Ctrl-C stops)", flush=True)
    try:
        while worker.is_alive():
            worker.join(0.5)
    except KeyboardInterrupt:
        _stop_worker(worker)
    print("worker stopped", flush=True)
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


def _add_base(parser: argparse.ArgumentParser) -> None:
    commands = parser.add_subparsers(dest="base_command", required=True, metavar="BASE_COMMAND")
    imports = commands.add_parser("import", help="import a GGUF file or Hugging Face directory",
                                  description="import a GGUF file (Llama architecture) or a Hugging "
                                  "Face Llama directory into $KILN_HOME/bases/NAME")
    imports.add_argument("path", metavar="PATH", help="a .gguf file or a directory with config.json")
    imports.add_argument("--name", required=True, help="the name to register it under")
    commands.add_parser("list", help="list the registered bases (and the built-in kiln-tiny)")
    show = commands.add_parser("show", help="show one base: configuration, identity, shards, tokenizer")
    show.add_argument("name", metavar="NAME")
    show.add_argument("--json", action="store_true", help="print the full record as JSON")


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
            print(f"imported {info.name}: {info.parameter_count:,} parameters, "
                  f"{len(info.shards)} shard(s), {_size(info.total_bytes)} in "
                  f"{time.perf_counter() - start:.1f} s")
            print(f"identity {info.identity}")
            print(f"path     {info.path}")
        elif args.base_command == "list":
            rows = [(i.name, f"{i.parameter_count:,}", i.identity[:16],
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
    except (ValueError, LookupError, OSError, ImportError) as exc:
        print(f"kiln base {args.base_command}: {exc}", file=sys.stderr)
        return 1
    return 0


# -- training jobs, through the HTTP API --

TERMINAL = {"succeeded", "cancelled", "failed", "lost"}


def _add_train(parser: argparse.ArgumentParser) -> None:
    commands = parser.add_subparsers(dest="train_command", required=True, metavar="TRAIN_COMMAND")
    sft = commands.add_parser("sft", help="submit a supervised fine-tuning run",
                              description="submit an SFT run; a file inside a data root ($KILN_HOME/datasets, "
                              "KILN_DATA_ROOTS) is sent as dataset_path, any other file is uploaded inline")
    sft.add_argument("--file", required=True, help="JSONL: {messages: [...]} or {prompt, completion} per line")
    sft.add_argument("--adapter", required=True, help="the output adapter name (config.output_name)")
    sft.add_argument("--epochs", type=int)
    sft.add_argument("--checkpoint-interval", type=int, help="committed steps between checkpoints "
                     "(default: the server's training.checkpoint_interval)")
    sft.add_argument("--resume-checkpoint", metavar="BASENAME", help="continue the same run from this checkpoint")
    sft.add_argument("--base", help="the base model (default: kiln-tiny)")
    sft.add_argument("--seed", type=int)
    sft.add_argument("--learning-rate", type=float)
    sft.add_argument("--lr-schedule", choices=("constant", "linear", "cosine"))
    sft.add_argument("--warmup-steps", type=int)
    sft.add_argument("--batch-size", type=int)
    sft.add_argument("--gradient-accumulation-steps", type=int)
    sft.add_argument("--max-grad-norm", type=float)
    sft.add_argument("--lora-rank", type=int)
    sft.add_argument("--lora-alpha", type=float)
    sft.add_argument("--qlora", action="store_true", help="quantize the base to NF4 (QLoRA)")
    sft.add_argument("--max-sequence-length", type=int)
    sft.add_argument("--upload", action="store_true", help="send the records inline even from a data root")
    sft.add_argument("--wait", action="store_true", help="follow the job until it ends")
    sft.add_argument("--json", action="store_true", help="print the job as JSON")
    cli_serving.add_promotion_arguments(sft)
    grpo = commands.add_parser("grpo", help="submit a GRPO run over scored groups",
                               description="submit a GRPO run; a file inside a data root is sent as dataset_path, "
                               "any other file is uploaded inline as groups")
    grpo.add_argument("--file", required=True, help="JSONL, one group per line: {prompt | messages, completions: "
                      "[{text, reward | rewards}...], reward_weights?}")
    grpo.add_argument("--adapter", required=True, help="the output adapter name (config.output_name)")
    grpo.add_argument("--checkpoint-interval", type=int, help="committed steps between checkpoints "
                      "(default: the server's training.checkpoint_interval)")
    grpo.add_argument("--resume-checkpoint", metavar="BASENAME", help="continue the same run from this checkpoint")
    grpo.add_argument("--streaming", action="store_true", help="the server reads the file lazily from a byte cursor "
                      "(the file must lie in a data root)")
    grpo.add_argument("--base", dest="base_model", help="the base model (default: kiln-tiny)")
    grpo.add_argument("--seed", type=int)
    grpo.add_argument("--learning-rate", type=float)
    grpo.add_argument("--epochs", type=int)
    grpo.add_argument("--groups-per-step", type=int)
    grpo.add_argument("--loss-type", choices=("grpo", "bnpo", "dr_grpo", "dapo"))
    grpo.add_argument("--beta", type=float, help="KL coefficient (default 0: no KL term)")
    grpo.add_argument("--num-iterations", type=int)
    opd = commands.add_parser("opd", help="submit an on-policy distillation run from a teacher alias",
                              description="submit an OPD run; --file is a request JSON ({prompts | dataset_path, "
                              "config?}) or a prompts file (JSON list or JSONL: sent by path from a data root, else "
                              "uploaded)")
    opd.add_argument("--file", required=True, help="opd-request.json: {prompts: [...], config: {...}}")
    opd.add_argument("--adapter", required=True, help="the output adapter name (config.output_name)")
    opd.add_argument("--teacher", required=True, metavar="ALIAS", help="a teacher alias name@route "
                     "(kiln teacher list)")
    opd.add_argument("--checkpoint-interval", type=int, help="committed steps between checkpoints (default: 25)")
    opd.add_argument("--resume-checkpoint", metavar="BASENAME", help="continue the same run from this checkpoint")
    opd.add_argument("--base", dest="base_model", help="the student base model (default: kiln-tiny)")
    opd.add_argument("--seed", type=int)
    opd.add_argument("--steps", type=int)
    opd.add_argument("--learning-rate", type=float)
    for kind in (grpo, opd):
        kind.add_argument("--upload", action="store_true", help="send the data inline even from a data root")
        kind.add_argument("--wait", action="store_true", help="follow the job until it ends")
        kind.add_argument("--json", action="store_true", help="print the job as JSON")
    status = commands.add_parser("status", help="show a job: status, progress, latest checkpoint")
    status.add_argument("--job-id", required=True)
    status.add_argument("--json", action="store_true", help="print the job as JSON")
    cancel = commands.add_parser("cancel", help="cancel a job (a running one publishes a checkpoint first)")
    cancel.add_argument("--job-id", required=True)
    cancel.add_argument("--wait", action="store_true", help="wait until the job has ended")
    jobs = commands.add_parser("list", help="list your jobs, newest first")
    jobs.add_argument("--status")
    jobs.add_argument("--limit", type=int, default=20)


def _sft_body(args: argparse.Namespace) -> dict:
    from pathlib import Path

    from kiln_web.client import ApiError, read_jsonl, within_data_root

    config = {"output_name": args.adapter}
    for key, value in (("base_model", args.base), ("epochs", args.epochs), ("seed", args.seed),
                       ("checkpoint_interval", args.checkpoint_interval),
                       ("resume_checkpoint", args.resume_checkpoint), ("learning_rate", args.learning_rate),
                       ("batch_size", args.batch_size), ("gradient_accumulation_steps", args.gradient_accumulation_steps),
                       ("max_grad_norm", args.max_grad_norm), ("max_sequence_length", args.max_sequence_length)):
        if value is not None:
            config[key] = value
    if args.lr_schedule is not None or args.warmup_steps is not None:
        config["lr_schedule"] = {"type": args.lr_schedule or "constant", "warmup_steps": args.warmup_steps or 0}
    lora = {key: value for key, value in (("rank", args.lora_rank), ("alpha", args.lora_alpha)) if value is not None}
    if lora:
        config["lora"] = lora
    if args.qlora:
        config["quantization"] = {"type": "nf4"}
    path = Path(args.file).expanduser()
    if not path.is_file():
        raise ApiError(None, {"code": "invalid_file", "message": f"{args.file} is not a file"})
    if not args.upload and within_data_root(path):
        return {"dataset_path": str(path.resolve()), "config": config}
    return {"data": read_jsonl(path), "config": config}


def _given(args: argparse.Namespace, options: tuple) -> dict:
    """{config key: value} of the OPTIONS (argparse dests, which are the config keys) given on the command line."""
    return {name: getattr(args, name) for name in options if getattr(args, name) is not None}


def _input_file(text: str):
    from pathlib import Path

    from kiln_web.client import ApiError

    path = Path(text).expanduser()
    if not path.is_file():
        raise ApiError(None, {"code": "invalid_file", "message": f"{text} is not a file"})
    return path


GRPO_OPTIONS = ("base_model", "seed", "learning_rate", "epochs", "groups_per_step", "loss_type", "beta",
                "num_iterations", "checkpoint_interval", "resume_checkpoint")
OPD_OPTIONS = ("base_model", "seed", "steps", "learning_rate", "checkpoint_interval", "resume_checkpoint")


def _grpo_body(args: argparse.Namespace) -> dict:
    from kiln_web.client import ApiError, read_jsonl, within_data_root

    config = {"output_name": args.adapter, **_given(args, GRPO_OPTIONS)}
    if args.streaming:
        config["streaming"] = True
    path = _input_file(args.file)
    if not args.upload and within_data_root(path):
        return {"dataset_path": str(path.resolve()), "config": config}
    if args.streaming:
        raise ApiError(None, {"code": "invalid_file", "message": f"--streaming makes the server read {args.file} "
                              "itself: put it in a data root ($KILN_HOME/datasets or KILN_DATA_ROOTS), without "
                              "--upload"})
    return {"groups": read_jsonl(path), "config": config}


def _opd_body(args: argparse.Namespace) -> dict:
    import json

    from kiln_web.client import ApiError, read_jsonl, within_data_root

    path = _input_file(args.file)
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except ValueError:
        document = None  # not one JSON value: JSONL prompts
    if isinstance(document, dict):  # a request: {prompts | dataset_path, config?}
        unknown = sorted(set(document) - {"prompts", "dataset_path", "config"})
        if unknown or not isinstance(document.get("config", {}), dict):
            raise ApiError(None, {"code": "invalid_file", "message": f"{args.file} must hold {{prompts | dataset_path, "
                                  f"config}}; it has {', '.join(unknown) or 'a config that is not an object'}"})
        body = {key: value for key, value in document.items() if key != "config"}
        config = dict(document.get("config") or {})
    elif not args.upload and within_data_root(path):
        body, config = {"dataset_path": str(path.resolve())}, {}
    else:
        body, config = {"prompts": document if isinstance(document, list) else read_jsonl(path)}, {}
    config.update(output_name=args.adapter, teacher=args.teacher, **_given(args, OPD_OPTIONS))
    return {**body, "config": config}


BODIES = {"sft": cli_serving.with_promotion(_sft_body), "grpo": _grpo_body, "opd": _opd_body}


def _print_api_error(command: str, exc) -> int:
    print(f"kiln {command}: {exc.code}: {exc.message}", file=sys.stderr)
    if exc.error.get("field"):
        print(f"  field: {exc.error['field']}", file=sys.stderr)
    for difference in exc.error.get("differences") or []:
        print(f"  {difference.get('field')}: checkpoint {difference.get('checkpoint')!r}, "
              f"request {difference.get('request')!r}", file=sys.stderr)
    if exc.status == 401:
        print("  check KILN_TOKEN (create a token with: kiln token create --user NAME)", file=sys.stderr)
    return 1


def _print_job(job: dict) -> None:
    progress = job["progress"]
    total = progress.get("total_steps")
    source = "inline data" if job.get("data_source_kind") == "inline" else job.get("dataset_path") or "file"
    print(f"job        {job['id']}")
    print(f"status     {job['status']}")
    print(f"adapter    {job['adapter']} ({job['kind']}, {source})")
    print(f"progress   {progress['committed_step']}/{total if total is not None else '?'} steps")
    print(f"seed       {job.get('effective_seed')}")
    if job.get("resume_from"):
        print(f"resumed    from {job['resume_from']}")
    teacher = job.get("teacher")
    if teacher:
        print(f"teacher    {teacher['alias']} (identity {teacher['identity_revision'][:16]}, "
              f"content {(teacher.get('content_revision') or '?')[:16]})")
    checkpoint = job.get("latest_checkpoint")
    if checkpoint:
        cursor = checkpoint.get("next_cursor") or {}
        where = ", ".join(f"{key} {value}" for key, value in cursor.items()) if isinstance(cursor, dict) else cursor
        print(f"checkpoint step {checkpoint.get('committed_step')} of {checkpoint.get('total_steps')}"
              f"{' (complete)' if checkpoint.get('complete') else ''}, next {where}")
        print(f"resume_checkpoint {checkpoint['resume_checkpoint']}")
    elif job.get("latest_checkpoint_error"):
        problem = job["latest_checkpoint_error"]
        print(f"checkpoint unavailable: {problem['code']}: {problem['message']}")
    if job.get("error"):
        print(f"error      {job['error']['code']}: {job['error']['message']}")
    cli_serving.print_promotion(job)


def _follow(client, job_id: str) -> dict:
    """Poll until the job ends, showing its progress on stderr."""
    import time

    shown = None
    while True:
        job = client.job(job_id)
        line = f"{job['status']} {job['progress']['committed_step']}/{job['progress'].get('total_steps')}"
        if line != shown:
            print(f"  {line}", file=sys.stderr, flush=True)
            shown = line
        if job["status"] in TERMINAL:
            return job
        time.sleep(1.0)


def cmd_train(args: argparse.Namespace) -> int:
    import json

    from kiln_web.client import ApiError, Client

    try:
        client = Client()
        if args.train_command in BODIES:
            job = client.submit(args.train_command, BODIES[args.train_command](args))
            if args.json and not args.wait:
                print(json.dumps(job, indent=2))
                return 0
            print(f"job {job['id']} {job['status']} ({job['adapter']}, {job['progress']['total_steps']} steps, "
                  f"seed {job['effective_seed']})", flush=True)
            if not args.wait:
                print(f"follow it with: kiln train status --job-id {job['id']}")
                return 0
            job = _follow(client, job["id"])
            if args.json:
                print(json.dumps(job, indent=2))
            else:
                _print_job(job)
            return 0 if job["status"] in ("succeeded", "cancelled") else 1
        if args.train_command == "status":
            job = client.job(args.job_id)
            if args.json:
                print(json.dumps(job, indent=2))
            else:
                _print_job(job)
            return 0
        if args.train_command == "cancel":
            job = client.cancel(args.job_id)
            print(f"job {job['id']} {job['status']}", flush=True)
            if args.wait:
                job = _follow(client, job["id"])
                _print_job(job)
            return 0
        listing = client.jobs(status=args.status, limit=args.limit)
        for job in listing["items"]:
            progress = job["progress"]
            print(f"{job['id']}  {job['status']:<10}  {job['kind']:<4}  {job['adapter']:<24}  "
                  f"{progress['committed_step']}/{progress.get('total_steps')}  {job.get('latest_checkpoint') or ''}")
        return 0
    except ApiError as exc:
        return _print_api_error(f"train {args.train_command}", exc)


# -- teacher aliases, through the HTTP API --


def _add_teacher(parser: argparse.ArgumentParser) -> None:
    commands = parser.add_subparsers(dest="teacher_command", required=True, metavar="TEACHER_COMMAND")
    add = commands.add_parser("add", help="register a teacher alias (or change it with --replace)",
                              description="register NAME@native (a registered base, optionally with a PEFT "
                              "adapter) or NAME@openai (an OpenAI-compatible endpoint and model)")
    add.add_argument("name", metavar="NAME@ROUTE", help="e.g. tutor@native or qwen@openai")
    add.add_argument("--base", help="native: a registered base (kiln base list)")
    add.add_argument("--adapter", metavar="PATH", help="native: a PEFT adapter directory in the adapter registry "
                     "or a data root")
    add.add_argument("--endpoint", metavar="URL", help="openai: the server root, e.g. http://gpu-1:8000")
    add.add_argument("--model", help="openai: the served model id")
    add.add_argument("--replace", action="store_true", help="change an existing alias (its identity revision "
                     "changes, so its OPD checkpoints no longer resume)")
    commands.add_parser("list", help="list the teacher aliases")
    show = commands.add_parser("show", help="show one alias: configuration and revisions")
    show.add_argument("name", metavar="NAME@ROUTE")
    show.add_argument("--json", action="store_true", help="print the alias as JSON")
    delete = commands.add_parser("delete", help="delete an alias you own")
    delete.add_argument("name", metavar="NAME@ROUTE")


def _print_teacher(alias: dict) -> None:
    target = (f"{alias['base']}" + (f" + adapter {alias['adapter']}" if alias.get("adapter") else "")
              if alias["route"] == "native" else f"{alias['model']} at {alias['endpoint']}")
    print(f"name      {alias['name']}")
    print(f"teacher   {target}")
    print(f"owner     {alias['owner']}")
    print(f"identity  {alias['identity_revision']}")
    print(f"content   {alias.get('content_revision') or 'not yet reconstructed (every OPD admission does)'}")


def cmd_teacher(args: argparse.Namespace) -> int:
    import json

    from kiln_web.client import ApiError, Client

    try:
        client = Client()
        if args.teacher_command == "add":
            config = {key: getattr(args, key) for key in ("base", "adapter", "endpoint", "model")
                      if getattr(args, key) is not None}
            if "adapter" in config:
                config["adapter"] = os.path.abspath(os.path.expanduser(config["adapter"]))
            alias = (client.update_teacher(args.name, config) if args.replace
                     else client.create_teacher({"name": args.name, **config}))
            _print_teacher(alias)
        elif args.teacher_command == "list":
            for alias in client.teachers()["items"]:
                target = alias["base"] if alias["route"] == "native" else alias["endpoint"]
                print(f"{alias['name']:<32}  {alias['identity_revision'][:12]}  {alias['owner']:<12}  {target}"
                      + (f" + {alias['adapter']}" if alias.get("adapter") else ""))
        elif args.teacher_command == "show":
            alias = client.teacher(args.name)
            if args.json:
                print(json.dumps(alias, indent=2))
            else:
                _print_teacher(alias)
        else:
            client.delete_teacher(args.name)
            print(f"deleted {args.name}")
        return 0
    except ApiError as exc:
        return _print_api_error(f"teacher {args.teacher_command}", exc)


# -- checkpoints, read locally --


def _add_checkpoint(parser: argparse.ArgumentParser) -> None:
    commands = parser.add_subparsers(dest="checkpoint_command", required=True, metavar="CHECKPOINT_COMMAND")
    verify = commands.add_parser("verify", help="fully validate a .kiln-checkpoint (every file's size and SHA-256)")
    verify.add_argument("path", metavar="PATH")
    show = commands.add_parser("show", help="show a checkpoint's summary and identities (bounded validation)")
    show.add_argument("path", metavar="PATH")
    show.add_argument("--json", action="store_true", help="print the manifest as JSON")
    clean = commands.add_parser("clean-orphans", help="remove hidden staging directories that interrupted "
                                "publications left in the adapter registry")
    clean.add_argument("--older-than", type=float, default=3600.0, metavar="SECONDS",
                       help="only those untouched this long (default 3600; a live publication is younger)")
    clean.add_argument("--registry", default=None, metavar="DIR",
                       help="the adapter registry (default: KILN_HOME's, as the server uses)")


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
    path = Path(args.path).expanduser()
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
        return 0
    if args.json:
        print(json.dumps(loaded.manifest, indent=2, sort_keys=True))
        return 0
    for key in ("resume_checkpoint", "training_kind", "adapter", "step", "checkpoint_id", "data_source_kind",
                "committed_step", "total_steps", "next_cursor", "complete"):
        print(f"{key:<18}{summary.get(key)}")
    print(f"{'manifest_digest':<18}{loaded.manifest_digest}")
    for key in ("seed", "base", "planning"):
        if key in loaded.manifest:
            value = loaded.manifest[key]
            print(f"{key:<18}{json.dumps(value, sort_keys=True) if isinstance(value, dict) else value}")
    print("(metadata only; `kiln checkpoint verify` checks every file's SHA-256)")
    return 0


def _clean_orphans(checkpoint_dir, args: argparse.Namespace) -> int:
    from pathlib import Path

    if args.registry is None:
        _setup_django()
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


# -- tokens, in the local database --


def _add_token(parser: argparse.ArgumentParser) -> None:
    commands = parser.add_subparsers(dest="token_command", required=True, metavar="TOKEN_COMMAND")
    create = commands.add_parser("create", help="create an API token (printed once) for a user, creating the user "
                                 "if needed")
    create.add_argument("--user", required=True, help="the username")
    create.add_argument("--name", default="created by kiln token create", help="what the token is for")


def cmd_token(args: argparse.Namespace) -> int:
    _setup_django()
    from kiln_web.accounts.actions import do_create_token_for_username

    row, token, created = do_create_token_for_username(args.user, args.name)
    if created:
        print(f"created user {args.user!r} (no password; set one in the admin to sign in)", file=sys.stderr)
    print(f"token {row.prefix}... for {args.user!r}; shown once, stored hashed:", file=sys.stderr)
    print(token)
    return 0


def _add_qualify(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", default="cpu", choices=["cpu", "cuda"],
                        help="the backend to qualify (default: cpu)")
    parser.add_argument("--output", help="receipt path (default: $KILN_HOME/qualification/latest-BACKEND.json)")


def cmd_qualify(args: argparse.Namespace) -> int:
    """Fresh-repeat and cancel-then-resume equivalence for SFT, GRPO (inline, streamed) and OPD."""
    import json

    from trainer.qualify import qualify

    from pathlib import Path

    home = Path(os.environ.get("KILN_HOME") or Path.home() / ".kiln")
    output = Path(args.output) if args.output else home / "qualification" / f"latest-{args.backend}.json"
    try:
        receipt = qualify(backend=args.backend, output=output)
    except RuntimeError as error:
        print(f"kiln qualify: {error}", file=sys.stderr)
        return 2
    stamped = output.with_name(f"receipt-{args.backend}-{receipt['created'].replace(':', '')}.json")
    stamped.write_text(json.dumps(receipt, indent=1, sort_keys=True) + "\n")
    print(f"{'PASSED' if receipt['passed'] else 'FAILED'}: receipt written to {output}")
    return 0 if receipt["passed"] else 1


# name, help, add arguments, run. A new subcommand is one more row.
SUBCOMMANDS: list[tuple[str, str, Callable[[argparse.ArgumentParser], None] | None, Callable[[argparse.Namespace], int]]] = [
    ("up", "migrate, ensure an admin user and API token, serve Kiln with its worker", _add_up, cmd_up),
    ("worker", "run queued training jobs from the database (no Redis needed)", _add_worker, cmd_worker),
    ("train", "submit, follow and cancel training jobs (through the API: KILN_URL, KILN_TOKEN)", _add_train,
     cmd_train),
    ("teacher", "register, list and show teacher aliases for OPD (through the API)", _add_teacher, cmd_teacher),
    ("adapter", "list, load, unload, activate and delete adapters; promotions (through the API)",
     cli_serving.add_adapter, cli_serving.cmd_adapter),
    ("eval", "evaluation suites and runs (through the API)", cli_serving.add_eval, cli_serving.cmd_eval),
    ("checkpoint", "verify or show a .kiln-checkpoint directory (locally)", _add_checkpoint, cmd_checkpoint),
    ("token", "create API tokens (in the local database)", _add_token, cmd_token),
    ("doctor", "show the Python, numpy, BLAS, native kernels and configuration in use", None, cmd_doctor),
    ("version", "print the Kiln version", None, cmd_version),
    ("base", "import, list and show base models ($KILN_HOME/bases)", _add_base, cmd_base),
    ("qualify", "prove fresh-repeat and cancel-then-resume equivalence on this backend; write a receipt",
     _add_qualify, cmd_qualify),
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
