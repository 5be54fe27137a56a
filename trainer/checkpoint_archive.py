"""Reading and writing the `.riftckpt` ZIP: member safety and sizes refused before anything inflates, checksummed arrays, v1 conversion, and the fixed-header writer."""

import hashlib
import math
import os
import zipfile
import zlib
from collections import Counter

import numpy as np

from trainer.checkpoint_format import (
    CheckpointError, MANIFEST, MAX_DIMENSIONS, MAX_INFLATION, MAX_MANIFEST_BYTES, MAX_MANIFEST_DEPTH,
    ZIP64_THRESHOLD, ZIP_TIMESTAMP, _DTYPES, _HEX64, _MOMENTS, _NAME, _byte_view, _check_block_count,
    _check_hyperparameters, _check_parameter_list, _config, _fail, _integer, _object, _random_state,
    checkpoint_id, parameter_signature, v1_member_name)
from trainer.checkpoint_manifest import (
    _array_entries, _build_manifest, _check_packed_contents, _validate_manifest)
from trainer.jsonio import strict_loads


# -- reading archives --------------------------------------------------------------------------


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
    try:  # integers of any size: metadata may hold them, and the field checks bound the rest
        return strict_loads(data, max_depth=MAX_MANIFEST_DEPTH, bounded_ints=False)
    except ValueError as error:
        raise CheckpointError(f"checkpoint {path}: {MANIFEST} is not valid strict UTF-8 JSON: {error}") \
            from None


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


def _write_zip(handle, manifest_bytes, manifest, arrays):
    """The archive: manifest.json first, then each array member in manifest order, stored, fixed headers."""
    members = [(MANIFEST, manifest_bytes)]
    for entry, _ in _array_entries(manifest):
        members.append((entry["member"], _byte_view(arrays[entry["member"]])))
    with zipfile.ZipFile(handle, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
        for name, data in members:
            with zf.open(_zip_info(name), "w", force_zip64=len(data) >= ZIP64_THRESHOLD) as out:
                out.write(data)
