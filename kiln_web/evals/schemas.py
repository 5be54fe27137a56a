"""Request and response shapes of the evaluation API."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from ninja import Schema
from pydantic import ConfigDict, Field


class Strict(Schema):
    model_config = ConfigDict(extra="forbid", strict=True)


class SuiteIn(Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,99}$")
    content: str = Field(min_length=1, description="JSONL: {prompt | messages, expected, metric?, tolerance?} per "
                                                   "line")
    default_metric: Literal["exact", "contains", "regex", "numeric"] = Field(
        "exact", description="for lines without their own metric")


class SuiteOut(Schema):
    name: str
    owner: str
    digest: str
    default_metric: str
    example_count: int
    created_at: datetime
    content: str | None = None


class SuiteListOut(Schema):
    items: list[SuiteOut]


class RunIn(Strict):
    adapter: str = Field(min_length=1, description="the candidate: an adapter with a PEFT snapshot")
    suite: str = Field(min_length=1)
    base: str | None = Field(None, min_length=1, description="absent: the base the adapter was trained over")
    baseline: str | None = Field(None, min_length=1, description=(
        "what to compare with: an adapter over the candidate's base, or that base; one over another base is refused "
        "(409 cross_base_comparison). Absent: your active adapter when it is over the candidate's base, else the base"))
    max_new_tokens: int = Field(64, ge=1, le=4096, description="greedy tokens per example")
    backend: Literal["auto", "cpu", "cuda"] | None = Field(None, description=(
        "the backend generation runs on. auto: cuda when the CUDA loader finds a device of compute capability >= 8.0 "
        "and a passing `kiln qualify --backend cuda` receipt holds for this server's envelope, else cpu; cuda without "
        "such a device is refused (400 backend_unavailable, with the loader's reason); absent: the server's "
        "KILN_TRAINING_BACKEND"))


class Summary(Schema):
    suite: str
    suite_digest: str
    correct: int
    total: int
    accuracy: float


class CandidateOut(Schema):
    adapter: str
    base: str
    adapter_sha256: str | None = Field(description="the snapshot evaluated")
    summary: Summary | None


class BaselineOut(Schema):
    kind: Literal["adapter", "base"] = Field(description="an adapter over the candidate's base (the one asked for, "
                                                         "or your active one when the run was queued), or that base")
    name: str
    base: str
    adapter_sha256: str | None
    note: str | None = Field(description="why this baseline was chosen")
    summary: Summary | None


class RunBackend(Schema):
    resolved: Literal["cpu", "cuda"]
    reason: str | None


class RunError(Schema):
    code: str
    message: str


class RunOut(Schema):
    id: str
    owner: str
    suite: str
    suite_digest: str
    candidate: CandidateOut
    baseline: BaselineOut
    training_job: str | None = Field(description="the training job whose promotion gate asked for this run")
    purpose: Literal["manual", "gate"]
    max_new_tokens: int
    backend: RunBackend | None = Field(None, description="the backend resolved when the run was queued, and why")
    status: Literal["queued", "running", "succeeded", "failed"]
    error: RunError | None
    worker_id: str | None
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    examples: list[dict[str, Any]] | None = Field(None, description="per example: index, expected, metric, and "
                                                                    "each side's output and correctness")


class RunListOut(Schema):
    items: list[RunOut]
    count: int
