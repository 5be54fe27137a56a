"""Reading and writing the `.riftckpt` ZIP: the canonical structure (checkpoint_zip), member safety, sizes and CRC-32s checked before anything is trusted or inflated, checksummed arrays, v1 conversion, and the writer."""

import hashlib
import math
import os
import re
import stat
import zlib
from collections import Counter

import numpy as np

from trainer import checkpoint_zip, fsio
from trainer.checkpoint_format import (
    CheckpointError, MANIFEST, MAX_DIMENSIONS, MAX_INFLATION, MAX_MANIFEST_BYTES, MAX_MANIFEST_DEPTH,
    _DTYPES, _HEX64, _MOMENTS, _NAME, _byte_view, _check_block_count,
    _check_hyperparameters, _check_parameter_list, _config, _fail, _integer, _object, _random_state,
    checkpoint_id, parameter_signature, v1_member_name)
from trainer.checkpoint_manifest import (
    _array_entries, _build_manifest, _check_packed_contents, _validate_manifest)
from trainer.jsonio import strict_loads


# -- reading archives --------------------------------------------------------------------------


class _Archive:
    """A checked archive in memory: its member names in file order, sizes and verified bytes."""

    def __init__(self, names, contents):
        self.names = names  # [name] in file order, unique
        self.contents = contents  # {name: bytes-like}, every CRC-32 verified

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.contents = {}


_V1_FOLDERS = ("params/", "adam/m/", "adam/v/")


def _read_file(path):
    """The archive's bytes: a regular file's, read to the size it has when opened (the open does not wait on
    a FIFO, and a device is never read: /dev/zero would be read until memory ran out)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path} does not exist", code="missing_checkpoint") from None
    except OSError as error:
        raise CheckpointError(f"checkpoint {path} cannot be read: {error}") from error
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointError(f"checkpoint {path} is not a regular file (a directory, FIFO, socket or "
                                  "device); a .riftckpt archive is a file written by TrainingCheckpoint.save")
        return fsio.read_exact(fd, st.st_size)
    except OSError as error:
        raise CheckpointError(f"checkpoint {path} cannot be read: {error}") from error
    finally:
        os.close(fd)


def _open_archive(path, data=None):
    """Validate the whole ZIP structure of `data` (read from `path` when None), then every member's
    CRC-32; nothing is trusted or inflated before the structure and declared sizes pass."""
    data = _read_file(path) if data is None else bytes(data)
    where = f"checkpoint {path}"
    members = checkpoint_zip.parse(data, where)
    on_disk = len(data)
    for m in members:
        name = m.name.decode("utf-8", "replace")
        if m.compressed > on_disk or (m.method == checkpoint_zip.STORED and m.size != m.compressed):
            raise CheckpointError(f"{where}: member {name!r} declares {m.size} bytes stored in "
                                  f"{m.compressed}, which the {on_disk}-byte archive cannot hold", code="zip_bomb")
    declared = sum(m.size for m in members)
    if declared > MAX_INFLATION * on_disk:  # a zip bomb: refused before anything inflates
        raise CheckpointError(f"{where}: its members declare {declared} bytes, more than {MAX_INFLATION} "
                              f"times the {on_disk} bytes of the archive", code="zip_bomb")
    names = [_member_name(m.name, where) for m in members]
    counts = Counter(names)  # linear: archives may list many
    duplicated = sorted(name for name, count in counts.items() if count > 1)
    if duplicated:
        raise CheckpointError(f"{where}: duplicate members {duplicated[:5]}", code="noncanonical_archive")
    legacy = all(n == MANIFEST or n.startswith(_V1_FOLDERS) for n in names)  # a dense v1 archive
    for m, name in zip(members, names):
        if m.method not in (checkpoint_zip.STORED, checkpoint_zip.DEFLATED) \
                or (m.method == checkpoint_zip.DEFLATED and not legacy):
            raise CheckpointError(f"{where}: member {name!r} uses compression method {m.method}; the "
                                  f"writer stores members (method 0)", code="noncanonical_archive")
    starts = checkpoint_zip.check(data, members, checkpoint_zip.V1 if legacy else checkpoint_zip.WRITER, where)
    contents, view = {}, memoryview(data)
    for m, name, start in zip(members, names, starts):
        raw = view[start:start + m.compressed]
        content = raw if m.method == checkpoint_zip.STORED else _inflate(raw, m.size, where, name)
        crc = zlib.crc32(content)
        if crc != m.crc:
            raise CheckpointError(f"{where}: member {name!r} is corrupt: Bad CRC-32 (its bytes give "
                                  f"{crc:#010x}, its headers say {m.crc:#010x})", code="corrupt_member")
        contents[name] = content
    return _Archive(names, contents)


_SAFE_NAME = re.compile(r"[A-Za-z0-9_\-]+(?:\.+[A-Za-z0-9_\-]+)*(?:/[A-Za-z0-9_\-]+(?:\.+[A-Za-z0-9_\-]+)*)*\Z")  # unambiguous: linear


def _member_name(raw, where):
    if raw.isascii() and _SAFE_NAME.match(raw.decode("ascii")):  # the common case, quickly
        return raw.decode("ascii")
    try:
        name = raw.decode("ascii" if raw.isascii() else "utf-8")
    except UnicodeDecodeError:
        raise CheckpointError(f"{where}: unsafe member name {raw!r} (not UTF-8)", code="unsafe_member") from None
    parts = name.split("/")
    if name.startswith("/") or "\\" in name or any(p in ("", ".", "..") for p in parts) \
            or ":" in name or "\x00" in name:
        raise CheckpointError(f"{where}: unsafe member name {name!r}", code="unsafe_member")
    return name


def _inflate(raw, size, where, name):
    """A raw deflate stream that must give exactly `size` bytes and end where the member ends."""
    inflater = zlib.decompressobj(-15)
    try:
        content = inflater.decompress(raw, size + 1)  # never more than declared (+1 to notice more)
    except zlib.error as error:
        raise CheckpointError(f"{where}: member {name!r} is corrupt: {error}", code="corrupt_member") from None
    if len(content) != size or not inflater.eof or inflater.unused_data or inflater.unconsumed_tail:
        raise CheckpointError(f"{where}: member {name!r} is corrupt: its deflate stream does not give "
                              f"exactly the {size} bytes declared", code="corrupt_member")
    return content


def _read_member(archive, path, name):
    try:
        return archive.contents[name]
    except KeyError:
        raise CheckpointError(f"checkpoint {path}: missing member {name!r}") from None


def _read_manifest(archive, path):
    if MANIFEST not in archive.contents:
        raise CheckpointError(f"checkpoint {path}: missing member {MANIFEST!r}")
    if archive.names[0] != MANIFEST:
        raise CheckpointError(f"checkpoint {path}: members are not in the writer's order: {MANIFEST} is "
                              f"member {archive.names.index(MANIFEST)}, the writer writes it first",
                              code="noncanonical_archive")
    size = len(archive.contents[MANIFEST])
    if size > MAX_MANIFEST_BYTES:
        raise CheckpointError(f"checkpoint {path}: {MANIFEST} is {size} bytes, more "
                              f"than the {MAX_MANIFEST_BYTES} allowed")
    data = bytes(_read_member(archive, path, MANIFEST))
    try:  # integers of any size: metadata may hold them, and the field checks bound the rest
        return strict_loads(data, max_depth=MAX_MANIFEST_DEPTH, bounded_ints=False)
    except ValueError as error:
        raise CheckpointError(f"checkpoint {path}: {MANIFEST} is not valid strict UTF-8 JSON: {error}") \
            from None


def _check_members(archive, path, expected):
    """expected: {member: bytes}, in the writer's order. Exact member set, sizes and order, before any
    array is read."""
    present = {name: len(archive.contents[name]) for name in archive.names}
    missing = sorted(set(expected) - set(present))
    unexpected = sorted(set(present) - set(expected))
    if missing:
        raise CheckpointError(f"checkpoint {path}: missing member(s) {missing[:5]}"
                              f"{' ...' if len(missing) > 5 else ''}")
    if unexpected:
        raise CheckpointError(f"checkpoint {path}: unexpected member(s) {unexpected[:5]}"
                              f"{' ...' if len(unexpected) > 5 else ''}")
    for name, size in expected.items():
        if name != MANIFEST and present[name] != size:
            raise CheckpointError(f"checkpoint {path}: member {name!r} has {present[name]} "
                                  f"bytes, the manifest says {size}")
    if archive.names != list(expected):
        index = next(i for i, (a, b) in enumerate(zip(archive.names, expected)) if a != b)
        raise CheckpointError(f"checkpoint {path}: members are not in the writer's order: member {index} is "
                              f"{archive.names[index]!r}, the writer writes {list(expected)[index]!r} there",
                              code="noncanonical_archive")


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
    array = np.frombuffer(data, dtype=dtype).reshape(shape)  # read-only, over the archive's bytes
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


def _write_zip(handle, manifest_bytes, manifest, arrays):
    """The archive: manifest.json first, then each array member in manifest order, stored, fixed headers."""
    members = [(MANIFEST, manifest_bytes)]
    for entry, _ in _array_entries(manifest):
        members.append((entry["member"], _byte_view(arrays[entry["member"]])))
    checkpoint_zip.write(handle, members)
