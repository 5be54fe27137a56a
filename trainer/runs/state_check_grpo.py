"""The semantic state rules of GRPO checkpoints (inline and streamed): trainer.runs.state_check's rules for the
plans, the pending batch, the audit history and accumulators, the EMA reference and the stream cursor, checked
against the manifest exactly as trainer.runs.grpo and grpo_data write them."""

import math

from trainer.runs.admission import PLANNING_SCHEMA_V3
from trainer.runs.formats import REFERENCE_FILE, ROLLOUT_FILE
from trainer.runs.grpo_data import CHAIN_START
from trainer.runs.state import ADAPTER_FILE, OPTIMIZER_FILE, STATE_FILE
from trainer.runs.state_check import Context, _current


AUDIT_KEYS = ("epoch", "groups", "completions", "tokens", "clip_low_fraction", "clip_high_fraction",
              "clip_region_fraction", "kl_mean", "ratio_mean", "ratio_min", "ratio_max", "reward_mean", "reward_std",
              "advantage_mean", "advantage_std")
ACCUMULATOR_KEYS = ("steps", "tokens", "completions", "clipped_low", "clipped_high", "ratio_sum", "kl_sum",
                    "reward_sum")
STREAM_REF = ("line", "offset", "length", "line_sha256")


def check_grpo_state(manifest: dict, files: dict) -> None:
    """A GRPO checkpoint's state (trainer.runs.grpo._state_document), inline or streamed; a CheckpointError."""
    if not _current(manifest, PLANNING_SCHEMA_V3):
        return
    x = Context(manifest, files, "grpo", ("optimizer", "loop", "scheduler", "loss_history", "audit_history",
                                          "accumulators", "plans", "pending", "reference", "rng"))
    c, s, step, config = x.c, x.state, x.step, x.config
    streamed = x.source_kind == "streamed_jsonl"
    c.equal("manifest.config.streaming", config.get("streaming"), streamed, "manifest.training.data_source_kind")
    c.equal("manifest.dataset.route", x.dataset.get("route"), x.source_kind, "manifest.training.data_source_kind")
    groups = x.dataset_int("groups")
    per_step, iterations, epochs = (x.config_int(k) for k in ("groups_per_step", "num_iterations", "epochs"))
    beta = c.number(config.get("beta"), "manifest.config.beta", 0.0)
    loss_type = config.get("loss_type")
    per_epoch = math.ceil(groups / per_step)
    total = per_epoch * epochs * iterations
    stream_keys = ("line", "byte", "consumed_lines", "consumed_lines_sha256") if streamed else ()
    cursor = x.progress_base(total, ("epoch", "group", "iteration", "group_sha256") + stream_keys)
    x.common(total)

    # the loop: batches read, the iteration within the pending one, the group cursor
    loop = c.object(s["loop"], "state.loop", ("epoch", "group", "step", "iteration", "line", "byte", "chain",
                                              "chain_lines"))
    for key in ("epoch", "group", "step", "iteration", "line", "byte", "chain_lines"):
        c.integer(loop[key], f"state.loop.{key}")
    c.hexdigest(loop["chain"], "state.loop.chain")
    c.equal("state.loop.step", loop["step"], step, "the manifest's committed step")
    batches = math.ceil(step / iterations)
    expected = {"epoch": batches // per_epoch, "group": (batches % per_epoch) * per_step,
                "iteration": step % iterations}
    reason = (f"step {step} ({iterations} iteration(s) a batch of {per_step} group(s), {groups} groups an epoch, "
              f"{epochs} epoch(s))")
    for key, value in expected.items():
        c.equal(f"state.loop.{key}", loop[key], value, reason)

    # plans: one a step, the groups each batch read, in source order
    plans = c.array(s["plans"], "state.plans", step)
    ref_keys = ("index", "sha256") + (STREAM_REF if streamed else ())
    identity, previous = {}, None  # previous: (epoch, line, end byte) of the last group read
    for index, plan in enumerate(plans):
        where = f"state.plans[{index}]"
        c.object(plan, where, ("step", "epoch", "iteration", "groups", "tokens", "loss_type", "accumulation"))
        batch = index // iterations
        first = (batch % per_epoch) * per_step
        indices = list(range(first, min(first + per_step, groups)))
        for key, value in (("step", index + 1), ("epoch", batch // per_epoch), ("iteration", index % iterations),
                           ("accumulation", len(indices)), ("loss_type", loss_type)):
            c.equal(f"{where}.{key}", plan[key], value, reason if key != "loss_type" else "manifest.config")
        entries = c.array(plan["groups"], f"{where}.groups")
        c.equal(f"len({where}.groups)", len(entries), len(indices), reason)
        tokens = 0
        for position, entry in enumerate(entries):
            here = f"{where}.groups[{position}]"
            c.object(entry, here, ref_keys + ("prompt_tokens", "completion_tokens"))
            c.equal(f"{here}.index", c.integer(entry["index"], f"{here}.index"), indices[position], reason)
            c.hexdigest(entry["sha256"], f"{here}.sha256")
            c.integer(entry["prompt_tokens"], f"{here}.prompt_tokens", 1)
            lengths = c.array(entry["completion_tokens"], f"{here}.completion_tokens")
            if len(lengths) < 2:
                raise c.bad(f"{here}.completion_tokens", "must list at least two completions")
            tokens += sum(c.integer(n, f"{here}.completion_tokens[{k}]") for k, n in enumerate(lengths))
            if streamed:
                line = c.integer(entry["line"], f"{here}.line")
                offset = c.integer(entry["offset"], f"{here}.offset")
                length = c.integer(entry["length"], f"{here}.length", 1)
                c.hexdigest(entry["line_sha256"], f"{here}.line_sha256")
                if offset + length > x.dataset_int("bytes") or line >= x.dataset_int("lines"):
                    raise c.drift(f"{here} line {line} bytes {offset}+{length}", offset + length,
                                  {"bytes": x.dataset["bytes"], "lines": x.dataset["lines"]}, "the file's size")
                if index % iterations == 0:
                    if previous is not None and previous[0] == plan["epoch"] and \
                            (line <= previous[1] or offset < previous[2]):
                        raise c.drift(f"{here}.line", line, f"a line after {previous[1]} (byte {previous[2]})",
                                      "source order")
                    previous = (plan["epoch"], line, offset + length)
            known = identity.setdefault(entry["index"], {k: v for k, v in entry.items() if k != "offset"})
            c.equal(here, {k: v for k, v in entry.items() if k != "offset"}, known,
                    f"the same group {entry['index']} in an earlier plan")
        c.equal(f"{where}.tokens", c.integer(plan["tokens"], f"{where}.tokens"), tokens,
                "the completion token counts of its groups")
        if index % iterations:
            c.equal(f"{where}.groups", entries, plans[index - 1]["groups"], "the batch of the previous iteration")

    # streamed cursor: the byte and line after the last group read, or the start of the next epoch
    if streamed:
        if loop["group"] == 0:
            start = {"line": 0, "byte": 0, "chain_lines": 0, "chain": CHAIN_START}
        else:
            last = plans[-1]["groups"][-1]
            start = {"line": last["line"] + 1, "byte": last["offset"] + last["length"], "chain_lines": last["line"] + 1}
        for key, value in start.items():
            c.equal(f"state.loop.{key}", loop[key], value, "the last group the plans read")
    else:
        for key, value in (("line", 0), ("byte", 0), ("chain_lines", 0), ("chain", CHAIN_START)):
            c.equal(f"state.loop.{key}", loop[key], value, f"the {x.source_kind} route (no stream cursor)")

    # progress.next_cursor mirrors the loop; group_sha256 names the next group unless complete
    mirror = {"epoch": loop["epoch"], "group": loop["group"], "iteration": loop["iteration"]}
    if streamed:
        mirror.update(line=loop["line"], byte=loop["byte"], consumed_lines=loop["chain_lines"],
                      consumed_lines_sha256=loop["chain"])
    for key, value in mirror.items():
        c.equal(f"manifest.progress.next_cursor.{key}", cursor[key], value, "state.loop")
    if step == total:
        c.equal("manifest.progress.next_cursor.group_sha256", cursor["group_sha256"], None, "a complete run")
    else:
        c.hexdigest(cursor["group_sha256"], "manifest.progress.next_cursor.group_sha256")
        if loop["group"] in identity:
            c.equal("manifest.progress.next_cursor.group_sha256", cursor["group_sha256"],
                    identity[loop["group"]]["sha256"],
                    f"the plans' group {loop['group']}")

    # pending: the batch still being iterated, exactly the last plan's group references
    pending = s["pending"]
    if step % iterations == 0:
        c.equal("state.pending", pending, None, f"a finished batch (step {step}, {iterations} iteration(s))")
    else:
        refs = [{k: v for k, v in entry.items() if k in ref_keys} for entry in plans[-1]["groups"]]
        c.equal("state.pending", pending, refs, "the last plan's groups (the batch being iterated)")

    # audits, accumulators
    audits = c.array(s["audit_history"], "state.audit_history", step)
    sums = {"tokens": 0, "completions": 0}
    for index, audit in enumerate(audits):
        where = f"state.audit_history[{index}]"
        c.object(audit, where, AUDIT_KEYS)
        plan = plans[index]
        completions = sum(len(entry["completion_tokens"]) for entry in plan["groups"])
        for key, value in (("epoch", plan["epoch"]), ("groups", plan["accumulation"]),
                           ("completions", completions), ("tokens", plan["tokens"])):
            c.equal(f"{where}.{key}", c.integer(audit[key], f"{where}.{key}"), value, f"state.plans[{index}]")
        for key in ("clip_low_fraction", "clip_high_fraction", "clip_region_fraction"):
            c.real(audit[key], f"{where}.{key}", 0.0, 1.0)
        for key in ("ratio_mean", "reward_mean", "advantage_mean"):
            c.real(audit[key], f"{where}.{key}")
        for key in ("reward_std", "advantage_std"):
            c.real(audit[key], f"{where}.{key}", 0.0)
        has_tokens = plan["tokens"] > 0
        for key in ("ratio_min", "ratio_max"):
            if (audit[key] is None) == has_tokens:
                raise c.drift(f"{where}.{key}", audit[key], "a number" if has_tokens else None,
                              f"{plan['tokens']} completion tokens")
            c.real(audit[key], f"{where}.{key}", 0.0, none=True)
        if (audit["kl_mean"] is None) != (beta == 0.0):
            raise c.drift(f"{where}.kl_mean", audit["kl_mean"], None if beta == 0.0 else "a number",
                          f"manifest.config.beta {beta!r}")
        c.real(audit["kl_mean"], f"{where}.kl_mean", none=True)
        sums["tokens"] += plan["tokens"]
        sums["completions"] += completions
    totals = c.object(s["accumulators"], "state.accumulators", ACCUMULATOR_KEYS)
    for key in ("steps", "tokens", "completions", "clipped_low", "clipped_high"):
        c.integer(totals[key], f"state.accumulators.{key}")
    for key in ("ratio_sum", "kl_sum", "reward_sum"):
        c.real(totals[key], f"state.accumulators.{key}")
    c.equal("state.accumulators.steps", totals["steps"], step, "the manifest's committed step")
    for key in ("tokens", "completions"):
        c.equal(f"state.accumulators.{key}", totals[key], sums[key], "the sum over state.audit_history")
    if totals["clipped_low"] + totals["clipped_high"] > totals["tokens"]:
        raise c.drift("state.accumulators.clipped_low+clipped_high", totals["clipped_low"] + totals["clipped_high"],
                      totals["tokens"], "at most one clip a completion token")
    if beta == 0.0:
        c.equal("state.accumulators.kl_sum", float(totals["kl_sum"]), 0.0, "manifest.config.beta 0 (no KL term)")

    # the reference and its refresh cadence
    reference = c.object(config.get("reference"), "manifest.config.reference", ("type", "refresh_steps",
                                                                                 "mixup_alpha"))
    ema = c.member(reference["type"], "manifest.config.reference.type", ("frozen", "ema")) == "ema"
    state_reference = c.object(s["reference"], "state.reference", ("type", "refresh_steps", "mixup_alpha",
                                                                   "refreshes"))
    for key in ("type", "refresh_steps", "mixup_alpha"):
        c.equal(f"state.reference.{key}", state_reference[key], reference[key], "manifest.config.reference")
    refreshes = c.array(state_reference["refreshes"], "state.reference.refreshes")
    every = c.integer(reference["refresh_steps"], "manifest.config.reference.refresh_steps", 1) if ema else None
    expected_refreshes = list(range(every, step + 1, every)) if ema else []
    c.equal("state.reference.refreshes", refreshes, expected_refreshes,
            f"refresh_steps {every} over {step} steps" if ema else "a frozen reference (never refreshed)")
    c.equal("manifest.progress.reference", x.progress["reference"],
            {"type": reference["type"], "refreshes": len(expected_refreshes)}, "state.reference")
    x.lora_seed(c.object(s["rng"], "state.rng", ("lora_init",)), "state.rng")

    # files and tensors
    needed = [ADAPTER_FILE, OPTIMIZER_FILE, STATE_FILE] + ([REFERENCE_FILE] if ema else []) \
        + ([ROLLOUT_FILE] if pending is not None else [])
    x.declared(needed)
    adapter = x.adapter_tensors()
    if ema:
        got = {k: v.shape for k, v in x.tensors(REFERENCE_FILE).items()}
        c.equal(f"{REFERENCE_FILE} names/shapes", sorted(got.items()), sorted((k, v.shape) for k, v in adapter.items()),
                "adapter.safetensors (the EMA reference has the adapter's tensors)")
    if pending is not None:
        for key in x.tensors(ROLLOUT_FILE):
            prefix, _, position = key.partition("/")
            if prefix not in ("old", "ref") or not position.isdigit() or int(position) >= len(pending) \
                    or (prefix == "ref" and beta == 0.0):
                raise c.bad(f"{ROLLOUT_FILE}[{key}]", f"is not an old/N or ref/N tensor of the {len(pending)} "
                                                      f"pending group(s) (beta {beta!r})")
