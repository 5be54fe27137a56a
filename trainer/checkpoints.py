"""TrainingCheckpoint: the exact, versioned .riftckpt archive of one Adam run.

A run is dense FP32 full-parameter training, LoRA (an adapter-only Adam over a frozen
FP32 base) or QLoRA (the same over packed NF4 Linear bases). A checkpoint holds
everything that decides the next step: the model configuration and execution policies,
every FP32 base parameter by name, the LoRA configuration and adapter values, the exact
packed NF4 nibbles and scales of each quantized weight, Adam's hyperparameters, step,
beta powers and both moments, the global step, the process-wide Python random state, the
batch source's checkpoint state and user metadata. On disk it is a ZIP with one
canonical `manifest.json` and one raw little-endian member per array; nothing is pickled.
Loading validates the whole archive before it returns, and `restore()` validates
compatibility before it changes anything, then commits transactionally (batch source,
FP32 base, packed bases, adapters, Adam, Python random state) and rolls back in reverse
order on failure. A packed base is never dequantized. The format is described in
docs/checkpoints.md.
"""

import copy
import hashlib
import json
import math
import os
import random
import re
import secrets
import zipfile
import zlib
from collections import Counter
from dataclasses import dataclass, fields

import numpy as np

from trainer.config import TransformerConfig
from trainer.lora import ATTENTION, LoraConfig
from trainer.training import SourceStateError, random_state_from_json, random_state_to_json

SCHEMA = "kiln.riftckpt"
FORMAT_VERSION = 2  # written by save(); load() also reads version 1
READABLE_VERSIONS = (1, 2)
MANIFEST = "manifest.json"
MAX_MANIFEST_BYTES = 64 << 20  # names, shapes and digests only: a real manifest is kilobytes
MAX_MANIFEST_DEPTH = 64  # manifest.json nesting; real ones nest 6 deep, deepcopy recurses per level
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
    """A refused capture, save, load or restore; the message names what failed."""


class IndeterminateStateError(CheckpointError):
    """A restore failed and rolling back failed too: live state is neither old nor new."""


@dataclass(frozen=True)
class RestoreResult:
    checkpoint_id: str
    format_version: int  # the version of the archive the checkpoint was read from
    global_step: int
    optimizer_step: int
    metadata: dict


def parameter_signature(config: TransformerConfig) -> list[tuple[str, tuple]]:
    """[(name, shape)] of the base parameters DecoderOnlyTransformer builds for `config`.

    The plain twin of the model's layout (Hugging Face Llama names and order), so an
    archive can be checked without allocating a model; tests compare it with the model.
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
    content = {k: v for k, v in manifest.items() if k != "checkpoint_id"}
    return hashlib.sha256(_canonical_json(content)).hexdigest()


def _byte_view(array):
    return memoryview(array).cast("B") if array.size else b""


def _canonical_json(value) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                      allow_nan=False).encode("ascii")


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
        again = json.loads(_canonical_json(value))
    except (TypeError, ValueError, RecursionError) as error:
        _fail(where, f"must be plain JSON data: {error}")
    if again != value or _canonical_json(again) != _canonical_json(value):
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
    pending = [(value, 1)]
    while pending:
        item, depth = pending.pop()
        if depth > MAX_MANIFEST_DEPTH:
            _fail(where, f"nests deeper than {MAX_MANIFEST_DEPTH} levels")
        children = item.values() if isinstance(item, dict) else \
            item if isinstance(item, list) else ()
        pending.extend((child, depth + 1) for child in children
                       if isinstance(child, (dict, list)))


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


def _check_member_entry(entry, where, member, dtype, shape=None, named=False):
    """One array member's entry: its shape, dtype, canonical member path, bytes and sha256."""
    _object(entry, where, (("name",) if named else ()) + ("shape", "dtype", "member", "bytes",
                                                          "sha256"))
    if not isinstance(entry["shape"], list) or len(entry["shape"]) > MAX_DIMENSIONS:
        _fail(where + ".shape", f"expected a list of at most {MAX_DIMENSIONS} sizes, got "
                                f"{entry['shape']!r}")
    for size in entry["shape"]:
        _integer(size, where + ".shape", minimum=1)
    if shape is not None and entry["shape"] != list(shape):
        _fail(where + ".shape", f"is {entry['shape']}, but the weight's shape and block sizes "
                                f"give {list(shape)}")
    if entry["dtype"] != _DTYPES[dtype][0]:
        _fail(where + ".dtype", f"only {_DTYPES[dtype][0]} is supported here, got "
                                f"{entry['dtype']!r}")
    if entry["member"] != member:
        _fail(where + ".member", f"is {entry['member']!r}, the format requires {member!r}")
    nbytes = _DTYPES[dtype][1] * math.prod(entry["shape"])
    if entry["bytes"] != nbytes:
        _fail(where + ".bytes", f"is {entry['bytes']!r}, but {entry['shape']} {_DTYPES[dtype][0]} "
                                f"elements take {nbytes}")
    if not isinstance(entry["sha256"], str) or not _HEX64.match(entry["sha256"]):
        _fail(where + ".sha256", f"expected 64 lowercase hex digits, got {entry['sha256']!r}")


def _check_array_entries(entries, where, section):
    """A v2 FP32 array list: name, shape, dtype, member, bytes and sha256 of each array."""
    if not isinstance(entries, list):
        _fail(where, f"expected a list, got {type(entries).__name__}")
    seen = set()
    for index, entry in enumerate(entries):
        at = f"{where}[{index}]"
        _object(entry, at, ("name", "shape", "dtype", "member", "bytes", "sha256"))
        name = entry["name"]
        if not isinstance(name, str) or not _NAME.match(name) or ".." in name:
            _fail(at + ".name", f"not a valid parameter name: {name!r}")
        if name in seen:
            _fail(at + ".name", f"duplicate parameter {name!r}")
        seen.add(name)
        _check_member_entry(entry, at, member_name(section, name), "<f4", named=True)


def _lora_config(value, where):
    """The adapter section's LoRA configuration, in the canonical form capture writes."""
    _object(value, where, _LORA_FIELDS)
    _real(value["alpha"], where + ".alpha")
    try:
        lora = LoraConfig.from_dict(value)
    except (TypeError, ValueError) as error:
        _fail(where, f"not a valid LoraConfig: {error}")
    if value != _lora_json(lora):
        _fail(where + ".targets", f"must be listed in canonical projection order "
                                  f"{list(lora.targets)}, got {value['targets']!r}")
    return lora


def _lora_json(lora):
    return {**lora.to_dict(), "alpha": float(lora.alpha)}


def _validate_manifest(manifest):
    """Every semantic check of a v2 manifest (v1 archives are converted first).

    Returns (TransformerConfig, LoraConfig or None).
    """
    where = MANIFEST
    _object(manifest, where, ("schema", "format_version", "checkpoint_id", "model", "policies",
                              "optimizer", "adapter", "quantization", "training", "source",
                              "metadata"))
    _check_depth(manifest, where)
    model = _object(manifest["model"], f"{where}: model", ("config", "parameters"))
    config = _config(model["config"], f"{where}: model.config")
    _check_block_count(config, model["parameters"], f"{where}: model.")
    policies = _object(manifest["policies"], f"{where}: policies", _POLICIES)
    for key in policies:
        if policies[key] != getattr(config, key):
            _fail(f"{where}: policies.{key}", f"is {policies[key]!r} but model.config has "
                                              f"{getattr(config, key)!r}")
    lora = None
    if manifest["adapter"] is not None:
        adapter = _object(manifest["adapter"], f"{where}: adapter",
                          ("type", "config", "parameters"))
        if adapter["type"] != "lora":
            _fail(f"{where}: adapter.type", f"only 'lora' is supported, got {adapter['type']!r}")
        lora = _lora_config(adapter["config"], f"{where}: adapter.config")
        _check_array_entries(adapter["parameters"], f"{where}: adapter.parameters", "adapter")
        _check_parameter_list(adapter["parameters"], adapter_signature(config, lora),
                              f"{where}: adapter.parameters", "model.config and adapter.config")
    dense_signature = parameter_signature(config)
    if manifest["quantization"] is not None:
        if lora is None:
            _fail(f"{where}: quantization", "a quantized (NF4) base is frozen, so the archive "
                                            "needs a LoRA adapter section; adapter is null")
        packed = _validate_quantization(manifest["quantization"], config,
                                        f"{where}: quantization")
        dense_signature = [(n, s) for n, s in dense_signature if n not in packed]
    _check_array_entries(model["parameters"], f"{where}: model.parameters", "model")
    _check_parameter_list(model["parameters"], dense_signature, f"{where}: model.parameters")
    adam = _object(manifest["optimizer"], f"{where}: optimizer",
                   ("type", "parameters", "hyperparameters", "step", "beta1_power",
                    "beta2_power") + _MOMENTS)
    if adam["type"] != "Adam":
        _fail(f"{where}: optimizer.type", f"only 'Adam' is supported, got {adam['type']!r}")
    owned = "base" if lora is None else "adapter"
    if adam["parameters"] != owned:
        _fail(f"{where}: optimizer.parameters", f"is {adam['parameters']!r}, but with adapter "
                                                f"{'null' if lora is None else 'present'} Adam "
                                                f"owns {owned!r} parameters")
    hyper = adam["hyperparameters"]
    _check_hyperparameters(hyper, f"{where}: optimizer.hyperparameters")
    step = _integer(adam["step"], f"{where}: optimizer.step")
    _check_beta_power(adam["beta1_power"], hyper["beta1"], step, f"{where}: optimizer.beta1_power")
    _check_beta_power(adam["beta2_power"], hyper["beta2"], step, f"{where}: optimizer.beta2_power")
    trained = model["parameters"] if lora is None else manifest["adapter"]["parameters"]
    signature = [(e["name"], e["shape"]) for e in trained]
    for key in _MOMENTS:
        _check_array_entries(adam[key], f"{where}: optimizer.{key}", key)
        if [(e["name"], e["shape"]) for e in adam[key]] != signature:
            trained_by = "model" if lora is None else "adapter"
            _fail(f"{where}: optimizer.{key}",
                  f"names and shapes must equal {trained_by}.parameters")
    training = _object(manifest["training"], f"{where}: training",
                       ("global_step", "python_random_state"))
    _integer(training["global_step"], f"{where}: training.global_step")
    _random_state(training["python_random_state"], f"{where}: training.python_random_state")
    if manifest["source"] is not None:
        source = _object(manifest["source"], f"{where}: source", ("state",))
        _source_state(source["state"], f"{where}: source.state")
    if not isinstance(manifest["metadata"], dict):
        _fail(f"{where}: metadata", f"expected an object, got {type(manifest['metadata']).__name__}")
    return config, lora


def _fp32_entries(section, mapping, arrays):
    """Array entries of {name: array} in `section`; adds the read-only arrays to `arrays`."""
    entries = []
    for name, value in mapping.items():
        array = np.ascontiguousarray(value, dtype="<f4")  # callers pass arrays they own
        array.flags.writeable = False
        member = member_name(section, name)
        arrays[member] = array
        entries.append({"name": name, **_member_entry(member, array)})
    return entries


def _member_entry(member, array):
    return {"shape": list(array.shape), "dtype": _DTYPES[array.dtype.str][0], "member": member,
            "bytes": array.nbytes, "sha256": hashlib.sha256(_byte_view(array)).hexdigest()}


def _build_manifest(*, config, values, adam, global_step, random_state, source_state, metadata,
                    lora=None, adapters=None, packed=None):
    """The v2 manifest and {member: read-only little-endian array} of one state.

    values: the FP32 base parameters (without packed ones); lora/adapters: the LoRA
    configuration and {name: value} when an adapter is attached; packed: {name: NF4
    tensor} when the Linear bases are quantized.
    """
    arrays = {}
    model_entries = _fp32_entries("model", values, arrays)
    adapter = None
    if lora is not None:
        adapter = {"type": "lora", "config": _lora_json(lora),
                   "parameters": _fp32_entries("adapter", adapters, arrays)}
    quantization = None if packed is None else _quantization_section(packed, arrays)
    moments = {key: _fp32_entries(key, adam[key], arrays) for key in _MOMENTS}
    manifest = {
        "schema": SCHEMA,
        "format_version": FORMAT_VERSION,
        "model": {"config": config.to_dict(), "parameters": model_entries},
        "policies": {key: getattr(config, key) for key in _POLICIES},
        "optimizer": {"type": "Adam", "parameters": "base" if lora is None else "adapter",
                      "hyperparameters": dict(adam["hyperparameters"]), "step": adam["step"],
                      "beta1_power": adam["beta1_power"], "beta2_power": adam["beta2_power"],
                      **moments},
        "adapter": adapter,  # null for dense full-parameter training
        "quantization": quantization,  # null unless the Linear bases are packed NF4
        "training": {"global_step": global_step, "python_random_state": random_state},
        "source": None if source_state is None else {"state": source_state},
        "metadata": metadata,
    }
    manifest = json.loads(_canonical_json(manifest))  # exactly what a reader will parse
    manifest["checkpoint_id"] = checkpoint_id(manifest)
    return manifest, arrays


def _array_entries(manifest):
    """(entry, numpy dtype) of every array member, in archive order."""
    listed = [(e, "<f4") for e in manifest["model"]["parameters"]]
    if manifest["adapter"] is not None:
        listed += [(e, "<f4") for e in manifest["adapter"]["parameters"]]
    if manifest["quantization"] is not None:
        listed += _packed_entries(manifest["quantization"])
    listed += [(e, "<f4") for key in _MOMENTS for e in manifest["optimizer"][key]]
    return listed


def _nf4_member(name, part):
    """The ZIP member of one part of a packed weight: packed.u8, absmax.f32,
    absmax_codes.u8 or absmax_scales.f32."""
    return f"nf4/{name}/{part}"


def _validate_quantization(section, config, where):
    """The packed NF4 weights: every size follows from the weight's shape and block sizes.

    Returns the set of packed weight names.
    """
    from trainer.quantization import ABSMAX_BLOCK_SIZE, BLOCK_SIZES

    _object(section, where, ("type", "weights"))
    if section["type"] != "nf4":
        _fail(f"{where}.type", f"only 'nf4' is supported, got {section['type']!r}")
    weights = section["weights"]
    if not isinstance(weights, list):
        _fail(f"{where}.weights", f"expected a list, got {type(weights).__name__}")
    for index, weight in enumerate(weights):
        at = f"{where}.weights[{index}]"
        _object(weight, at, ("name", "shape", "block_size", "packed", "absmax",
                             "double_quantization"))
        name = weight["name"]
        if not isinstance(name, str) or not _NAME.match(name) or ".." in name:
            _fail(at + ".name", f"not a valid parameter name: {name!r}")
        if not isinstance(weight["shape"], list) or not 1 <= len(weight["shape"]) <= MAX_DIMENSIONS:
            _fail(at + ".shape", f"expected a list of 1 to {MAX_DIMENSIONS} sizes, got "
                                 f"{weight['shape']!r}")
        for size in weight["shape"]:
            _integer(size, at + ".shape", minimum=1)
        block_size = weight["block_size"]
        if isinstance(block_size, bool) or block_size not in BLOCK_SIZES:
            _fail(at + ".block_size", f"must be one of {BLOCK_SIZES}, got {block_size!r}")
        n = math.prod(weight["shape"])
        blocks = -(-n // block_size)
        _check_member_entry(weight["packed"], at + ".packed", _nf4_member(name, "packed.u8"),
                            "|u1", [(n + 1) // 2])
        if (weight["absmax"] is None) == (weight["double_quantization"] is None):
            _fail(at, "needs exactly one of absmax (FP32 scales) and double_quantization")
        if weight["absmax"] is not None:
            _check_member_entry(weight["absmax"], at + ".absmax", _nf4_member(name, "absmax.f32"),
                                "<f4", [blocks])
            continue
        double = _object(weight["double_quantization"], at + ".double_quantization",
                         ("block_size", "offset", "codes", "scales"))
        if double["block_size"] != ABSMAX_BLOCK_SIZE or isinstance(double["block_size"], bool):
            _fail(at + ".double_quantization.block_size",
                  f"must be {ABSMAX_BLOCK_SIZE}, got {double['block_size']!r}")
        offset = _real(double["offset"], at + ".double_quantization.offset")
        if float(np.float32(offset)) != offset:
            _fail(at + ".double_quantization.offset", f"{offset!r} is not a float32 value")
        _check_member_entry(double["codes"], at + ".double_quantization.codes",
                            _nf4_member(name, "absmax_codes.u8"), "|u1", [blocks])
        _check_member_entry(double["scales"], at + ".double_quantization.scales",
                            _nf4_member(name, "absmax_scales.f32"), "<f4",
                            [-(-blocks // ABSMAX_BLOCK_SIZE)])
    _check_parameter_list(weights, quantized_signature(config), f"{where}.weights",
                          "model.config (model.quantize() packs every block projection)")
    return {weight["name"] for weight in weights}


def _packed_entries(section):
    """(entry, numpy dtype) of each packed weight's members, in archive order."""
    listed = []
    for weight in section["weights"]:
        listed.append((weight["packed"], "|u1"))
        if weight["absmax"] is not None:
            listed.append((weight["absmax"], "<f4"))
        else:
            double = weight["double_quantization"]
            listed += [(double["codes"], "|u1"), (double["scales"], "<f4")]
    return listed


def _quantization_section(packed, arrays):
    """The manifest section of {name: NF4Tensor}; adds copies of their arrays to `arrays`."""
    weights = []
    for name, tensor in packed.items():
        def part(member_part, array, dtype):
            array = np.array(array, dtype=dtype)  # a copy the checkpoint owns
            array.flags.writeable = False
            member = _nf4_member(name, member_part)
            arrays[member] = array
            return _member_entry(member, array)

        entry = {"name": name, "shape": list(tensor.shape), "block_size": int(tensor.block_size),
                 "packed": part("packed.u8", tensor.packed, "|u1"), "absmax": None,
                 "double_quantization": None}
        if tensor.double_quantized:
            entry["double_quantization"] = {
                "block_size": int(tensor.absmax_block_size), "offset": float(tensor.offset),
                "codes": part("absmax_codes.u8", tensor.absmax_codes, "|u1"),
                "scales": part("absmax_scales.f32", tensor.absmax_scales, "<f4")}
        else:
            entry["absmax"] = part("absmax.f32", tensor.absmax, "<f4")
        weights.append(entry)
    return {"type": "nf4", "weights": weights}


def _nf4_tensors(section, arrays):
    """{name: NF4Tensor} over the archived read-only arrays: no copy, no dequantization."""
    from trainer.quantization import NF4Tensor

    tensors = {}
    for weight in section["weights"]:
        parts = {"absmax": None if weight["absmax"] is None else arrays[weight["absmax"]["member"]]}
        double = weight["double_quantization"]
        if double is not None:
            parts = {"absmax_codes": arrays[double["codes"]["member"]],
                     "absmax_scales": arrays[double["scales"]["member"]],
                     "offset": np.float32(double["offset"]),
                     "absmax_block_size": double["block_size"]}
        tensors[weight["name"]] = NF4Tensor(arrays[weight["packed"]["member"]],
                                            tuple(weight["shape"]), weight["block_size"], **parts)
    return tensors


def _check_packed_contents(section, arrays, where):
    """Scales are finite and non-negative (a block's absmax), and each weight forms an NF4Tensor."""
    for weight in section["weights"]:
        if weight["absmax"] is not None:
            entry, what = weight["absmax"], "absmax"
        else:
            entry, what = weight["double_quantization"]["scales"], "second-level absmax scales"
        values = arrays[entry["member"]]
        if not np.all(np.isfinite(values)):
            raise CheckpointError(f"{where}: {entry['member']!r}: the {what} of "
                                  f"{weight['name']} have non-finite entries")
        if np.any(values < 0):
            raise CheckpointError(f"{where}: {entry['member']!r}: the {what} of "
                                  f"{weight['name']} have negative entries")
    try:
        _nf4_tensors(section, arrays)
    except (TypeError, ValueError) as error:
        raise CheckpointError(f"{where}: quantization: not a valid NF4 tensor: {error}") from error


# -- reading archives --------------------------------------------------------------------------


def _reject_duplicate_keys(pairs):
    result = {}
    for key, value in pairs:
        if key in result:
            raise CheckpointError(f"{MANIFEST}: duplicate key {key!r}")
        result[key] = value
    return result


def _reject_constant(name):
    raise CheckpointError(f"{MANIFEST}: {name} is not valid JSON")


def _finite_float(text):
    value = float(text)
    if not math.isfinite(value):  # 1e999 parses to inf, which no manifest may hold
        raise ValueError(f"number {text[:24]} overflows a double")
    return value


def _open_archive(path):
    try:
        archive = zipfile.ZipFile(path, "r")
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path} does not exist") from None
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, EOFError, ValueError,
            NotImplementedError) as error:  # NotImplementedError: a damaged "version needed"
        raise CheckpointError(f"checkpoint {path} is not a complete ZIP archive (truncated or "
                              f"corrupt): {error}") from error
    try:
        infos = archive.infolist()
        counts = Counter(info.filename for info in infos)  # linear: archives may list many
        duplicated = sorted(name for name, count in counts.items() if count > 1)
        if duplicated:
            raise CheckpointError(f"checkpoint {path}: duplicate members {duplicated[:5]}")
        on_disk = os.fstat(archive.fp.fileno()).st_size
        for info in infos:
            name = info.filename
            parts = name.split("/")
            if name.startswith("/") or "\\" in name or any(p in ("", ".", "..") for p in parts) \
                    or ":" in name or "\x00" in info.orig_filename:
                raise CheckpointError(f"checkpoint {path}: unsafe member name "
                                      f"{info.orig_filename!r}")
            if info.flag_bits & 0x1:
                raise CheckpointError(f"checkpoint {path}: member {name!r} is encrypted")
            if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
                raise CheckpointError(f"checkpoint {path}: member {name!r} uses unsupported "
                                      f"compression {info.compress_type}")
            if info.compress_size > on_disk or (info.compress_type == zipfile.ZIP_STORED
                                                and info.file_size != info.compress_size):
                raise CheckpointError(f"checkpoint {path}: member {name!r} declares "
                                      f"{info.file_size} bytes stored in {info.compress_size}, "
                                      f"which the {on_disk}-byte archive cannot hold")
        declared = sum(info.file_size for info in infos)
        if declared > MAX_INFLATION * on_disk:  # a zip bomb: refused before anything inflates
            raise CheckpointError(f"checkpoint {path}: its members declare {declared} bytes, more "
                                  f"than {MAX_INFLATION} times the {on_disk} bytes of the archive")
    except BaseException:
        archive.close()
        raise
    return archive


def _read_member(archive, path, name):
    try:
        return archive.read(name)
    except (KeyError, zipfile.BadZipFile, OSError, EOFError, ValueError, RuntimeError,
            zlib.error) as error:
        raise CheckpointError(f"checkpoint {path}: member {name!r} is corrupt: {error}") from error


def _read_manifest(archive, path):
    try:
        info = archive.getinfo(MANIFEST)
    except KeyError:
        raise CheckpointError(f"checkpoint {path}: missing member {MANIFEST!r}") from None
    if info.file_size > MAX_MANIFEST_BYTES:
        raise CheckpointError(f"checkpoint {path}: {MANIFEST} is {info.file_size} bytes, more "
                              f"than the {MAX_MANIFEST_BYTES} allowed")
    data = _read_member(archive, path, MANIFEST)
    try:
        manifest = json.loads(data.decode("utf-8"), object_pairs_hook=_reject_duplicate_keys,
                              parse_constant=_reject_constant, parse_float=_finite_float)
    except (UnicodeDecodeError, ValueError, RecursionError) as error:
        raise CheckpointError(f"checkpoint {path}: {MANIFEST} is not valid UTF-8 JSON: {error}") \
            from error
    try:
        _check_depth(manifest, MANIFEST)  # before anything walks it recursively
    except CheckpointError as error:
        raise CheckpointError(f"checkpoint {path}: {error}") from None
    return manifest


def _check_members(archive, path, expected):
    """expected: {member: bytes}. Exact member set and sizes, before any array is read."""
    present = {info.filename: info for info in archive.infolist()}
    missing = sorted(set(expected) - set(present))
    unexpected = sorted(set(present) - set(expected))
    if missing:
        raise CheckpointError(f"checkpoint {path}: missing member(s) {missing[:5]}"
                              f"{' ...' if len(missing) > 5 else ''}")
    if unexpected:
        raise CheckpointError(f"checkpoint {path}: unexpected member(s) {unexpected[:5]}"
                              f"{' ...' if len(unexpected) > 5 else ''}")
    for name, size in expected.items():
        info = present[name]
        if name != MANIFEST and info.file_size != size:
            raise CheckpointError(f"checkpoint {path}: member {name!r} has {info.file_size} "
                                  f"bytes, the manifest says {size}")


def _read_array(archive, path, member, shape, sha256, dtype="<f4"):
    data = _read_member(archive, path, member)
    nbytes = _DTYPES[dtype][1] * math.prod(shape)
    if len(data) != nbytes:
        raise CheckpointError(f"checkpoint {path}: member {member!r} has {len(data)} bytes, "
                              f"the manifest says {nbytes}")
    digest = hashlib.sha256(data).hexdigest()
    if digest != sha256:
        raise CheckpointError(f"checkpoint {path}: member {member!r} fails its checksum: "
                              f"sha256 {digest}, the manifest says {sha256}")
    array = np.frombuffer(data, dtype=dtype).reshape(shape)  # read-only, over the bytes
    return array


def _check_contents(manifest, arrays, where):
    """Checks on array values: non-negative second moments, well-formed packed NF4 bases."""
    for entry in manifest["optimizer"]["second_moment"]:
        if np.any(arrays[entry["member"]] < 0):
            raise CheckpointError(f"{where}: {entry['member']!r}: Adam's second moment has "
                                  f"negative entries")
    if manifest["quantization"] is not None:
        _check_packed_contents(manifest["quantization"], arrays, where)


def _load_v2(archive, path, manifest):
    stored_id = manifest.get("checkpoint_id")
    if not isinstance(stored_id, str) or not _HEX64.match(stored_id):
        raise CheckpointError(f"checkpoint {path}: {MANIFEST}: checkpoint_id must be 64 "
                              f"lowercase hex digits, got {stored_id!r}")
    computed = checkpoint_id(manifest)
    if computed != stored_id:
        raise CheckpointError(f"checkpoint {path}: {MANIFEST} does not match its checkpoint_id "
                              f"(stored {stored_id}, content hashes to {computed}); the manifest "
                              f"was modified or damaged")
    try:
        config, lora = _validate_manifest(manifest)
    except CheckpointError as error:
        raise CheckpointError(f"checkpoint {path}: {error}") from None
    listed = _array_entries(manifest)
    _check_members(archive, path, {MANIFEST: None, **{e["member"]: e["bytes"] for e, _ in listed}})
    arrays = {e["member"]: _read_array(archive, path, e["member"], tuple(e["shape"]), e["sha256"],
                                       dtype)
              for e, dtype in listed}
    _check_contents(manifest, arrays, f"checkpoint {path}")
    return config, lora, arrays


V1_KEYS = ("schema", "format_version", "config", "parameters", "optimizer", "global_step",
           "python_random_state", "metadata", "sha256")


def _load_v1(archive, path, manifest):
    """Read a dense v1 archive and convert it to the v2 manifest it would have been."""
    try:
        _object(manifest, MANIFEST, V1_KEYS)
        config = _config(manifest["config"], f"{MANIFEST}: config")
        params = manifest["parameters"]
        if not isinstance(params, list):
            _fail(f"{MANIFEST}: parameters", "expected a list")
        _check_block_count(config, params, f"{MANIFEST}: ")
        for index, entry in enumerate(params):
            _object(entry, f"{MANIFEST}: parameters[{index}]", ("name", "shape"))
            name, shape = entry["name"], entry["shape"]
            if not isinstance(name, str) or not _NAME.match(name) or ".." in name:
                _fail(f"{MANIFEST}: parameters[{index}].name", f"not a valid name: {name!r}")
            if not isinstance(shape, list) or len(shape) > MAX_DIMENSIONS:
                _fail(f"{MANIFEST}: parameters[{index}].shape",
                      f"expected a list of at most {MAX_DIMENSIONS} sizes, got {shape!r}")
            for size in shape:
                _integer(size, f"{MANIFEST}: parameters[{index}].shape", minimum=1)
        _check_parameter_list(params, parameter_signature(config), f"{MANIFEST}: parameters")
        adam = _object(manifest["optimizer"], f"{MANIFEST}: optimizer",
                       ("hyperparameters", "step", "beta1_power", "beta2_power"))
        _check_hyperparameters(adam["hyperparameters"], f"{MANIFEST}: optimizer.hyperparameters")
        _integer(adam["step"], f"{MANIFEST}: optimizer.step")
        _integer(manifest["global_step"], f"{MANIFEST}: global_step")
        _random_state(manifest["python_random_state"], f"{MANIFEST}: python_random_state")
        metadata = manifest["metadata"]
        if not isinstance(metadata, dict):
            _fail(f"{MANIFEST}: metadata", "expected an object")
        digests = manifest["sha256"]
        if not isinstance(digests, dict):
            _fail(f"{MANIFEST}: sha256", "expected an object of member digests")
    except CheckpointError as error:
        raise CheckpointError(f"checkpoint {path}: {error}") from None
    sizes = {}
    for entry in params:
        for section in ("model",) + _MOMENTS:
            sizes[v1_member_name(section, entry["name"])] = 4 * math.prod(entry["shape"])
    if set(digests) != set(sizes):
        raise CheckpointError(f"checkpoint {path}: {MANIFEST}: sha256 must list exactly the "
                              f"array members; missing {sorted(set(sizes) - set(digests))[:5]}, "
                              f"unexpected {sorted(set(digests) - set(sizes))[:5]}")
    for member, digest in digests.items():
        if not isinstance(digest, str) or not _HEX64.match(digest):
            raise CheckpointError(f"checkpoint {path}: {MANIFEST}: sha256[{member!r}] must be 64 "
                                  f"lowercase hex digits")
    _check_members(archive, path, {MANIFEST: None, **sizes})
    values, moments = {}, {key: {} for key in _MOMENTS}
    for entry in params:
        name, shape = entry["name"], tuple(entry["shape"])
        values[name] = _read_array(archive, path, v1_member_name("model", name), shape,
                                   digests[v1_member_name("model", name)])
        for key in _MOMENTS:
            member = v1_member_name(key, name)
            moments[key][name] = _read_array(archive, path, member, shape, digests[member])
    adam_state = {"hyperparameters": adam["hyperparameters"], "step": adam["step"],
                  "beta1_power": adam["beta1_power"], "beta2_power": adam["beta2_power"],
                  **moments}
    v2, arrays = _build_manifest(config=config, values=values, adam=adam_state,
                                 global_step=manifest["global_step"],
                                 random_state=manifest["python_random_state"],
                                 source_state=None, metadata=metadata)
    try:
        _validate_manifest(v2)
    except CheckpointError as error:
        raise CheckpointError(f"checkpoint {path} (format v1): {error}") from None
    for entry in v2["optimizer"]["second_moment"]:
        if np.any(arrays[entry["member"]] < 0):
            raise CheckpointError(f"checkpoint {path}: {v1_member_name('second_moment', entry['name'])!r}:"
                                  f" Adam's second moment has negative entries")
    return config, None, v2, arrays


# -- writing -------------------------------------------------------------------------------


def _zip_info(name):
    info = zipfile.ZipInfo(name, date_time=ZIP_TIMESTAMP)
    info.compress_type = zipfile.ZIP_STORED
    info.create_system = 3  # fixed, whatever the host
    info.external_attr = 0o100644 << 16
    return info


def _fsync_directory(directory):
    if not hasattr(os, "O_DIRECTORY"):  # Windows: directories cannot be opened for fsync
        return
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class TrainingCheckpoint:
    """The exact state of one Adam run (dense, LoRA or QLoRA); build with capture() or load()."""

    def __init__(self, manifest, arrays, config, lora, format_version):
        self._manifest = manifest  # validated v2 manifest, checkpoint_id included
        self._arrays = arrays  # {member: read-only little-endian array}
        self._config = config
        self._lora = lora  # the archived LoraConfig, or None for dense training
        self._format_version = format_version

    # -- read-only view ---------------------------------------------------------------

    @property
    def checkpoint_id(self) -> str:
        return self._manifest["checkpoint_id"]

    @property
    def format_version(self) -> int:
        return self._format_version

    @property
    def config(self) -> TransformerConfig:
        return self._config

    @property
    def lora_config(self) -> LoraConfig | None:
        """The archived LoRA configuration (its initializer seed included), or None."""
        return self._lora

    @property
    def quantized(self) -> bool:
        """Whether the archive holds packed NF4 Linear bases (QLoRA)."""
        return self._manifest["quantization"] is not None

    @property
    def global_step(self) -> int:
        return self._manifest["training"]["global_step"]

    @property
    def optimizer_step(self) -> int:
        return self._manifest["optimizer"]["step"]

    @property
    def metadata(self) -> dict:
        return copy.deepcopy(self._manifest["metadata"])

    @property
    def source_state(self) -> dict | None:
        source = self._manifest["source"]
        return None if source is None else copy.deepcopy(source["state"])

    @property
    def parameter_names(self) -> tuple:
        """The FP32 base parameters' names (packed NF4 weights are listed under quantization)."""
        return tuple(e["name"] for e in self._manifest["model"]["parameters"])

    def manifest(self) -> dict:
        """A copy of the v2 manifest (what save() writes as manifest.json)."""
        return copy.deepcopy(self._manifest)

    def _section(self, section):
        """{name: read-only array} of "model", "adapter", "first_moment" or "second_moment"."""
        if section == "model":
            entries = self._manifest["model"]["parameters"]
        elif section == "adapter":
            entries = self._manifest["adapter"]["parameters"]
        else:
            entries = self._manifest["optimizer"][section]
        return {e["name"]: self._arrays[e["member"]] for e in entries}

    # -- capture --------------------------------------------------------------------------

    @classmethod
    def capture(cls, model, optimizer, *, source, global_step, metadata=None):
        """Copy the state of `model`, its `optimizer` and `source` at a clean step boundary."""
        refused = "capture refused"
        if getattr(optimizer, "model", None) is not model:
            raise CheckpointError(f"{refused}: the optimizer belongs to a different model "
                                  f"instance (optimizer.model is not model)")
        lora = getattr(model, "lora_config", None)
        quantized = getattr(model, "quantization", None) is not None
        _check_optimizer_owns(model, optimizer, lora, refused,
                              "the model has no LoRA adapter" if lora is None
                              else "the model has a LoRA adapter attached")
        if quantized and lora is None:  # quantize() freezes the base; Adam could own nothing
            raise CheckpointError(f"{refused}: the model has a quantized (NF4) base but no LoRA "
                                  f"adapter; attach_lora before training")
        if model.gradient_pending or optimizer.gradient_pending:
            raise CheckpointError(f"{refused}: a gradient is pending; call optimizer.step() "
                                  f"or optimizer.zero_gradients() first (an exactly-zero gradient "
                                  f"is still pending)")
        _integer(global_step, f"{refused}: global_step")
        metadata = {} if metadata is None else metadata
        if not isinstance(metadata, dict):
            raise CheckpointError(f"{refused}: metadata must be a dict, got "
                                  f"{type(metadata).__name__}")
        metadata = _plain_json(metadata, f"{refused}: metadata")
        source_state = None
        if source is not None:
            _check_source_protocol(source, refused)
            try:
                state = source.checkpoint_state()
            except Exception as error:
                raise CheckpointError(f"{refused}: {type(source).__name__}."
                                      f"checkpoint_state() failed: {error}") from error
            source_state = _source_state(_plain_json(state, f"{refused}: source state"),
                                         f"{refused}: source state")
        try:
            values = _fp32_base_state(model)
            adapters = None if lora is None else model.adapter_state_dict()
            packed = None if not quantized else model.packed_state()
            adam = optimizer.state_dict()
        except RuntimeError as error:  # a closed model or optimizer
            raise CheckpointError(f"{refused}: {error}") from error
        names = list(values if lora is None else adapters)
        for key in _MOMENTS:
            if list(adam[key]) != names:
                raise CheckpointError(f"{refused}: Adam's {key} names do not match the model's "
                                      f"{'base' if lora is None else 'adapter'} parameters")
        manifest, arrays = _build_manifest(
            config=model.config, values=values, adam=adam, global_step=global_step,
            random_state=random_state_to_json(random.getstate()), source_state=source_state,
            metadata=metadata, lora=lora, adapters=adapters, packed=packed)
        try:
            config, lora = _validate_manifest(manifest)
            _check_contents(manifest, arrays, refused)
        except CheckpointError as error:
            raise CheckpointError(f"{refused}: {error}") from None
        checkpoint = cls(manifest, arrays, config, lora, FORMAT_VERSION)
        size = len(checkpoint.manifest_bytes())
        if size > MAX_MANIFEST_BYTES:
            raise CheckpointError(f"{refused}: the manifest would be {size} bytes, more than "
                                  f"the {MAX_MANIFEST_BYTES} a reader accepts (large metadata?)")
        return checkpoint

    # -- save and load --------------------------------------------------------------------

    def manifest_bytes(self) -> bytes:
        return json.dumps(self._manifest, sort_keys=True, indent=1, ensure_ascii=True,
                          allow_nan=False).encode("ascii") + b"\n"

    def save(self, path):
        """Write the archive beside `path`, fsync it, then atomically replace `path`."""
        path = os.fspath(path)
        directory = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(directory):
            raise CheckpointError(f"cannot save {path}: directory {directory} does not exist")
        temporary = os.path.join(
            directory, f".{os.path.basename(path)}.{os.getpid()}.{secrets.token_hex(6)}.tmp")
        try:
            fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL
                         | getattr(os, "O_BINARY", 0), 0o666)
            try:
                with os.fdopen(fd, "wb") as handle:
                    self._write_zip(handle)
                    handle.flush()
                    os.fsync(handle.fileno())
                os.replace(temporary, path)
            except BaseException:
                try:
                    os.unlink(temporary)
                except FileNotFoundError:
                    pass
                raise
            _fsync_directory(directory)
        except OSError as error:
            raise CheckpointError(f"cannot save {path}: {error}") from error

    def _write_zip(self, handle):
        members = [(MANIFEST, self.manifest_bytes())]
        for entry, _ in _array_entries(self._manifest):
            members.append((entry["member"], _byte_view(self._arrays[entry["member"]])))
        with zipfile.ZipFile(handle, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
            for name, data in members:
                with zf.open(_zip_info(name), "w", force_zip64=len(data) >= ZIP64_THRESHOLD) as out:
                    out.write(data)

    @classmethod
    def load(cls, path):
        """Read and fully validate an archive (format 2 or dense format 1)."""
        path = os.fspath(path)
        with _open_archive(path) as archive:
            manifest = _read_manifest(archive, path)
            if not isinstance(manifest, dict):
                raise CheckpointError(f"checkpoint {path}: {MANIFEST} must be a JSON object")
            if manifest.get("schema") != SCHEMA:
                raise CheckpointError(f"checkpoint {path}: {MANIFEST}: schema is "
                                      f"{manifest.get('schema')!r}, expected {SCHEMA!r}")
            version = manifest.get("format_version")
            if version == 2:
                config, lora, arrays = _load_v2(archive, path, manifest)
            elif version == 1:
                config, lora, manifest, arrays = _load_v1(archive, path, manifest)
            else:
                raise CheckpointError(f"checkpoint {path}: {MANIFEST}: format_version "
                                      f"{version!r} is not readable; this version reads "
                                      f"{list(READABLE_VERSIONS)}")
        return cls(manifest, arrays, config, lora, version)

    # -- restore ----------------------------------------------------------------------------

    def restore(self, model, optimizer, source=None) -> RestoreResult:
        """Replace the state of fresh, compatible objects; all or nothing."""
        prior = self._check_restore(model, optimizer, source)
        adam = {"step": self.optimizer_step,
                "beta1_power": self._manifest["optimizer"]["beta1_power"],
                "beta2_power": self._manifest["optimizer"]["beta2_power"],
                "hyperparameters": dict(self._manifest["optimizer"]["hyperparameters"]),
                "first_moment": self._section("first_moment"),
                "second_moment": self._section("second_moment")}
        values = self._section("model")
        random_state = random_state_from_json(self._manifest["training"]["python_random_state"])
        steps = []  # (what, apply, undo): the source callback runs before the Adam commit
        if source is not None:
            steps.append(("batch source",
                          lambda: source.restore_checkpoint_state(self.source_state),
                          lambda: source.restore_checkpoint_state(copy.deepcopy(prior.source))))
        steps.append(("model parameters", lambda: model.load_state_dict(values),
                      lambda: model.load_state_dict(prior.values)))
        if self.quantized:
            packed = self._packed_tensors()  # fresh NF4 tensors over copies of the archived bytes
            steps.append(("packed NF4 bases", lambda: model.load_packed_state(packed),
                          lambda: model.load_packed_state(prior.packed)))
        if self._lora is not None:
            adapters = self._section("adapter")
            steps.append(("LoRA adapter values", lambda: model.load_adapter_state_dict(adapters),
                          lambda: model.load_adapter_state_dict(prior.adapters)))
        steps += [
            ("Adam state", lambda: optimizer.load_state_dict(adam),
             lambda: optimizer.load_state_dict(prior.adam)),
            ("Python random state", lambda: random.setstate(random_state),
             lambda: random.setstate(prior.random)),
        ]
        started = []
        for what, apply, undo in steps:
            started.append((what, undo))  # a failed step may have changed part of its state
            try:
                apply()
            except BaseException as error:
                self._roll_back(started, prior.random, what, error)
                if not isinstance(error, Exception):
                    raise
                raise CheckpointError(
                    f"restore failed while restoring the {what}: {type(error).__name__}: {error}; "
                    f"rolled back: model, optimizer, batch source and Python random state are as "
                    f"before") from error
        return RestoreResult(checkpoint_id=self.checkpoint_id, format_version=self.format_version,
                             global_step=self.global_step, optimizer_step=self.optimizer_step,
                             metadata=self.metadata)

    @staticmethod
    def _roll_back(started, prior_random, failed, error):
        failures = []
        for what, undo in reversed(started):
            try:
                undo()
            except BaseException as undo_error:  # keep undoing the rest
                failures.append(f"{what} ({type(undo_error).__name__}: {undo_error})")
        random.setstate(prior_random)  # a custom callback may have drawn from it
        if failures:
            raise IndeterminateStateError(
                f"restore failed while restoring the {failed} ({type(error).__name__}: {error}) "
                f"and rolling back failed for: {'; '.join(failures)}. Live state is indeterminate: "
                f"discard these objects and construct fresh ones") from error

    def _check_restore(self, model, optimizer, source):
        """Every compatibility check; returns the snapshots for rollback. Mutates nothing."""
        refused = "restore refused"
        if getattr(optimizer, "model", None) is not model:
            raise CheckpointError(f"{refused}: the optimizer belongs to a different model instance; "
                                  f"construct Adam from `with model.parameters()` (or "
                                  f"`model.adapter_parameters()`) of this model")
        config = getattr(model, "config", None)
        if not isinstance(config, TransformerConfig):
            raise CheckpointError(f"{refused}: the model has no TransformerConfig")
        self._check_structure(model, refused)
        _check_optimizer_owns(model, optimizer, self._lora, refused,
                              "the checkpoint holds base-parameter Adam state" if self._lora is None
                              else "the checkpoint holds LoRA adapter Adam state")
        self._check_config(config, refused)
        hyper, live_hyper = self._manifest["optimizer"]["hyperparameters"], optimizer.hyperparameters()
        drift = [f"{k}: checkpoint {hyper[k]!r}, optimizer {live_hyper.get(k)!r}"
                 for k in _HYPERPARAMETERS if hyper[k] != live_hyper.get(k)]
        if drift:
            raise CheckpointError(f"{refused}: Adam hyperparameters differ: " + "; ".join(drift))
        if model.gradient_pending or optimizer.gradient_pending:
            raise CheckpointError(f"{refused}: the target has a pending gradient; call "
                                  f"optimizer.step() or optimizer.zero_gradients() first")
        archived_source = self._manifest["source"]
        if archived_source is None and source is not None:
            raise CheckpointError(
                f"{refused}: the checkpoint was captured with source=None (format "
                f"v{self.format_version}) and holds no data position, but a "
                f"{type(source).__name__} was given; restore with source=None")
        if archived_source is not None and source is None:
            raise CheckpointError(
                f"{refused}: the checkpoint holds batch-source state (data position and RNG) but "
                f"source=None was given; pass a source built over the same data and settings")
        try:
            prior = _Prior(values=_fp32_base_state(model),
                           adapters=None if self._lora is None else model.adapter_state_dict(),
                           packed=None if not self.quantized else dict(model.packed_state()),
                           adam=optimizer.state_dict(), source=None, random=None)
        except RuntimeError as error:  # closed objects
            raise CheckpointError(f"{refused}: {error}") from error
        sections = [("parameters", prior.values, self._manifest["model"]["parameters"])]
        if self._lora is not None:
            sections.append(("adapters", prior.adapters, self._manifest["adapter"]["parameters"]))
        if self.quantized:
            sections.append(("packed NF4 weights", prior.packed,
                             self._manifest["quantization"]["weights"]))
        for what, live_state, entries in sections:
            archived = [(e["name"], tuple(e["shape"])) for e in entries]
            live = [(name, tuple(value.shape)) for name, value in live_state.items()]
            if live != archived:
                raise CheckpointError(f"{refused}: the model's {what} do not match the checkpoint "
                                      f"(names or shapes); checkpoint {len(archived)}, model "
                                      f"{len(live)}")
        if source is not None:
            _check_source_protocol(source, refused)
            try:
                prior.source = copy.deepcopy(source.checkpoint_state())
            except Exception as error:
                raise CheckpointError(f"{refused}: {type(source).__name__}.checkpoint_state() "
                                      f"failed: {error}") from error
            _check_source_match(archived_source["state"], prior.source, refused)
        prior.random = random.getstate()
        return prior

    def _check_structure(self, model, refused):
        """Adapter and quantization presence, then the LoRA shape identity."""
        live_lora = getattr(model, "lora_config", None)
        live_quantization = getattr(model, "quantization", None)
        if self._lora is None and live_lora is not None:
            raise CheckpointError(f"{refused}: the checkpoint is dense (adapter: null) but the "
                                  f"model has a LoRA adapter attached; restore into a model "
                                  f"without attach_lora")
        if self._lora is not None and live_lora is None:
            raise CheckpointError(
                f"{refused}: the checkpoint holds a LoRA adapter ({_describe_lora(self._lora)}) "
                f"but the model has none; attach_lora with the same rank, alpha, targets and "
                f"use_rslora before constructing Adam over model.adapter_parameters()")
        if not self.quantized and live_quantization is not None:
            raise CheckpointError(f"{refused}: the checkpoint has an FP32 base (quantization: "
                                  f"null) but the model has a quantized (NF4) base; restore into "
                                  f"a model without quantize()")
        if self.quantized and live_quantization is None:
            raise CheckpointError(f"{refused}: the checkpoint holds packed NF4 (QLoRA) bases but "
                                  f"the model is not quantized; call model.quantize() (any block "
                                  f"size or scale encoding) before attach_lora")
        if self._lora is not None:
            archived, live = self._lora.shape_identity(), live_lora.shape_identity()
            drift = [f"{k}: checkpoint {archived[k]!r}, model {live[k]!r}"
                     for k in _LORA_IDENTITY if archived[k] != live[k]]
            if drift:
                raise CheckpointError(f"{refused}: the LoRA configuration differs from the "
                                      f"checkpoint: " + "; ".join(drift)
                                      + " (only initializer_seed may differ)")

    def _check_config(self, config, refused):
        """The whole TransformerConfig must match; only the initializer seed may differ."""
        archived = self._config
        drift = [f"{k}: checkpoint {getattr(archived, k)!r}, model {getattr(config, k)!r}"
                 for k in _ARCHITECTURE if getattr(archived, k) != getattr(config, k)]
        if drift:
            raise CheckpointError(f"{refused}: the model architecture differs from the checkpoint: "
                                  + "; ".join(drift))
        for key in _POLICIES:
            if getattr(archived, key) != getattr(config, key):
                raise CheckpointError(f"{refused}: {key} differs: checkpoint "
                                      f"{getattr(archived, key)!r}, model "
                                      f"{getattr(config, key)!r}; construct the model with the "
                                      f"archived policy")
        checked = set(_ARCHITECTURE + _POLICIES + _FREE_CONFIG_FIELDS)
        drift = [f"{f.name}: checkpoint {getattr(archived, f.name)!r}, model "
                 f"{getattr(config, f.name)!r}" for f in fields(TransformerConfig)
                 if f.name not in checked and getattr(archived, f.name) != getattr(config, f.name)]
        if drift:
            raise CheckpointError(f"{refused}: the model configuration differs from the "
                                  f"checkpoint: " + "; ".join(drift)
                                  + " (only initializer_seed may differ)")

    def _packed_tensors(self):
        return _nf4_tensors(self._manifest["quantization"], self._arrays)


@dataclass
class _Prior:
    """What restore() snapshots before it changes anything, for rollback."""
    values: dict  # FP32 base values by name (never a dequantized copy of a packed base)
    adapters: dict | None
    packed: dict | None  # {name: NF4 tensor}: the model's own objects, replaced not mutated
    adam: dict
    source: dict | None
    random: tuple | None


def _fp32_base_state(model):
    """{name: copy} of the base parameters that hold FP32 values; packed bases are skipped.

    model.state_dict() would dequantize packed bases into full FP32 copies.
    """
    return {p.name: p.value.copy() for p in model.parameters() if p.value is not None}


def _describe_lora(lora):
    identity = lora.shape_identity()
    return ", ".join(f"{k} {identity[k]!r}" for k in _LORA_IDENTITY)


def _check_optimizer_owns(model, optimizer, lora, refused, reason):
    """Adam owns the base list of a dense model, or the complete adapter list of a LoRA model."""
    kind = getattr(optimizer, "parameter_kind", None)
    expected = "base" if lora is None else "adapter"
    if kind != expected:
        raise CheckpointError(
            f"{refused}: {reason}, so Adam must own model."
            f"{'parameters' if lora is None else 'adapter_parameters'}(); this optimizer owns "
            f"{kind!r} parameters")
    if lora is not None:
        try:
            complete = [id(p) for p in model.adapter_parameters()]
        except (RuntimeError, ValueError) as error:
            raise CheckpointError(f"{refused}: {error}") from error
        if [id(p) for p in getattr(optimizer, "parameters", ())] != complete:
            raise CheckpointError(f"{refused}: Adam must own the complete, ordered "
                                  f"model.adapter_parameters() list of this model")


def _check_source_protocol(source, refused):
    missing = [m for m in ("checkpoint_state", "restore_checkpoint_state")
               if not callable(getattr(source, m, None))]
    if missing:
        raise CheckpointError(f"{refused}: {type(source).__name__} does not implement the batch-"
                              f"source checkpoint protocol (missing {', '.join(missing)}); pass a "
                              f"checkpointable source, or source=None to omit the data position")


def _check_source_match(archived, live, refused):
    """The parts of a source state that must agree before the source is asked to restore."""
    if not isinstance(live, dict):
        raise CheckpointError(f"{refused}: the source's checkpoint_state() is not an object")
    if set(archived) != set(live):
        raise CheckpointError(f"{refused}: batch-source state fields differ: checkpoint "
                              f"{sorted(archived)}, source {sorted(live)}")
    if archived.get("kind") != live.get("kind"):
        raise CheckpointError(f"{refused}: batch-source kind differs: checkpoint "
                              f"{archived.get('kind')!r}, source {live.get('kind')!r}")
    if archived.get("fingerprint") != live.get("fingerprint"):
        raise CheckpointError(
            f"{refused}: data fingerprint mismatch: checkpoint {archived.get('fingerprint')}, "
            f"source {live.get('fingerprint')} (different tokens/examples or batch_size, "
            f"context_size, random_seed, shuffle, pad_token)")
