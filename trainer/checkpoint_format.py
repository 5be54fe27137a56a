"""The `.riftckpt` format's constants and errors, the array layouts a configuration implies, member names, the checkpoint id, and the field checks every refusal is phrased by."""

import json
import math
import re

from trainer import jsonio
from trainer.config import TransformerConfig
from trainer.jsonio import canonical_bytes, check_depth, content_sha256
from trainer.lora import ATTENTION, LoraConfig
from trainer.training import SourceStateError, random_state_from_json

SCHEMA = "kiln.riftckpt"
FORMAT_VERSION = 2  # written by save(); load() also reads version 1
READABLE_VERSIONS = (1, 2)
MANIFEST = "manifest.json"
MAX_MANIFEST_BYTES = 64 << 20  # names, shapes and digests only: a real manifest is kilobytes
MAX_MANIFEST_DEPTH = jsonio.MAX_DEPTH  # manifest.json nesting; real ones nest 6 deep, deepcopy recurses per level
MAX_INFLATION = 16  # declared bytes per byte on disk; save() writes 1, float data deflates < 2x
MAX_INT = 2 ** 63 - 1  # every count, size and step fits a signed 64-bit integer
MAX_DIMENSIONS = 8  # array ranks; the format's arrays have 1 or 2
EXACT_POWER_STEPS = 1_000_000  # up to here beta powers are recomputed bit for bit (~0.1 s)
ZIP_TIMESTAMP = (1980, 1, 1, 0, 0, 0)  # the earliest ZIP date, fixed so equal state gives equal bytes
ZIP64_THRESHOLD = 1 << 31  # members this large need ZIP64 headers, decided before writing
BUILTIN_SOURCE_KINDS = ("RandomWindowBatchSource", "SequenceWindowBatchSource",
                        "ExampleWindowBatchSource")

_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]*\Z")  # a parameter name, safe inside a member path
_HEX64 = re.compile(r"[0-9a-f]{64}\Z")
_MOMENTS = ("first_moment", "second_moment")
_DTYPES = {"<f4": ("float32", 4), "|u1": ("uint8", 1)}  # numpy dtype: (manifest dtype, bytes)
_HYPERPARAMETERS = ("learning_rate", "beta1", "beta2", "epsilon", "weight_decay")
_ARCHITECTURE = ("vocabulary_size", "maximum_context", "model_width", "head_count", "block_count",
                 "feed_forward_width", "kv_head_count", "head_size", "rope_theta",
                 "norm_epsilon", "tie_embeddings")
_POLICIES = ("attention_algorithm", "activation_checkpointing")
_SIZES = ("vocabulary_size", "maximum_context", "model_width", "head_count", "block_count",
          "feed_forward_width", "kv_head_count", "head_size", "attention_block_size",
          "loss_chunk_tokens")  # TransformerConfig's integer sizes
# every other TransformerConfig field must match too; only the initial values may differ
_FREE_CONFIG_FIELDS = ("initializer_seed",)
_LORA_IDENTITY = ("rank", "alpha", "targets", "use_rslora")  # LoraConfig.shape_identity()
_LORA_FIELDS = _LORA_IDENTITY + ("initializer_seed",)


class CheckpointError(Exception):
    """A refused capture, save, load or restore; the message names what failed, `code` the kind.

    Codes: "noncanonical_archive" (the ZIP structure is not exactly what save() writes),
    "corrupt_member" (a member's bytes fail its CRC-32 or do not inflate), "zip_bomb" (declared
    sizes the file cannot hold), "unsafe_member" (a hostile member name), "missing_checkpoint",
    "indeterminate_state"; every other refusal is "invalid_checkpoint".
    """
    code = "invalid_checkpoint"

    def __init__(self, message, code=None):
        super().__init__(message)
        if code is not None:
            self.code = code


class IndeterminateStateError(CheckpointError):
    """A restore failed and rolling back failed too: live state is neither old nor new."""
    code = "indeterminate_state"



def parameter_signature(config: TransformerConfig) -> list[tuple[str, tuple]]:
    """[(name, shape)] of the base parameters DecoderOnlyTransformer builds for `config`.

    The plain twin of the model's layout (Hugging Face Llama names and order; Qwen2's q/k/v
    biases and Qwen3's q_norm/k_norm after the attention weights), so an archive can be
    checked without allocating a model; tests compare it with the model.
    """
    C, F, V = config.model_width, config.feed_forward_width, config.vocabulary_size
    H, KV, D = config.head_count, config.kv_heads, config.head_dimension
    signature = [("model.embed_tokens.weight", (V, C))]
    for index in range(config.block_count):
        prefix = f"model.layers.{index}."
        signature += [
            (prefix + "self_attn.q_proj.weight", (H * D, C)),
            (prefix + "self_attn.k_proj.weight", (KV * D, C)),
            (prefix + "self_attn.v_proj.weight", (KV * D, C)),
            (prefix + "self_attn.o_proj.weight", (C, H * D)),
        ]
        if config.attention_bias:
            signature += [(prefix + "self_attn.q_proj.bias", (H * D,)),
                          (prefix + "self_attn.k_proj.bias", (KV * D,)),
                          (prefix + "self_attn.v_proj.bias", (KV * D,))]
        if config.qk_norm:
            signature += [(prefix + "self_attn.q_norm.weight", (D,)), (prefix + "self_attn.k_norm.weight", (D,))]
        signature += [
            (prefix + "mlp.gate_proj.weight", (F, C)),
            (prefix + "mlp.up_proj.weight", (F, C)),
            (prefix + "mlp.down_proj.weight", (C, F)),
            (prefix + "input_layernorm.weight", (C,)),
            (prefix + "post_attention_layernorm.weight", (C,)),
        ]
    signature.append(("model.norm.weight", (C,)))
    if not config.tie_embeddings:
        signature.append(("lm_head.weight", (V, C)))
    return signature


def adapter_signature(config: TransformerConfig, lora: LoraConfig) -> list[tuple[str, tuple]]:
    """[(name, shape)] of the adapters attach_lora(lora) adds, in model.adapter_parameters() order.

    Per block, per target in canonical order: lora_A [r, in], then lora_B [out, r].
    """
    shapes = dict(parameter_signature(config))
    signature = []
    for index in range(config.block_count):
        for target in lora.targets:
            group = "self_attn" if target in ATTENTION else "mlp"
            prefix = f"model.layers.{index}.{group}.{target}"
            out_features, in_features = shapes[prefix + ".weight"]
            signature += [(prefix + ".lora_A.weight", (lora.rank, in_features)),
                          (prefix + ".lora_B.weight", (out_features, lora.rank))]
    return signature


def quantized_signature(config: TransformerConfig) -> list[tuple[str, tuple]]:
    """[(name, shape)] of the Linear weights model.quantize() packs: every block projection."""
    return [(name, shape) for name, shape in parameter_signature(config)
            if name.startswith("model.layers.") and name.endswith("_proj.weight")]


def member_name(section: str, name: str) -> str:
    """The v2 ZIP member of one FP32 array.

    section: "model" (a base parameter), "adapter" (a LoRA matrix), "first_moment" or
    "second_moment" (Adam's moments of whatever the optimizer owns).
    """
    if section in ("model", "adapter"):
        return f"{section}/{name}.f32"
    return f"adam/{section}/{name}.f32"


def v1_member_name(section: str, name: str) -> str:
    folder = {"model": "params", "first_moment": "adam/m", "second_moment": "adam/v"}[section]
    return f"{folder}/{name}.bin"


def checkpoint_id(manifest: dict) -> str:
    """SHA-256 of the canonical JSON of the manifest without its "checkpoint_id" field."""
    return content_sha256(manifest, "checkpoint_id")


def _byte_view(array):
    return memoryview(array).cast("B") if array.size else b""




# -- field checks: every refusal names the field, what it holds and what was expected --------


def _fail(where, problem):
    raise CheckpointError(f"{where}: {problem}")


def _object(value, where, keys):
    if not isinstance(value, dict):
        _fail(where, f"expected an object, got {type(value).__name__}")
    missing, unexpected = sorted(set(keys) - set(value)), sorted(set(value) - set(keys))
    if missing or unexpected:
        _fail(where, f"fields do not match the format: missing {missing}, unexpected {unexpected}")
    return value


def _integer(value, where, minimum=0):
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        _fail(where, f"expected an integer >= {minimum}, got {value!r}")
    if value > MAX_INT:
        _fail(where, f"expected an integer <= {MAX_INT} (64 bits), got {value!r}")
    return value


def _real(value, where):
    if isinstance(value, bool) or not isinstance(value, float) or not math.isfinite(value):
        _fail(where, f"expected a finite float, got {value!r}")
    return value


def _plain_json(value, where):
    """`value` must survive a JSON round trip unchanged (dict/list/str/int/float/bool/None)."""
    try:
        again = json.loads(canonical_bytes(value))
    except (TypeError, ValueError, RecursionError) as error:
        _fail(where, f"must be plain JSON data: {error}")
    if again != value or canonical_bytes(again) != canonical_bytes(value):
        _fail(where, "must be plain JSON data (objects with string keys, lists, strings, "
                     "numbers, booleans, null); a JSON round trip changed it")
    return again


def _random_state(value, where):
    try:
        return random_state_from_json(value)
    except (SourceStateError, TypeError, ValueError) as error:
        _fail(where, f"invalid Python random state: {error}")


def _source_state(value, where):
    """A batch-source state: a JSON object; the built-in protocol's fields are checked."""
    if not isinstance(value, dict):
        _fail(where, f"expected a JSON object, got {type(value).__name__}")
    builtin = value.get("kind") in BUILTIN_SOURCE_KINDS
    if builtin:
        missing = sorted({"fingerprint", "emitted_batches", "random_state"} - set(value))
        if missing:
            _fail(where, f"a {value['kind']} state needs {missing}")
    if "fingerprint" in value and (not isinstance(value["fingerprint"], str)
                                   or not _HEX64.match(value["fingerprint"])):
        _fail(where + ".fingerprint",
              f"expected 64 lowercase hex digits (SHA-256), got {value['fingerprint']!r}")
    for key in ("emitted_batches", "epoch", "position"):
        if key in value:
            _integer(value[key], f"{where}.{key}")
    if "order" in value:  # the epoch-ordered sources' permutation: integers only
        order = value["order"]
        if not isinstance(order, list) or any(isinstance(i, bool) or not isinstance(i, int)
                                              for i in order):
            _fail(where + ".order", "expected a list of integer item indices")
    if "random_state" in value:
        _random_state(value["random_state"], where + ".random_state")
    return value


def _check_hyperparameters(value, where):
    _object(value, where, _HYPERPARAMETERS)
    for key in _HYPERPARAMETERS:
        _real(value[key], f"{where}.{key}")
    for key in ("beta1", "beta2"):
        if not 0.0 <= value[key] < 1.0:
            _fail(f"{where}.{key}", f"must lie in [0, 1), got {value[key]!r}")
    if value["learning_rate"] < 0.0:
        _fail(f"{where}.learning_rate", f"must be >= 0, got {value['learning_rate']!r}")
    if not value["epsilon"] > 0.0:
        _fail(f"{where}.epsilon", f"must be > 0, got {value['epsilon']!r}")
    if value["weight_decay"] < 0.0:
        _fail(f"{where}.weight_decay", f"must be >= 0, got {value['weight_decay']!r}")


def _check_beta_power(power, beta, step, where):
    """Adam multiplies its power by beta once per step, starting from 1.0."""
    _real(power, where)
    if step <= EXACT_POWER_STEPS:
        expected = 1.0
        for _ in range(step):
            expected *= beta
            if expected == 0.0:
                break
        if power != expected:
            _fail(where, f"is {power!r}, but {step} Adam steps with beta {beta!r} give {expected!r}")
    else:  # the product's rounding error grows at most ~step ulps
        expected = beta ** step
        if not math.isclose(power, expected, rel_tol=4 * step * 2.0 ** -53, abs_tol=2.0 ** -1000):
            _fail(where, f"is {power!r}, but {step} Adam steps with beta {beta!r} give about "
                         f"{expected!r}")


def _config(value, where):
    if not isinstance(value, dict):
        _fail(where, f"expected an object, got {type(value).__name__}")
    for key in _SIZES:  # signatures multiply them; a product must print in an error message
        size = value.get(key)
        if isinstance(size, int) and not isinstance(size, bool) and size > MAX_INT:
            _fail(f"{where}.{key}", f"exceeds {MAX_INT}")
    try:
        return TransformerConfig.from_dict(value)
    except (TypeError, ValueError) as error:
        _fail(where, f"not a valid TransformerConfig: {error}")


def _check_depth(value, where):
    """Refuse JSON nested deeper than MAX_MANIFEST_DEPTH, without recursing."""
    try:
        check_depth(value, MAX_MANIFEST_DEPTH)
    except ValueError as error:
        _fail(where, str(error))


def _check_block_count(config, entries, where):
    """Each block lists FP32 arrays (weights or norms), so block_count cannot exceed the list.

    Checked before any signature is built: a hostile block_count must not cost memory or time.
    where: the prefix of the "config" and "parameters" fields.
    """
    if not isinstance(entries, list):
        _fail(where + "parameters", f"expected a list, got {type(entries).__name__}")
    if config.block_count > len(entries):
        _fail(where + "config.block_count", f"is {config.block_count}, but the archive lists only "
                                            f"{len(entries)} FP32 parameters")


def _check_parameter_list(entries, expected, where, against="model.config"):
    """Archived (name, shape) pairs must be exactly `expected`, the layout `against` implies."""
    got = [(e["name"], tuple(e["shape"])) for e in entries]
    if got == expected:
        return
    got_names, expected_names = [n for n, _ in got], [n for n, _ in expected]
    missing = [n for n in expected_names if n not in got_names]
    unexpected = [n for n in got_names if n not in expected_names]
    if missing or unexpected:
        _fail(where, f"parameter names do not match {against}: missing {missing[:5]}, "
                     f"unexpected {unexpected[:5]}")
    if got_names != expected_names:
        _fail(where, "parameters are not in the model's order")
    for (name, shape), (_, want) in zip(got, expected):
        if shape != want:
            _fail(f"{where}[{name}]", f"shape {list(shape)} does not match {against} {list(want)}")
