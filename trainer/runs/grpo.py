"""GRPO runs over scored groups: request validation, admission, exact resume and the training loop.

A group is one prompt (text or chat messages) with two or more completions, each with a reward
(or named reward components and weights). Groups come inline, from a JSONL file read whole, or
from a JSONL file streamed line by line (`streaming: true`), always in source order, epoch after
epoch (trainer.runs.grpo_data). The objective is TRL's GRPO (trainer.runs.objectives): group-relative advantages, the
clipped ratio surrogate, an optional k3 KL to a reference (the frozen base, i.e. the adapter
switched off, or an EMA of the adapter refreshed every N steps), and the grpo / bnpo / dr_grpo /
dapo reductions, with num_iterations updates per batch. One group is one micro-batch; a step
accumulates `groups_per_step` of them.

The control plane calls `admit_grpo`, `revalidate_grpo` and `run_grpo` through `RUN_KIND`, as for
SFT. Exactness: everything that decides the arithmetic is in the effective configuration and
identities (compared at resume) or in the checkpoint (restored): adapter, optimizer, cursor,
reference tensors and cadence, pending old/reference log-probabilities, audit accumulators.
"""

import math
import time
from dataclasses import dataclass, field

import numpy as np

from trainer.model import IGNORE_INDEX
from trainer.runs import checkpoint_dir, device_plan, objectives
from trainer.runs.admission import admission_tokenizer, check_run_tokenizer
from trainer.runs.admission import admit_backend, device_precision, loss_options, precision_options, run_backend
from trainer.runs.admission import (MANIFEST_FIELDS, Admission, AdmissionError, RequestError, RunSettings,
                                    adam_options, admit_resume, base_adapter_identity, check_base_adapter,
                                    check_base_adapter_unchanged, check_planning_schema, check_request, check_shared,
                                    difference, find_base, has_dataset_path, int_field, load_resume, lora_config,
                                    merge_config, number_field, planning_identity, reopen_resume, require_loss_route,
                                    revalidate, run_identities, select_loss_route, settle_seed, training_view,
                                    warm_start)
from trainer.runs.admission import refuse_existing_checkpoints, refuse_record, render_chat
from trainer.runs.grpo_data import (CHAIN_START, GRPOLoop, MemorySource, StreamSource, group_sha256,  # noqa: F401
                                    parse_group, read_groups, scan_stream, verify_stream_prefix)
from trainer.runs.defaults import EMA_DEFAULTS, GRPO_DEFAULTS
from trainer.runs.formats import REFERENCE_FILE, ROLLOUT_FILE  # noqa: F401 (read from here too)
from trainer.runs.kind import RunKind
from trainer.runs.state import (STATE_FILE, RunResult, check_restored_step, publish, publish_final,
                                restore_optimizer, snapshot, tensors_from)
from trainer.runs.device import computing_model, publishable, step_on
from trainer.runs.step import NullHooks, adapter_values, should_publish

KIND = "grpo"



# -- request --------------------------------------------------------------------------------


def normalise_config(config: dict, settings: RunSettings) -> dict:
    """The validated, complete GRPO configuration; RequestError on bad input."""
    given_lora = isinstance(config, dict) and config.get("lora") is not None
    c = check_shared(merge_config(config, GRPO_DEFAULTS, KIND), settings)
    check_base_adapter(c, settings, given_lora)
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


def tokenize_group(record, tokenizer, config: dict, maximum_context: int, where: str):
    """(prompt ids, [completion ids]) with completions truncated to max_completion_length and the context."""
    if "messages" in record:
        prompt = render_chat(tokenizer, record["messages"], where)
    else:
        prompt = record["prompt"]
    prompt_ids = tokenizer.encode(prompt)
    if not prompt_ids:
        raise refuse_record(where, "the prompt has no tokens")
    limit = min(config["max_completion_length"], maximum_context + 1 - len(prompt_ids))
    if limit < 1:
        raise refuse_record(where, f"the prompt ({len(prompt_ids)} tokens) leaves no room in the model's "
                                   f"context of {maximum_context}")
    completions = [tokenizer.encode(c["text"])[:limit] for c in record["completions"]]
    if not any(completions):
        raise refuse_record(where, "no completion of the group has a token")
    return prompt_ids, completions


def group_rewards(record) -> np.ndarray:
    weights = record.get("reward_weights", {})
    return np.array([objectives.completion_reward(c, weights) for c in record["completions"]], np.float64)


def group_shape(prompt_ids, completions) -> tuple:
    """(rows, positions) of the micro-batch group_batch makes of one group: a row a completion, each the prompt and
    the longest completion less one token."""
    return len(completions), len(prompt_ids) + max(len(c) for c in completions) - 1


def group_batch(prompt_ids, completions, pad: int):
    """inputs [G,T], targets [G,T] (completion tokens, IGNORE elsewhere) and mask [G,T] of one group."""
    P = len(prompt_ids)
    G, T = group_shape(prompt_ids, completions)
    inputs = np.full((G, T), pad, np.int64)  # [G,T]
    targets = np.full((G, T), IGNORE_INDEX, np.int64)  # [G,T]
    for row, completion in enumerate(completions):
        sequence = list(prompt_ids) + list(completion)
        inputs[row, :len(sequence) - 1] = sequence[:-1]
        targets[row, P - 1:P - 1 + len(completion)] = completion
    return inputs, targets, targets != IGNORE_INDEX


# -- admission ------------------------------------------------------------------------------


def _prepare(request: dict, settings: RunSettings):
    check_request(request, "groups")
    config = normalise_config(request.get("config", {}), settings)
    has_path = has_dataset_path(request, "groups")
    if config["streaming"] and not has_path:
        raise RequestError("config.streaming", "the streamed route reads a dataset_path JSONL file")
    base = find_base(config, settings)
    return config, base


def admit_grpo(request: dict, settings: RunSettings) -> Admission:
    """Validate the request and resolve what the run will be; refuse drift on resume."""
    config, base = _prepare(request, settings)
    tokenizer = admission_tokenizer(config, settings)
    context = base.config["maximum_context"]
    largest = [0, 0]  # (rows, positions) of the largest micro-batch, one group's, for the device plan

    def check(record, where):
        prompt_ids, completions = tokenize_group(record, tokenizer, config, context, where)
        shape = group_shape(prompt_ids, completions)
        if shape[0] * shape[1] > largest[0] * largest[1]:
            largest[:] = shape

    kind, dataset, _, path = read_groups(request, config, settings, check)
    if dataset["groups"] == 0:
        raise RequestError("groups", "the dataset has no groups")
    need = device_plan.grpo_bytes(config, base, tuple(largest))
    backend = admit_backend(config, settings, base, need_bytes=need)
    loss_route = select_loss_route(backend.resolved)
    steps_per_epoch = math.ceil(dataset["groups"] / config["groups_per_step"])
    total_steps = steps_per_epoch * config["epochs"] * config["num_iterations"]
    identities = run_identities(config, base, tokenizer, dataset, settings, planning_identity(KIND, config, loss_route),
                                backend)
    identities["base_adapter"] = base_adapter_identity(config)
    identities["device_plan"] = device_plan.record(need)
    resume = None
    if config["resume_checkpoint"] is None:
        refuse_existing_checkpoints(settings.registry, config["output_name"])
    else:
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
        resume = admit_resume(loaded, training_view(KIND, config["output_name"], kind, identities),
                              config, identities)
    seed = settle_seed(config, resume)
    return Admission(kind=KIND, adapter=config["output_name"], request=request, effective_config=config,
                     effective_seed=seed, data_source_kind=kind, total_steps=total_steps,
                     steps_per_epoch=steps_per_epoch, identities=identities, resume=resume)


def _stream_cursor(next_cursor: dict) -> dict:
    return {"epoch": next_cursor["epoch"], "byte": next_cursor["byte"],
            "chain": next_cursor["consumed_lines_sha256"], "chain_lines": next_cursor["consumed_lines"]}


def revalidate_grpo(admission: Admission, settings: RunSettings) -> None:
    """Dequeue-time proof: the checkpoint is still the one admission validated."""
    revalidate(admission, settings)
    check_base_adapter_unchanged(admission)


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
    check_restored_step(loop.step, optimizer, loaded)
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
    require_loss_route(route, run_backend(admission))
    _, base = _prepare(admission.request, settings)
    if base.identity != admission.identities["base"]["identity"]:
        raise AdmissionError("base_changed", "the base model changed after admission")
    kind, dataset, records, path = read_groups(admission.request, config, settings)
    if dataset != admission.identities["dataset"]:
        code = "source_changed" if kind == "streamed_jsonl" else "dataset_changed"
        raise AdmissionError(code, "the dataset changed after admission",
                             [difference("dataset", admission.identities["dataset"], dataset)])
    source = StreamSource(path, dataset) if kind == "streamed_jsonl" else MemorySource(records)
    model, tokenizer = load_base(config["base_model"], settings.bases_root, verify=True,
                                 **loss_options(route, base.config["vocabulary_size"]),
                                 activation_checkpointing=config["activation_checkpointing"],
                                 **precision_options(config))
    try:
        check_run_tokenizer(tokenizer, admission)
        model.attach_lora(lora_config(config, admission.effective_seed))
        warm_start(model, admission)
        with model.adapter_parameters() as adapters, \
                Adam(adapters, learning_rate=config["learning_rate"], **adam_options(config)) as optimizer:
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
            with computing_model(model, optimizer, run_backend(admission),
                                 device_precision(admission.effective_config)) as computing:
                result = _train(admission, settings, model, tokenizer, optimizer, adapters, source, loop, reference,
                                batch, latest, hooks, computing)
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
           latest, hooks, computing):
    """The loop; COMPUTING (MODEL, or its device model on the cuda backend) takes every forward and backward."""
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
                batch.ref[position] = _reference_logp(computing, reference, inputs, targets, config)
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

            computing.forward_backward_weighted(inputs, targets, coefficients)
            loss_total += captured["loss"]
            sums.append(captured["audit"])
        grad_norm, clipped, learning_rate = step_on(computing, config, optimizer, adapters, loop.step,
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
            policy = computing.adapter_state_dict()
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
        if should_publish(interval, loop.step, done, cancel):
            publishable(computing, model, optimizer)
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
        "reward_mean": float(np.nanmean(rewards)),  # unscorable completions (NaN) left out, as TRL logs it
        "reward_std": float(np.mean([g[4] for g in batch.groups])),  # mean group std, as TRL < 1.0 logged it
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
    totals["reward_sum"] += float(sum(np.nansum(g[2]) for g in batch.groups))


def _publish(admission, settings, model, optimizer, loop, source, reference, rollout, hooks, complete):
    config = admission.effective_config
    files, seconds = snapshot(model, optimizer, lambda scalars: _state_document(loop, scalars, config,
                                                                                admission.effective_seed),
                              {REFERENCE_FILE: reference, ROLLOUT_FILE: rollout})
    cursor = {"epoch": loop.epoch, "group": loop.group, "iteration": loop.iteration,
              "group_sha256": None if complete else source.peek(loop)}
    if admission.data_source_kind == "streamed_jsonl":
        cursor.update({"line": loop.line, "byte": loop.byte, "consumed_lines": loop.chain_lines,
                       "consumed_lines_sha256": loop.chain})
    progress = {"next_cursor": cursor, "complete": complete,
                "reference": {"type": config["reference"]["type"], "refreshes": len(loop.refreshes)}}
    return publish(admission, settings, loop.step, files, progress, hooks, seconds)


from trainer.runs import state_check_grpo  # noqa: E402  (each kind's semantic checkpoint validator)

RUN_KIND = RunKind(name=KIND, admit=admit_grpo, revalidate=revalidate_grpo, run=run_grpo,
                   admission_from_json=Admission.from_json, defaults=GRPO_DEFAULTS, manifest_fields=MANIFEST_FIELDS,
                   check_state=state_check_grpo.check_grpo_state)
