"""Request and response shapes of the training API; /v1/openapi.json is generated from these.

Requests refuse unknown fields. An optional field left out (or null) means "the server
default": the trainer's admission resolves it and reports the result in the job's
effective_config. The trainer's admission does the semantic validation (paths, bases,
resume drift); these shapes check types and ranges.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any, ClassVar, Literal

from ninja import Schema
from pydantic import ConfigDict, Field, model_validator

from kiln_web.core.http import field_refusal
from kiln_web.jobs.runtime import request_default
from kiln_web.serving.schemas import JobPromotionOut, PromotionGate

ADAPTER_NAME = r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,99}$"
TEACHER_ALIAS = r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,99}@(native|openai|vllm)$"


def absent(kind: str, path: str, before: str = "", after: str = "") -> str:
    """A field's description ending in "absent: <the default admission uses>" (request_default)."""
    value = request_default(kind, path)
    if isinstance(value, list):
        shown = ", ".join(map(str, value)) or "none"
    else:
        shown = value if isinstance(value, str) else json.dumps(value)
    return f"{before}absent: {shown}{after}"


class Strict(Schema):
    # strict: "3" is not an integer and true is not 1 (an integer is still a valid number)
    model_config = ConfigDict(extra="forbid", strict=True)


class OneSource(Strict):
    """A training request whose data comes from exactly one of a file (dataset_path) and an inline list."""

    INLINE: ClassVar[str]  # the name of the inline field

    @model_validator(mode="after")
    def _one_source(self):
        if (self.dataset_path is None) == (getattr(self, self.INLINE) is None):
            raise field_refusal("dataset_path", f"give exactly one of dataset_path and {self.INLINE}")
        return self


class LRSchedule(Strict):
    type: Literal["constant", "linear", "cosine"] = Field(
        request_default("sft", "lr_schedule.type"), description="constant, or warmup then linear or cosine decay "
                                                                "to zero")
    warmup_steps: int = Field(request_default("sft", "lr_schedule.warmup_steps"), ge=0,
                              description="optimizer steps of linear warmup from zero")


class LoRAConfig(Strict):
    rank: int | None = Field(None, gt=0, description=absent("sft", "lora.rank"))
    alpha: float | None = Field(None, gt=0, description=absent("sft", "lora.alpha"))
    targets: list[str] | None = Field(None, min_length=1, description=absent("sft", "lora.targets",
                                                                             "projection names; "))
    use_rslora: bool | None = Field(None, description=absent("sft", "lora.use_rslora", "scale by alpha/sqrt(rank) "
                                                                                       "instead of alpha/rank; "))


class OptimizerConfig(Strict):
    """Adam's hyperparameters; part of the effective configuration, so a resume with others is refused."""

    beta1: float | None = Field(None, ge=0, lt=1, description=absent("sft", "optimizer.beta1"))
    beta2: float | None = Field(None, ge=0, lt=1, description=absent("sft", "optimizer.beta2"))
    epsilon: float | None = Field(None, gt=0, description=absent("sft", "optimizer.epsilon"))
    weight_decay: float | None = Field(None, ge=0, description=absent(
        "sft", "optimizer.weight_decay", "L2 weight decay added to the gradient, as torch.optim.Adam; "))


class QuantizationConfig(Strict):
    type: Literal["nf4"] = Field(description="NF4 as bitsandbytes quantize_4bit(quant_type='nf4')")
    block_size: int | None = Field(None, ge=32, description=absent(
        "sft", "quantization.block_size", "32, 64, 128, 256, 512, 1024, 2048 or 4096 (bitsandbytes' block sizes); "))
    double_quantization: bool | None = Field(None, description=absent("sft", "quantization.double_quantization"))


MAX_SEED = 2**63 - 1
BASE_ADAPTER = ("weights-only warm start of a new run: an absolute PEFT adapter directory (a finished run's snapshot, "
                "e.g. $KILN_HOME/adapters/NAME) in the adapter registry or a data root; the LoRA shape becomes its own")
PRECISION = ("how the frozen base computes: its products and the output projection's (attention, adapters, softmax "
             "and cross-entropy stay float32). bfloat16: from bfloat16-rounded operands with float32 accumulation, on "
             "oneDNN on a CPU with AVX-512-BF16 or AMX, or on a CUDA device's BF16 tensor cores; tfloat32: on a CUDA "
             "device's TF32 tensor cores (cuda only: auto then needs the device). Not with quantization; "
             "400 backend_unavailable with the reason where it cannot run; recorded in effective_config and the "
             "execution identity, so a resume must ask for the same; absent: float32")
BACKEND = ("the backend the run computes on. auto: cuda when the CUDA loader finds a device of compute capability "
           ">= 8.0 and a passing `kiln qualify --backend cuda` receipt holds for this server's envelope, else cpu; "
           "cuda without such a device is refused (400 backend_unavailable, with the loader's reason); absent: the "
           "server's KILN_TRAINING_BACKEND. The resolved one is effective_config.backend, and identities.backend "
           "says why; a resume must resolve to its checkpoint's backend")
DEFAULT_BASE = ("absent: the server's default base (KILN_DEFAULT_BASE; unset: SmolLM2-135M-Instruct once registered, "
                "else kiln-tiny), reported in effective_config")


class SFTConfig(Strict):
    """A field left out (or null, where null has no meaning of its own) takes the server default;
    the job's effective_config reports every resolved value."""

    output_name: str = Field(pattern=ADAPTER_NAME, description="the adapter name checkpoints publish under")
    base_model: str | None = Field(None, min_length=1,
                                   description="a registered base (kiln base list); " + DEFAULT_BASE)
    epochs: int | None = Field(None, gt=0, description=absent("sft", "epochs"))
    learning_rate: float | None = Field(None, gt=0, description=absent("sft", "learning_rate", "peak learning rate; "))
    lr_schedule: LRSchedule | None = None
    batch_size: int | None = Field(None, gt=0, description=absent("sft", "batch_size", "examples per micro-batch; "))
    gradient_accumulation_steps: int | None = Field(None, gt=0, description=absent(
        "sft", "gradient_accumulation_steps", "micro-batches per optimizer step; "))
    max_grad_norm: float | None = Field(None, gt=0, description=absent("sft", "max_grad_norm", "clip the global "
                                        "gradient norm to this; ", "; null: no clipping"))
    optimizer: OptimizerConfig | None = None
    lora: LoRAConfig | None = None
    quantization: QuantizationConfig | None = Field(None, description="null or absent: an FP32 base (LoRA); "
                                                                      "nf4: a quantized base (QLoRA)")
    seed: int | None = Field(None, ge=0, le=MAX_SEED, description="null or absent: chosen at admission and "
                                                                  "reported as effective_seed")
    checkpoint_interval: int | None = Field(
        None, gt=0, description="committed optimizer steps between checkpoints; null or absent: the server's "
                                "training.checkpoint_interval (KILN_CHECKPOINT_INTERVAL); zero is invalid")
    resume_checkpoint: str | None = Field(
        None, min_length=1, description="continue the same run from a .kiln-checkpoint: its basename in the "
                                        "adapter registry, or an absolute path directly inside it")
    base_adapter: str | None = Field(None, min_length=1, description=BASE_ADAPTER)
    max_sequence_length: int | None = Field(None, ge=2, description=absent(
        "sft", "max_sequence_length", "tokens per example (longer ones are truncated); "))
    activation_checkpointing: Literal["none", "blocks"] | None = Field(None, description=absent(
        "sft", "activation_checkpointing", "recompute block activations in backward to save memory; "))
    backend: Literal["auto", "cpu", "cuda"] | None = Field(None, description=BACKEND)
    precision: Literal["float32", "bfloat16", "tfloat32"] | None = Field(None, description=PRECISION)


class SFTRequest(OneSource):
    INLINE = "data"

    dataset_path: str | None = Field(None, min_length=1, description="absolute path of a JSONL file in a data root")
    data: list[dict[str, Any]] | None = Field(
        None, min_length=1, description="inline records: {messages: [...]} or {prompt, completion}")
    config: SFTConfig
    # promotion: decided after the run succeeds, never admitted or bound into a checkpoint (kiln_web.serving)
    auto_load: bool | None = Field(None, description="activate the adapter after success once its serving canary "
                                                     "passes (with a gate: once its evaluation passes); absent: false")
    gate: PromotionGate | None = Field(None, description="a held-out post-eval accuracy gate; needs auto_load")


class GRPOReference(Strict):
    type: Literal["frozen", "ema"] = Field(
        request_default("grpo", "reference.type"),
        description="frozen: the base (adapter off); ema: an EMA of the adapter refreshed every "
                    "refresh_steps optimizer steps as (1 - mixup_alpha) * ref + mixup_alpha * policy")
    refresh_steps: int | None = Field(None, gt=0, description=absent("grpo", "reference.refresh_steps", "ema only; "))
    mixup_alpha: float | None = Field(None, gt=0, le=1, description=absent("grpo", "reference.mixup_alpha",
                                                                           "ema only; "))


class GRPOConfig(Strict):
    """TRL's GRPO over scored groups; a field left out (or null) takes the default the job's
    effective_config reports (docs/grpo-opd.md)."""

    output_name: str = Field(pattern=ADAPTER_NAME, description="the adapter name checkpoints publish under")
    base_model: str | None = Field(None, min_length=1, description="a registered base; " + DEFAULT_BASE)
    epochs: int | None = Field(None, gt=0, description=absent("grpo", "epochs", "passes over the groups; "))
    groups_per_step: int | None = Field(None, gt=0, description=absent(
        "grpo", "groups_per_step", "groups (one micro-batch each) per optimizer step; "))
    learning_rate: float | None = Field(None, gt=0, description=absent("grpo", "learning_rate"))
    lr_schedule: LRSchedule | None = None
    max_grad_norm: float | None = Field(None, gt=0, description=absent("grpo", "max_grad_norm",
                                                                       after="; null: no clipping"))
    optimizer: OptimizerConfig | None = None
    lora: LoRAConfig | None = None
    seed: int | None = Field(None, ge=0, le=MAX_SEED, description="null or absent: chosen at admission")
    checkpoint_interval: int | None = Field(
        None, gt=0, description="committed optimizer steps between checkpoints; null or absent: the server's "
                                "training.checkpoint_interval (KILN_CHECKPOINT_INTERVAL)")
    resume_checkpoint: str | None = Field(None, min_length=1, description="continue the same run from a GRPO "
                                                                          ".kiln-checkpoint basename")
    epsilon: float | None = Field(None, gt=0, lt=1, description=absent("grpo", "epsilon", "lower clip range; "))
    epsilon_high: float | None = Field(None, gt=0, description="upper clip range; absent: epsilon")
    beta: float | None = Field(None, ge=0, description=absent("grpo", "beta", "k3 KL coefficient to the reference; ",
                                                              " (0: no KL)"))
    scale_rewards: Literal["group", "batch", "none"] | None = Field(None, description=absent(
        "grpo", "scale_rewards", "advantage scaling by the reward std of the group, the step, or none; "))
    loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo"] | None = Field(None, description=absent("grpo", "loss_type"))
    num_iterations: int | None = Field(None, gt=0, description=absent("grpo", "num_iterations",
                                                                      "optimizer updates per batch (TRL's mu); "))
    max_completion_length: int | None = Field(None, gt=0, description=absent("grpo", "max_completion_length",
                                                                             "completion tokens kept; "))
    reference: GRPOReference | None = None
    base_adapter: str | None = Field(None, min_length=1, description=BASE_ADAPTER)
    streaming: bool | None = Field(None, description=absent("grpo", "streaming", "read dataset_path lazily from a "
                                                            "byte cursor (files too large to hold); "))
    activation_checkpointing: Literal["none", "blocks"] | None = Field(None, description=absent(
        "grpo", "activation_checkpointing"))
    backend: Literal["auto", "cpu", "cuda"] | None = Field(None, description=BACKEND)
    precision: Literal["float32", "bfloat16", "tfloat32"] | None = Field(None, description=PRECISION)


class GRPORequest(OneSource):
    INLINE = "groups"

    dataset_path: str | None = Field(None, min_length=1, description="absolute path of a JSONL file of groups in "
                                                                     "a data root")
    groups: list[dict[str, Any]] | None = Field(
        None, min_length=1, description="inline groups: {prompt | messages, completions: [{text, reward | "
                                        "rewards: {name: number}}...], reward_weights?}")
    config: GRPOConfig


class OPDGuardrails(Strict):
    """Collapse guardrails over the last `window` candidates; a null threshold is off."""

    entropy_floor: float | None = Field(None, description="stop when the mean student entropy falls below")
    max_repetition_rate: float | None = Field(None, ge=0, le=1, description="stop above this repeated-trigram rate")
    max_empty_rate: float | None = Field(None, ge=0, le=1, description="stop above this empty-completion rate")
    kl_ceiling: float | None = Field(None, description="stop when the mean sampled reverse KL rises above")
    window: int | None = Field(None, gt=0, description=absent("opd", "guardrails.window", "candidates per window; "))


class OPDConfig(Strict):
    """On-policy distillation from a teacher alias; a field left out (or null) takes the default the
    job's effective_config reports (docs/grpo-opd.md)."""

    output_name: str = Field(pattern=ADAPTER_NAME, description="the adapter name checkpoints publish under")
    teacher: str = Field(pattern=TEACHER_ALIAS, description="a registered teacher alias name@route "
                                                            "(GET /v1/teachers); the server resolves it")
    base_model: str | None = Field(None, min_length=1, description="the student base; " + DEFAULT_BASE)
    base_adapter: str | None = Field(None, min_length=1, description=BASE_ADAPTER)
    steps: int | None = Field(None, gt=0, description=absent("opd", "steps", "optimizer steps; "))
    candidates_per_step: int | None = Field(None, gt=0, description=absent("opd", "candidates_per_step",
                                                                           "non-empty candidates per step; "))
    max_new_tokens: int | None = Field(None, gt=0, description=absent("opd", "max_new_tokens"))
    temperature: float | None = Field(None, ge=0, description=absent("opd", "temperature",
                                                                     "student sampling; 0 is greedy; "))
    top_p: float | None = Field(None, gt=0, le=1, description=absent("opd", "top_p"))
    top_k: int | None = Field(None, ge=0, description=absent("opd", "top_k", after=" (0: off)"))
    stop_strings: list[str] | None = Field(None, description=absent("opd", "stop_strings", "strings that end a "
                                                                                         "completion; "))
    learning_rate: float | None = Field(None, gt=0, description=absent("opd", "learning_rate"))
    lr_schedule: LRSchedule | None = None
    max_grad_norm: float | None = Field(None, gt=0, description=absent("opd", "max_grad_norm",
                                                                       after="; null: no clipping"))
    optimizer: OptimizerConfig | None = None
    lora: LoRAConfig | None = None
    seed: int | None = Field(None, ge=0, le=MAX_SEED, description="null or absent: chosen at admission")
    checkpoint_interval: int | None = Field(None, gt=0, description=absent(
        "opd", "checkpoint_interval", "committed optimizer steps between checkpoints; null or "))
    resume_checkpoint: str | None = Field(None, min_length=1, description="continue the same run from an OPD "
                                                                          ".kiln-checkpoint basename")
    guardrails: OPDGuardrails | None = None
    activation_checkpointing: Literal["none", "blocks"] | None = Field(None, description=absent(
        "opd", "activation_checkpointing"))
    backend: Literal["auto", "cpu", "cuda"] | None = Field(None, description=BACKEND)
    precision: Literal["float32", "bfloat16", "tfloat32"] | None = Field(None, description=PRECISION)


class OPDRequest(OneSource):
    INLINE = "prompts"

    dataset_path: str | None = Field(None, min_length=1, description="absolute path of a JSON list or JSONL file "
                                                                     "of prompts in a data root")
    prompts: list[str | dict[str, Any]] | None = Field(
        None, min_length=1, description="inline prompts: a string, {prompt} or {messages: [{role, content}...]}")
    config: OPDConfig


# -- responses --


class Progress(Schema):
    committed_step: int
    total_steps: int | None


class CheckpointSummary(Schema):
    resume_checkpoint: str = Field(description="the basename to pass as config.resume_checkpoint")
    training_kind: str
    adapter: str
    step: int
    checkpoint_id: str
    data_source_kind: str | None = None
    committed_step: int | None = None
    total_steps: int | None = None
    next_cursor: Any = Field(None, description="where the run continues: SFT {epoch, example}; GRPO {epoch, group, "
                                               "iteration, group_sha256} (streamed: also line, byte, "
                                               "consumed_lines, consumed_lines_sha256); OPD {candidate, prompt, "
                                               "epoch, prompt_sha256}")
    complete: bool | None = Field(None, description="whether the run had finished when it was published")
    manifest_sha256: str | None = Field(None, description="SHA-256 of the checkpoint's manifest file, as published")
    teacher: dict[str, Any] | None = Field(None, description="OPD: the teacher alias and the identity and content "
                                                             "revisions the checkpoint binds")

    model_config = ConfigDict(extra="allow")


class TeacherRef(Schema):
    alias: str
    route: str
    identity_revision: str = Field(description="SHA-256 of the alias's configuration when the job was admitted")
    content_revision: str | None = Field(description="SHA-256 of the teacher's content evidence (weights, "
                                                     "adapter, served model) reconstructed at admission")


class JobError(Schema):
    code: str
    message: str
    details: dict[str, Any] | None = None


class JobSummaryOut(Schema):
    id: str
    kind: str
    status: Literal["queued", "running", "cancelling", "cancelled", "failed", "succeeded", "lost"]
    owner: str
    adapter: str
    data_source_kind: str
    effective_seed: int | None
    resume_from: str | None
    progress: Progress
    latest_checkpoint: str | None = Field(description="basename of the newest checkpoint this job published")
    error: JobError | None
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None


class JobOut(Schema):
    id: str
    kind: str
    status: Literal["queued", "running", "cancelling", "cancelled", "failed", "succeeded", "lost"]
    owner: str
    adapter: str
    data_source_kind: str
    dataset_path: str | None
    effective_seed: int | None
    effective_config: dict[str, Any]
    identities: dict[str, Any] = Field(description="base, dataset, tokenizer, execution and planning identity "
                                                   "(OPD: also teacher and base_adapter), backend: how the run's "
                                                   "backend was chosen {requested, resolved, reason}, and "
                                                   "device_plan: the device bytes it plans {bytes} and the head "
                                                   "sizes its attention runs, attention [{head_size, training}] "
                                                   "(bytes null with unplannable: why it cannot be planned)")
    teacher: TeacherRef | None = Field(None, description="OPD: the teacher alias and its revisions")
    resume_from: str | None = Field(description="the checkpoint this run resumed from")
    progress: Progress
    latest_checkpoint: CheckpointSummary | None = Field(
        description="the job's newest checkpoint, else the one it resumed from: as recorded at publication while "
                    "the job is active, checked against its directory once the job has ended")
    latest_checkpoint_error: JobError | None = Field(
        None, description="why latest_checkpoint could not be read (moved, deleted, damaged, changed); checked once "
                          "the job has ended")
    error: JobError | None
    worker_id: str | None
    heartbeat_at: datetime | None
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    promotion: JobPromotionOut | None = Field(None, description="auto_load and gate as requested, and the outcome")
    evaluation_ids: list[str] = Field(default_factory=list, description="the evaluations run for this job's gate")


class JobListOut(Schema):
    items: list[JobSummaryOut]
    count: int


class CheckpointOut(Schema):
    basename: str
    adapter: str
    step: int
    checkpoint_id: str
    manifest_digest: str
    present: bool = Field(description="whether the directory still exists beneath the registry")
    summary: dict[str, Any]
    timing: dict[str, Any] = Field(description="seconds waiting for the state lock, snapshotting, publishing")
    created_at: datetime


class CheckpointListOut(Schema):
    items: list[CheckpointOut]


class MetricOut(Schema):
    """One committed step; a kind's keys only (null where the run reported no finite value)."""

    step: int
    loss: float | None = Field(None, description="SFT: cross-entropy; GRPO: the objective; OPD: mean reverse KL")
    learning_rate: float | None = None
    grad_norm: float | None = None
    clipped: bool | None = None
    loss_spike: bool | None = Field(None, description="SFT")
    tokens: int | None = None
    epoch: int | None = None
    elapsed_seconds: float | None = None
    # GRPO's policy audit (TRL's definitions, over the step's completion tokens)
    groups: int | None = None
    completions: int | None = None
    clip_low_fraction: float | None = None
    clip_high_fraction: float | None = None
    clip_region_fraction: float | None = None
    kl_mean: float | None = Field(None, description="GRPO: mean k3 KL to the reference; null when beta is 0")
    ratio_mean: float | None = None
    ratio_min: float | None = None
    ratio_max: float | None = None
    reward_mean: float | None = None
    reward_std: float | None = Field(None, description="GRPO: the mean of the groups' reward std")
    advantage_mean: float | None = None
    advantage_std: float | None = None
    # OPD
    kl: float | None = Field(None, description="OPD: mean sampled reverse KL to the teacher")
    entropy: float | None = Field(None, description="OPD: mean student entropy, nats per token")
    repetition_rate: float | None = Field(None, description="OPD: repeated-trigram rate")
    empty_candidates: int | None = Field(None, description="OPD: empty completions consumed in the step")
    candidates_consumed: int | None = Field(None, description="OPD: the candidate cursor after the step")

    model_config = ConfigDict(extra="allow")


class MetricListOut(Schema):
    items: list[MetricOut]
    next_after_step: int | None = Field(description="pass as after_step for the next page; null at the end")


class EventOut(Schema):
    time: datetime
    level: str
    message: str


class EventListOut(Schema):
    items: list[EventOut]
    next_offset: int | None = Field(None, description="pass as offset for the next page; null at the end")


class ResumeIn(Strict):
    """The data of a resumed run, when it is not the job's own dataset_path: at most one field, and the
    inline field of the job's kind (SFT data, GRPO groups, OPD prompts). Empty: keep the job's dataset_path."""

    dataset_path: str | None = Field(None, min_length=1, description="absolute path of the data file in a data "
                                                                     "root; absent: the job's own dataset_path")
    data: list[dict[str, Any]] | None = Field(None, min_length=1, description="SFT: the job's inline records again")
    groups: list[dict[str, Any]] | None = Field(None, min_length=1, description="GRPO: the job's inline groups "
                                                                               "again")
    prompts: list[str | dict[str, Any]] | None = Field(None, min_length=1, description="OPD: the job's inline "
                                                                                       "prompts again")
