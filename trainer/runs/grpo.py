"""GRPO runs over scored groups: request validation, admission, exact resume and the training loop.

A group is one prompt (text or chat messages) with two or more completions, each with a reward
(or named reward components and weights). Groups come inline, from a JSONL file read whole, or
from a JSONL file streamed line by line (`streaming: true`), always in source order, epoch after
epoch. The objective is TRL's GRPO (trainer.runs.objectives): group-relative advantages, the
clipped ratio surrogate, an optional k3 KL to a reference (the frozen base, i.e. the adapter
switched off, or an EMA of the adapter refreshed every N steps), and the grpo / bnpo / dr_grpo /
dapo reductions, with num_iterations updates per batch. One group is one micro-batch; a step
accumulates `groups_per_step` of them.

The control plane calls `admit_grpo`, `revalidate_grpo` and `run_grpo` with plain data, as for
SFT. Exactness: everything that decides the arithmetic is in the effective configuration and
identities (compared at resume) or in the checkpoint (restored): adapter, optimizer, cursor,
reference tensors and cadence, pending old/reference log-probabilities, audit accumulators.
"""

import hashlib
import json
import math
import secrets
import time
from dataclasses import dataclass, field

import numpy as np

from trainer.model import IGNORE_INDEX
from trainer.runs import checkpoint_dir, objectives
from trainer.runs.common import (check_request, find_base, publish_final, BACKEND_LOSS_ROUTES, LORA_DEFAULT, SCHEDULE_DEFAULT, STATE_FILE, Admission,
                                 AdmissionError, NullHooks, RequestError, RunFailed, RunResult, RunSettings,
                                 adapter_values, canonical, check_planning_schema, check_shared, clip_and_step,
                                 comparable_config, confined, difference, execution_identity, int_field, load_resume,
                                 lora_config, merge_config, number_field, optimizer_files, planning_identity, publish,
                                 refuse_drift, reopen_resume, restore_optimizer, resume_record, revalidate,
                                 select_loss_route, sha256_hex, state_bytes, tensors_bytes, tensors_from)

KIND = "grpo"
REFERENCE_FILE = "reference.safetensors"  # EMA reference adapter values
ROLLOUT_FILE = "rollout.safetensors"  # old / reference log-probabilities of a batch still being iterated
CHAIN_START = hashlib.sha256(b"kiln.grpo.consumed-lines.v1").hexdigest()

GRPO_DEFAULTS = {
    "output_name": None,
    "base_model": "kiln-tiny",
    "learning_rate": 1e-5,  # LoRA needs more than TRL's full-model 1e-6
    "lr_schedule": SCHEDULE_DEFAULT,
    "epochs": 1,
    "groups_per_step": 1,  # micro-batches (groups) accumulated into one optimizer step
    "max_grad_norm": 1.0,  # TRL / transformers default
    "lora": LORA_DEFAULT,
    "seed": None,
    "checkpoint_interval": None,  # the server's training.checkpoint_interval when absent
    "resume_checkpoint": None,
    "epsilon": 0.2,  # TRL
    "epsilon_high": None,  # None: epsilon (symmetric clipping)
    "beta": 0.0,  # TRL: no KL term, no reference forward
    "scale_rewards": "group",  # TRL
    "loss_type": "dapo",  # TRL's current default
    "num_iterations": 1,  # TRL's mu
    "max_completion_length": 256,  # TRL; completions are truncated to it; dr_grpo divides by it
    "reference": {"type": "frozen"},
    "streaming": False,
    "activation_checkpointing": "none",
}
EMA_DEFAULTS = {"refresh_steps": 512, "mixup_alpha": 0.6}  # TRL ref_model_sync_steps / ref_model_mixup_alpha


# -- request --------------------------------------------------------------------------------


def normalise_config(config: dict, settings: RunSettings) -> dict:
    """The validated, complete GRPO configuration; RequestError on bad input."""
    c = check_shared(merge_config(config, GRPO_DEFAULTS, KIND), settings)
    c["epochs"] = int_field(c["epochs"], "config.epochs", 1)
    c["groups_per_step"] = int_field(c["groups_per_step"], "config.groups_per_step", 1)
    c["epsilon"] = number_field(c["epsilon"], "config.epsilon", 0.0)
    if c["epsilon"] >= 1.0:
        raise RequestError("config.epsilon", f"must be below 1, got {c['epsilon']}")
    c["epsilon_high"] = number_field(c["epsilon"] if c["epsilon_high"] is None else c["epsilon_high"],
                                     "config.epsilon_high", 0.0)
    c["beta"] = number_field(c["beta"], "config.beta")
    if c["beta"] < 0:
        raise RequestError("config.beta", f"must be at least 0, got {c['beta']}")
    if c["scale_rewards"] not in objectives.SCALE_REWARDS:
        raise RequestError("config.scale_rewards", f"must be one of {', '.join(objectives.SCALE_REWARDS)}")
    if c["loss_type"] not in objectives.LOSS_TYPES:
        raise RequestError("config.loss_type", f"must be one of {', '.join(objectives.LOSS_TYPES)}")
    c["num_iterations"] = int_field(c["num_iterations"], "config.num_iterations", 1)
    c["max_completion_length"] = int_field(c["max_completion_length"], "config.max_completion_length", 1)
    reference = c["reference"]
    if not isinstance(reference, dict) or set(reference) - {"type", "refresh_steps", "mixup_alpha"}:
        raise RequestError("config.reference", "must be {type: frozen|ema, refresh_steps, mixup_alpha}")
    kind = reference.get("type", "frozen")
    if kind == "frozen":
        if reference.get("refresh_steps") is not None or reference.get("mixup_alpha") is not None:
            raise RequestError("config.reference", "a frozen reference has no refresh_steps or mixup_alpha")
        c["reference"] = {"type": "frozen", "refresh_steps": None, "mixup_alpha": None}
    elif kind == "ema":
        steps = reference.get("refresh_steps", EMA_DEFAULTS["refresh_steps"])
        alpha = reference.get("mixup_alpha", EMA_DEFAULTS["mixup_alpha"])
        steps = int_field(steps, "config.reference.refresh_steps", 1)
        alpha = number_field(alpha, "config.reference.mixup_alpha", 0.0)
        if alpha > 1.0:
            raise RequestError("config.reference.mixup_alpha", f"must lie in (0, 1], got {alpha}")
        c["reference"] = {"type": "ema", "refresh_steps": steps, "mixup_alpha": alpha}
    else:
        raise RequestError("config.reference.type", "must be frozen or ema")
    if not isinstance(c["streaming"], bool):
        raise RequestError("config.streaming", "must be true or false")
    return c


def _finite(value) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)


def parse_group(record, where: str) -> dict:
    """The group unchanged after checking its shape; RequestError naming `where` otherwise."""
    if not isinstance(record, dict):
        raise RequestError(where, "must be an object with prompt or messages, and completions")
    if ("prompt" in record) == ("messages" in record):
        raise RequestError(where, "needs exactly one of prompt (text) or messages (chat)")
    if "prompt" in record and not isinstance(record["prompt"], str):
        raise RequestError(where, "prompt must be a string")
    if "messages" in record:
        messages = record["messages"]
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages):
            raise RequestError(where, "messages must be a non-empty list of {role, content}")
    completions = record.get("completions")
    if not isinstance(completions, list) or len(completions) < 2:
        raise RequestError(where, "completions must be a list of at least two scored completions")
    for index, completion in enumerate(completions):
        here = f"{where}.completions[{index}]"
        if not isinstance(completion, dict) or not isinstance(completion.get("text"), str):
            raise RequestError(here, "must be an object with a text string")
        if ("reward" in completion) == ("rewards" in completion):
            raise RequestError(here, "needs exactly one of reward (a number) or rewards ({name: number})")
        if "reward" in completion and not _finite(completion["reward"]):
            raise RequestError(here, f"reward must be a finite number, got {completion['reward']!r}")
        if "rewards" in completion:
            rewards = completion["rewards"]
            if not isinstance(rewards, dict) or not rewards or not all(
                    v is None or _finite(v) for v in rewards.values()):
                raise RequestError(here, "rewards must map names to finite numbers (or null)")
    weights = record.get("reward_weights", {})
    if not isinstance(weights, dict) or not all(_finite(v) for v in weights.values()):
        raise RequestError(where, "reward_weights must map reward names to finite numbers")
    try:
        canonical(record)
    except ValueError:
        raise RequestError(where, "holds a non-finite number") from None
    return record


def group_sha256(record) -> str:
    """A group's identity: SHA-256 of its canonical JSON."""
    return sha256_hex(canonical(record))


def tokenize_group(record, tokenizer, config: dict, maximum_context: int, where: str):
    """(prompt ids, [completion ids]) with completions truncated to max_completion_length and the context."""
    if "messages" in record:
        prompt = tokenizer.apply_chat_template(record["messages"], add_generation_prompt=True)
    else:
        prompt = record["prompt"]
    prompt_ids = tokenizer.encode(prompt)
    if not prompt_ids:
        raise RequestError(where, "the prompt has no tokens")
    limit = min(config["max_completion_length"], maximum_context + 1 - len(prompt_ids))
    if limit < 1:
        raise RequestError(where, f"the prompt ({len(prompt_ids)} tokens) leaves no room in the model's "
                                  f"context of {maximum_context}")
    completions = [tokenizer.encode(c["text"])[:limit] for c in record["completions"]]
    if not any(completions):
        raise RequestError(where, "no completion of the group has a token")
    return prompt_ids, completions


def group_rewards(record) -> np.ndarray:
    weights = record.get("reward_weights", {})
    return np.array([objectives.completion_reward(c, weights) for c in record["completions"]], np.float64)


def group_batch(prompt_ids, completions, pad: int):
    """inputs [G,T], targets [G,T] (completion tokens, IGNORE elsewhere) and mask [G,T] of one group."""
    P = len(prompt_ids)
    T = P + max(len(c) for c in completions) - 1
    G = len(completions)
    inputs = np.full((G, T), pad, np.int64)  # [G,T]
    targets = np.full((G, T), IGNORE_INDEX, np.int64)  # [G,T]
    for row, completion in enumerate(completions):
        sequence = list(prompt_ids) + list(completion)
        inputs[row, :len(sequence) - 1] = sequence[:-1]
        targets[row, P - 1:P - 1 + len(completion)] = completion
    return inputs, targets, targets != IGNORE_INDEX


# -- sources ----------------------------------------------------------------------------------


def _chain(chain: str, line_sha: str) -> str:
    return hashlib.sha256(bytes.fromhex(chain) + bytes.fromhex(line_sha)).hexdigest()


def _blank(raw: bytes) -> bool:
    return raw.strip() == b""


def _parse_line(raw: bytes, number: int, source: str):
    try:
        return json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise RequestError(source, f"line {number + 1} is not UTF-8 JSON: {error}") from None


def scan_stream(path, on_group=None) -> dict:
    """Read a JSONL file once, lazily: its identity (sha256, bytes, lines, groups, line chain)."""
    digest, chain = hashlib.sha256(), CHAIN_START
    lines = groups = size = 0
    with open(path, "rb") as handle:
        for raw in handle:
            digest.update(raw)
            size += len(raw)
            chain = _chain(chain, sha256_hex(raw))
            if not _blank(raw):
                record = parse_group(_parse_line(raw, lines, "dataset_path"), f"dataset_path line {lines + 1}")
                if on_group is not None:
                    on_group(record, f"dataset_path line {lines + 1}")
                groups += 1
            lines += 1
    return {"route": "streamed_jsonl", "sha256": digest.hexdigest(), "bytes": size, "lines": lines,
            "groups": groups, "line_chain_sha256": chain, "order": "source"}


@dataclass
class GRPOLoop:
    epoch: int = 0
    group: int = 0  # next group index within the epoch
    step: int = 0  # committed optimizer steps
    iteration: int = 0  # iterations done on the pending batch (0: none pending)
    line: int = 0  # streamed: next physical line (0-based) and its byte offset
    byte: int = 0
    chain: str = CHAIN_START  # streamed: chain hash of the lines consumed this epoch
    chain_lines: int = 0
    losses: list = field(default_factory=list)
    audits: list = field(default_factory=list)
    plans: list = field(default_factory=list)
    totals: dict = field(default_factory=lambda: {
        "steps": 0, "tokens": 0, "completions": 0, "clipped_low": 0, "clipped_high": 0,
        "ratio_sum": 0.0, "kl_sum": 0.0, "reward_sum": 0.0})
    refreshes: list = field(default_factory=list)  # steps after which the EMA reference was refreshed
    pending: list | None = None  # group refs of the batch still being iterated

    def cursor(self) -> dict:
        return {"epoch": self.epoch, "group": self.group, "line": self.line, "byte": self.byte,
                "chain": self.chain, "chain_lines": self.chain_lines}


class MemorySource:
    """Inline groups or a JSONL file read whole."""

    def __init__(self, records):
        self.records = records
        self.hashes = [group_sha256(r) for r in records]

    @property
    def count(self):
        return len(self.records)

    def read(self, loop: GRPOLoop, count: int):
        out = []
        while len(out) < count and loop.group < self.count:
            i = loop.group
            out.append(({"index": i, "sha256": self.hashes[i]}, self.records[i]))
            loop.group += 1
        if loop.group >= self.count:
            loop.epoch += 1
            loop.group = 0
        return out

    def reread(self, ref):
        record = self.records[ref["index"]]
        if self.hashes[ref["index"]] != ref["sha256"]:
            raise AdmissionError("source_changed", f"group {ref['index']} is not the group the checkpoint "
                                 "was iterating", [difference(f"dataset.group[{ref['index']}]", ref["sha256"],
                                                              self.hashes[ref["index"]])])
        return record

    def peek(self, loop: GRPOLoop):
        return self.hashes[loop.group] if loop.group < self.count else None

    def close(self):
        pass


class StreamSource:
    """A JSONL file read lazily from a byte cursor; each consumed line's hash enters a chain."""

    def __init__(self, path, identity: dict):
        self.path = path
        self.identity = identity
        self.handle = open(path, "rb")

    def _consume(self, loop: GRPOLoop):
        """The next physical line at the cursor, or None at the end of the file."""
        self.handle.seek(loop.byte)
        raw = self.handle.readline()
        if not raw:
            return None
        offset, number = loop.byte, loop.line
        line_sha = sha256_hex(raw)
        loop.byte += len(raw)
        loop.line += 1
        loop.chain = _chain(loop.chain, line_sha)
        loop.chain_lines += 1
        return number, offset, raw, line_sha

    def _record(self, raw, number):
        try:
            return parse_group(_parse_line(raw, number, "dataset_path"), f"dataset_path line {number + 1}")
        except RequestError as error:
            raise RunFailed("source_changed", f"{self.path} changed while streaming: {error}") from None

    def read(self, loop: GRPOLoop, count: int):
        out = []
        while len(out) < count and loop.group < self.identity["groups"]:
            consumed = self._consume(loop)
            if consumed is None:
                raise RunFailed("source_changed", f"{self.path} ended before group {loop.group}; it changed "
                                                  "while streaming")
            number, offset, raw, line_sha = consumed
            if _blank(raw):
                continue
            record = self._record(raw, number)
            out.append(({"index": loop.group, "sha256": group_sha256(record), "line": number, "offset": offset,
                         "length": len(raw), "line_sha256": line_sha}, record))
            loop.group += 1
        if loop.group >= self.identity["groups"]:
            while self._consume(loop) is not None:  # trailing blank lines belong to this epoch
                pass
            if loop.chain != self.identity["line_chain_sha256"] or loop.chain_lines != self.identity["lines"]:
                raise RunFailed("source_changed", f"{self.path} changed while streaming: the lines read in "
                                                  f"epoch {loop.epoch} do not hash to the admitted file")
            loop.epoch += 1
            loop.group = loop.line = loop.byte = loop.chain_lines = 0
            loop.chain = CHAIN_START
        return out

    def reread(self, ref):
        self.handle.seek(ref["offset"])
        raw = self.handle.read(ref["length"])
        if sha256_hex(raw) != ref["line_sha256"]:
            raise AdmissionError("source_changed", f"line {ref['line'] + 1} of {self.path} changed since the "
                                 "checkpoint", [difference(f"dataset.line[{ref['line'] + 1}]", ref["line_sha256"],
                                                           sha256_hex(raw))])
        return self._record(raw, ref["line"])

    def peek(self, loop: GRPOLoop):
        probe = GRPOLoop(byte=loop.byte, line=loop.line)
        while (consumed := self._consume(probe)) is not None:
            if not _blank(consumed[2]):
                return group_sha256(self._record(consumed[2], consumed[0]))
        return None

    def close(self):
        self.handle.close()


def verify_stream_prefix(path, cursor: dict, plans=()) -> None:
    """Re-read the lines before the byte cursor; AdmissionError("source_changed") unless they hash the same."""
    chain, lines, position = CHAIN_START, 0, 0
    seen = {}
    with open(path, "rb") as handle:
        while position < cursor["byte"]:
            raw = handle.readline()
            if not raw:
                break
            line_sha = sha256_hex(raw)
            seen[lines] = line_sha
            chain = _chain(chain, line_sha)
            position += len(raw)
            lines += 1
    if (chain, lines, position) == (cursor["chain"], cursor["chain_lines"], cursor["byte"]):
        return
    differences = [difference("dataset.consumed_lines", {"lines": cursor["chain_lines"], "byte": cursor["byte"],
                                                         "chain_sha256": cursor["chain"]},
                              {"lines": lines, "byte": position, "chain_sha256": chain})]
    for plan in plans:
        if plan["epoch"] != cursor["epoch"]:
            continue
        for ref in plan["groups"]:
            if seen.get(ref["line"]) != ref["line_sha256"]:
                differences.append(difference(f"dataset.line[{ref['line'] + 1}]", ref["line_sha256"],
                                              seen.get(ref["line"])))
                break
        if len(differences) > 1:
            break
    raise AdmissionError("source_changed", f"{path} changed: the {cursor['chain_lines']} line(s) the checkpoint "
                         "consumed this epoch no longer hash the same; restore the original file or start a "
                         "new run", differences)


# -- admission ------------------------------------------------------------------------------


def _prepare(request: dict, settings: RunSettings):
    check_request(request, "groups")
    config = normalise_config(request.get("config", {}), settings)
    has_path, has_groups = request.get("dataset_path") is not None, request.get("groups") is not None
    if has_path == has_groups:
        raise RequestError("dataset_path", "give exactly one of dataset_path or groups")
    if config["streaming"] and not has_path:
        raise RequestError("config.streaming", "the streamed route reads a dataset_path JSONL file")
    base = find_base(config, settings)
    return config, base


def _dataset_path(request, settings):
    roots = (settings.home / "datasets",) + tuple(settings.data_roots)
    return confined(request["dataset_path"], roots)


def read_groups(request: dict, config: dict, settings: RunSettings, check=None):
    """(kind, dataset identity, records or None, path or None); `check(record, where)` validates each group."""
    if config["streaming"]:
        path = _dataset_path(request, settings)
        return "streamed_jsonl", scan_stream(path, check), None, path
    if request.get("dataset_path") is not None:
        path = _dataset_path(request, settings)
        raw = path.read_bytes()
        records = []
        for number, line in enumerate(raw.split(b"\n")):
            if not _blank(line):
                records.append(parse_group(_parse_line(line, number, "dataset_path"),
                                           f"dataset_path line {number + 1}"))
        kind = "file"
    else:
        groups = request["groups"]
        if not isinstance(groups, list):
            raise RequestError("groups", "must be a list of groups")
        records = [parse_group(g, f"groups[{i}]") for i, g in enumerate(groups)]
        raw = b"".join(canonical(r) + b"\n" for r in records)
        kind, path = "inline", None
    if check is not None:
        for index, record in enumerate(records):
            check(record, f"groups[{index}]")
    identity = {"route": kind, "sha256": sha256_hex(raw), "bytes": len(raw), "groups": len(records),
                "order": "source"}
    return kind, identity, records, path


def admit_grpo(request: dict, settings: RunSettings) -> Admission:
    """Validate the request and resolve what the run will be; refuse drift on resume."""
    from trainer.bases import load_base
    config, base = _prepare(request, settings)
    loss_route = select_loss_route(settings.backend)
    model, tokenizer = load_base(config["base_model"], settings.bases_root, verify=True, loss_route=loss_route)
    context = model.config.maximum_context
    model.close()
    kind, dataset, _, path = read_groups(
        request, config, settings, lambda r, where: tokenize_group(r, tokenizer, config, context, where))
    if dataset["groups"] == 0:
        raise RequestError("groups", "the dataset has no groups")
    steps_per_epoch = math.ceil(dataset["groups"] / config["groups_per_step"])
    total_steps = steps_per_epoch * config["epochs"] * config["num_iterations"]
    identities = {
        "base": {"name": config["base_model"], "identity": base.identity, "config": base.config},
        "tokenizer": tokenizer.identity(),
        "dataset": dataset,
        "execution": execution_identity(settings.backend),
        "planning": planning_identity(KIND, config, loss_route),
    }
    resume, seed = None, config["seed"]
    if config["resume_checkpoint"] is not None:
        loaded = load_resume(config["resume_checkpoint"], config["output_name"], KIND, settings)
        manifest = loaded.manifest
        check_planning_schema(manifest)
        if kind == "streamed_jsonl" and manifest.get("training", {}).get("data_source_kind") == kind:
            cursor = manifest["progress"]["next_cursor"]
            plans = loaded.read_json(STATE_FILE)["plans"]
            verify_stream_prefix(path, _stream_cursor(cursor), plans)
            changed = []
            compare_dataset = manifest.get("dataset") or {}
            for key in sorted(set(compare_dataset) | set(dataset)):
                if compare_dataset.get(key) != dataset.get(key):
                    changed.append(difference(f"dataset.{key}", compare_dataset.get(key), dataset.get(key)))
            if changed:
                raise AdmissionError("source_changed", f"{path} changed after the lines the checkpoint consumed; "
                                     "restore the original file or start a new run", changed)
        request_view = {"training": {"kind": KIND, "adapter": config["output_name"], "data_source_kind": kind},
                        "config": comparable_config(config), **{k: identities[k] for k in (
                            "base", "tokenizer", "dataset", "execution", "planning")}}
        refuse_drift(manifest, request_view, seed)
        resume = resume_record(loaded)
        seed = manifest["seed"]
    if seed is None:
        seed = secrets.randbelow(2**31)
    config["seed"] = seed
    return Admission(kind=KIND, adapter=config["output_name"], request=request, effective_config=config,
                     effective_seed=seed, data_source_kind=kind, total_steps=total_steps,
                     steps_per_epoch=steps_per_epoch, identities=identities, resume=resume)


def _stream_cursor(next_cursor: dict) -> dict:
    return {"epoch": next_cursor["epoch"], "byte": next_cursor["byte"],
            "chain": next_cursor["consumed_lines_sha256"], "chain_lines": next_cursor["consumed_lines"]}


def revalidate_grpo(admission: Admission, settings: RunSettings) -> None:
    """Dequeue-time proof: the checkpoint is still the one admission validated."""
    revalidate(admission, settings)


# -- the run --------------------------------------------------------------------------------


def _state_document(loop: GRPOLoop, scalars: dict, config: dict, seed: int) -> dict:
    return {
        "optimizer": scalars,
        "loop": {"epoch": loop.epoch, "group": loop.group, "step": loop.step, "iteration": loop.iteration,
                 "line": loop.line, "byte": loop.byte, "chain": loop.chain, "chain_lines": loop.chain_lines},
        "scheduler": {"step": loop.step},
        "loss_history": loop.losses,
        "audit_history": loop.audits,
        "accumulators": loop.totals,
        "plans": loop.plans,
        "pending": loop.pending,
        "reference": {**config["reference"], "refreshes": loop.refreshes},
        "rng": {"lora_init": {"seed": seed}},
    }


def _restore(loaded, model, optimizer, loop: GRPOLoop, config: dict):
    """Restore adapter, optimizer and loop; returns (EMA reference or None, pending rollout tensors)."""
    document = loaded.read_json(STATE_FILE)
    restore_optimizer(loaded, model, optimizer, document["optimizer"])
    for key, value in document["loop"].items():
        setattr(loop, key, value)
    loop.losses = list(document["loss_history"])
    loop.audits = list(document["audit_history"])
    loop.totals = dict(document["accumulators"])
    loop.plans = list(document["plans"])
    loop.pending = document["pending"]
    loop.refreshes = list(document["reference"]["refreshes"])
    if loop.step != optimizer.step_count or loop.step != loaded.manifest["progress"]["committed_step"]:
        raise AdmissionError("checkpoint_invalid", "checkpoint loop, optimizer and progress steps disagree")
    reference = tensors_from(loaded.read(REFERENCE_FILE)) if config["reference"]["type"] == "ema" else None
    rollout = tensors_from(loaded.read(ROLLOUT_FILE)) if loop.pending is not None else {}
    return reference, rollout


@dataclass
class _Batch:
    refs: list
    groups: list  # (prompt ids, completions, rewards, advantages)
    epoch: int
    old: dict = field(default_factory=dict)  # group position -> old log p [G,T] (num_iterations > 1)
    ref: dict = field(default_factory=dict)  # group position -> reference log p [G,T] (beta > 0)


def run_grpo(admission: Admission, settings: RunSettings, hooks=None) -> RunResult:
    """Train (or continue) the admitted GRPO run; publish checkpoints; stop cooperatively."""
    from trainer import Adam
    from trainer.bases import load_base
    hooks = hooks or NullHooks()
    config = admission.effective_config
    route = admission.identities["planning"]["loss_route"]
    if route not in BACKEND_LOSS_ROUTES.get(settings.backend, ()):
        raise AdmissionError("loss_route_unavailable", f"loss route {route!r} is not available on backend "
                                                       f"{settings.backend!r}")
    _, base = _prepare(admission.request, settings)
    if base.identity != admission.identities["base"]["identity"]:
        raise AdmissionError("base_changed", "the base model changed after admission")
    kind, dataset, records, path = read_groups(admission.request, config, settings)
    if dataset != admission.identities["dataset"]:
        code = "source_changed" if kind == "streamed_jsonl" else "dataset_changed"
        raise AdmissionError(code, "the dataset changed after admission",
                             [difference("dataset", admission.identities["dataset"], dataset)])
    source = StreamSource(path, dataset) if kind == "streamed_jsonl" else MemorySource(records)
    model, tokenizer = load_base(config["base_model"], settings.bases_root, verify=True, loss_route=route,
                                 activation_checkpointing=config["activation_checkpointing"])
    try:
        model.attach_lora(lora_config(config, admission.effective_seed))
        with model.adapter_parameters() as adapters, \
                Adam(adapters, learning_rate=config["learning_rate"]) as optimizer:
            loop = GRPOLoop()
            reference = model.adapter_state_dict() if config["reference"]["type"] == "ema" else None
            latest, batch = None, None
            if admission.resume is not None:
                loaded = reopen_resume(admission, settings)
                restored, rollout = _restore(loaded, model, optimizer, loop, config)
                reference = restored if restored is not None else reference
                if kind == "streamed_jsonl":
                    verify_stream_prefix(path, loop.cursor(), loop.plans)
                expected = loaded.manifest["progress"]["next_cursor"]["group_sha256"]
                if loop.step < admission.total_steps and source.peek(loop) != expected:
                    raise AdmissionError("source_changed", "the group at the checkpoint's cursor is not the one "
                                         "it names", [difference("next_cursor.group_sha256", expected,
                                                                 source.peek(loop))])
                if loop.pending is not None:
                    batch = _batch(admission, tokenizer, model, [(ref, source.reread(ref)) for ref in loop.pending],
                                   loop.plans[-1]["epoch"])
                    batch.old = {int(k.split("/")[1]): v for k, v in rollout.items() if k.startswith("old/")}
                    batch.ref = {int(k.split("/")[1]): v for k, v in rollout.items() if k.startswith("ref/")}
                latest = checkpoint_dir.checkpoint_summary(loaded)
                hooks.on_event("info", f"resumed from {loaded.path.name} at step {loop.step}")
            result = _train(admission, settings, model, tokenizer, optimizer, adapters, source, loop, reference,
                            batch, latest, hooks)
            return publish_final(result, model, settings, admission.adapter, config["base_model"], hooks)
    finally:
        source.close()
        model.close()


def _batch(admission, tokenizer, model, read, epoch) -> _Batch:
    config = admission.effective_config
    context = model.config.maximum_context
    refs, groups, rewards = [], [], []
    for ref, record in read:
        prompt_ids, completions = tokenize_group(record, tokenizer, config, context, f"group {ref['index']}")
        refs.append(ref)
        groups.append((prompt_ids, completions))
        rewards.append(group_rewards(record))
    advantages, stds = objectives.group_advantages(rewards, config["scale_rewards"])
    return _Batch(refs=refs, epoch=epoch,
                  groups=[(p, c, r, a, s) for (p, c), r, a, s in zip(groups, rewards, advantages, stds)])


def _reference_logp(model, reference, inputs, targets, config):
    """log p [G,T] of the targets under the reference (the adapter off, or the EMA adapter)."""
    if config["reference"]["type"] == "frozen":
        values = {k: np.zeros_like(v) for k, v in model.adapter_state_dict().items()}
    else:
        values = reference
    with adapter_values(model, values):
        return -model.token_losses(inputs, targets)


def _train(admission, settings, model, tokenizer, optimizer, adapters, source, loop, reference, batch,
           latest, hooks):
    config = admission.effective_config
    interval = config["checkpoint_interval"]
    iterations = config["num_iterations"]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    started = time.perf_counter()
    while loop.step < admission.total_steps:
        if batch is None:
            epoch = loop.epoch
            batch = _batch(admission, tokenizer, model, source.read(loop, config["groups_per_step"]), epoch)
            loop.pending = [dict(r) for r in batch.refs] if iterations > 1 else None
        step_tokens = sum(sum(len(c) for c in g[1]) for g in batch.groups)
        loss_total, sums = 0.0, []
        plan_groups = []
        for position, (prompt_ids, completions, rewards, advantages, _) in enumerate(batch.groups):
            inputs, targets, mask = group_batch(prompt_ids, completions, pad)
            plan_groups.append({**batch.refs[position], "prompt_tokens": len(prompt_ids),
                                "completion_tokens": [len(c) for c in completions]})
            if not mask.any():
                continue
            if config["beta"] != 0.0 and position not in batch.ref:
                batch.ref[position] = _reference_logp(model, reference, inputs, targets, config)
            captured = {}

            def coefficients(logp, position=position, mask=mask, advantages=advantages):
                if position not in batch.old:
                    old = logp
                    if iterations > 1:
                        batch.old[position] = logp.copy()
                else:
                    old = batch.old[position]
                loss, c, audit = objectives.grpo_micro_batch(
                    logp, old, batch.ref.get(position), advantages, mask,
                    epsilon_low=config["epsilon"], epsilon_high=config["epsilon_high"], beta=config["beta"],
                    loss_type=config["loss_type"], accumulation=len(batch.groups),
                    max_completion_length=config["max_completion_length"], step_tokens=step_tokens)
                captured.update(loss=loss, audit=audit)
                return c

            model.forward_backward_weighted(inputs, targets, coefficients)
            loss_total += captured["loss"]
            sums.append(captured["audit"])
        grad_norm, clipped, learning_rate = clip_and_step(config, optimizer, adapters, loop.step,
                                                          admission.total_steps, loss_total)
        loop.step += 1
        loop.iteration += 1
        audit = _audit(batch, sums, config)
        _accumulate(loop.totals, audit, sums, batch)
        loop.losses.append(loss_total)
        loop.audits.append(audit)
        loop.plans.append({"step": loop.step, "epoch": batch.epoch, "iteration": loop.iteration - 1,
                           "groups": plan_groups, "tokens": step_tokens, "loss_type": config["loss_type"],
                           "accumulation": len(batch.groups)})
        if config["reference"]["type"] == "ema" and loop.step % config["reference"]["refresh_steps"] == 0:
            alpha = np.float32(config["reference"]["mixup_alpha"])
            policy = model.adapter_state_dict()
            reference = {k: v * (np.float32(1.0) - alpha) + policy[k] * alpha for k, v in reference.items()}
            loop.refreshes.append(loop.step)
        finished_batch = loop.iteration >= iterations
        rollout = None
        if finished_batch:
            loop.iteration, loop.pending, batch = 0, None, None
        else:
            rollout = {f"old/{k}": v for k, v in batch.old.items()}
            rollout.update({f"ref/{k}": v for k, v in batch.ref.items()})
        hooks.on_step({"step": loop.step, "loss": loss_total, "learning_rate": learning_rate,
                       "grad_norm": grad_norm, "clipped": clipped, "epoch": audit["epoch"],
                       "elapsed_seconds": time.perf_counter() - started, **audit})
        done = loop.step >= admission.total_steps
        cancel = not done and hooks.should_cancel()
        if interval and (loop.step % interval == 0 or done or cancel):
            latest = _publish(admission, settings, model, optimizer, loop, source, reference, rollout, hooks, done)
        if cancel:
            hooks.on_event("info", f"cancelled after step {loop.step}")
            return RunResult("cancelled", loop.step, latest, list(loop.losses))
    return RunResult("succeeded", loop.step, latest, list(loop.losses))


def _audit(batch: _Batch, sums: list, config: dict) -> dict:
    """The policy audit of one step: clip fractions, KL, ratio, reward and advantage statistics."""
    tokens = sum(s["tokens"] for s in sums)
    rewards = np.concatenate([g[2] for g in batch.groups])
    advantages = np.concatenate([g[3] for g in batch.groups])
    mins = [s["ratio_min"] for s in sums if s["ratio_min"] is not None]
    maxs = [s["ratio_max"] for s in sums if s["ratio_max"] is not None]
    per = max(tokens, 1)
    low = sum(s["clipped_low"] for s in sums)
    high = sum(s["clipped_high"] for s in sums)
    return {
        "epoch": batch.epoch,
        "groups": len(batch.groups),
        "completions": int(rewards.size),
        "tokens": tokens,
        "clip_low_fraction": low / per,
        "clip_high_fraction": high / per,
        "clip_region_fraction": (low + high) / per,
        "kl_mean": (sum(s["kl_sum"] for s in sums) / per) if config["beta"] != 0.0 else None,
        "ratio_mean": sum(s["ratio_sum"] for s in sums) / per,
        "ratio_min": min(mins) if mins else None,
        "ratio_max": max(maxs) if maxs else None,
        "reward_mean": float(rewards.mean()),
        "reward_std": float(np.mean([g[4] for g in batch.groups])),  # TRL logs the mean group std
        "advantage_mean": float(advantages.mean()),
        "advantage_std": float(advantages.std()),
    }


def _accumulate(totals: dict, audit: dict, sums: list, batch: _Batch):
    totals["steps"] += 1
    totals["tokens"] += audit["tokens"]
    totals["completions"] += audit["completions"]
    totals["clipped_low"] += sum(s["clipped_low"] for s in sums)
    totals["clipped_high"] += sum(s["clipped_high"] for s in sums)
    totals["ratio_sum"] += sum(s["ratio_sum"] for s in sums)
    totals["kl_sum"] += sum(s["kl_sum"] or 0.0 for s in sums)
    totals["reward_sum"] += float(sum(g[2].sum() for g in batch.groups))


def _publish(admission, settings, model, optimizer, loop, source, reference, rollout, hooks, complete):
    started = time.perf_counter()
    files, scalars = optimizer_files(model, optimizer)
    config = admission.effective_config
    if reference is not None:
        files[REFERENCE_FILE] = tensors_bytes(reference)
    if rollout is not None:
        files[ROLLOUT_FILE] = tensors_bytes(rollout)
    files[STATE_FILE] = state_bytes(_state_document(loop, scalars, config, admission.effective_seed))
    snapshot_seconds = time.perf_counter() - started
    cursor = {"epoch": loop.epoch, "group": loop.group, "iteration": loop.iteration,
              "group_sha256": None if complete else source.peek(loop)}
    if admission.data_source_kind == "streamed_jsonl":
        cursor.update({"line": loop.line, "byte": loop.byte, "consumed_lines": loop.chain_lines,
                       "consumed_lines_sha256": loop.chain})
    progress = {"next_cursor": cursor, "complete": complete,
                "reference": {"type": config["reference"]["type"], "refreshes": len(loop.refreshes)}}
    return publish(admission, settings, loop.step, files, progress, hooks, snapshot_seconds)
