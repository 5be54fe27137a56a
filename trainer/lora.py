"""LoRA adapters: the configuration and the per-projection low-rank pair (A, B).

A projection y = x @ W.T gains y += scaling * (x @ A.T) @ B.T with A [r, in] and B
[out, r]; scaling is alpha / r, or alpha / sqrt(r) with rsLoRA. A starts like PEFT's
kaiming-uniform (bound 1/sqrt(in)) from a seeded generator; B starts at zero, so an
attached adapter leaves the model's outputs unchanged until it is trained.
"""

import math
from dataclasses import asdict, dataclass

import numpy as np

from trainer.parameters import Parameter

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
# Phi-3's fused modules, as peft names them: a target that names one means all its projections
FUSED_TARGETS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


@dataclass(frozen=True)
class LoraConfig:
    rank: int
    alpha: float
    targets: tuple = PROJECTIONS  # projection names that get an adapter
    use_rslora: bool = False  # scaling alpha/sqrt(rank) instead of alpha/rank
    initializer_seed: int = 0  # seed of lora_A's initialiser

    def __post_init__(self):
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank <= 0:
            raise ValueError(f"rank must be a positive integer, got {self.rank!r}")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) \
                or not math.isfinite(self.alpha) or self.alpha <= 0:
            raise ValueError(f"alpha must be a positive number, got {self.alpha!r}")
        targets = (self.targets,) if isinstance(self.targets, str) else tuple(self.targets)
        targets = tuple(member for t in targets for member in FUSED_TARGETS.get(t, (t,)))
        if not targets:
            raise ValueError("targets must name at least one projection")
        unknown = [t for t in targets if t not in PROJECTIONS]
        if unknown:
            raise ValueError(f"targets {unknown} are not projections; choose from {PROJECTIONS} "
                             f"(or Phi-3's fused {tuple(FUSED_TARGETS)})")
        if len(set(targets)) != len(targets):
            raise ValueError(f"targets repeat a projection: {targets}")
        # canonical order, so that equal configurations compare equal
        object.__setattr__(self, "targets", tuple(t for t in PROJECTIONS if t in targets))
        if not isinstance(self.use_rslora, bool):
            raise ValueError(f"use_rslora must be a bool, got {self.use_rslora!r}")
        if isinstance(self.initializer_seed, bool) or not isinstance(self.initializer_seed, int) \
                or self.initializer_seed < 0:
            raise ValueError(f"initializer_seed must be a non-negative integer, got {self.initializer_seed!r}")

    @property
    def scaling(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)

    def to_dict(self) -> dict:
        data = asdict(self)
        data["targets"] = list(self.targets)
        return data

    @classmethod
    def from_dict(cls, data: dict) -> "LoraConfig":
        return cls(**{**data, "targets": tuple(data["targets"])})

    def shape_identity(self) -> dict:
        """What must match for an exact restore (the initializer seed need not)."""
        return {"rank": self.rank, "alpha": float(self.alpha), "targets": list(self.targets),
                "use_rslora": self.use_rslora}


class LoraAdapter:
    """The (A, B) pair of one projection."""

    def __init__(self, prefix, rank, in_features, out_features, scaling, rng):
        bound = 1.0 / math.sqrt(in_features)
        a = rng.uniform(-bound, bound, size=(rank, in_features)).astype(np.float32)
        self.A = Parameter(prefix + ".lora_A.weight", a, np.zeros_like(a))  # [r, in]
        b = np.zeros((out_features, rank), np.float32)
        self.B = Parameter(prefix + ".lora_B.weight", b, np.zeros_like(b))  # [out, r]
        self.scaling = np.float32(scaling)
