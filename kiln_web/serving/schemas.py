"""Request and response shapes of the adapter and promotion API, and the promotion fields of a
training request (kiln_web.jobs.schemas uses PromotionGate and JobPromotionOut)."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from ninja import Schema
from pydantic import ConfigDict, Field, model_validator

from kiln_web.core.http import field_refusal

OUTCOMES = Literal["promoted", "gate_failed", "inconclusive", "unavailable", "canary_failed", "not_requested",
                   "pending"]


class PromotionGate(Schema):
    """A held-out post-eval accuracy gate: the adapter is activated only when its evaluation passes."""

    model_config = ConfigDict(extra="forbid", strict=True)

    suite: str = Field(min_length=1, description="an evaluation suite's name (GET /v1/evals/suites)")
    min_accuracy: float | None = Field(None, ge=0, le=1, description="the candidate's accuracy must reach this")
    min_examples: int | None = Field(None, ge=1, description="a suite with fewer examples decides nothing "
                                                             "(inconclusive); absent: the server's "
                                                             "KILN_GATE_MIN_EXAMPLES (20)")
    min_improvement: float | None = Field(None, ge=-1, le=1, description="the candidate's accuracy minus that of "
                                                                        "your active adapter (or the base) must "
                                                                        "reach this")

    @model_validator(mode="after")
    def _a_threshold(self) -> "PromotionGate":
        if self.min_accuracy is None and self.min_improvement is None:
            raise field_refusal("min_accuracy", "a gate needs min_accuracy, min_improvement or both")
        return self


class JobPromotionOut(Schema):
    auto_load: bool
    gate: dict[str, Any] | None
    outcome: OUTCOMES | None = Field(description="null until the training job succeeds")
    reason: str | None
    decided_by: str | None = Field(description="'gate', 'auto_load' or a username")
    decided_at: datetime | None
    evaluation: str | None = Field(description="the evaluation the decision rests on")


class LoadIn(Schema):
    model_config = ConfigDict(extra="forbid", strict=True)

    base: str | None = Field(None, min_length=1, description="absent: the base the adapter was trained over")


class ServedOut(Schema):
    adapter: str
    base: str
    adapter_sha256: str
    generation: int = Field(description="raised by every load; each web process reloads on a change")
    active: bool = Field(description="whether it is someone's active adapter (active_for)")
    active_for: str | None = Field(None, description="whose requests that name no model it answers (a username)")
    loaded_by: str
    loaded_at: datetime
    activated_at: datetime | None


class PromotionOut(Schema):
    id: int
    adapter: str
    job: str | None
    evaluation: str | None
    outcome: OUTCOMES
    reason: str
    decided_by: str
    adapter_sha256: str | None
    previous_active: str | None
    decided_at: datetime


class PromotionListOut(Schema):
    items: list[PromotionOut]


class ShareIn(Schema):
    """Exactly one of user and group."""

    model_config = ConfigDict(extra="forbid", strict=True)

    user: str | None = Field(None, min_length=1, description="a username")
    group: str | None = Field(None, min_length=1, description="a group's name (Django's auth groups)")

    @model_validator(mode="after")
    def _one_target(self) -> "ShareIn":
        if (self.user is None) == (self.group is None):
            raise field_refusal("user", "name exactly one of user and group")
        return self


class ShareOut(Schema):
    kind: Literal["user", "group"]
    name: str = Field(description="the username or the group's name")
    created_by: str | None
    created_at: datetime


class AdapterOut(Schema):
    name: str
    owner: str
    base: str | None = Field(description="the base it was trained over")
    snapshot: bool = Field(description="whether its PEFT snapshot is in the registry")
    loaded: bool
    active: bool = Field(description="whether it is your active adapter (served to you when you name no model)")
    serving: ServedOut | None
    loaded_here: bool = Field(description="whether the process that answered holds it in memory")
    checkpoint_records: int | None = Field(description="checkpoints its runs published; null unless you may "
                                                   "manage it (they are its owner's training state)")
    latest_promotion: PromotionOut | None = Field(description="null unless you may manage it (promotions are its "
                                                           "owner's history)")
    created_at: datetime
    can_manage: bool = Field(description="whether you may load, unload, activate, delete and share it (its owner, "
                                         "or staff); an adapter shared with you can only be used")
    shares: list[ShareOut] | None = Field(description="who it is shared with; null unless you may manage it")


class AdapterListOut(Schema):
    items: list[AdapterOut]
    active: str | None = Field(description="your active adapter: served to you when a request names no model")


class DeleteOut(Schema):
    adapter: str
    checkpoints_removed: list[str] = Field(description="the .kiln-checkpoint directories removed")
    snapshot_removed: list[str] = Field(description="the PEFT snapshot (and orphaned staging copies) removed")


class UnloadOut(Schema):
    adapter: str
    was_active: bool
