"""What a training request asks of promotion (`auto_load`, `gate`), parsed and split off before admission so
the trainer never sees it; kiln_web.serving.promotion decides on it once the job has succeeded."""

from __future__ import annotations

import math
from dataclasses import dataclass

from kiln_web.core.http import ActionRefused
from kiln_web.evals.actions import suite_for

PROMOTION_FIELDS = ("auto_load", "gate")
@dataclass(frozen=True)
class PromotionRequest:
    auto_load: bool = False
    suite: str | None = None
    min_accuracy: float | None = None
    min_improvement: float | None = None
    min_examples: int | None = None  # None: the server's KILN_GATE_MIN_EXAMPLES

    @property
    def gate(self) -> dict | None:
        if self.suite is None:
            return None
        asked = {"suite": self.suite, "min_accuracy": self.min_accuracy, "min_improvement": self.min_improvement}
        return asked | ({"min_examples": self.min_examples} if self.min_examples is not None else {})


def _threshold(gate: dict, key: str, low: float) -> float | None:
    value = gate.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not low <= value <= 1:
        raise ActionRefused(400, "invalid_request", f"gate.{key} must be a number in [{low:g}, 1]", field=f"gate.{key}")
    return float(value)


def _count(gate: dict, key: str) -> int | None:
    value = gate.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ActionRefused(400, "invalid_request", f"gate.{key} must be an integer of at least 1", field=f"gate.{key}")
    return value


def requested_promotion(body) -> PromotionRequest:
    """The promotion a request body asks for; ActionRefused (400) names a malformed field."""
    body = body if isinstance(body, dict) else {}
    auto_load = body.get("auto_load")
    if auto_load is not None and not isinstance(auto_load, bool):
        raise ActionRefused(400, "invalid_request", "auto_load must be true or false", field="auto_load")
    gate = body.get("gate")
    if gate is None:
        return PromotionRequest(auto_load=bool(auto_load))
    if not isinstance(gate, dict) or not isinstance(gate.get("suite"), str) or not gate["suite"]:
        raise ActionRefused(400, "invalid_request", "gate must be {suite, min_accuracy?, min_improvement?, "
                                                    "min_examples?}",
                            field="gate")
    unknown = sorted(set(gate) - {"suite", "min_accuracy", "min_improvement", "min_examples"})
    if unknown:
        raise ActionRefused(400, "invalid_request", f"unknown field 'gate.{unknown[0]}'", field=f"gate.{unknown[0]}")
    wanted = PromotionRequest(auto_load=bool(auto_load), suite=gate["suite"],
                              min_accuracy=_threshold(gate, "min_accuracy", 0.0),
                              min_improvement=_threshold(gate, "min_improvement", -1.0),
                              min_examples=_count(gate, "min_examples"))
    if wanted.min_accuracy is None and wanted.min_improvement is None:
        raise ActionRefused(400, "invalid_request", "a gate needs min_accuracy, min_improvement or both", field="gate")
    if not wanted.auto_load:
        raise ActionRefused(400, "invalid_request", "a gate decides whether auto_load may activate the adapter; "
                                                    "set auto_load: true with it", field="gate")
    return wanted


def split_promotion_fields(user, request: dict) -> dict:
    """REQUEST without auto_load and gate, which admission and the trainer never see; refuses a malformed
    promotion, or a gate whose suite USER cannot use."""
    wanted = requested_promotion(request)
    if wanted.suite is not None:
        try:
            suite_for(user, wanted.suite)
        except ActionRefused as refused:
            raise ActionRefused(400, refused.code, refused.message, field="gate.suite") from None
    return {key: value for key, value in request.items() if key not in PROMOTION_FIELDS}
