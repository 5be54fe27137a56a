"""`kiln train` and `kiln teacher`: training jobs and teacher aliases through the HTTP API (KILN_URL, KILN_TOKEN)."""

from __future__ import annotations

import argparse
import os
import sys

from kiln_web import cli_serving
from kiln_web.cli_server import add_subcommand, readable, subcommands

TERMINAL = {"succeeded", "cancelled", "failed", "lost"}
PENDING = "pending"  # a succeeded job's promotion outcome until its decision is recorded (serving.promotion)
JOB_ID_HELP = "the job's id, or a unique prefix of it (at least 8 hex digits)"


def add_train(parser: argparse.ArgumentParser) -> None:
    commands = subcommands(parser, "train")
    sft = commands.add_parser("sft", help="submit a supervised fine-tuning run",
                              description="submit an SFT run; a file inside a data root ($KILN_HOME/datasets, "
                              "KILN_DATA_ROOTS) is sent as dataset_path, any other file is uploaded inline")
    sft.add_argument("--file", required=True, help="JSONL: {messages: [...]} or {prompt, completion} per line")
    sft.add_argument("--adapter", required=True, help="the output adapter name (config.output_name)")
    sft.add_argument("--epochs", type=int)
    sft.add_argument("--checkpoint-interval", type=int, help="committed steps between checkpoints "
                     "(default: the server's training.checkpoint_interval)")
    sft.add_argument("--resume-checkpoint", metavar="BASENAME", help="continue the same run from this checkpoint")
    sft.add_argument("--base", dest="base_model", help="the base model (default: the server's default base)")
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
    sft.add_argument("--wait", action="store_true", help="follow the job until it ends, and with --auto-load until "
                     "its promotion is decided")
    sft.add_argument("--json", action="store_true", help="print the job as JSON")
    add_optimizer_arguments(sft)
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
    grpo.add_argument("--base", dest="base_model", help="the base model (default: the server's default base)")
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
    opd.add_argument("--base", dest="base_model", help="the student base model (default: the server's default base)")
    opd.add_argument("--seed", type=int)
    opd.add_argument("--steps", type=int)
    opd.add_argument("--learning-rate", type=float)
    for kind in (sft, grpo, opd):
        kind.add_argument("--base-adapter", metavar="DIR", help="weights-only warm start from a PEFT adapter "
                          "directory (a finished run's snapshot) in the adapter registry or a data root")
        add_backend_argument(kind)
    for kind in (grpo, opd):
        add_optimizer_arguments(kind)
        kind.add_argument("--upload", action="store_true", help="send the data inline even from a data root")
        kind.add_argument("--wait", action="store_true", help="follow the job until it ends")
        kind.add_argument("--json", action="store_true", help="print the job as JSON")
    resume = commands.add_parser("resume", help="continue an ended job from its latest checkpoint",
                                 description="resubmit a cancelled, failed or lost job's effective configuration and "
                                 "seed with config.resume_checkpoint set to its latest checkpoint (as the dashboard's "
                                 "Prepare resume does); its dataset_path is kept, inline data must be given again "
                                 "with --file")
    resume.add_argument("--job-id", required=True, help=JOB_ID_HELP)
    resume.add_argument("--file", help="the job's data again (required when it trained on inline data): SFT records, "
                        "GRPO groups or OPD prompts; a file inside a data root is sent as dataset_path")
    resume.add_argument("--upload", action="store_true", help="send the data inline even from a data root")
    resume.add_argument("--wait", action="store_true", help="follow the job until it ends")
    resume.add_argument("--json", action="store_true", help="print the job as JSON")
    status = commands.add_parser("status", help="show a job: status, progress, latest checkpoint")
    status.add_argument("--job-id", required=True, help=JOB_ID_HELP)
    status.add_argument("--json", action="store_true", help="print the job as JSON")
    cancel = commands.add_parser("cancel", help="cancel a job (a running one publishes a checkpoint first)")
    cancel.add_argument("--job-id", required=True, help=JOB_ID_HELP)
    cancel.add_argument("--wait", action="store_true", help="wait until the job has ended")
    events = commands.add_parser("events", help="a job's log: claims, checkpoints, warnings, errors")
    events.add_argument("--job-id", required=True, help=JOB_ID_HELP)
    events.add_argument("--json", action="store_true", help="print the events as JSON")
    jobs = commands.add_parser("list", help="list your jobs, newest first")
    jobs.add_argument("--status", choices=("queued", "running", "cancelling", "cancelled", "failed", "succeeded",
                                           "lost"), help="only jobs with this status")
    jobs.add_argument("--limit", type=int, default=20, help="at most this many jobs, 1 to 500 (default: %(default)s)")
    jobs.add_argument("--json", action="store_true", help="print the listing as JSON")


SFT_OPTIONS = ("base_model", "epochs", "seed", "checkpoint_interval", "resume_checkpoint", "learning_rate",
               "batch_size", "gradient_accumulation_steps", "max_grad_norm", "max_sequence_length", "base_adapter",
               "backend", "precision")
GRPO_OPTIONS = ("base_model", "seed", "learning_rate", "epochs", "groups_per_step", "loss_type", "beta",
                "num_iterations", "checkpoint_interval", "resume_checkpoint", "base_adapter", "backend", "precision")
OPD_OPTIONS = ("base_model", "seed", "steps", "learning_rate", "checkpoint_interval", "resume_checkpoint",
               "base_adapter", "backend", "precision")
BACKENDS = ("auto", "cpu", "cuda")


def add_backend_argument(parser: argparse.ArgumentParser) -> None:
    """config.backend: the server resolves auto, and refuses cuda without a device (backend_unavailable)."""
    parser.add_argument("--backend", choices=BACKENDS, help="auto: cuda when the server's CUDA device is found and "
                        "qualified, else cpu; cuda is refused without a device (default: the server's "
                        "KILN_TRAINING_BACKEND)")
    parser.add_argument("--precision", choices=("float32", "bfloat16", "tfloat32"),
                        help="bfloat16: the frozen LoRA base's products from bfloat16 operands (oneDNN on CPUs with "
                        "AVX-512-BF16 or AMX, or a CUDA device's tensor cores); tfloat32: a CUDA device's TF32 "
                        "tensor cores; not with --qlora; refused where unavailable (default: float32)")


def _sft_body(args: argparse.Namespace) -> dict:
    from kiln_web.client import read_jsonl, within_data_root

    config = {"output_name": args.adapter, **_given(args, SFT_OPTIONS), **_optimizer(args)}
    if args.lr_schedule is not None or args.warmup_steps is not None:
        config["lr_schedule"] = {"type": args.lr_schedule or "constant", "warmup_steps": args.warmup_steps or 0}
    lora = {key: value for key, value in (("rank", args.lora_rank), ("alpha", args.lora_alpha)) if value is not None}
    if lora:
        config["lora"] = lora
    if args.qlora:
        config["quantization"] = {"type": "nf4"}
    path = _input_file(args.file)
    if not args.upload and within_data_root(path):
        return {"dataset_path": str(path.resolve()), "config": config}
    return {"data": read_jsonl(path), "config": config}


OPTIMIZER_FLAGS = (("beta1", "--adam-beta1"), ("beta2", "--adam-beta2"), ("epsilon", "--adam-epsilon"),
                   ("weight_decay", "--weight-decay"))


def add_optimizer_arguments(parser: argparse.ArgumentParser) -> None:
    """Adam's hyperparameters (config.optimizer; the server's defaults when left out)."""
    for key, flag in OPTIMIZER_FLAGS:
        parser.add_argument(flag, dest=f"optimizer_{key}", type=float, metavar="X",
                            help=f"config.optimizer.{key} (default: the server's)")


def _optimizer(args: argparse.Namespace) -> dict:
    """{"optimizer": {...}} with the optimizer flags given, or {}."""
    given = {key: getattr(args, f"optimizer_{key}") for key, _ in OPTIMIZER_FLAGS
             if getattr(args, f"optimizer_{key}", None) is not None}
    return {"optimizer": given} if given else {}


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


def _grpo_body(args: argparse.Namespace) -> dict:
    from kiln_web.client import ApiError, read_jsonl, within_data_root

    config = {"output_name": args.adapter, **_given(args, GRPO_OPTIONS), **_optimizer(args)}
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
        document = json.loads(path.read_text(encoding="utf-8-sig"))
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
    config.update(output_name=args.adapter, teacher=args.teacher, **_given(args, OPD_OPTIONS), **_optimizer(args))
    return {**body, "config": config}


BODIES = {"sft": cli_serving.with_promotion(_sft_body), "grpo": _grpo_body, "opd": _opd_body}
INLINE = {"sft": "data", "grpo": "groups", "opd": "prompts"}  # each kind's inline data field


def _resume_source(args: argparse.Namespace, kind: str) -> dict:
    """The data of a resumed run: {} (the job's own dataset_path), {dataset_path} for a file in a data root,
    else the file's records as the kind's inline field (OPD prompts: a JSON list or JSONL)."""
    import json

    from kiln_web.client import read_jsonl, within_data_root

    if not args.file:
        return {}
    path = _input_file(args.file)
    if not args.upload and within_data_root(path):
        return {"dataset_path": str(path.resolve())}
    if kind == "opd":
        try:
            document = json.loads(path.read_text(encoding="utf-8-sig"))
        except ValueError:
            document = None
        if isinstance(document, list):
            return {"prompts": document}
    return {INLINE.get(kind, "data"): read_jsonl(path)}


def _print_job(job: dict) -> None:
    progress = job["progress"]
    total = progress.get("total_steps")
    source = "inline data" if job.get("data_source_kind") == "inline" else job.get("dataset_path") or "file"
    print(f"job        {job['id']}")
    print(f"status     {job['status']}")
    print(f"adapter    {job['adapter']} ({job['kind']}, {source})")
    print(f"progress   {progress['committed_step']}/{total if total is not None else '?'} steps")
    print(f"seed       {job.get('effective_seed')}")
    chosen = (job.get("identities") or {}).get("backend")
    if isinstance(chosen, dict):
        print(f"backend    {chosen.get('resolved')} ({chosen.get('reason')})")
    if job.get("resume_from"):
        print(f"resumed    from {job['resume_from']}")
    teacher = job.get("teacher")
    if teacher:
        print(f"teacher    {teacher['alias']} (identity {teacher['identity_revision'][:16]}, "
              f"content {(teacher.get('content_revision') or '?')[:16]})")
    checkpoint = job.get("latest_checkpoint")
    if checkpoint:
        print(f"checkpoint step {checkpoint.get('committed_step')} of {checkpoint.get('total_steps')}"
              f"{' (complete)' if checkpoint.get('complete') else ''}, next {readable(checkpoint.get('next_cursor'))}")
        print(f"resume_checkpoint {checkpoint['resume_checkpoint']}")
    elif job.get("latest_checkpoint_error"):
        problem = job["latest_checkpoint_error"]
        print(f"checkpoint unavailable: {problem['code']}: {problem['message']}")
    if job.get("error"):
        print(f"error      {job['error']['code']}: {job['error']['message']}")
    cli_serving.print_promotion(job)


# no answer at all, or a proxy's while the web process behind it restarts: the job goes on with its worker
_NOT_ANSWERING = ("unreachable", "http_502", "http_503", "http_504")


def _poll(client, job_id: str) -> dict:
    """The job, waiting out a server that does not answer (restarting: an upgrade, a crash) for at most the
    client's timeout, saying so once on stderr; a refusal (a 404, say) is raised at once."""
    import time

    from kiln_web.client import ApiError

    since = None
    while True:
        try:
            job = client.job(job_id)
        except ApiError as error:
            if error.code not in _NOT_ANSWERING:
                raise
            if since is None:
                since = time.monotonic()
                print(f"  the server does not answer ({error.message}); still following, Ctrl-C stops",
                      file=sys.stderr, flush=True)
            elif time.monotonic() - since >= client.timeout:
                raise
            time.sleep(2.0)
            continue
        if since is not None:
            print("  the server answers again", file=sys.stderr, flush=True)
        return job


def _follow(client, job_id: str) -> dict:
    """Poll until the job ends, showing its progress, and its warnings and errors as they come, on stderr."""
    import time

    shown, told = None, 0
    while True:
        job = _poll(client, job_id)
        line = f"{job['status']} {job['progress']['committed_step']}/{job['progress'].get('total_steps')}"
        if line != shown:
            print(f"  {line}", file=sys.stderr, flush=True)
            shown = line
            told = _tell_warnings(client, job_id, told)  # asked when something changed, not every poll
        if job["status"] in TERMINAL:
            return job
        time.sleep(1.0)


def _tell_warnings(client, job_id: str, told: int) -> int:
    """Print the job's warning and error events after its first TOLD events; how many events it has now."""
    items = client.all_events(job_id, offset=told)  # only those not seen yet
    for event in items:
        if event["level"] in ("warning", "error"):
            print(f"  {event['level']}: {event['message']}", file=sys.stderr, flush=True)
    return told + len(items)


def _await_promotion(client, job: dict) -> dict:
    """A succeeded job whose promotion is pending (auto_load: the serving canary, and with a gate its evaluation
    first), polled until the decision is recorded; for at most the client's timeout, the wait it gives each request."""
    import time

    if job["status"] != "succeeded" or (job.get("promotion") or {}).get("outcome") != PENDING:
        return job
    waiting_for = "the gate's evaluation and the serving canary" if job["promotion"].get("gate") else \
        "the serving canary"
    print(f"  succeeded; waiting for the promotion decision ({waiting_for})", file=sys.stderr, flush=True)
    deadline = time.monotonic() + client.timeout
    while (job.get("promotion") or {}).get("outcome") == PENDING:
        if time.monotonic() >= deadline:
            print(f"kiln train: the promotion is still pending after {client.timeout:g} s; the adapter serves only "
                  f"once it is promoted: follow it with: kiln train status --job-id {job['id']}", file=sys.stderr)
            break
        time.sleep(1.0)
        job = client.job(job["id"])
    return job


def _stopped_following(job_id: str, doing: str, cancel: bool) -> int:
    """Ctrl-C during --wait stops the following, not the job: say so, and how to follow or stop it; status 130."""
    print(f"\nkiln train: stopped following job {job_id}; it goes on {doing} on the server. Follow it with: kiln train "
          f"status --job-id {job_id}" + (f"; stop it with: kiln train cancel --job-id {job_id}" if cancel else ""),
          file=sys.stderr, flush=True)
    return 130


def _submitted(client, job: dict, args: argparse.Namespace) -> int:
    """Report a job just submitted (or resumed); with --wait, follow it until it ends and its promotion (if asked
    for) is decided."""
    if args.json and not args.wait:
        cli_serving.show(job, True, None)
        return 0
    resumed = f", resuming from {job['resume_from']}" if job.get("resume_from") else ""
    backend = (job.get("effective_config") or {}).get("backend")
    backend = f", backend {backend}" if backend else ""
    print(f"job {job['id']} {job['status']} ({job['adapter']}, {job['progress']['total_steps']} steps, "
          f"seed {job['effective_seed']}{backend}{resumed})", flush=True)
    if not args.wait:
        print(f"follow it with: kiln train status --job-id {job['id']}")
        return 0
    try:
        job = _await_promotion(client, _follow(client, job["id"]))
    except KeyboardInterrupt:
        return _stopped_following(job["id"], "training", cancel=True)
    cli_serving.show(job, args.json, _print_job)
    return 0 if job["status"] in ("succeeded", "cancelled") else 1


def cmd_train(args: argparse.Namespace) -> int:
    from kiln_web.client import ApiError, Client, uploaded_place

    body = None  # what was submitted: a refused record of an uploaded file is then named by its line
    try:
        client = Client()
        if args.train_command in BODIES:
            body = BODIES[args.train_command](args)
            return _submitted(client, client.submit(args.train_command, body), args)
        if args.train_command == "resume":
            ended = client.job(args.job_id)
            body = _resume_source(args, ended["kind"])
            return _submitted(client, client.resume(ended["id"], body), args)
        if args.train_command == "events":
            listing = {"items": client.all_events(args.job_id)}
            if args.json:
                cli_serving.show(listing, True, None)
                return 0
            for event in listing["items"]:
                print(f"{event['time']}  {event['level']:<7}  {event['message']}")
            return 0
        if args.train_command == "status":
            job = client.job(args.job_id)
            cli_serving.show(job, args.json, _print_job)
            return 0
        if args.train_command == "cancel":
            job = client.cancel(args.job_id)
            print(f"job {job['id']} {job['status']}", flush=True)
            if args.wait:
                try:
                    job = _follow(client, job["id"])
                except KeyboardInterrupt:
                    return _stopped_following(job["id"], "cancelling", cancel=False)
                _print_job(job)
            return 0
        listing = client.jobs(status=args.status, limit=args.limit)
        if args.json:
            cli_serving.show(listing, True, None)
            return 0
        print(f"{'ID':<36}  {'STATUS':<10}  {'KIND':<4}  {'ADAPTER':<24}  {'STEPS':<11}  LATEST CHECKPOINT")
        for job in listing["items"]:
            progress = job["progress"]
            steps = f"{progress['committed_step']}/{progress.get('total_steps')}"
            print(f"{job['id']}  {job['status']:<10}  {job['kind']:<4}  {job['adapter']:<24}  {steps:<11}  "
                  f"{job.get('latest_checkpoint') or ''}")
        if not listing["items"]:
            print("(no jobs" + (f" with status {args.status})" if args.status else ")"))
        return 0
    except ApiError as exc:
        return cli_serving.print_api_error(f"train {args.train_command}", exc,
                                           at=uploaded_place(body, exc.error.get("field")))


# -- teacher aliases, through the HTTP API --


def add_teacher(parser: argparse.ArgumentParser) -> None:
    commands = subcommands(parser, "teacher")
    add = add_subcommand(commands, "add", "register a teacher alias (or change it with --replace)", "name",
                         metavar="NAME@ROUTE", operand_help="e.g. tutor@native or qwen@openai",
                         description="register NAME@native (a registered base, optionally with a PEFT "
                         "adapter) or NAME@openai (an OpenAI-compatible endpoint and model)")
    add.add_argument("--base", help="native: a registered base (kiln base list)")
    add.add_argument("--adapter", metavar="PATH", help="native: a PEFT adapter directory in the adapter registry "
                     "or a data root")
    add.add_argument("--endpoint", metavar="URL", help="openai, vllm: the server root, e.g. http://gpu-1:8000")
    add.add_argument("--model", help="openai, vllm: the served model id")
    add.add_argument("--replace", action="store_true", help="change an existing alias (its identity revision "
                     "changes, so its OPD checkpoints no longer resume)")
    add_subcommand(commands, "list", "list the teacher aliases", json="print the listing as JSON")
    add_subcommand(commands, "show", "show one alias: configuration and revisions", "name", metavar="NAME@ROUTE",
                   json="print the alias as JSON")
    add_subcommand(commands, "delete", "delete an alias you own", "name", metavar="NAME@ROUTE")


def _teacher_adapter(alias: dict) -> str:
    """' + adapter PATH' for a native teacher's adapter; the server leaves out one not shared with you."""
    if alias.get("adapter_hidden"):
        return " + an adapter not shared with you"
    return f" + adapter {alias['adapter']}" if alias.get("adapter") else ""


def _print_teacher(alias: dict) -> None:
    target = (f"{alias['base']}{_teacher_adapter(alias)}" if alias["route"] == "native"
              else f"{alias['model']} at {alias['endpoint']}")
    print(f"name      {alias['name']}")
    print(f"teacher   {target}")
    print(f"owner     {alias['owner']}")
    print(f"identity  {alias['identity_revision']}")
    print(f"content   {alias.get('content_revision') or 'not yet reconstructed (every OPD admission does)'}")


def cmd_teacher(args: argparse.Namespace) -> int:
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
            listing = client.teachers()
            if args.json:
                cli_serving.show(listing, True, None)
                return 0
            for alias in listing["items"]:
                target = alias["base"] if alias["route"] == "native" else alias["endpoint"]
                print(f"{alias['name']:<32}  {alias['identity_revision'][:12]}  {alias['owner']:<12}  {target}"
                      + _teacher_adapter(alias))
        elif args.teacher_command == "show":
            alias = client.teacher(args.name)
            cli_serving.show(alias, args.json, _print_teacher)
        else:
            client.delete_teacher(args.name)
            print(f"deleted {args.name}")
        return 0
    except ApiError as exc:
        return cli_serving.print_api_error(f"teacher {args.teacher_command}", exc)

