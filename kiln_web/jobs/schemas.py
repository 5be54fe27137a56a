"""Request and response shapes of the training API; /v1/openapi.json is generated from these.

Requests refuse unknown fields. An optional field left out (or null) means "the server
default": the trainer's admission resolves it and reports the result in the job's
effective_config. The trainer's admission does the semantic validation (paths, bases,
resume drift); these shapes check types and ranges.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from ninja import Schema
from pydantic import ConfigDict, Field, model_validator

ADAPTER_NAME = r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,99}$"


class Strict(Schema):
    # strict: "3" is not an integer and true is not 1 (an integer is still a valid number)
    model_config = ConfigDict(extra="forbid", strict=True)


class LRSchedule(Strict):
    type: Literal["constant", "linear", "cosine"] = Field(
        "constant", description="constant, or warmup then linear or cosine decay to zero")
    warmup_steps: int = Field(0, ge=0, description="optimizer steps of linear warmup from zero")


class LoRAConfig(Strict):
    rank: int | None = Field(None, gt=0, description="absent: 8")
    alpha: float | None = Field(None, gt=0, description="absent: 16")
    targets: list[str] | None = Field(None, min_length=1, description="projection names, e.g. q_proj, v_proj; "
                                                                      "absent: every projection")
    use_rslora: bool | None = Field(None, description="scale by alpha/sqrt(rank) instead of alpha/rank")


class QuantizationConfig(Strict):
    type: Literal["nf4"] = Field(description="NF4 as bitsandbytes quantize_4bit(quant_type='nf4')")
    block_size: int | None = Field(None, ge=32, description="absent: 64")
    double_quantization: bool | None = Field(None, description="absent: false")


MAX_SEED = 2**63 - 1


class SFTConfig(Strict):
    """A field left out (or null, where null has no meaning of its own) takes the server default;
    the job's effective_config reports every resolved value."""

    output_name: str = Field(pattern=ADAPTER_NAME, description="the adapter name checkpoints publish under")
    base_model: str | None = Field(None, min_length=1, description="a registered base (kiln base list); "
                                                                   "absent: kiln-tiny")
    epochs: int | None = Field(None, gt=0, description="absent: 1")
    learning_rate: float | None = Field(None, gt=0, description="peak learning rate; absent: 2e-4")
    lr_schedule: LRSchedule | None = None
    batch_size: int | None = Field(None, gt=0, description="examples per micro-batch; absent: 1")
    gradient_accumulation_steps: int | None = Field(None, gt=0, description="micro-batches per optimizer step")
    max_grad_norm: float | None = Field(None, gt=0, description="clip the global gradient norm to this; "
                                                                "absent: 1.0; null: no clipping")
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
    max_sequence_length: int | None = Field(None, ge=2, description="tokens per example (longer ones are "
                                                                    "truncated); absent: 512")
    activation_checkpointing: Literal["none", "blocks"] | None = Field(
        None, description="recompute block activations in backward to save memory; absent: none")


class SFTRequest(Strict):
    dataset_path: str | None = Field(None, min_length=1, description="absolute path of a JSONL file in a data root")
    data: list[dict[str, Any]] | None = Field(
        None, min_length=1, description="inline records: {messages: [...]} or {prompt, completion}")
    config: SFTConfig

    @model_validator(mode="after")
    def _one_source(self) -> "SFTRequest":
        if (self.dataset_path is None) == (self.data is None):
            raise ValueError("give exactly one of dataset_path and data")
        return self


# -- responses --


class ErrorBody(Schema):
    code: str = Field(description="machine-readable, e.g. invalid_request, resume_drift, unauthorized")
    message: str = Field(description="a sentence a person can act on")
    field: str | None = Field(None, description="the request field at fault, dotted: config.checkpoint_interval")
    differences: list[dict[str, Any]] | None = Field(
        None, description="resume drift: [{field, checkpoint, request}, ...]")

    model_config = ConfigDict(extra="allow")


class ErrorOut(Schema):
    error: ErrorBody


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
    next_cursor: Any = Field(None, description="SFT: the epoch/example cursor the run continues from")
    complete: bool | None = Field(None, description="whether the run had finished when it was published")

    model_config = ConfigDict(extra="allow")


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
    identities: dict[str, Any] = Field(description="base, dataset, tokenizer, execution and planning identity")
    resume_from: str | None = Field(description="the checkpoint this run resumed from")
    progress: Progress
    latest_checkpoint: CheckpointSummary | None = Field(
        description="read from the checkpoint directory (bounded metadata); the job's newest, else the one it "
                    "resumed from")
    latest_checkpoint_error: JobError | None = Field(
        None, description="why latest_checkpoint could not be read (moved, deleted, damaged)")
    error: JobError | None
    worker_id: str | None
    heartbeat_at: datetime | None
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None


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
    step: int
    loss: float | None = None
    learning_rate: float | None = None
    grad_norm: float | None = None
    clipped: bool | None = None
    loss_spike: bool | None = None
    tokens: int | None = None
    epoch: int | None = None
    elapsed_seconds: float | None = None

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
