"""TransformerConfig: validation names the field, defaults, dict round trip."""

import dataclasses
import json

import pytest

from trainer import TransformerConfig
from trainer.config import FAMILY_DEFAULTS, OMITTED_AT_DEFAULT

REQUIRED = dict(vocabulary_size=32, maximum_context=16, model_width=16, head_count=4, block_count=1,
                feed_forward_width=24)

INVALID = [
    # (field, bad value, other overrides) -> ValueError naming the field
    *[(name, value, {}) for name in REQUIRED for value in (0, -1, 2.0, True, "8", None)],
    ("attention_block_size", 0, {}),
    ("attention_block_size", 1.5, {}),
    ("loss_chunk_tokens", -3, {}),
    ("loss_chunk_tokens", False, {}),
    ("kv_head_count", 0, {}),
    ("kv_head_count", 3, {}),  # does not divide head_count 4
    ("kv_head_count", True, {}),
    ("kv_head_count", 2.0, {}),
    ("head_size", 0, {}),
    ("head_size", 5, {}),  # odd: rotary positions rotate pairs
    ("head_size", "8", {}),
    ("head_size", None, {"model_width": 12}),  # derived head size 3 is odd
    ("model_width", 18, {}),  # not divisible by head_count 4 without head_size
    ("rope_theta", 0.0, {}),
    ("rope_theta", float("nan"), {}),
    ("rope_theta", "1e4", {}),
    ("norm_epsilon", -1e-5, {}),
    ("norm_epsilon", 0, {}),
    ("initializer_range", 0.0, {}),
    ("initializer_range", True, {}),
    ("tie_embeddings", 1, {}),
    ("tie_embeddings", "yes", {}),
    ("initializer_seed", -1, {}),
    ("initializer_seed", 1.0, {}),
    ("initializer_seed", True, {}),
    ("attention_algorithm", "flash", {}),
    ("attention_algorithm", None, {}),
    ("activation_checkpointing", "all", {}),
    ("activation_checkpointing", False, {}),
    ("loss_route", "chunked", {}),
]


def _case_id(field, value, overrides):
    # "checkpointing" shortened: the quick run deselects ids containing "checkpoint"
    name = field.replace("checkpointing", "ckpt")
    return f"{name}={value!r}" + (f"+{','.join(overrides)}" if overrides else "")


@pytest.mark.parametrize("field,value,overrides", INVALID, ids=[_case_id(*case) for case in INVALID])
def test_invalid_field_raises_value_error_naming_it(field, value, overrides):
    settings = {**REQUIRED, **overrides, field: value}
    with pytest.raises(ValueError) as info:
        TransformerConfig(**settings)
    assert field in str(info.value), f"{field!r} not named in: {info.value}"


def test_defaults():
    config = TransformerConfig(**REQUIRED)
    assert config.kv_head_count is None and config.kv_heads == 4
    assert config.head_size is None and config.head_dimension == 4
    assert config.rope_theta == 10000.0
    assert config.norm_epsilon == 1e-5
    assert config.tie_embeddings is False
    assert config.initializer_seed == 0
    assert config.initializer_range == 0.02
    assert config.attention_algorithm == "dense"
    assert config.attention_block_size == 64
    assert config.activation_checkpointing == "none"
    assert config.loss_route == "full_logits"
    assert config.loss_chunk_tokens == 64


def test_derived_sizes_follow_explicit_settings():
    config = TransformerConfig(**REQUIRED, kv_head_count=2, head_size=6)
    assert config.kv_heads == 2
    assert config.head_dimension == 6


def test_accepted_edge_values():
    # an int where a float is expected, a single KV head, a head size that ignores model_width
    config = TransformerConfig(**{**REQUIRED, "model_width": 18}, rope_theta=500000, kv_head_count=1,
                               head_size=8)
    assert config.rope_theta == 500000 and config.kv_heads == 1 and config.head_dimension == 8


def test_dict_round_trip_through_json():
    config = TransformerConfig(**REQUIRED, kv_head_count=2, head_size=6, tie_embeddings=True,
                               attention_algorithm="tiled", activation_checkpointing="blocks",
                               loss_route="kt_tape_flce", loss_chunk_tokens=7, initializer_seed=3)
    data = config.to_dict()
    # the family fields and base_precision are written only where they differ from their defaults
    assert set(data) == {f.name for f in dataclasses.fields(TransformerConfig)} - set(OMITTED_AT_DEFAULT)
    assert TransformerConfig.from_dict(data) == config
    assert TransformerConfig.from_dict(json.loads(json.dumps(data))) == config


def test_family_fields_round_trip_and_enter_the_architecture():
    plain = TransformerConfig(**REQUIRED)
    config = TransformerConfig(**REQUIRED, family="qwen3", qk_norm=True, attention_bias=True, sliding_window=5,
                               rope_scaling=("llama3", 8.0, 1.0, 4.0, 32.0))
    data = json.loads(json.dumps(config.to_dict()))
    assert data["rope_scaling"] == ["llama3", 8.0, 1.0, 4.0, 32.0] and data["family"] == "qwen3"
    assert TransformerConfig.from_dict(data) == config
    assert set(config.architecture()) - set(plain.architecture()) == set(FAMILY_DEFAULTS)
    assert "family" not in plain.architecture()  # configurations written before families keep their identity


@pytest.mark.parametrize("field, value, message", [
    ("family", "gpt2", "family must be one of"),
    ("sliding_window", 0, "sliding_window must be a positive integer"),
    ("rope_scaling", ("yarn", 2.0), "rope_scaling must be None or (type, ...)"),
    ("rope_scaling", ("llama3", 8.0, 1.0), "rope_scaling 'llama3' takes"),
    ("rope_scaling", ("llama3", 8.0, 2.0, 2.0, 32.0), "must differ"),
    ("qk_norm", 1, "qk_norm must be a bool"),
])
def test_family_fields_are_checked(field, value, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        TransformerConfig(**REQUIRED, **{field: value})


def test_to_dict_is_a_copy():
    config = TransformerConfig(**REQUIRED)
    data = config.to_dict()
    data["model_width"] = 999
    assert config.model_width == 16


def test_unknown_field_rejected_by_name():
    data = {**TransformerConfig(**REQUIRED).to_dict(), "hidden_act": "silu", "zz_extra": 1}
    with pytest.raises(ValueError, match="unknown TransformerConfig fields: hidden_act, zz_extra"):
        TransformerConfig.from_dict(data)


def test_from_dict_validates_values():
    data = {**TransformerConfig(**REQUIRED).to_dict(), "loss_route": "nope"}
    with pytest.raises(ValueError, match="loss_route"):
        TransformerConfig.from_dict(data)


def test_config_is_frozen():
    config = TransformerConfig(**REQUIRED)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.model_width = 32


def test_architecture_excludes_execution_options():
    a = TransformerConfig(**REQUIRED)
    b = TransformerConfig(**REQUIRED, attention_algorithm="tiled", loss_route="kt_tape_flce",
                          activation_checkpointing="blocks", initializer_seed=9)
    assert a.architecture() == b.architecture()
    assert a.architecture() != TransformerConfig(**REQUIRED, tie_embeddings=True).architecture()
    assert "attention_algorithm" not in a.architecture()
