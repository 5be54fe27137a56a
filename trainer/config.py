"""TransformerConfig: the shape and execution options of one Llama-family decoder.

The family fields (`family`, `attention_bias`, `qk_norm`, `rope_scaling`, `sliding_window`)
describe how Llama 3, Qwen2/2.5, Qwen3, Mistral and Phi-3 differ from the plain Llama
shape; at their defaults the model is SmolLM2's Llama, and to_dict()/architecture() leave
them out, so every configuration written before they existed keeps its bytes and identity.
"""

import math
from dataclasses import MISSING, asdict, dataclass, fields

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "phi3")
ROPE_SCALING_TYPES = ("llama3",)
LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
# the family fields and their defaults (the plain Llama shape): written only when they differ
FAMILY_DEFAULTS = {"family": "llama", "attention_bias": False, "qk_norm": False, "rope_scaling": None,
                   "sliding_window": None}
ATTENTION_ALGORITHMS = ("dense", "tiled")
CHECKPOINTING_POLICIES = ("none", "blocks")
LOSS_ROUTES = ("full_logits", "kt_tape_flce")
# how a LoRA model's frozen base computes: float32 (OpenBLAS), or its Linear products from bfloat16-rounded
# operands with float32 accumulation, every product on oneDNN (native_ext.onednn). Written by to_dict() only
# when not float32, so every configuration written before the option existed keeps its bytes.
BASE_PRECISIONS = ("float32", "bfloat16")
OMITTED_AT_DEFAULT = {**FAMILY_DEFAULTS, "base_precision": "float32"}  # fields to_dict() writes only when set


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
    family: str = "llama"  # the Hugging Face model_type its names and exports follow (FAMILIES)
    attention_bias: bool = False  # q/k/v projections carry biases (Qwen2)
    qk_norm: bool = False  # per-head RMSNorm of queries and keys before rotary (Qwen3)
    rope_scaling: tuple | None = None  # ("llama3", factor, low_freq_factor, high_freq_factor, original context)
    sliding_window: int | None = None  # a query sees at most this many keys, itself included (Mistral, Phi-3)
    base_precision: str = "float32"  # or "bfloat16": the frozen base's products of a LoRA model (BASE_PRECISIONS)

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
                              ("loss_route", LOSS_ROUTES), ("base_precision", BASE_PRECISIONS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        self._check_family()

    def _check_family(self):
        if self.family not in FAMILIES:
            raise ValueError(f"family must be one of {FAMILIES}, got {self.family!r}")
        for name in ("attention_bias", "qk_norm"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        window = self.sliding_window
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window <= 0):
            raise ValueError(f"sliding_window must be a positive integer or None, got {window!r}")
        scaling = self.rope_scaling
        if scaling is None:
            return
        if isinstance(scaling, list):  # from JSON
            object.__setattr__(self, "rope_scaling", scaling := tuple(scaling))
        if not isinstance(scaling, tuple) or not scaling or scaling[0] not in ROPE_SCALING_TYPES:
            raise ValueError(f"rope_scaling must be None or (type, ...) with a type in {ROPE_SCALING_TYPES}, "
                             f"got {scaling!r}")
        if len(scaling) != 1 + len(LLAMA3_ROPE_KEYS) or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0
                for v in scaling[1:]):
            raise ValueError(f"rope_scaling {scaling[0]!r} takes ({', '.join(LLAMA3_ROPE_KEYS)}), finite and "
                             f"positive, got {scaling[1:]!r}")
        if scaling[2] == scaling[3]:
            raise ValueError("rope_scaling llama3: low_freq_factor and high_freq_factor must differ")

    @property
    def kv_heads(self) -> int:
        return self.kv_head_count if self.kv_head_count is not None else self.head_count

    @property
    def head_dimension(self) -> int:
        return self.head_size if self.head_size is not None else self.model_width // self.head_count

    def projection_shapes(self) -> dict:
        """{name: (out_features, in_features)} of each block's linear projections (trainer.lora.PROJECTIONS)."""
        C, F, D, H, KV = self.model_width, self.feed_forward_width, self.head_dimension, self.head_count, self.kv_heads
        return {"q_proj": (H * D, C), "k_proj": (KV * D, C), "v_proj": (KV * D, C), "o_proj": (C, H * D),
                "gate_proj": (F, C), "up_proj": (F, C), "down_proj": (C, F)}

    def to_dict(self) -> dict:
        """Every field, but the family fields and base_precision only where they differ from their defaults."""
        data = asdict(self)
        for name, default in OMITTED_AT_DEFAULT.items():
            if data[name] == default:
                del data[name]
        if data.get("rope_scaling") is not None:
            data["rope_scaling"] = list(data["rope_scaling"])
        return data

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
        architecture = {k: getattr(self, k) for k in keys}
        for name, default in FAMILY_DEFAULTS.items():
            if getattr(self, name) != default:
                value = getattr(self, name)
                architecture[name] = list(value) if isinstance(value, tuple) else value
        return architecture
