"""TrainingCheckpoint: the exact, versioned .riftckpt archive of one dense FP32 Adam run.

A checkpoint holds everything that decides the next step: the model configuration and
execution policies, every base parameter by name, Adam's hyperparameters, step, beta
powers and both moments, the global step, the process-wide Python random state, the
batch source's checkpoint state and user metadata. On disk it is a ZIP with one
canonical `manifest.json` and one raw little-endian float32 member per array; nothing
is pickled. Loading validates the whole archive before it returns, and `restore()`
validates compatibility before it changes anything, then commits transactionally
(batch source, model values, Adam, Python random state) and rolls back in reverse
order on failure. The format is described in docs/checkpoints.md.
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
from dataclasses import dataclass

import numpy as np

from trainer.config import TransformerConfig
from trainer.training import SourceStateError, random_state_from_json, random_state_to_json

SCHEMA = "kiln.riftckpt"
FORMAT_VERSION = 2  # written by save(); load() also reads version 1
READABLE_VERSIONS = (1, 2)
MANIFEST = "manifest.json"
MAX_MANIFEST_BYTES = 64 << 20  # names, shapes and digests only: a real manifest is kilobytes
EXACT_POWER_STEPS = 1_000_000  # up to here beta powers are recomputed bit for bit (~0.1 s)
ZIP_TIMESTAMP = (1980, 1, 1, 0, 0, 0)  # the earliest ZIP date, fixed so equal state gives equal bytes
ZIP64_THRESHOLD = 1 << 31  # members this large need ZIP64 headers, decided before writing
BUILTIN_SOURCE_KINDS = ("RandomWindowBatchSource", "SequenceWindowBatchSource",
                        "ExampleWindowBatchSource")

_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]*\Z")  # a parameter name, safe inside a member path
_HEX64 = re.compile(r"[0-9a-f]{64}\Z")
_MOMENTS = ("first_moment", "second_moment")
_HYPERPARAMETERS = ("learning_rate", "beta1", "beta2", "epsilon", "weight_decay")
_ARCHITECTURE = ("vocabulary_size", "maximum_context", "model_width", "head_count", "block_count",
                 "feed_forward_width", "kv_head_count", "head_size", "rope_theta",
                 "norm_epsilon", "tie_embeddings")


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


def member_name(section: str, name: str) -> str:
    """The v2 ZIP member of one array: section is "model", "first_moment" or "second_moment"."""
    return f"model/{name}.f32" if section == "model" else f"adam/{section}/{name}.f32"


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
    return value


def _real(value, where):
    if isinstance(value, bool) or not isinstance(value, float) or not math.isfinite(value):
        _fail(where, f"expected a finite float, got {value!r}")
    return value


def _plain_json(value, where):
    """`value` must survive a JSON round trip unchanged (dict/list/str/int/float/bool/None)."""
    try:
        again = json.loads(_canonical_json(value))
    except (TypeError, ValueError) as error:
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
    try:
        return TransformerConfig.from_dict(value)
    except (TypeError, ValueError) as error:
        _fail(where, f"not a valid TransformerConfig: {error}")


def _check_parameter_list(entries, config, where):
    """Archived (name, shape) pairs must be exactly the layout of `config`."""
    got = [(e["name"], tuple(e["shape"])) for e in entries]
    expected = parameter_signature(config)
    if got == expected:
        return
    got_names, expected_names = [n for n, _ in got], [n for n, _ in expected]
    missing = [n for n in expected_names if n not in got_names]
    unexpected = [n for n in got_names if n not in expected_names]
    if missing or unexpected:
        _fail(where, f"parameter names do not match model.config: missing {missing[:5]}, "
                     f"unexpected {unexpected[:5]}")
    if got_names != expected_names:
        _fail(where, "parameters are not in the model's order")
    for (name, shape), (_, want) in zip(got, expected):
        if shape != want:
            _fail(f"{where}[{name}]", f"shape {list(shape)} does not match model.config {list(want)}")


def _check_array_entries(entries, where, section):
    """A v2 array list: name, shape, dtype, member, bytes and sha256 of each array."""
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
        shape = entry["shape"]
        if not isinstance(shape, list):
            _fail(at + ".shape", f"expected a list of sizes, got {shape!r}")
        for size in shape:
            _integer(size, at + ".shape", minimum=1)
        if entry["dtype"] != "float32":
            _fail(at + ".dtype", f"only float32 is supported, got {entry['dtype']!r}")
        if entry["member"] != member_name(section, name):
            _fail(at + ".member", f"is {entry['member']!r}, the format requires "
                                  f"{member_name(section, name)!r}")
        nbytes = 4 * math.prod(shape)
        if entry["bytes"] != nbytes:
            _fail(at + ".bytes", f"is {entry['bytes']!r}, but {shape} float32 elements take {nbytes}")
        if not isinstance(entry["sha256"], str) or not _HEX64.match(entry["sha256"]):
            _fail(at + ".sha256", f"expected 64 lowercase hex digits, got {entry['sha256']!r}")


def _validate_manifest(manifest):
    """Every semantic check of a v2 manifest (v1 archives are converted first)."""
    where = MANIFEST
    _object(manifest, where, ("schema", "format_version", "checkpoint_id", "model", "policies",
                              "optimizer", "adapter", "quantization", "training", "source",
                              "metadata"))
    for section, what in (("adapter", "LoRA adapter"), ("quantization", "packed NF4 (QLoRA)")):
        if manifest[section] is not None:
            _fail(f"{where}: {section}", f"this version reads dense checkpoints only; {what} "
                                         f"sections are not implemented yet")
    model = _object(manifest["model"], f"{where}: model", ("config", "parameters"))
    config = _config(model["config"], f"{where}: model.config")
    policies = _object(manifest["policies"], f"{where}: policies",
                       ("attention_algorithm", "activation_checkpointing"))
    for key in policies:
        if policies[key] != getattr(config, key):
            _fail(f"{where}: policies.{key}", f"is {policies[key]!r} but model.config has "
                                              f"{getattr(config, key)!r}")
    _check_array_entries(model["parameters"], f"{where}: model.parameters", "model")
    _check_parameter_list(model["parameters"], config, f"{where}: model.parameters")
    adam = _object(manifest["optimizer"], f"{where}: optimizer",
                   ("type", "parameters", "hyperparameters", "step", "beta1_power",
                    "beta2_power") + _MOMENTS)
    if adam["type"] != "Adam":
        _fail(f"{where}: optimizer.type", f"only 'Adam' is supported, got {adam['type']!r}")
    if adam["parameters"] != "base":
        _fail(f"{where}: optimizer.parameters", f"only 'base' is supported, got {adam['parameters']!r}")
    hyper = adam["hyperparameters"]
    _check_hyperparameters(hyper, f"{where}: optimizer.hyperparameters")
    step = _integer(adam["step"], f"{where}: optimizer.step")
    _check_beta_power(adam["beta1_power"], hyper["beta1"], step, f"{where}: optimizer.beta1_power")
    _check_beta_power(adam["beta2_power"], hyper["beta2"], step, f"{where}: optimizer.beta2_power")
    signature = [(e["name"], e["shape"]) for e in model["parameters"]]
    for key in _MOMENTS:
        _check_array_entries(adam[key], f"{where}: optimizer.{key}", key)
        if [(e["name"], e["shape"]) for e in adam[key]] != signature:
            _fail(f"{where}: optimizer.{key}", "names and shapes must equal model.parameters")
    training = _object(manifest["training"], f"{where}: training",
                       ("global_step", "python_random_state"))
    _integer(training["global_step"], f"{where}: training.global_step")
    _random_state(training["python_random_state"], f"{where}: training.python_random_state")
    if manifest["source"] is not None:
        source = _object(manifest["source"], f"{where}: source", ("state",))
        _source_state(source["state"], f"{where}: source.state")
    if not isinstance(manifest["metadata"], dict):
        _fail(f"{where}: metadata", f"expected an object, got {type(manifest['metadata']).__name__}")
    return config


def _build_manifest(*, config, values, adam, global_step, random_state, source_state, metadata):
    """The v2 manifest and {member: read-only little-endian float32 array} of one state."""
    arrays, sections = {}, {}
    for section, mapping in (("model", values), ("first_moment", adam["first_moment"]),
                             ("second_moment", adam["second_moment"])):
        entries = []
        for name, value in mapping.items():
            array = np.ascontiguousarray(value, dtype="<f4")  # callers pass arrays they own
            array.flags.writeable = False
            member = member_name(section, name)
            arrays[member] = array
            entries.append({"name": name, "shape": list(array.shape), "dtype": "float32",
                            "member": member, "bytes": array.nbytes,
                            "sha256": hashlib.sha256(_byte_view(array)).hexdigest()})
        sections[section] = entries
    manifest = {
        "schema": SCHEMA,
        "format_version": FORMAT_VERSION,
        "model": {"config": config.to_dict(), "parameters": sections["model"]},
        "policies": {"attention_algorithm": config.attention_algorithm,
                     "activation_checkpointing": config.activation_checkpointing},
        "optimizer": {"type": "Adam", "parameters": "base",
                      "hyperparameters": dict(adam["hyperparameters"]), "step": adam["step"],
                      "beta1_power": adam["beta1_power"], "beta2_power": adam["beta2_power"],
                      "first_moment": sections["first_moment"],
                      "second_moment": sections["second_moment"]},
        "adapter": None,  # reserved for LoRA: typed section, null for dense runs
        "quantization": None,  # reserved for packed NF4 bases: typed section, null when dense
        "training": {"global_step": global_step, "python_random_state": random_state},
        "source": None if source_state is None else {"state": source_state},
        "metadata": metadata,
    }
    manifest = json.loads(_canonical_json(manifest))  # exactly what a reader will parse
    manifest["checkpoint_id"] = checkpoint_id(manifest)
    return manifest, arrays


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


def _open_archive(path):
    try:
        archive = zipfile.ZipFile(path, "r")
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path} does not exist") from None
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, EOFError, ValueError) as error:
        raise CheckpointError(f"checkpoint {path} is not a complete ZIP archive (truncated or "
                              f"corrupt): {error}") from error
    try:
        infos = archive.infolist()
        names = [info.filename for info in infos]
        duplicated = sorted({n for n in names if names.count(n) > 1})
        if duplicated:
            raise CheckpointError(f"checkpoint {path}: duplicate members {duplicated}")
        for info in infos:
            name = info.filename
            parts = name.split("/")
            if name.startswith("/") or "\\" in name or any(p in ("", ".", "..") for p in parts) \
                    or ":" in name:
                raise CheckpointError(f"checkpoint {path}: unsafe member name {name!r}")
            if info.flag_bits & 0x1:
                raise CheckpointError(f"checkpoint {path}: member {name!r} is encrypted")
            if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
                raise CheckpointError(f"checkpoint {path}: member {name!r} uses unsupported "
                                      f"compression {info.compress_type}")
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
        return json.loads(data.decode("utf-8"), object_pairs_hook=_reject_duplicate_keys,
                          parse_constant=_reject_constant)
    except (UnicodeDecodeError, ValueError) as error:
        raise CheckpointError(f"checkpoint {path}: {MANIFEST} is not valid UTF-8 JSON: {error}") \
            from error


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


def _read_array(archive, path, member, shape, sha256):
    data = _read_member(archive, path, member)
    if len(data) != 4 * math.prod(shape):
        raise CheckpointError(f"checkpoint {path}: member {member!r} has {len(data)} bytes, "
                              f"the manifest says {4 * math.prod(shape)}")
    digest = hashlib.sha256(data).hexdigest()
    if digest != sha256:
        raise CheckpointError(f"checkpoint {path}: member {member!r} fails its checksum: "
                              f"sha256 {digest}, the manifest says {sha256}")
    array = np.frombuffer(data, dtype="<f4").reshape(shape)  # read-only, over the bytes
    return array


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
        config = _validate_manifest(manifest)
    except CheckpointError as error:
        raise CheckpointError(f"checkpoint {path}: {error}") from None
    entries = manifest["model"]["parameters"] + [
        e for key in _MOMENTS for e in manifest["optimizer"][key]]
    _check_members(archive, path, {MANIFEST: None, **{e["member"]: e["bytes"] for e in entries}})
    arrays = {e["member"]: _read_array(archive, path, e["member"], tuple(e["shape"]), e["sha256"])
              for e in entries}
    for entry in manifest["optimizer"]["second_moment"]:
        if np.any(arrays[entry["member"]] < 0):
            raise CheckpointError(f"checkpoint {path}: {entry['member']!r}: Adam's second moment "
                                  f"has negative entries")
    return config, arrays


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
        for index, entry in enumerate(params):
            _object(entry, f"{MANIFEST}: parameters[{index}]", ("name", "shape"))
            name, shape = entry["name"], entry["shape"]
            if not isinstance(name, str) or not _NAME.match(name) or ".." in name:
                _fail(f"{MANIFEST}: parameters[{index}].name", f"not a valid name: {name!r}")
            if not isinstance(shape, list):
                _fail(f"{MANIFEST}: parameters[{index}].shape", f"expected a list, got {shape!r}")
            for size in shape:
                _integer(size, f"{MANIFEST}: parameters[{index}].shape", minimum=1)
        _check_parameter_list(params, config, f"{MANIFEST}: parameters")
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
    return config, v2, arrays


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
    """The exact state of one dense FP32 Adam run; build with capture() or load()."""

    def __init__(self, manifest, arrays, config, format_version):
        self._manifest = manifest  # validated v2 manifest, checkpoint_id included
        self._arrays = arrays  # {member: read-only little-endian float32 array}
        self._config = config
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
        return tuple(e["name"] for e in self._manifest["model"]["parameters"])

    def manifest(self) -> dict:
        """A copy of the v2 manifest (what save() writes as manifest.json)."""
        return copy.deepcopy(self._manifest)

    def _section(self, section):
        key = ("model", "parameters") if section == "model" else ("optimizer", section)
        return {e["name"]: self._arrays[e["member"]]
                for e in self._manifest[key[0]][key[1]]}

    # -- capture --------------------------------------------------------------------------

    @classmethod
    def capture(cls, model, optimizer, *, source, global_step, metadata=None):
        """Copy the state of `model`, its `optimizer` and `source` at a clean step boundary."""
        if getattr(optimizer, "model", None) is not model:
            raise CheckpointError("capture refused: the optimizer belongs to a different model "
                                  "instance (optimizer.model is not model)")
        if getattr(model, "lora_config", None) is not None:
            raise CheckpointError("capture refused: the model has a LoRA adapter attached; this "
                                  "version captures dense base-parameter training only")
        if getattr(model, "quantization", None) is not None:
            raise CheckpointError("capture refused: the model has a quantized (NF4) base; this "
                                  "version captures dense base-parameter training only")
        if getattr(optimizer, "parameter_kind", None) != "base":
            raise CheckpointError(f"capture refused: only base-parameter Adam is supported, this "
                                  f"optimizer owns {getattr(optimizer, 'parameter_kind', None)!r} "
                                  f"parameters (LoRA checkpoints are not implemented yet)")
        if model.gradient_pending or optimizer.gradient_pending:
            raise CheckpointError("capture refused: a gradient is pending; call optimizer.step() "
                                  "or optimizer.zero_gradients() first (an exactly-zero gradient "
                                  "is still pending)")
        _integer(global_step, "capture refused: global_step")
        metadata = {} if metadata is None else metadata
        if not isinstance(metadata, dict):
            raise CheckpointError(f"capture refused: metadata must be a dict, got "
                                  f"{type(metadata).__name__}")
        metadata = _plain_json(metadata, "capture refused: metadata")
        source_state = None
        if source is not None:
            _check_source_protocol(source, "capture refused")
            try:
                state = source.checkpoint_state()
            except Exception as error:
                raise CheckpointError(f"capture refused: {type(source).__name__}."
                                      f"checkpoint_state() failed: {error}") from error
            source_state = _source_state(_plain_json(state, "capture refused: source state"),
                                         "capture refused: source state")
        try:
            values = model.state_dict()
            adam = optimizer.state_dict()
        except RuntimeError as error:  # a closed model or optimizer
            raise CheckpointError(f"capture refused: {error}") from error
        names = list(values)
        for key in _MOMENTS:
            if list(adam[key]) != names:
                raise CheckpointError(f"capture refused: Adam's {key} names do not match the "
                                      f"model's parameters")
        manifest, arrays = _build_manifest(
            config=model.config, values=values, adam=adam, global_step=global_step,
            random_state=random_state_to_json(random.getstate()), source_state=source_state,
            metadata=metadata)
        try:
            config = _validate_manifest(manifest)
        except CheckpointError as error:
            raise CheckpointError(f"capture refused: {error}") from None
        checkpoint = cls(manifest, arrays, config, FORMAT_VERSION)
        size = len(checkpoint.manifest_bytes())
        if size > MAX_MANIFEST_BYTES:
            raise CheckpointError(f"capture refused: the manifest would be {size} bytes, more than "
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
        for section in ("model",) + _MOMENTS:
            key = ("model", "parameters") if section == "model" else ("optimizer", section)
            for entry in self._manifest[key[0]][key[1]]:
                array = self._arrays[entry["member"]]
                members.append((entry["member"], _byte_view(array)))
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
                config, arrays = _load_v2(archive, path, manifest)
            elif version == 1:
                config, manifest, arrays = _load_v1(archive, path, manifest)
            else:
                raise CheckpointError(f"checkpoint {path}: {MANIFEST}: format_version "
                                      f"{version!r} is not readable; this version reads "
                                      f"{list(READABLE_VERSIONS)}")
        return cls(manifest, arrays, config, version)

    # -- restore ----------------------------------------------------------------------------

    def restore(self, model, optimizer, source=None) -> RestoreResult:
        """Replace the state of fresh, compatible objects; all or nothing."""
        prior = self._check_restore(model, optimizer, source)
        prior_values, prior_adam, prior_source, prior_random = prior
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
                          lambda: source.restore_checkpoint_state(copy.deepcopy(prior_source))))
        steps += [
            ("model parameters", lambda: model.load_state_dict(values),
             lambda: model.load_state_dict(prior_values)),
            ("Adam state", lambda: optimizer.load_state_dict(adam),
             lambda: optimizer.load_state_dict(prior_adam)),
            ("Python random state", lambda: random.setstate(random_state),
             lambda: random.setstate(prior_random)),
        ]
        started = []
        for what, apply, undo in steps:
            started.append((what, undo))  # a failed step may have changed part of its state
            try:
                apply()
            except BaseException as error:
                self._roll_back(started, prior_random, what, error)
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
                                  f"construct Adam from `with model.parameters()` of this model")
        if getattr(optimizer, "parameter_kind", None) != "base":
            raise CheckpointError(f"{refused}: the checkpoint holds base-parameter Adam state, the "
                                  f"optimizer owns {getattr(optimizer, 'parameter_kind', None)!r} "
                                  f"parameters")
        if getattr(model, "lora_config", None) is not None:
            raise CheckpointError(f"{refused}: the checkpoint is dense (adapter: null) but the "
                                  f"model has a LoRA adapter attached; restore into a model "
                                  f"without attach_lora")
        if getattr(model, "quantization", None) is not None:
            raise CheckpointError(f"{refused}: the checkpoint is dense (quantization: null) but "
                                  f"the model has a quantized (NF4) base")
        config = getattr(model, "config", None)
        if not isinstance(config, TransformerConfig):
            raise CheckpointError(f"{refused}: the model has no TransformerConfig")
        drift = [f"{k}: checkpoint {getattr(self._config, k)!r}, model {getattr(config, k)!r}"
                 for k in _ARCHITECTURE if getattr(self._config, k) != getattr(config, k)]
        if drift:
            raise CheckpointError(f"{refused}: the model architecture differs from the checkpoint: "
                                  + "; ".join(drift))
        for key in ("attention_algorithm", "activation_checkpointing"):
            archived, live = self._manifest["policies"][key], getattr(config, key)
            if archived != live:
                raise CheckpointError(f"{refused}: {key} differs: checkpoint {archived!r}, model "
                                      f"{live!r}; construct the model with the archived policy")
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
            prior_values = model.state_dict()
            prior_adam = optimizer.state_dict()
        except RuntimeError as error:  # closed objects
            raise CheckpointError(f"{refused}: {error}") from error
        archived = [(e["name"], tuple(e["shape"])) for e in self._manifest["model"]["parameters"]]
        live = [(name, tuple(value.shape)) for name, value in prior_values.items()]
        if live != archived:
            raise CheckpointError(f"{refused}: the model's parameters do not match the checkpoint "
                                  f"(names or shapes); checkpoint {len(archived)}, model {len(live)}")
        prior_source = None
        if source is not None:
            _check_source_protocol(source, refused)
            try:
                prior_source = copy.deepcopy(source.checkpoint_state())
            except Exception as error:
                raise CheckpointError(f"{refused}: {type(source).__name__}.checkpoint_state() "
                                      f"failed: {error}") from error
            _check_source_match(archived_source["state"], prior_source, refused)
        return prior_values, prior_adam, prior_source, random.getstate()


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
