"""TransformerConfig: the shape and execution options of one Llama-family decoder."""

import math
from dataclasses import MISSING, asdict, dataclass, fields

ATTENTION_ALGORITHMS = ("dense", "tiled")
CHECKPOINTING_POLICIES = ("none", "blocks")
LOSS_ROUTES = ("full_logits", "kt_tape_flce")


@dataclass(frozen=True)
class TransformerConfig:
    vocabulary_size: int
    maximum_context: int
    model_width: int
    head_count: int
    block_count: int
    feed_forward_width: int
    kv_head_count: int | None = None  # None: one KV head per query head (no grouping)
    head_size: int | None = None  # None: model_width // head_count, as in Llama
    rope_theta: float = 10000.0  # Llama's default rotary base
    norm_epsilon: float = 1e-5  # RMSNorm epsilon of Llama 2/3 and SmolLM2
    tie_embeddings: bool = False  # output projection shares the token embedding
    initializer_seed: int = 0
    initializer_range: float = 0.02  # std of the normal init, as in Hugging Face Llama
    attention_algorithm: str = "dense"  # "dense" scores or "tiled" online softmax
    attention_block_size: int = 64  # query and key block of the tiled algorithm
    activation_checkpointing: str = "none"  # "none", or "blocks": recompute each block
    loss_route: str = "full_logits"  # or "kt_tape_flce": chunked fused linear cross-entropy
    loss_chunk_tokens: int = 64  # rows per chunk of the fused route

    def __post_init__(self):
        positive = ("vocabulary_size", "maximum_context", "model_width", "head_count",
                    "block_count", "feed_forward_width", "attention_block_size",
                    "loss_chunk_tokens")
        for name in positive:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.kv_head_count is not None:
            if isinstance(self.kv_head_count, bool) or not isinstance(self.kv_head_count, int) \
                    or self.kv_head_count <= 0:
                raise ValueError(f"kv_head_count must be a positive integer, got {self.kv_head_count!r}")
            if self.head_count % self.kv_head_count:
                raise ValueError(
                    f"kv_head_count {self.kv_head_count} must divide head_count {self.head_count}")
        if self.head_size is None:
            if self.model_width % self.head_count:
                raise ValueError(
                    f"model_width {self.model_width} must be divisible by head_count "
                    f"{self.head_count} (or set head_size)")
        elif isinstance(self.head_size, bool) or not isinstance(self.head_size, int) \
                or self.head_size <= 0:
            raise ValueError(f"head_size must be a positive integer, got {self.head_size!r}")
        if self.head_dimension % 2:
            raise ValueError(f"head_size must be even for rotary positions, got {self.head_dimension}")
        for name in ("rope_theta", "norm_epsilon", "initializer_range"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 \
                    or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite positive number, got {value!r}")
        if not isinstance(self.tie_embeddings, bool):
            raise ValueError(f"tie_embeddings must be a bool, got {self.tie_embeddings!r}")
        if isinstance(self.initializer_seed, bool) or not isinstance(self.initializer_seed, int) \
                or self.initializer_seed < 0:
            raise ValueError(f"initializer_seed must be a non-negative integer, got {self.initializer_seed!r}")
        for name, allowed in (("attention_algorithm", ATTENTION_ALGORITHMS),
                              ("activation_checkpointing", CHECKPOINTING_POLICIES),
                              ("loss_route", LOSS_ROUTES)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")

    @property
    def kv_heads(self) -> int:
        return self.kv_head_count if self.kv_head_count is not None else self.head_count

    @property
    def head_dimension(self) -> int:
        return self.head_size if self.head_size is not None else self.model_width // self.head_count

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "TransformerConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown TransformerConfig fields: {', '.join(unknown)}")
        required = [f.name for f in fields(cls) if f.default is MISSING and f.name not in data]
        if required:
            raise ValueError(f"missing TransformerConfig fields: {', '.join(required)}")
        return cls(**data)

    def architecture(self) -> dict:
        """The fields that decide parameter names and shapes (not execution options)."""
        keys = ("vocabulary_size", "maximum_context", "model_width", "head_count", "block_count",
                "feed_forward_width", "kv_head_count", "head_size", "rope_theta",
                "norm_epsilon", "tie_embeddings")
        return {k: getattr(self, k) for k in keys}
