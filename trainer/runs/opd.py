"""On-policy distillation runs: request validation, teacher checks, admission, exact resume and the loop.

The student samples a completion of each candidate prompt with a named rollout RNG; the teacher
(trainer.teachers: a native base or an OpenAI-compatible endpoint) scores every sampled token; the
per-token advantage is the negative reverse KL -(log p_student - log p_teacher), held constant in
a REINFORCE update (trainer.runs.objectives.opd_terms). Candidates are the prompts in source
order, cycled; the candidate cursor is separate from the optimizer-step counter because a
candidate whose completion is empty produces no update and is still consumed exactly once.
Collapse guardrails (entropy floor, repetition, empty rate, KL ceiling, over a window of
candidates) stop the run with RunFailed("guardrail_<name>").

The control plane calls `admit_opd`, `revalidate_opd` and `run_opd` through `RUN_KIND`, as for SFT.
Admission and resume require the teacher alias to still have the checkpoint's identity revision,
then reconstruct and verify its content revision.
"""

import json
import time
from dataclasses import dataclass, field

import numpy as np

from native_ext.cuda import CudaUnavailable
from trainer import teachers
from trainer.jsonio import data_loads, jsonl_lines, without_bom
from trainer.model import IGNORE_INDEX
from trainer.runs import checkpoint_dir, device_plan, objectives
from trainer.runs.admission import admission_tokenizer, check_run_tokenizer
from trainer.runs.admission import admit_backend, device_precision, loss_options, precision_options, run_backend
from trainer.runs.admission import (MANIFEST_FIELDS, Admission, AdmissionError, RequestError, RunFailed, RunSettings,
                                    adam_options, admit_resume, base_adapter_identity, canonical, check_base_adapter,
                                    check_base_adapter_unchanged, check_planning_schema, check_shared, compare,
                                    dataset_file, difference, has_dataset_path, int_field, load_resume, lora_config,
                                    merge_config, number_field, planning_identity, prepare, reopen_resume,
                                    require_loss_route, revalidate, run_identities, select_loss_route, settle_seed,
                                    sha256_hex, warm_start)
from trainer.runs.admission import (FileRecords, message_problem, record_place, refuse_existing_checkpoints,
                                    refuse_record, render_chat)
from trainer.runs.defaults import GUARDRAIL_DEFAULTS, OPD_CHECKPOINT_INTERVAL, OPD_DEFAULTS
from trainer.runs.formats import GUARDRAILS, MAX_IDLE_CANDIDATES, rollout_seed  # noqa: F401 (read from here too)
from trainer.runs.kind import RunKind
from trainer.runs.state import (STATE_FILE, RunResult, check_restored_step, publish, publish_final,
                                restore_optimizer, snapshot)
from trainer.runs.device import computing_model, publishable, step_on
from trainer.runs.step import NullHooks, should_publish

KIND = "opd"


# -- request --------------------------------------------------------------------------------


def normalise_config(config: dict, settings: RunSettings) -> dict:
    """The validated, complete OPD configuration; RequestError on bad input."""
    given_lora = isinstance(config, dict) and config.get("lora") is not None
    c = merge_config(config, OPD_DEFAULTS, KIND)
    if c["checkpoint_interval"] is None:
        c["checkpoint_interval"] = OPD_CHECKPOINT_INTERVAL
    c = check_shared(c, settings)
    if c["teacher"] is None:
        raise RequestError("config.teacher", "is required: the resolved teacher alias")
    try:
        c["teacher"] = teachers.parse_teacher(c["teacher"]).to_dict()
    except ValueError as error:
        raise RequestError("config.teacher", str(error)) from None
    c["max_new_tokens"] = int_field(c["max_new_tokens"], "config.max_new_tokens", 1)
    c["temperature"] = number_field(c["temperature"], "config.temperature")
    if c["temperature"] < 0:
        raise RequestError("config.temperature", "must be at least 0 (0 is greedy)")
    c["top_p"] = number_field(c["top_p"], "config.top_p", 0.0)
    if c["top_p"] > 1:
        raise RequestError("config.top_p", "must lie in (0, 1]")
    c["top_k"] = int_field(c["top_k"], "config.top_k", 0)
    if not isinstance(c["stop_strings"], list) or not all(isinstance(s, str) and s for s in c["stop_strings"]):
        raise RequestError("config.stop_strings", "must be a list of non-empty strings")
    c["steps"] = int_field(c["steps"], "config.steps", 1)
    c["candidates_per_step"] = int_field(c["candidates_per_step"], "config.candidates_per_step", 1)
    guardrails = c["guardrails"]
    if not isinstance(guardrails, dict) or set(guardrails) - set(GUARDRAIL_DEFAULTS):
        raise RequestError("config.guardrails", f"must hold only {', '.join(GUARDRAIL_DEFAULTS)}")
    guardrails = {**GUARDRAIL_DEFAULTS, **guardrails}
    guardrails["window"] = int_field(guardrails["window"], "config.guardrails.window", 1)
    for name in GUARDRAILS:
        guardrails[name] = number_field(guardrails[name], f"config.guardrails.{name}", allow_none=True)
    for name in ("max_repetition_rate", "max_empty_rate"):
        if guardrails[name] is not None and not 0 <= guardrails[name] <= 1:
            raise RequestError(f"config.guardrails.{name}", "must lie in [0, 1]")
    c["guardrails"] = guardrails
    check_base_adapter(c, settings, given_lora)
    return c


def _prompt_record(record, where):
    if isinstance(record, str):
        return {"prompt": record}
    if isinstance(record, dict) and set(record) == {"prompt"} and isinstance(record["prompt"], str):
        return record
    if isinstance(record, dict) and set(record) == {"messages"}:
        problem = message_problem(record["messages"]) or (None if record["messages"] else "messages is empty")
        if problem is None:
            return record
        raise refuse_record(where, problem)
    raise refuse_record(where, "a prompt is a string, {prompt: string} or {messages: [{role, content}...]}")


def read_prompts(request: dict, settings: RunSettings):
    """(records, raw bytes, data_source_kind) from inline prompts or a JSON / JSONL file."""
    if has_dataset_path(request, "prompts"):
        raw = dataset_file(request, settings).read_bytes()
        try:
            text = without_bom(raw.decode("utf-8"))
            if text.lstrip().startswith("["):
                items = data_loads(text)
                items = FileRecords(items) if isinstance(items, list) else items
            else:
                numbered = list(jsonl_lines(text))
                items = FileRecords([data_loads(line) for _, line in numbered], [number for number, _ in numbered])
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise RequestError("dataset_path", f"is not a UTF-8 JSON list or JSONL of prompts: {error}") from None
        kind = "file"
    else:
        items = request["prompts"]
        if not isinstance(items, list):
            raise RequestError("prompts", "must be a list of prompts")
        raw = None
        kind = "inline"
    if not isinstance(items, list):
        raise RequestError("dataset_path", "is a JSON value that is not a list of prompts")
    records = [_prompt_record(item, record_place(items, i, "prompts")) for i, item in enumerate(items)]
    if isinstance(items, FileRecords):
        records = FileRecords(records, items.lines)
    if not records:
        raise RequestError("dataset_path" if kind == "file" else "prompts", "there are no prompts")
    if raw is None:
        raw = b"".join(canonical(r) + b"\n" for r in records)
    return records, raw, kind


def prompt_ids(record, tokenizer, maximum_context, where) -> list:
    text = render_chat(tokenizer, record["messages"], where) if "messages" in record else record["prompt"]
    ids = tokenizer.encode(text)
    if not ids:
        raise refuse_record(where, "the prompt has no tokens")
    if len(ids) >= maximum_context:
        raise refuse_record(where, f"the prompt ({len(ids)} tokens) leaves no room to sample in the model's "
                                   f"context of {maximum_context}")
    return ids


# -- identities -------------------------------------------------------------------------------


def native_teacher(config: dict, settings: RunSettings):
    """(BaseInfo, LoraConfig or None) of the configuration's native teacher, whose own device model a cuda run holds
    beside the student's (trainer.teachers.NativeTeacher); None for an endpoint teacher. AdmissionError
    teacher_unavailable when its base is not registered or its adapter cannot be read."""
    from trainer.bases import show_base
    from trainer.peft import read_adapter_config

    spec = teachers.parse_teacher(config["teacher"])
    if spec.route != "native":
        return None
    try:
        base = show_base(spec.base, settings.bases_root)
        return base, None if spec.adapter is None else read_adapter_config(spec.adapter)
    except (LookupError, OSError, ValueError) as error:
        raise AdmissionError("teacher_unavailable", f"teacher {spec.alias}: {error}") from None


def teacher_identity(config: dict, settings: RunSettings) -> dict:
    """The alias, its identity revision and its content revision reconstructed now."""
    spec = teachers.parse_teacher(config["teacher"])
    try:
        content = teachers.content_revision(spec, settings.bases_root)
    except teachers.TeacherError as error:
        raise AdmissionError(error.code, error.message) from None
    return {"alias": spec.alias, "route": spec.route, "identity_revision": spec.identity_revision,
            "content_revision": content["revision"], "content_evidence": content["evidence"]}


def check_teacher(checkpoint_teacher: dict, teacher: dict):
    """AdmissionError("teacher_changed") unless the alias keeps the checkpoint's two revisions."""
    checkpoint_teacher = checkpoint_teacher or {}
    if checkpoint_teacher.get("identity_revision") != teacher["identity_revision"] \
            or checkpoint_teacher.get("alias") != teacher["alias"]:
        differences = [difference(f"teacher.{key}", checkpoint_teacher.get(key), teacher[key])
                       for key in ("alias", "identity_revision") if checkpoint_teacher.get(key) != teacher[key]]
        raise AdmissionError("teacher_changed", f"teacher alias {teacher['alias']} no longer has the checkpoint's "
                             "identity revision: its configuration changed. Restore the alias or start a new run",
                             differences)
    if checkpoint_teacher.get("content_revision") != teacher["content_revision"]:
        differences = [difference("teacher.content_revision", checkpoint_teacher.get("content_revision"),
                                  teacher["content_revision"])]
        before, now = checkpoint_teacher.get("content_evidence") or {}, teacher["content_evidence"]
        differences += [difference(f"teacher.content_evidence.{key}", before.get(key), now.get(key))
                        for key in sorted(set(before) | set(now)) if before.get(key) != now.get(key)]
        raise AdmissionError("teacher_changed", f"teacher {teacher['alias']} keeps its configuration but its numeric "
                             "content changed (weights, adapter or served model); exact resume needs the same "
                             "teacher. Restore it or start a new run", differences)


def _prepare(request: dict, settings: RunSettings):
    return prepare(request, settings, "prompts", normalise_config, read_prompts)


def admit_opd(request: dict, settings: RunSettings) -> Admission:
    """Validate the request and resolve what the run will be; refuse teacher or config drift on resume."""
    config, records, raw, kind, base = _prepare(request, settings)
    tokenizer = admission_tokenizer(config, settings)
    context = base.config["maximum_context"]
    longest = max(len(prompt_ids(record, tokenizer, context, record_place(records, index, "prompts")))
                  for index, record in enumerate(records))
    native = native_teacher(config, settings)
    need = device_plan.opd_bytes(config, base, longest, native)
    backend = admit_backend(config, settings, base, need_bytes=need)
    loss_route = select_loss_route(backend.resolved)
    teacher = teacher_identity(config, settings)
    if native is not None:
        teacher_base = native[0]
        if teacher_base.tokenizer != tokenizer.identity():
            # differences: the teacher base's tokenizer as `checkpoint`, the student base's as `request`
            differences = []
            compare("teacher.tokenizer", teacher_base.tokenizer, tokenizer.identity(), differences)
            raise AdmissionError("teacher_tokenizer_mismatch", f"teacher {teacher['alias']} is over the base "
                                 f"{teacher_base.name!r}, whose tokenizer is not that of the student's base "
                                 f"{base.name!r}; distillation scores the student's own tokens, so choose a teacher "
                                 "over a base with the student's tokenizer, or a student base with the teacher's",
                                 differences)
    dataset = {"route": kind, "sha256": sha256_hex(raw), "bytes": len(raw), "prompts": len(records),
               "order": "source"}
    identities = run_identities(config, base, tokenizer, dataset, settings, planning_identity(KIND, config, loss_route),
                                backend)
    identities.update(teacher=teacher, base_adapter=base_adapter_identity(config), device_plan=device_plan.record(need))
    resume = None
    if config["resume_checkpoint"] is None:
        refuse_existing_checkpoints(settings.registry, config["output_name"])
    else:
        loaded = load_resume(config["resume_checkpoint"], config["output_name"], KIND, settings)
        manifest = loaded.manifest
        check_planning_schema(manifest)
        check_teacher((manifest.get("training") or {}).get("teacher"), teacher)
        resume = admit_resume(loaded, _training_view(config["output_name"], kind, identities), config, identities)
    seed = settle_seed(config, resume)
    return Admission(kind=KIND, adapter=config["output_name"], request=request, effective_config=config,
                     effective_seed=seed, data_source_kind=kind, total_steps=config["steps"],
                     identities=identities, resume=resume)


def _training_view(adapter, kind, identities) -> dict:
    return {"kind": KIND, "adapter": adapter, "data_source_kind": kind, "teacher": identities["teacher"],
            "base_adapter": identities["base_adapter"]}


def revalidate_opd(admission: Admission, settings: RunSettings) -> None:
    """Dequeue-time proof: the checkpoint is unchanged and the teacher still has both revisions."""
    revalidate(admission, settings)
    check_teacher(admission.identities["teacher"], teacher_identity(admission.effective_config, settings))


# -- the loop -------------------------------------------------------------------------------


@dataclass
class OPDLoop:
    step: int = 0  # committed optimizer steps
    candidate: int = 0  # next candidate (prompt index = candidate % prompts)
    idle: int = 0  # consecutive candidates without an update
    losses: list = field(default_factory=list)
    metrics: list = field(default_factory=list)  # per step
    candidates: list = field(default_factory=list)  # per consumed candidate
    window: list = field(default_factory=list)  # guardrail statistics of the last `window` candidates
    rollout: dict | None = None  # the rollout RNG's state at the boundary


class Guardrails:
    """Collapse checks over the statistics of the last `window` candidates."""

    def __init__(self, config: dict):
        self.config = config

    def observe(self, loop: OPDLoop, stats: dict):
        loop.window.append(stats)
        del loop.window[:-self.config["window"]]

    def check(self, loop: OPDLoop):
        if len(loop.window) < self.config["window"]:
            return
        for name, (key, direction, meaning) in GUARDRAILS.items():
            threshold = self.config[name]
            if threshold is None:
                continue
            values = [float(s[key]) for s in loop.window if s[key] is not None]
            if not values:
                continue
            value = sum(values) / len(values)
            tripped = value < threshold if direction == "below" else value > threshold
            if tripped:
                raise RunFailed(f"guardrail_{name}", (
                    f"collapse guardrail {name} stopped the run at candidate {loop.candidate - 1} (after step "
                    f"{loop.step}): the {meaning} over the last {len(loop.window)} candidates is {value:.4f}, "
                    f"{direction} the limit {threshold}. Inspect recent completions; lower the learning rate or "
                    "temperature, check the teacher, or resume from an earlier checkpoint"))


def _special_free(text: str, tokenizer) -> str:
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        token = tokenizer.config.get(name)
        if token:
            text = text.replace(token, "")
    return text


def run_opd(admission: Admission, settings: RunSettings, hooks=None) -> RunResult:
    """Train (or continue) the admitted OPD run; publish checkpoints; stop cooperatively or on a guardrail."""
    from trainer import Adam
    from trainer.bases import load_base
    from trainer.generation import SamplingRNG
    hooks = hooks or NullHooks()
    config = admission.effective_config
    route = admission.identities["planning"]["loss_route"]
    require_loss_route(route, run_backend(admission))
    _, records, raw, _, base = _prepare(admission.request, settings)
    if sha256_hex(raw) != admission.identities["dataset"]["sha256"]:
        raise AdmissionError("dataset_changed", "the prompts changed after admission")
    if base.identity != admission.identities["base"]["identity"]:
        raise AdmissionError("base_changed", "the base model changed after admission")
    check_teacher(admission.identities["teacher"], teacher_identity(config, settings))
    check_base_adapter_unchanged(admission)
    model, tokenizer = load_base(config["base_model"], settings.bases_root, verify=True,
                                 **loss_options(route, base.config["vocabulary_size"]),
                                 activation_checkpointing=config["activation_checkpointing"],
                                 **precision_options(config))
    teacher = None
    try:
        check_run_tokenizer(tokenizer, admission)
        try:
            teacher = teachers.open_teacher(teachers.parse_teacher(config["teacher"]), settings.bases_root,
                                            backend=run_backend(admission))
        except teachers.TeacherError as error:
            raise AdmissionError(error.code, error.message) from None
        except CudaUnavailable as error:
            raise AdmissionError("backend_unavailable", f"backend cuda is unavailable here: {error}") from None
        context = model.config.maximum_context
        prompts = [prompt_ids(r, tokenizer, context, record_place(records, i, "prompts"))
                   for i, r in enumerate(records)]
        model.attach_lora(lora_config(config, admission.effective_seed))
        warm_start(model, admission)
        samplings = rollout_sampling(config, tokenizer, records)
        with model.adapter_parameters() as adapters, \
                Adam(adapters, learning_rate=config["learning_rate"], **adam_options(config)) as optimizer:
            loop = OPDLoop()
            rng = SamplingRNG(rollout_seed(admission.effective_seed))
            latest = None
            if admission.resume is not None:
                loaded = reopen_resume(admission, settings)
                document = loaded.read_json(STATE_FILE)
                restore_optimizer(loaded, model, optimizer, document["optimizer"])
                for key, value in document["loop"].items():
                    setattr(loop, key, value)
                loop.losses, loop.metrics = list(document["loss_history"]), list(document["metric_history"])
                loop.candidates, loop.window = list(document["candidates"]), list(document["guardrails"]["window"])
                rng = SamplingRNG.from_state(document["rng"]["rollout"])
                check_restored_step(loop.step, optimizer, loaded)
                latest = checkpoint_dir.checkpoint_summary(loaded)
                hooks.on_event("info", f"resumed from {loaded.path.name} at step {loop.step}, candidate "
                                       f"{loop.candidate}")
            with computing_model(model, optimizer, run_backend(admission),
                                 device_precision(admission.effective_config)) as computing:
                result = _train(admission, settings, model, tokenizer, teacher, optimizer, adapters, records,
                                prompts, samplings, rng, loop, latest, hooks, computing)
            return publish_final(result, model, settings, admission.adapter, config["base_model"], hooks)
    finally:
        if teacher is not None:
            teacher.close()
        model.close()


def _sample(model, tokenizer, teacher, prompt, sampling, rng):
    """One candidate: its generation and statistics; teacher log-probabilities for a non-empty one."""
    from trainer.generation import gather_logprobs, generate
    generation = generate(model, prompt, sampling, rng, tokenizer=tokenizer)
    tokens = list(generation.tokens)
    text = _special_free(generation.text or "", tokenizer)
    empty = not tokens or text.strip() == ""
    stats = {"empty": empty, "entropy": None, "repetition": None, "kl": None}
    teacher_logp = None
    if not empty:
        sequence = np.asarray(prompt + tokens, np.int64)
        logits = model.logits(sequence[None, :-1])[0, len(prompt) - 1:]  # [n,V]
        student = gather_logprobs(logits, np.asarray(tokens, np.int64))
        teacher_logp = np.asarray(teacher.score(prompt, tokens), np.float32)
        if teacher_logp.shape != (len(tokens),) or not np.all(np.isfinite(teacher_logp)):
            raise RunFailed("teacher_invalid", "the teacher returned log-probabilities of the wrong shape or "
                                               "non-finite values")
        content = tokens[:-1] if generation.finish_reason == "stop" and tokens[-1] in sampling.stop_token_ids \
            else tokens
        stats.update(entropy=objectives.mean_entropy(logits), repetition=objectives.repetition_rate(content),
                     kl=float(np.mean(student.astype(np.float64) - teacher_logp)))
    return tokens, teacher_logp, stats


def rollout_sampling(config: dict, tokenizer, records) -> list:
    """The SamplingConfig of each record's rollouts: the run's sampling, stopped where an answer ends, as
    /v1/chat/completions and /v1/completions stop it (trainer.generation.stop_token_ids): a chat prompt at the
    template's end-of-turn marker too, a plain prompt at end of text."""
    from dataclasses import replace

    from trainer.generation import SamplingConfig, stop_token_ids
    plain = SamplingConfig(max_new_tokens=config["max_new_tokens"], temperature=config["temperature"],
                           top_p=config["top_p"], top_k=config["top_k"],
                           stop_token_ids=stop_token_ids(tokenizer, chat=False),
                           stop_strings=tuple(config["stop_strings"]))
    chat = replace(plain, stop_token_ids=stop_token_ids(tokenizer, chat=True))
    return [chat if isinstance(record, dict) and "messages" in record else plain for record in records]


def _train(admission, settings, model, tokenizer, teacher, optimizer, adapters, records, prompts, samplings, rng,
           loop, latest, hooks, computing):
    """The loop; COMPUTING (MODEL, or its device model on the cuda backend) samples and takes every forward and
    backward; SAMPLINGS are the prompts' (rollout_sampling)."""
    config = admission.effective_config
    interval = config["checkpoint_interval"]
    guardrails = Guardrails(config["guardrails"])
    started = time.perf_counter()
    while loop.step < admission.total_steps:
        chosen, empties = [], 0
        while len(chosen) < config["candidates_per_step"]:
            index = loop.candidate
            prompt = prompts[index % len(prompts)]
            tokens, teacher_logp, stats = _sample(computing, tokenizer, teacher, prompt,
                                                  samplings[index % len(prompts)], rng)
            loop.candidate += 1
            loop.candidates.append({"candidate": index, "prompt": index % len(prompts), "tokens": len(tokens),
                                    "empty": stats["empty"], "update_step": None if stats["empty"] else loop.step + 1})
            guardrails.observe(loop, stats)
            guardrails.check(loop)
            if stats["empty"]:
                empties += 1
                loop.idle += 1
                if loop.idle >= MAX_IDLE_CANDIDATES:
                    raise RunFailed("no_update", f"{loop.idle} consecutive candidates produced empty completions "
                                                 "and no update; the student has collapsed or the stop strings "
                                                 "end every completion")
                continue
            loop.idle = 0
            chosen.append((prompt, tokens, teacher_logp, stats))
        kls, token_count = [], 0
        for prompt, tokens, teacher_logp, _ in chosen:
            sequence = np.asarray(prompt + tokens, np.int64)
            inputs = sequence[None, :-1]  # [1,T]
            targets = np.full(inputs.shape, IGNORE_INDEX, np.int64)
            targets[0, len(prompt) - 1:] = tokens
            mask = targets != IGNORE_INDEX
            aligned = np.zeros(inputs.shape, np.float32)
            aligned[0, len(prompt) - 1:] = teacher_logp
            captured = {}

            def coefficients(logp, aligned=aligned, mask=mask):
                kl, c, _ = objectives.opd_terms(logp, aligned, mask, len(chosen))
                captured["kl"] = kl
                return c

            computing.forward_backward_weighted(inputs, targets, coefficients)
            kls.append(captured["kl"])
            token_count += len(tokens)
        loss = float(np.mean(kls))
        grad_norm, clipped, learning_rate = step_on(computing, config, optimizer, adapters, loop.step,
                                                    admission.total_steps, loss)
        loop.step += 1
        metrics = {
            "kl": loss,
            "entropy": float(np.mean([s["entropy"] for *_, s in chosen])),
            "repetition_rate": float(np.mean([s["repetition"] for *_, s in chosen])),
            "empty_candidates": empties,
            "candidates_consumed": loop.candidate,
            "tokens": token_count,
            "grad_norm": grad_norm,
            "clipped": clipped,
            "learning_rate": learning_rate,
        }
        loop.losses.append(loss)
        loop.metrics.append(metrics)
        hooks.on_step({"step": loop.step, "loss": loss, **metrics,
                       "elapsed_seconds": time.perf_counter() - started})
        done = loop.step >= admission.total_steps
        cancel = not done and hooks.should_cancel()
        if should_publish(interval, loop.step, done, cancel):
            loop.rollout = rng.state()
            publishable(computing, model, optimizer)
            latest = _publish(admission, settings, model, optimizer, loop, records, done, hooks)
        if cancel:
            hooks.on_event("info", f"cancelled after step {loop.step}")
            return RunResult("cancelled", loop.step, latest, list(loop.losses))
    return RunResult("succeeded", loop.step, latest, list(loop.losses))


def _publish(admission, settings, model, optimizer, loop: OPDLoop, records, complete, hooks):
    config = admission.effective_config
    files, seconds = snapshot(model, optimizer, lambda scalars: {
        "optimizer": scalars,
        "loop": {"step": loop.step, "candidate": loop.candidate, "idle": loop.idle},
        "scheduler": {"step": loop.step},
        "loss_history": loop.losses,
        "metric_history": loop.metrics,
        "candidates": loop.candidates,
        "guardrails": {"config": config["guardrails"], "window": loop.window},
        "rng": {"rollout": loop.rollout, "lora_init": {"seed": admission.effective_seed}},
        "teacher": admission.identities["teacher"],
        "base_adapter": admission.identities["base_adapter"],
    })
    n = len(records)
    cursor = {"candidate": loop.candidate, "prompt": loop.candidate % n, "epoch": loop.candidate // n,
              "prompt_sha256": sha256_hex(canonical(records[loop.candidate % n]))}
    progress = {"next_cursor": cursor, "complete": complete,
                "teacher": {"alias": admission.identities["teacher"]["alias"],
                            "identity_revision": admission.identities["teacher"]["identity_revision"],
                            "content_revision": admission.identities["teacher"]["content_revision"]}}
    extra = {"teacher": admission.identities["teacher"], "base_adapter": admission.identities["base_adapter"]}
    return publish(admission, settings, loop.step, files, progress, hooks, seconds, extra)


from trainer.runs import state_check  # noqa: E402  (each kind's semantic checkpoint validator)

RUN_KIND = RunKind(name=KIND, admit=admit_opd, revalidate=revalidate_opd, run=run_opd,
                   admission_from_json=Admission.from_json, defaults=OPD_DEFAULTS, manifest_fields=MANIFEST_FIELDS,
                   check_state=state_check.check_opd_state)
