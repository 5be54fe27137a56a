"""Native SFT runs: request validation, admission, exact resume and the training loop.

The control plane reaches it through `RUN_KIND` (trainer.runs.kind.RunKind), with plain data:
`admit_sft` (validate the request, resolve the effective configuration and seed, fully
validate a resume checkpoint and refuse any drift field by field), `revalidate_sft` (the
same checkpoint proof again at dequeue), `run_sft` (train, publish `.kiln-checkpoint`s at
committed boundaries, stop cooperatively) and the admission record's JSON round trip. What
the kinds share (admission, state files and publication, the step) is in trainer.runs.

Exactness: every number that decides the arithmetic is either part of the effective
configuration and identities (compared at resume) or part of the checkpoint (restored),
so a resumed run ends with the same bytes as an uninterrupted one.

On the cuda backend the steps run on trainer.cuda_model.CudaModel (trainer.runs.device.computing_model).
"""

import hashlib
import json
import math
import time
from dataclasses import dataclass, field

import numpy as np

from trainer import Adam
from trainer.jsonio import data_loads, jsonl_lines
from trainer.model import IGNORE_INDEX
from trainer.quantization import BLOCK_SIZES
from trainer.runs import checkpoint_dir, device_plan
from trainer.runs.admission import admission_tokenizer, check_run_tokenizer
from trainer.runs.admission import (admit_backend, attention_options, device_precision, loss_options,
                                    precision_options, run_backend)
from trainer.runs.admission import (MANIFEST_FIELDS, Admission, AdmissionError, RequestError, RunSettings,
                                    adam_options, admit_resume, base_adapter_identity, check_base_adapter,
                                    check_base_adapter_unchanged, check_planning_schema, check_shared, dataset_file,
                                    has_dataset_path, int_field, load_resume, lora_config, merge_config, prepare,
                                    reopen_resume, require_loss_route, revalidate, run_identities, select_loss_route,
                                    settle_seed, training_view, warm_start)
from trainer.runs.admission import (FileRecords, json_kind, message_problem, record_place, refuse_existing_checkpoints,
                                    refuse_record, render_chat)
from trainer.runs.admission import execution_identity  # noqa: F401  (trainer.qualify reads it here)
from trainer.runs.defaults import NF4_DEFAULT, SFT_DEFAULTS
from trainer.runs.formats import PLANNING_SCHEMA_SFT, SPIKE_FACTOR, SPIKE_WINDOW  # noqa: F401 (read from here too)
from trainer.runs.kind import RunKind
from trainer.runs.state import (STATE_FILE, RunResult, check_restored_step, publish, publish_final,
                                restore_optimizer, snapshot)
from trainer.runs.device import computing_model, publishable, step_on
from trainer.runs.step import NullHooks, should_publish



# -- request ------------------------------------------------------------------------------



def normalise_config(config: dict, settings: RunSettings) -> dict:
    """The validated, complete configuration (defaults filled in); RequestError on bad input."""
    given_lora = isinstance(config, dict) and config.get("lora") is not None
    c = check_shared(merge_config(config, SFT_DEFAULTS, "sft"), settings)
    check_base_adapter(c, settings, given_lora)
    c["epochs"] = int_field(c["epochs"], "config.epochs", 1)
    c["batch_size"] = int_field(c["batch_size"], "config.batch_size", 1)
    c["gradient_accumulation_steps"] = int_field(c["gradient_accumulation_steps"],
                                                 "config.gradient_accumulation_steps", 1)
    quantization = c["quantization"]
    if quantization is not None:
        if not isinstance(quantization, dict) or quantization.get("type") != "nf4" \
                or set(quantization) - {"type", "block_size", "double_quantization"}:
            raise RequestError("config.quantization", "must be null or {type: nf4, block_size, double_quantization}")
        block_size = int_field(quantization.get("block_size", NF4_DEFAULT["block_size"]),
                               "config.quantization.block_size", 32)
        if block_size not in BLOCK_SIZES:  # what the run's quantizer takes: refused here, not by the worker
            raise RequestError("config.quantization.block_size", f"must be one of {BLOCK_SIZES}, got {block_size}")
        c["quantization"] = {"type": "nf4", "block_size": block_size,
                             "double_quantization": bool(quantization.get("double_quantization",
                                                                          NF4_DEFAULT["double_quantization"]))}
    c["max_sequence_length"] = int_field(c["max_sequence_length"], "config.max_sequence_length", 2)
    return c


# -- data ---------------------------------------------------------------------------------


def _parse_records(text: str, source: str) -> FileRecords:
    records, lines = [], []
    for number, line in jsonl_lines(text):
        try:
            records.append(data_loads(line))
        except json.JSONDecodeError as error:
            raise RequestError(source, f"line {number} is not JSON: {error.msg}") from None
        lines.append(number)
    return FileRecords(records, lines)


def read_dataset(request: dict, settings: RunSettings):
    """(records, raw bytes, data_source_kind) from dataset_path or inline data."""
    if has_dataset_path(request, "data"):
        raw = dataset_file(request, settings).read_bytes()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise RequestError("dataset_path", "the file is not UTF-8 JSONL") from None
        return _parse_records(text, "dataset_path"), raw, "file"
    data = request["data"]
    if not isinstance(data, list):
        raise RequestError("data", "must be a list of records")
    raw = "".join(json.dumps(r, sort_keys=True, separators=(",", ":")) + "\n" for r in data).encode()
    return data, raw, "inline"


def _without_nulls(value: dict) -> dict:
    return {key: item for key, item in value.items() if item is not None}


def _parts_of(record, where):
    """(messages, None) for a chat record, (None, (prompt, completion)) for a plain-text one. A null field is an
    absent one, in the record and in its messages, as TRL reads them (remove_none_values): the datasets library's
    to_json writes every column of every row, null where a row has none."""
    if not isinstance(record, dict):
        raise refuse_record(where, f"must be an object with messages or prompt/completion, got {json_kind(record)}")
    record = _without_nulls(record)
    if "messages" in record:
        messages = record["messages"]
        problem = message_problem(messages)
        if problem is not None:
            raise refuse_record(where, problem)
        messages = [_without_nulls(message) for message in messages]
        if len(messages) < 2:
            raise refuse_record(where, "messages must hold at least two entries: what is asked, then the "
                                       "assistant's answer that is learnt")
        if messages[-1]["role"] != "assistant":
            raise refuse_record(where, "the last message must be the assistant's (it is what is learnt)")
        return messages, None
    if isinstance(record.get("prompt"), str) and isinstance(record.get("completion"), str):
        return None, (record["prompt"], record["completion"])
    if "prompt" in record or "completion" in record:
        got = ", ".join(f"{key}: {json_kind(record[key]) if key in record else 'missing'}"
                        for key in ("prompt", "completion"))
        raise refuse_record(where, f"needs messages, or prompt and completion strings; got {got} (a chat is "
                                   "messages: [{role, content}...] ending with the assistant's answer)")
    raise refuse_record(where, f"needs messages, or prompt and completion strings; its keys are {sorted(record)}")


def _chat_example(messages, tokenizer, where):
    """The chat template's prompt (up to the generation prompt) and the final assistant turn after it."""
    prompt = render_chat(tokenizer, messages[:-1], where, add_generation_prompt=True)
    full = render_chat(tokenizer, messages, where, add_generation_prompt=False)
    if not full.startswith(prompt):
        raise refuse_record(where, "the chat template does not extend the prompt with the assistant turn; cannot "
                                   "mask the prompt")
    return tokenizer.encode(prompt), tokenizer.encode(full[len(prompt):])


def _plain_example(prompt, completion, tokenizer, where):
    """TRL's standard prompt-completion: the text prompt + completion as it is (no chat template), with the
    base's special tokens (BOS where it adds one) and EOS after the completion; /v1/completions sends the
    same prompt the same way."""
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=True)
    full_ids = tokenizer.encode(prompt + completion, add_special_tokens=True)
    if full_ids[:len(prompt_ids)] != prompt_ids:
        same = next((i for i, (a, b) in enumerate(zip(prompt_ids, full_ids)) if a != b), len(full_ids))
        tokens = ", ".join(repr(tokenizer.decode([t])) for t in prompt_ids[same:][-4:])
        joined = ", ".join(repr(tokenizer.decode([t])) for t in full_ids[same:same + 2])
        fix = ("end the prompt before its trailing whitespace and start the completion with it"
               if prompt[-1:].isspace() else "start the completion with a space or a newline")
        raise refuse_record(where, f"the prompt's last tokens change when the completion follows it (the prompt "
                                   f"ends in {tokens}, the two together read {joined} there), so no mask can "
                                   f"separate them; {fix}")
    if tokenizer.eos_token_id is not None and full_ids[-1:] != [tokenizer.eos_token_id]:
        full_ids.append(tokenizer.eos_token_id)
    return prompt_ids, full_ids[len(prompt_ids):]


class Examples(list):
    """tokenize_examples' [(tokens, loss_mask)], with how many were cut to their limit (`truncated`), the longest
    one's tokens before the cut (`longest`) and the limit in words (`limit`: max_sequence_length's, or the base's
    context where that is shorter)."""

    truncated = 0
    longest = 0
    limit = ""

    def truncation_warning(self) -> str | None:
        """What a run says, once, when it trains on cut examples (their tails are not learnt), or None."""
        if not self.truncated:
            return None
        remedy = ("raise max_sequence_length to keep them" if self.limit.startswith("max_sequence_length")
                  else "the model reads no more; shorten or split them to learn their ends")
        return (f"{self.truncated} of {len(self)} examples are longer than {self.limit} (the longest has "
                f"{self.longest} tokens) and were cut to it: their last tokens are not learnt; {remedy}")


def tokenize_examples(records, tokenizer, max_length, context=None) -> Examples:
    """[(tokens, loss_mask)] with loss on the final assistant turn (chat records) or the completion and its EOS
    (plain prompt/completion records) only, truncated at the end (TRL's keep_start) to MAX_LENGTH tokens, or to
    the base's CONTEXT where that is shorter (the model takes no longer sequence)."""
    examples = Examples()
    if context is not None and context < max_length:
        max_length, examples.limit = context, f"the base's context of {context} tokens"
    else:
        examples.limit = f"max_sequence_length {max_length}"
    for index, record in enumerate(records):
        where = record_place(records, index, "data")
        messages, plain = _parts_of(record, where)
        if plain is None:
            prompt_ids, completion_ids = _chat_example(messages, tokenizer, where)
        else:
            prompt_ids, completion_ids = _plain_example(*plain, tokenizer, where)
        length = len(prompt_ids) + len(completion_ids)
        tokens = (prompt_ids + completion_ids)[:max_length]
        mask = ([0] * len(prompt_ids) + [1] * len(completion_ids))[:max_length]
        if sum(mask[1:]) == 0:
            raise refuse_record(where, f"no completion token fits in {examples.limit} after the prompt "
                                       f"({len(prompt_ids)} tokens)")
        if length > max_length:
            examples.truncated += 1
            examples.longest = max(examples.longest, length)
        examples.append((tokens, mask))
    if not examples:
        raise RequestError("dataset_path" if isinstance(records, FileRecords) else "data", "the dataset has no records")
    return examples


# -- identities -----------------------------------------------------------------------------


def planning_identity(config: dict, loss_route: str) -> dict:
    return {
        "schema": PLANNING_SCHEMA_SFT,
        "sft_loss_route": loss_route,
        "checkpoint_boundary_replay": {"policy": "retain_all"},
        "activation_checkpointing": config["activation_checkpointing"],
        "streaming_prefill": "none",
    }


# -- admission ----------------------------------------------------------------------------


SFTAdmission = Admission  # the admission record every training kind stores in its job row


def _steps_per_epoch(examples: int, config: dict) -> int:
    micro = math.ceil(examples / config["batch_size"])
    return math.ceil(micro / config["gradient_accumulation_steps"])


def _prepare(request: dict, settings: RunSettings):
    return prepare(request, settings, "data", normalise_config, read_dataset)


def admit_sft(request: dict, settings: RunSettings) -> SFTAdmission:
    """Validate the request and resolve what the run will be; refuse drift on resume."""
    config, records, raw, kind, base = _prepare(request, settings)
    dataset = {"sha256": hashlib.sha256(raw).hexdigest(), "bytes": len(raw), "records": len(records),
               "order": "source"}
    del raw  # not held beside the records and their tokenized examples
    need = device_plan.sft_bytes(config, base)
    backend = admit_backend(config, settings, base, need_bytes=need)
    loss_route = select_loss_route(backend.resolved)
    tokenizer = admission_tokenizer(config, settings)
    examples = tokenize_examples(records, tokenizer, config["max_sequence_length"], base.config["maximum_context"])
    steps_per_epoch = _steps_per_epoch(len(examples), config)
    identities = run_identities(config, base, tokenizer, dataset, settings, planning_identity(config, loss_route),
                                backend)
    identities["base_adapter"] = base_adapter_identity(config)
    identities["device_plan"] = device_plan.record(need)
    resume = None
    if config["resume_checkpoint"] is None:
        refuse_existing_checkpoints(settings.registry, config["output_name"])
    else:
        loaded = load_resume(config["resume_checkpoint"], config["output_name"], "sft", settings)
        check_planning_schema(loaded.manifest, PLANNING_SCHEMA_SFT, "it was planned before plain prompt/completion "
                              "records were tokenized as text (TRL's standard format) instead of through the chat "
                              "template, or without proof of the loss route admission budgeted")
        resume = admit_resume(loaded, training_view("sft", config["output_name"], kind, identities), config,
                              identities)
    seed = settle_seed(config, resume)
    return SFTAdmission(kind="sft", adapter=config["output_name"], request=request,
                        effective_config=config, effective_seed=seed, data_source_kind=kind,
                        total_steps=steps_per_epoch * config["epochs"], steps_per_epoch=steps_per_epoch,
                        identities=identities, resume=resume)


def revalidate_sft(admission: SFTAdmission, settings: RunSettings) -> None:
    """Dequeue-time proof: the checkpoint is still the one admission validated."""
    revalidate(admission, settings, route_field="sft_loss_route")
    check_base_adapter_unchanged(admission)


# -- the run --------------------------------------------------------------------------------


def epoch_order(seed: int, epoch: int, count: int) -> list:
    """The example order of one epoch: the named stream "data_order", derived per epoch."""
    rng = np.random.Generator(np.random.PCG64([seed, 0x5F7, epoch]))
    return rng.permutation(count).tolist()


@dataclass
class LoopState:
    epoch: int = 0
    position: int = 0  # next example index within the epoch's order
    step: int = 0  # committed optimizer steps
    losses: list = field(default_factory=list)
    diagnostics: list = field(default_factory=list)


def _batch(examples, indices, pad_token):
    T = max(len(examples[i][0]) for i in indices) - 1
    inputs = np.full((len(indices), T), pad_token, np.int64)  # [B,T]
    targets = np.full((len(indices), T), IGNORE_INDEX, np.int64)  # [B,T]
    for row, index in enumerate(indices):
        tokens, mask = examples[index]
        n = len(tokens) - 1
        inputs[row, :n] = tokens[:-1]
        targets[row, :n] = np.where(np.asarray(mask[1:]) == 1, tokens[1:], IGNORE_INDEX)
    return inputs, targets


def accumulate(computing, micro_batches):
    """(loss, tokens) of one optimizer step whose gradient accumulates over MICRO_BATCHES [(inputs, targets)].

    As transformers' Trainer (and so TRL's SFTTrainer) with gradient accumulation: every micro-batch's summed
    token losses are divided by the loss tokens of the whole step (its num_items_in_batch), so the step's loss
    and gradient are the mean over all its tokens, not a mean of micro-batch means."""
    counts = [int(np.count_nonzero(targets != IGNORE_INDEX)) for _, targets in micro_batches]
    tokens = sum(counts)
    losses = [computing.forward_backward(inputs, targets, normalizer=tokens) for inputs, targets in micro_batches]
    if len(losses) == 1:
        return losses[0], tokens
    return sum(loss * count for loss, count in zip(losses, counts)) / tokens, tokens


def _state_document(loop: LoopState, scalars: dict) -> dict:
    return {
        "optimizer": scalars,
        "loop": {"epoch": loop.epoch, "position": loop.position, "step": loop.step},
        "scheduler": {"step": loop.step},
        "loss_history": loop.losses,
        "diagnostics": loop.diagnostics,
    }


def _restore_state(loaded, model, optimizer, loop: LoopState):
    document = loaded.read_json(STATE_FILE)
    restore_optimizer(loaded, model, optimizer, document["optimizer"])
    loop.epoch = document["loop"]["epoch"]
    loop.position = document["loop"]["position"]
    loop.step = document["loop"]["step"]
    loop.losses = list(document["loss_history"])
    loop.diagnostics = list(document["diagnostics"])
    check_restored_step(loop.step, optimizer, loaded)


def _publish(admission, settings, model, optimizer, loop, hooks, complete, computing):
    publishable(computing, model, optimizer)
    files, seconds = snapshot(model, optimizer, lambda scalars: _state_document(loop, scalars))
    progress = {"next_cursor": {"epoch": loop.epoch, "example": loop.position}, "complete": complete}
    return publish(admission, settings, loop.step, files, progress, hooks, seconds)


def run_sft(admission: SFTAdmission, settings: RunSettings, hooks=None) -> RunResult:
    """Train (or continue) the admitted run; publish checkpoints; stop cooperatively."""
    from trainer.bases import load_base
    hooks = hooks or NullHooks()
    config = admission.effective_config
    seed = admission.effective_seed
    loss_route = admission.identities["planning"]["sft_loss_route"]
    require_loss_route(loss_route, run_backend(admission))
    _, records, raw, _, base = _prepare(admission.request, settings)
    digest = hashlib.sha256(raw).hexdigest()
    del raw  # the run trains on the tokenized examples: the file's bytes and its records are not held while it does
    if digest != admission.identities["dataset"]["sha256"]:
        raise AdmissionError("dataset_changed", "the dataset changed after admission")
    if base.identity != admission.identities["base"]["identity"]:
        raise AdmissionError("base_changed", "the base model changed after admission")
    model, tokenizer = load_base(config["base_model"], settings.bases_root, verify=True,
                                 **loss_options(loss_route, base.config["vocabulary_size"]),
                                 **attention_options(config["max_sequence_length"]),
                                 activation_checkpointing=config["activation_checkpointing"],
                                 **precision_options(config))
    try:
        check_run_tokenizer(tokenizer, admission)
        examples = tokenize_examples(records, tokenizer, config["max_sequence_length"],
                                     model.config.maximum_context)
        del records
        if config["quantization"]:
            model.quantize(block_size=config["quantization"]["block_size"],
                           double_quantization=config["quantization"]["double_quantization"])
        model.attach_lora(lora_config(config, seed))
        warm_start(model, admission)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        with model.adapter_parameters() as adapters, \
                Adam(adapters, learning_rate=config["learning_rate"], **adam_options(config)) as optimizer:
            loop = LoopState()
            latest = None
            if admission.resume is not None:
                loaded = reopen_resume(admission, settings)
                _restore_state(loaded, model, optimizer, loop)
                latest = checkpoint_dir.checkpoint_summary(loaded)
                hooks.on_event("info", f"resumed from {loaded.path.name} at step {loop.step}")
            truncation = examples.truncation_warning()
            if truncation is not None:
                hooks.on_event("warning", truncation)
            with computing_model(model, optimizer, run_backend(admission),
                                 device_precision(admission.effective_config)) as computing:
                result = _train(admission, settings, model, optimizer, adapters, examples, pad, loop, latest, hooks,
                                computing)
            return publish_final(result, model, settings, admission.adapter, config["base_model"], hooks)
    finally:
        model.close()


def _train(admission, settings, model, optimizer, adapters, examples, pad, loop, latest, hooks, computing):
    """The loop; COMPUTING (MODEL, or its device model on the cuda backend) takes every forward and backward."""
    config = admission.effective_config
    interval = config["checkpoint_interval"]
    batch_size, accumulation = config["batch_size"], config["gradient_accumulation_steps"]
    started = time.perf_counter()
    order = epoch_order(admission.effective_seed, loop.epoch, len(examples))
    while loop.step < admission.total_steps:
        if loop.position >= len(order):
            loop.epoch += 1
            loop.position = 0
            order = epoch_order(admission.effective_seed, loop.epoch, len(examples))
        micro_batches = []
        while len(micro_batches) < accumulation and loop.position < len(order):
            indices = order[loop.position:loop.position + batch_size]
            micro_batches.append(_batch(examples, indices, pad))
            loop.position += len(indices)
        loss, tokens = accumulate(computing, micro_batches)
        grad_norm, clipped, learning_rate = step_on(computing, config, optimizer, adapters, loop.step,
                                                    admission.total_steps, loss)
        recent = loop.losses[-SPIKE_WINDOW:]
        spike = len(recent) >= 5 and loss > SPIKE_FACTOR * (sum(recent) / len(recent))
        loop.step += 1
        loop.losses.append(loss)
        loop.diagnostics.append({"grad_norm": grad_norm, "clipped": clipped, "loss_spike": spike})
        hooks.on_step({"step": loop.step, "loss": loss, "learning_rate": learning_rate,
                       "grad_norm": grad_norm, "clipped": clipped, "loss_spike": spike,
                       "tokens": tokens, "epoch": loop.epoch,
                       "elapsed_seconds": time.perf_counter() - started})
        if spike:
            hooks.on_event("warning", f"step {loop.step}: loss {loss:.4f} spiked above "
                                      f"{SPIKE_FACTOR}x the recent mean")
        done = loop.step >= admission.total_steps
        cancel = not done and hooks.should_cancel()
        if should_publish(interval, loop.step, done, cancel):
            latest = _publish(admission, settings, model, optimizer, loop, hooks, done, computing)
        if cancel:
            hooks.on_event("info", f"cancelled after step {loop.step}")
            return RunResult("cancelled", loop.step, latest, list(loop.losses))
    return RunResult("succeeded", loop.step, latest, list(loop.losses))


from trainer.runs import state_check  # noqa: E402  (each kind's semantic checkpoint validator)

RUN_KIND = RunKind(name="sft", admit=admit_sft, revalidate=revalidate_sft, run=run_sft,
                   admission_from_json=SFTAdmission.from_json, defaults=SFT_DEFAULTS,
                   manifest_fields=MANIFEST_FIELDS,
                   check_state=state_check.check_sft_state)
