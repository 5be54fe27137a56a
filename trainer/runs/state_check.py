"""Semantic validation of a `.kiln-checkpoint`'s state: each training kind's `check_state(manifest, files)`.

The strict loader (checkpoint_dir_load, full=True) has proven every file's size and SHA-256 and the
manifest's checkpoint_id; that proves the files are the ones the manifest names, not that they are
state a run can have written. These checks do: every count, cursor, step, Adam power (beta^step), RNG
state and history length is recomputed from the manifest (progress, config, dataset, seed) and from the
other fields, exactly as the SFT, GRPO and OPD loops write them (trainer.runs.sft, grpo, grpo_data, opd,
state, step; trainer.optim), and must be equal. Types are exact: integers are not booleans, numbers are
finite, nothing is a string standing in for a number.

GRPO's rules are in trainer.runs.state_check_grpo, on the same Checker and Context.

Two refusals, both CheckpointErrors with a stable code and a `field` naming the state field:
`bad_field` (BadField) when a value has the wrong type, shape or range, and `inconsistent_state`
(InconsistentState) when well-formed values disagree. Nothing here mutates anything; the validators
run before anything is restored.
"""

import inspect
import json
import math

import numpy as np

from trainer.runs.admission import PLANNING_SCHEMA_V3
from trainer.runs.checkpoint_dir_names import BadField, InconsistentState, NoncanonicalName, checkpoint_basename
from trainer.jsonio import strict_loads
from trainer.runs.formats import (GUARDRAILS, MAX_IDLE_CANDIDATES, PLANNING_SCHEMA_SFT, SPIKE_FACTOR, SPIKE_WINDOW,
                                  rollout_seed)
from trainer.runs.state import ADAPTER_FILE, OPTIMIZER_FILE, STATE_FILE
from trainer.runs.step import learning_rate_at
from trainer.tensorfiles import tensors_from_buffer

SCHEDULES = ("constant", "linear", "cosine")


def _current(manifest: dict, schema: str) -> bool:
    """Whether the checkpoint was planned under the schema its kind writes now. One planned under another
    is inspectable and checksum-valid but no exact-resume authority (admission refuses it: planning_schema),
    and its state follows that older writer, so these rules do not apply to it."""
    planning = manifest.get("planning")
    return isinstance(planning, dict) and planning.get("schema") == schema


def state_rules_apply(kind: str, manifest: dict) -> bool:
    """Whether the semantic state rules were applied to a checkpoint of KIND (its planning schema is the one the
    kind writes now); `kiln checkpoint verify` says so when they were not."""
    current = {"sft": PLANNING_SCHEMA_SFT, "grpo": PLANNING_SCHEMA_V3, "opd": PLANNING_SCHEMA_V3}.get(kind)
    return current is not None and _current(manifest, current)


def _adam_defaults() -> dict:
    """The Adam hyperparameters every run keeps (runs pass only the learning rate)."""
    from trainer.optim import Adam
    parameters = inspect.signature(Adam.__init__).parameters
    return {name: float(parameters[name].default) for name in ("beta1", "beta2", "epsilon", "weight_decay")}


def _power(beta: float, step: int) -> float:
    """beta^step exactly as Adam.step accumulates it: one float multiplication a step, from 1.0."""
    value = 1.0
    for _ in range(step):
        value *= beta
    return value


# ---------------------------------------------------------------------------------------------
# refusals and typed reads


class Checker:
    """Typed reads of one checkpoint's documents; every refusal names the checkpoint and the field."""

    def __init__(self, manifest: dict):
        try:
            self.name = f"checkpoint {checkpoint_basename(manifest.get('adapter'), manifest.get('step'))}"
        except NoncanonicalName:
            self.name = "checkpoint"

    def bad(self, field: str, message: str):
        error = BadField(f"{self.name}: {field} {message}")
        error.field = field
        return error

    def drift(self, field: str, got, expected, reason: str):
        error = InconsistentState(f"{self.name}: {field} is {_short(got)} but {reason} gives {_short(expected)}; "
                                  "the state was edited or written by another program. Do not edit checkpoints; "
                                  "resume from an unedited one")
        error.field = field
        return error

    def equal(self, field: str, got, expected, reason: str):
        """Equal as JSON: 1 is not 1.0 nor true, and nested values compare the same way."""
        if _canonical(got) != _canonical(expected):
            raise self.drift(field, got, expected, reason)

    def mapping(self, value, field: str) -> dict:
        if not isinstance(value, dict):
            raise self.bad(field, f"must be an object, got {_kind(value)}")
        return value

    def object(self, value, field: str, keys) -> dict:
        if not isinstance(value, dict):
            raise self.bad(field, f"must be an object, got {_kind(value)}")
        if set(value) != set(keys):
            missing, extra = sorted(set(keys) - set(value)), sorted(set(value) - set(keys))
            raise self.bad(field, f"must hold exactly {', '.join(sorted(keys))}"
                                  f"{'; missing ' + ', '.join(missing) if missing else ''}"
                                  f"{'; unknown ' + ', '.join(map(str, extra)) if extra else ''}")
        return value

    def integer(self, value, field: str, low=0, high=None) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.bad(field, f"must be an integer, got {_kind(value)}")
        if value < low or (high is not None and value > high):
            bound = f"from {low} to {high}" if high is not None else f"at least {low}"
            raise self.bad(field, f"must be an integer {bound}, got {value}")
        return value

    def number(self, value, field: str, low=None, high=None, none=False):
        if value is None and none:
            return None
        if not _number(value) or not math.isfinite(value):
            raise self.bad(field, f"must be a finite number{' or null' if none else ''}, got {_kind(value)}")
        if (low is not None and value < low) or (high is not None and value > high):
            raise self.bad(field, f"must lie in [{low}, {high}], got {value!r}")
        return value

    def real(self, value, field: str, low=None, high=None, none=False):
        """A float the run computed (json writes it with a point): an integer or a boolean is refused too."""
        if value is None and none:
            return None
        if type(value) is not float:
            raise self.bad(field, f"must be a finite float{' or null' if none else ''}, got {_kind(value)}")
        return self.number(value, field, low, high)

    def boolean(self, value, field: str) -> bool:
        if not isinstance(value, bool):
            raise self.bad(field, f"must be true or false, got {_kind(value)}")
        return value

    def hexdigest(self, value, field: str, none=False):
        if value is None and none:
            return None
        if not isinstance(value, str) or len(value) != 64 or set(value) - set("0123456789abcdef"):
            raise self.bad(field, f"must be 64 lowercase hex digits, got {_kind(value)}")
        return value

    def array(self, value, field: str, length=None) -> list:
        if not isinstance(value, list):
            raise self.bad(field, f"must be a list, got {_kind(value)}")
        if length is not None and len(value) != length:
            raise self.drift(f"len({field})", len(value), length, "the committed step count")
        return value

    def member(self, value, field: str, choices):
        if isinstance(value, bool) or value not in choices:
            raise self.bad(field, f"must be one of {', '.join(map(repr, choices))}, got {_short(value)}")
        return value


def _canonical(value) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=True, default=repr)


def _number(value) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float))


def _kind(value) -> str:
    if isinstance(value, (bool, int, float, str)) or value is None:
        return f"{type(value).__name__} {_short(value)}"
    return type(value).__name__


def _short(value) -> str:
    text = json.dumps(value, sort_keys=True) if _jsonable(value) else repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


def _jsonable(value) -> bool:
    try:
        json.dumps(value, allow_nan=True)
        return True
    except (TypeError, ValueError):
        return False


# ---------------------------------------------------------------------------------------------
# what every kind shares


class Context:
    """The state document and the manifest sections every check reads, typed."""

    def __init__(self, manifest: dict, files: dict, kind: str, top_keys):
        self.c = c = Checker(manifest)
        self.manifest, self.files = manifest, files
        raw = files.get(STATE_FILE)
        if raw is None:
            raise c.bad(STATE_FILE, "is missing: every run checkpoint holds its state document")
        raw = bytes(raw)
        try:  # strict (no duplicate keys, no NaN); integers unbounded (RNG states are 128-bit); ASCII by the
            document = strict_loads(raw, bounded_ints=False)  # canonical-form comparison below
        except ValueError as error:
            raise c.bad(STATE_FILE, f"is not strict ASCII JSON: {error}") from None
        if json.dumps(document, sort_keys=True, separators=(",", ":"), allow_nan=False).encode() != raw:
            raise c.bad(STATE_FILE, "is not in the canonical form runs write (sorted keys, compact); it was rewritten")
        self.state = c.object(document, "state", top_keys)
        self.training = c.object(manifest.get("training"), "manifest.training",
                                 self.training_keys(kind, manifest.get("training")))
        c.equal("manifest.training.kind", self.training["kind"], kind, "checkpoint_type")
        c.equal("manifest.training.adapter", self.training["adapter"], manifest.get("adapter"),
                "the manifest's adapter")
        self.config = c.mapping(manifest.get("config"), "manifest.config")
        self.dataset = c.mapping(manifest.get("dataset"), "manifest.dataset")
        self.seed = c.integer(manifest.get("seed"), "manifest.seed")
        self.progress = manifest.get("progress")
        if not isinstance(self.progress, dict):
            raise c.bad("manifest.progress", f"must be an object, got {_kind(self.progress)}")
        self.step = c.integer(manifest.get("step"), "manifest.step", 1)
        self.source_kind = c.member(self.training["data_source_kind"], "manifest.training.data_source_kind",
                                    ("inline", "file", "streamed_jsonl") if kind == "grpo" else ("inline", "file"))
        c.equal("manifest.progress.data_source_kind", self.progress.get("data_source_kind"), self.source_kind,
                "manifest.training.data_source_kind")
        self.kind = kind

    @staticmethod
    def training_keys(kind, training=None):
        keys = ("kind", "adapter", "data_source_kind")
        if kind == "opd":
            return keys + ("teacher", "base_adapter")
        # SFT and GRPO name a warm start only when the run had one (trainer.runs.admission.training_view)
        return keys + (("base_adapter",) if isinstance(training, dict) and "base_adapter" in training else ())

    def config_int(self, key, low=1):
        return self.c.integer(self.config.get(key), f"manifest.config.{key}", low)

    def dataset_int(self, key, low=1):
        return self.c.integer(self.dataset.get(key), f"manifest.dataset.{key}", low)

    def progress_base(self, total: int, cursor_keys):
        """progress: the committed step within total_steps, complete exactly at the end; returns next_cursor."""
        c, p = self.c, self.progress
        keys = {"data_source_kind", "committed_step", "total_steps", "next_cursor", "complete"}
        c.object(p, "manifest.progress", keys | ({"reference"} if self.kind == "grpo" else set())
                 | ({"teacher"} if self.kind == "opd" else set()))
        c.integer(p["total_steps"], "manifest.progress.total_steps", 1)
        c.equal("manifest.progress.total_steps", p["total_steps"], total, "the configuration and dataset")
        if self.step > total:
            raise c.drift("manifest.step", self.step, total, "progress.total_steps (the last step)")
        c.boolean(p["complete"], "manifest.progress.complete")
        c.equal("manifest.progress.complete", p["complete"], self.step == total, f"step {self.step} of {total}")
        return c.object(p["next_cursor"], "manifest.progress.next_cursor", cursor_keys)

    def schedule(self):
        """The configuration learning_rate_at reads, checked before it is called."""
        c = self.c
        c.number(self.config.get("learning_rate"), "manifest.config.learning_rate", 0.0)
        schedule = c.object(self.config.get("lr_schedule"), "manifest.config.lr_schedule", ("type", "warmup_steps"))
        c.member(schedule["type"], "manifest.config.lr_schedule.type", SCHEDULES)
        c.integer(schedule["warmup_steps"], "manifest.config.lr_schedule.warmup_steps")
        return self.config

    def adam(self) -> tuple[dict, str]:
        """(Adam's hyperparameters besides the learning rate, where they come from): the configuration's
        `optimizer` when it has one, else the defaults every run used before it did."""
        options = self.config.get("optimizer")
        if options is None:
            return _adam_defaults(), "the Adam every run builds"
        self.c.object(options, "manifest.config.optimizer", ("beta1", "beta2", "epsilon", "weight_decay"))
        return ({key: float(self.c.number(value, f"manifest.config.optimizer.{key}", 0.0))
                 for key, value in options.items()}, "manifest.config.optimizer")

    def learning_rate(self, index: int, total: int) -> float:
        return learning_rate_at(index, self.schedule(), total)

    def max_grad_norm(self):
        return self.c.number(self.config.get("max_grad_norm"), "manifest.config.max_grad_norm", 0.0, none=True)

    def common(self, total: int):
        """optimizer, scheduler and loss_history against the committed step and the schedule."""
        c, s, step = self.c, self.state, self.step
        optimizer = c.object(s["optimizer"], "state.optimizer", ("step", "beta1_power", "beta2_power",
                                                                 "hyperparameters"))
        c.integer(optimizer["step"], "state.optimizer.step")
        c.equal("state.optimizer.step", optimizer["step"], step, "the manifest's committed step")
        adam, where = self.adam()
        hyper = c.object(optimizer["hyperparameters"], "state.optimizer.hyperparameters",
                         ("learning_rate", *adam))
        for key in hyper:
            c.number(hyper[key], f"state.optimizer.hyperparameters.{key}")
        for key, value in adam.items():
            c.equal(f"state.optimizer.hyperparameters.{key}", hyper[key], value, where)
        c.equal("state.optimizer.hyperparameters.learning_rate", hyper["learning_rate"],
                float(self.learning_rate(step - 1, total)), f"the learning-rate schedule at step {step}")
        for which in ("beta1", "beta2"):
            key = f"{which}_power"
            c.real(optimizer[key], f"state.optimizer.{key}", 0.0, 1.0)
            c.equal(f"state.optimizer.{key}", optimizer[key], _power(adam[which], step),
                    f"{which}^{step} (Adam's bias correction after {step} steps)")
        scheduler = c.object(s["scheduler"], "state.scheduler", ("step",))
        c.integer(scheduler["step"], "state.scheduler.step")
        c.equal("state.scheduler.step", scheduler["step"], step, "the manifest's committed step")
        losses = c.array(s["loss_history"], "state.loss_history", step)
        for index, loss in enumerate(losses):
            c.real(loss, f"state.loss_history[{index}]")
        return losses

    def declared(self, expected):
        """The checkpoint's files are exactly what this kind writes at this boundary."""
        got = sorted(self.manifest.get("files") or {})
        if got != sorted(expected):
            raise self.c.drift("manifest.files", got, sorted(expected), "the state (which tensor files it needs)")

    def tensors(self, name: str) -> dict:
        try:
            tensors = tensors_from_buffer(self.files[name], name)
        except (ValueError, KeyError) as error:
            raise self.c.bad(name, f"is not a readable safetensors file: {error}") from None
        for key, value in tensors.items():
            if value.dtype != np.float32:
                raise self.c.bad(f"{name}[{key}]", f"must be float32, got {value.dtype}")
            if not np.all(np.isfinite(value)):
                raise self.c.bad(f"{name}[{key}]", "holds a non-finite value")
        return tensors

    def adapter_tensors(self) -> dict:
        """adapter.safetensors and optimizer.safetensors: the same names and shapes, finite, v >= 0."""
        c = self.c
        adapter = self.tensors(ADAPTER_FILE)
        if not adapter:
            raise c.bad(ADAPTER_FILE, "holds no tensors")
        moments = self.tensors(OPTIMIZER_FILE)
        expected = {f"{which}/{key}": value.shape for key, value in adapter.items()
                    for which in ("first_moment", "second_moment")}
        got = {key: value.shape for key, value in moments.items()}
        if got != expected:
            names = sorted(set(got) ^ set(expected)) or sorted(k for k in got if got[k] != expected[k])
            raise c.drift(f"{OPTIMIZER_FILE} names/shapes", names[:4], "the adapter's",
                          "adapter.safetensors (one first and one second moment per adapter tensor)")
        for key, value in moments.items():
            if key.startswith("second_moment/") and np.any(value < 0):
                raise c.bad(f"{OPTIMIZER_FILE}[{key}]", "holds a negative second moment")
        return adapter

    def lora_seed(self, rng: dict, rng_field: str):
        lora = self.c.object(rng["lora_init"], f"{rng_field}.lora_init", ("seed",))
        self.c.integer(lora["seed"], f"{rng_field}.lora_init.seed")
        self.c.equal(f"{rng_field}.lora_init.seed", lora["seed"], self.seed, "the manifest's effective seed")

    def clipped(self, field: str, grad_norm, clipped, limit):
        self.c.equal(field, clipped, limit is not None and grad_norm > limit,
                     f"grad_norm {grad_norm!r} against max_grad_norm {limit!r}")


# ---------------------------------------------------------------------------------------------
# SFT


def check_sft_state(manifest: dict, files: dict) -> None:
    """An SFT checkpoint's state (trainer.runs.sft._state_document) against its manifest; a CheckpointError."""
    if not _current(manifest, PLANNING_SCHEMA_SFT):
        return
    x = Context(manifest, files, "sft", ("optimizer", "loop", "scheduler", "loss_history", "diagnostics"))
    c, s, step = x.c, x.state, x.step
    x.declared((ADAPTER_FILE, OPTIMIZER_FILE, STATE_FILE))
    records = x.dataset_int("records")
    batch, accumulation, epochs = (x.config_int(k) for k in ("batch_size", "gradient_accumulation_steps", "epochs"))
    per_epoch = math.ceil(math.ceil(records / batch) / accumulation)
    total = per_epoch * epochs
    cursor = x.progress_base(total, ("epoch", "example"))
    losses = x.common(total)
    loop = c.object(s["loop"], "state.loop", ("epoch", "position", "step"))
    for key in loop:
        c.integer(loop[key], f"state.loop.{key}")
    c.equal("state.loop.step", loop["step"], step, "the manifest's committed step")
    epoch = (step - 1) // per_epoch
    position = min((step - epoch * per_epoch) * batch * accumulation, records)
    c.equal("state.loop.epoch", loop["epoch"], epoch, f"step {step} at {per_epoch} steps an epoch")
    c.equal("state.loop.position", loop["position"], position,
            f"step {step} ({batch} examples x {accumulation} micro-batches a step, {records} examples an epoch)")
    c.equal("manifest.progress.next_cursor", cursor, {"epoch": epoch, "example": position}, "state.loop")
    diagnostics = c.array(s["diagnostics"], "state.diagnostics", step)
    limit = x.max_grad_norm()
    for index, entry in enumerate(diagnostics):
        where = f"state.diagnostics[{index}]"
        c.object(entry, where, ("grad_norm", "clipped", "loss_spike"))
        grad_norm = c.real(entry["grad_norm"], f"{where}.grad_norm", 0.0)
        x.clipped(f"{where}.clipped", grad_norm, c.boolean(entry["clipped"], f"{where}.clipped"), limit)
        recent = losses[max(0, index - SPIKE_WINDOW):index]
        spike = len(recent) >= 5 and losses[index] > SPIKE_FACTOR * (sum(recent) / len(recent))
        c.equal(f"{where}.loss_spike", c.boolean(entry["loss_spike"], f"{where}.loss_spike"), spike,
                "the loss history (a loss above twice the mean of the previous 20)")
    x.adapter_tensors()


# ---------------------------------------------------------------------------------------------
# OPD

METRIC_KEYS = ("kl", "entropy", "repetition_rate", "empty_candidates", "candidates_consumed", "tokens",
               "grad_norm", "clipped", "learning_rate")
WINDOW_KEYS = ("empty", "entropy", "repetition", "kl")


def check_opd_state(manifest: dict, files: dict) -> None:
    """An OPD checkpoint's state (trainer.runs.opd._publish) against its manifest; a CheckpointError."""
    if not _current(manifest, PLANNING_SCHEMA_V3):
        return
    x = Context(manifest, files, "opd", ("optimizer", "loop", "scheduler", "loss_history", "metric_history",
                                         "candidates", "guardrails", "rng", "teacher", "base_adapter"))
    c, s, step, config = x.c, x.state, x.step, x.config
    x.declared((ADAPTER_FILE, OPTIMIZER_FILE, STATE_FILE))
    total = x.config_int("steps")
    per_step = x.config_int("candidates_per_step")
    prompts = x.dataset_int("prompts")
    cursor = x.progress_base(total, ("candidate", "prompt", "epoch", "prompt_sha256"))
    losses = x.common(total)
    loop = c.object(s["loop"], "state.loop", ("step", "candidate", "idle"))
    for key in loop:
        c.integer(loop[key], f"state.loop.{key}")
    c.equal("state.loop.step", loop["step"], step, "the manifest's committed step")
    c.equal("state.loop.idle", loop["idle"], 0, "a step boundary (its last candidate produced the update)")
    count = loop["candidate"]
    if count < step * per_step:
        raise c.drift("state.loop.candidate", count, f"at least {step * per_step}",
                      f"{step} step(s) of {per_step} updating candidate(s)")
    c.equal("manifest.progress.next_cursor", cursor, {"candidate": count, "prompt": count % prompts,
                                                      "epoch": count // prompts,
                                                      "prompt_sha256": cursor.get("prompt_sha256")}, "state.loop")
    c.hexdigest(cursor["prompt_sha256"], "manifest.progress.next_cursor.prompt_sha256")

    # candidates: one a consumed candidate, prompts cycled; k-th update lands in step k // per_step + 1
    candidates = c.array(s["candidates"], "state.candidates")
    c.equal("len(state.candidates)", len(candidates), count, "state.loop.candidate")
    updates, empties, run = 0, [0] * (step + 1), 0
    per = [{"tokens": 0, "last": -1} for _ in range(step)]
    for index, entry in enumerate(candidates):
        where = f"state.candidates[{index}]"
        c.object(entry, where, ("candidate", "prompt", "tokens", "empty", "update_step"))
        c.equal(f"{where}.candidate", entry["candidate"], index, "its position")
        c.equal(f"{where}.prompt", entry["prompt"], index % prompts, f"{prompts} prompts cycled")
        tokens = c.integer(entry["tokens"], f"{where}.tokens")
        if c.boolean(entry["empty"], f"{where}.empty"):
            c.equal(f"{where}.update_step", entry["update_step"], None, "an empty candidate (no update)")
            run += 1
            if run >= MAX_IDLE_CANDIDATES:
                raise c.drift(f"{where}.empty", True, False, f"the run's stop after {MAX_IDLE_CANDIDATES} idle "
                                                             "candidates")
            if updates // per_step < step:
                empties[updates // per_step] += 1
            continue
        run = 0
        if updates >= step * per_step:
            raise c.drift(f"{where}.update_step", entry["update_step"], None,
                          f"{step} step(s) of {per_step} candidate(s) (no more updates)")
        c.integer(entry["update_step"], f"{where}.update_step", 1)
        c.equal(f"{where}.update_step", entry["update_step"], updates // per_step + 1,
                f"its place among the updating candidates ({per_step} a step)")
        c.integer(tokens, f"{where}.tokens", 1)
        per[updates // per_step]["tokens"] += tokens
        per[updates // per_step]["last"] = index
        updates += 1
    c.equal("updating candidates in state.candidates", updates, step * per_step,
            f"{step} step(s) of {per_step} candidate(s)")
    if candidates and candidates[-1]["empty"]:
        raise c.drift(f"state.candidates[{count - 1}].empty", True, False, "a step boundary")

    # metric_history: one a step, consistent with the candidates, the losses and the schedule
    metrics = c.array(s["metric_history"], "state.metric_history", step)
    limit = x.max_grad_norm()
    for index, entry in enumerate(metrics):
        where = f"state.metric_history[{index}]"
        c.object(entry, where, METRIC_KEYS)
        for key, value in (("kl", losses[index]), ("empty_candidates", empties[index]),
                           ("candidates_consumed", per[index]["last"] + 1), ("tokens", per[index]["tokens"]),
                           ("learning_rate", x.learning_rate(index, total))):
            if key == "kl":
                c.real(entry[key], f"{where}.{key}")
            elif key == "learning_rate":
                c.number(entry[key], f"{where}.{key}")
            else:
                c.integer(entry[key], f"{where}.{key}")
            c.equal(f"{where}.{key}", entry[key], value, "state.loss_history" if key == "kl" else
                    "the learning-rate schedule" if key == "learning_rate" else "state.candidates")
        c.real(entry["entropy"], f"{where}.entropy", 0.0)
        c.real(entry["repetition_rate"], f"{where}.repetition_rate", 0.0, 1.0)
        grad_norm = c.real(entry["grad_norm"], f"{where}.grad_norm", 0.0)
        x.clipped(f"{where}.clipped", grad_norm, c.boolean(entry["clipped"], f"{where}.clipped"), limit)

    # guardrails: the configured window over the last candidates, and not tripped (a trip stops the run)
    guardrails = c.object(s["guardrails"], "state.guardrails", ("config", "window"))
    c.equal("state.guardrails.config", guardrails["config"], config.get("guardrails"), "manifest.config.guardrails")
    settings = c.object(guardrails["config"], "state.guardrails.config", ("window", *GUARDRAILS))
    size = c.integer(settings["window"], "state.guardrails.config.window", 1)
    window = c.array(guardrails["window"], "state.guardrails.window")
    c.equal("len(state.guardrails.window)", len(window), min(size, count), f"window {size} over {count} candidates")
    for offset, stats in enumerate(window):
        where = f"state.guardrails.window[{offset}]"
        c.object(stats, where, WINDOW_KEYS)
        empty = candidates[count - len(window) + offset]["empty"]
        c.equal(f"{where}.empty", stats["empty"], empty, f"state.candidates[{count - len(window) + offset}]")
        for key in ("entropy", "repetition", "kl"):
            if empty:
                c.equal(f"{where}.{key}", stats[key], None, "an empty candidate")
            else:
                c.real(stats[key], f"{where}.{key}")
    if len(window) >= size:
        for name, (key, direction, _) in GUARDRAILS.items():
            threshold = c.number(settings[name], f"state.guardrails.config.{name}", none=True)
            values = [float(stats[key]) for stats in window if stats[key] is not None]
            if threshold is None or not values:
                continue
            value = sum(values) / len(values)
            if (value < threshold) if direction == "below" else (value > threshold):
                raise c.drift(f"state.guardrails.window ({name})", value, f"{direction} not past {threshold}",
                              "the collapse guardrail, which would have stopped the run")

    # RNG streams, teacher and base adapter
    rng = c.object(s["rng"], "state.rng", ("rollout", "lora_init"))
    x.lora_seed(rng, "state.rng")
    rollout = c.object(rng["rollout"], "state.rng.rollout", ("bit_generator", "state", "has_uint32", "uinteger"))
    c.equal("state.rng.rollout.bit_generator", rollout["bit_generator"], "PCG64", "the rollout stream's generator")
    inner = c.object(rollout["state"], "state.rng.rollout.state", ("state", "inc"))
    c.integer(inner["state"], "state.rng.rollout.state.state", 0, (1 << 128) - 1)
    c.integer(inner["inc"], "state.rng.rollout.state.inc", 0, (1 << 128) - 1)
    inc = np.random.PCG64(rollout_seed(x.seed)).state["state"]["inc"]
    c.equal("state.rng.rollout.state.inc", inner["inc"], inc, "the rollout stream of the effective seed")
    c.equal("state.rng.rollout.has_uint32", rollout["has_uint32"], 0, "sampling (it draws only doubles)")
    c.equal("state.rng.rollout.uinteger", rollout["uinteger"], 0, "sampling (it draws only doubles)")
    c.equal("state.teacher", s["teacher"], x.training["teacher"], "manifest.training.teacher")
    c.equal("state.base_adapter", s["base_adapter"], x.training["base_adapter"], "manifest.training.base_adapter")
    teacher = c.mapping(x.training["teacher"], "manifest.training.teacher")
    c.equal("manifest.progress.teacher", x.progress["teacher"],
            {key: teacher.get(key) for key in ("alias", "identity_revision", "content_revision")},
            "manifest.training.teacher")
    x.adapter_tensors()


STATE_CHECKS = {"sft": check_sft_state, "opd": check_opd_state}  # GRPO's: trainer.runs.state_check_grpo
