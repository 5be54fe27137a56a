"""The `.riftckpt` v2 manifest: building it from live state, validating every field of it (packed NF4 sections included) and checking the array values it lists."""

import hashlib
import json
import math

import numpy as np

from trainer.checkpoint_format import (
    CheckpointError, FORMAT_VERSION, MANIFEST, MAX_DIMENSIONS, SCHEMA, _DTYPES, _HEX64, _LORA_FIELDS,
    _MOMENTS, _NAME, _POLICIES, _byte_view, _check_beta_power, _check_block_count, _check_depth,
    _check_hyperparameters, _check_parameter_list, _config, _fail, _integer, _object, _random_state, _real,
    _source_state, adapter_signature, checkpoint_id, member_name, parameter_signature, quantized_signature)
from trainer.jsonio import canonical_bytes
from trainer.lora import LoraConfig


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
    manifest = json.loads(canonical_bytes(manifest))  # exactly what a reader will parse
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
