"""The `.kiln-checkpoint` run directory: its name, atomic publication, strict loading and deletion.

A checkpoint is a directory directly inside the adapter registry named
`{adapter}-checkpoint-step-{step:08d}.kiln-checkpoint`. It holds the caller's state files
and one canonical `checkpoint_manifest.json` (schema kiln.training-checkpoint.v1) that
declares each file's size and SHA-256 and carries a `checkpoint_id`, the SHA-256 of the
canonical manifest without that id. Publication stages everything in a hidden sibling
directory and renames it into place, so the canonical name is absent before publication and
complete after it; names are never overwritten. The loader refuses anything it cannot prove
(each refusal is a `CheckpointError` subclass with a stable `code`) and returns nothing
until validation has finished. The format and protocol are described in
docs/run-checkpoints.md. The SFT, GRPO and OPD loops decide what goes inside.
"""

import ctypes
import errno
import hashlib
import json
import mmap
import os
import queue
import re
import secrets
import shutil
import stat
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

SCHEMA = "kiln.training-checkpoint.v1"
CHECKPOINT_TYPES = ("sft", "grpo", "opd")
SUFFIX = ".kiln-checkpoint"
MANIFEST = "checkpoint_manifest.json"
SENTINEL = ".incomplete"
PEFT_MARKER = "adapter_config.json"
OUTER_FIELDS = ("schema", "checkpoint_type", "adapter", "step", "files", "checkpoint_id")
SUMMARY_FIELDS = ("resume_checkpoint", "training_kind", "adapter", "step", "checkpoint_id")
MAX_MANIFEST_BYTES = 16 << 20  # identities, cursors and loss history: real manifests are kilobytes
MAX_FILES = 4096  # declared artifacts; far above any run's state files, far below a walk that hurts
MAX_PATH_DEPTH = 8  # directory levels inside a checkpoint
MAX_JSON_DEPTH = 64  # manifest nesting; real ones nest 4 deep, and json/deepcopy recurse per level
MAX_INT = 2 ** 63 - 1  # JSON integers must fit a signed 64-bit value
MIN_INT = -(2 ** 63)
IO_CHUNK = 64 << 20  # one write() call; large enough that syscall overhead vanishes
READ_CHUNK = 4 << 20  # validation reads land in chunks this size (cache-sized), each hashed while the next is read
SYNC_THREADS = 4  # fsyncs in flight at once; they wait on the device, not the CPU
PIPELINE_MIN = 4 << 20  # below this a file is read, then hashed, in one thread

_ADAPTER = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}\Z")
_BASENAME = re.compile(r"(?P<adapter>.+)-checkpoint-step-(?P<step>[0-9]{8,19})" + re.escape(SUFFIX) + r"\Z")
_STAGING = re.compile(r"\.(?P<basename>.+" + re.escape(SUFFIX) + r")\.staging-[0-9a-f]{16}\Z")
_PATH_PART = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+=-]{0,254}\Z")  # no leading dot: nothing hidden
_HEX64 = re.compile(r"[0-9a-f]{64}\Z")
_RENAME_NOREPLACE = 1  # linux/fs.h
_AT_FDCWD = -100


class CheckpointError(Exception):
    """A refused checkpoint operation; `code` is stable, the message says what to do."""

    code = "checkpoint_error"

    def __init__(self, message: str, path=None):
        super().__init__(message)
        self.message = message
        self.path = path


class NoncanonicalName(CheckpointError):
    code = "noncanonical_name"


class MissingManifest(CheckpointError):
    code = "missing_manifest"


class IncompleteCheckpoint(CheckpointError):
    code = "incomplete"


class UnsupportedSchema(CheckpointError):
    code = "unsupported_schema"


class UnsupportedType(CheckpointError):
    code = "unsupported_type"


class UnknownField(CheckpointError):
    code = "unknown_field"


class BadField(CheckpointError):
    code = "bad_field"


class BadPath(CheckpointError):
    code = "bad_path"


class UntrackedFile(CheckpointError):
    """Something that cannot be an artifact: a FIFO, socket or device, or a declared path that is a directory."""

    code = "untracked_file"


class SymlinkRefused(CheckpointError):
    code = "symlink"


class HardLinkRefused(CheckpointError):
    code = "hard_link"


class MissingFile(CheckpointError):
    code = "missing_file"


class ExtraFile(CheckpointError):
    code = "extra_file"


class SizeMismatch(CheckpointError):
    code = "size_mismatch"


class ChecksumMismatch(CheckpointError):
    code = "checksum_mismatch"


class InconsistentState(CheckpointError):
    code = "inconsistent_state"


class NotACheckpoint(CheckpointError):
    code = "not_a_checkpoint"


class NameExists(CheckpointError):
    code = "name_exists"


class OutsideRegistry(CheckpointError):
    code = "outside_registry"


class CheckpointNotFound(CheckpointError):
    code = "not_found"


class WrongKind(CheckpointError):
    code = "wrong_kind"


class WrongAdapter(CheckpointError):
    code = "wrong_adapter"


ERRORS = {cls.code: cls for cls in (
    NoncanonicalName, MissingManifest, IncompleteCheckpoint, UnsupportedSchema, UnsupportedType,
    UnknownField, BadField, BadPath, UntrackedFile, SymlinkRefused, HardLinkRefused, MissingFile,
    ExtraFile, SizeMismatch, ChecksumMismatch, InconsistentState, NotACheckpoint, NameExists,
    OutsideRegistry, CheckpointNotFound, WrongKind, WrongAdapter)}


# ---------------------------------------------------------------------------------------------
# names


def check_adapter_name(adapter) -> str:
    """The adapter name unchanged, or NoncanonicalName saying what is wrong with it."""
    if not isinstance(adapter, str) or not _ADAPTER.match(adapter):
        raise NoncanonicalName(
            f"adapter name {adapter!r} is not valid: use 1-100 characters from A-Z a-z 0-9 . _ -, "
            "starting with a letter or digit")
    if ".." in adapter:
        raise NoncanonicalName(f"adapter name {adapter!r} must not contain '..'")
    if "-checkpoint-step-" in adapter or adapter.endswith(SUFFIX):
        raise NoncanonicalName(f"adapter name {adapter!r} must not contain '-checkpoint-step-' or end in "
                               f"{SUFFIX!r}: it would make checkpoint names ambiguous")
    return adapter


def _check_step(step) -> int:
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= MAX_INT:
        raise NoncanonicalName(f"checkpoint step {step!r} must be an integer from 0 to {MAX_INT}")
    return step


def checkpoint_basename(adapter: str, step: int) -> str:
    """`{adapter}-checkpoint-step-{step:08d}.kiln-checkpoint`, after validating both parts."""
    return f"{check_adapter_name(adapter)}-checkpoint-step-{_check_step(step):08d}{SUFFIX}"


def parse_basename(name) -> tuple[str, int]:
    """(adapter, step) of a canonical checkpoint basename; NoncanonicalName otherwise."""
    match = _BASENAME.match(name) if isinstance(name, str) else None
    if match is not None:
        adapter, step = match["adapter"], int(match["step"])
        try:
            if checkpoint_basename(adapter, step) == name:  # also refuses extra leading zeros
                return adapter, step
        except NoncanonicalName:
            pass
    raise NoncanonicalName(
        f"{name!r} is not a canonical checkpoint name: expected ADAPTER-checkpoint-step-NNNNNNNN{SUFFIX} "
        "(8 or more digits, no extra leading zeros), as reported in latest_checkpoint.resume_checkpoint")


def _staging_basename(name: str) -> str | None:
    """The canonical basename a hidden staging directory was publishing, or None."""
    match = _STAGING.match(name)
    if match is None:
        return None
    try:
        parse_basename(match["basename"])
    except NoncanonicalName:
        return None
    return match["basename"]


# ---------------------------------------------------------------------------------------------
# canonical JSON


def _canonical(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                      allow_nan=False).encode("ascii")


def _pairs(pairs):
    out = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def _parse_int(text):
    if len(text.lstrip("-")) > 19:
        raise ValueError(f"integer {text[:24]}... does not fit 64 bits")
    value = int(text)
    if not MIN_INT <= value <= MAX_INT:
        raise ValueError(f"integer {text} does not fit 64 bits")
    return value


def _parse_float(text):
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise ValueError(f"number {text[:24]} overflows a double")
    return value


def _parse_constant(text):
    raise ValueError(f"{text} is not JSON")


def _strict_json(data: bytes):
    """Parse JSON refusing duplicate keys, NaN/Infinity, overflowing numbers and deep nesting."""
    try:
        text = data.decode("utf-8")
        value = json.loads(text, object_pairs_hook=_pairs, parse_int=_parse_int,
                           parse_float=_parse_float, parse_constant=_parse_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as error:
        raise ValueError(str(error) or type(error).__name__) from None
    pending = [(value, 1)]  # a depth the parser survives may still overflow json.dumps or deepcopy
    while pending:
        item, depth = pending.pop()
        if depth > MAX_JSON_DEPTH:
            raise ValueError(f"nested deeper than {MAX_JSON_DEPTH} levels")
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else ()
        pending.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return value


def _checkpoint_id(manifest: dict) -> str:
    return hashlib.sha256(_canonical({k: v for k, v in manifest.items() if k != "checkpoint_id"})).hexdigest()


# ---------------------------------------------------------------------------------------------
# artifact paths and manifest fields


def _check_artifact_path(path, where: str) -> str:
    """A declared artifact path: relative POSIX, normalized, nothing hidden or escaping."""
    if not isinstance(path, str) or not path:
        raise BadPath(f"{where}: artifact path {path!r} must be a non-empty string")
    if "\x00" in path:
        raise BadPath(f"{where}: artifact path {path!r} contains NUL")
    if "\\" in path:
        raise BadPath(f"{where}: artifact path {path!r} contains a backslash; use '/'")
    if path.startswith("/"):
        raise BadPath(f"{where}: artifact path {path!r} is absolute; it must be relative to the checkpoint")
    parts = path.split("/")
    if any(part in ("..", ".") for part in parts):
        raise BadPath(f"{where}: artifact path {path!r} is not normalized or escapes the checkpoint "
                      "('.' or '..')")
    if any(part == "" for part in parts):
        raise BadPath(f"{where}: artifact path {path!r} is not normalized (empty component)")
    if len(parts) > MAX_PATH_DEPTH or len(path) > 1024:
        raise BadPath(f"{where}: artifact path {path!r} is deeper than {MAX_PATH_DEPTH} levels or "
                      "longer than 1024 characters")
    for part in parts:
        if not _PATH_PART.match(part):
            raise BadPath(f"{where}: artifact path {path!r}: component {part!r} must use A-Z a-z 0-9 _ . + = - "
                          "and not start with '.' (at most 255 characters)")
    if path == MANIFEST:
        raise BadPath(f"{where}: artifact path {path!r} is reserved for the manifest")
    return path


def _check_path_set(paths, where: str):
    folded = {}
    for path in paths:
        key = path.casefold()
        if key in folded:
            raise BadPath(f"{where}: artifact paths {folded[key]!r} and {path!r} differ only in case")
        folded[key] = path
    declared = set(paths)
    for path in paths:
        parts = path.split("/")
        for i in range(1, len(parts)):
            if "/".join(parts[:i]) in declared:
                raise BadPath(f"{where}: artifact {'/'.join(parts[:i])!r} is both a file and the directory "
                              f"holding {path!r}")


def _check_manifest(manifest: dict, name: str, allowed_manifest_fields) -> tuple[str, int]:
    """Schema, type, fields, file table, id and progress; returns (adapter, step). No I/O."""
    where = f"checkpoint {name}"
    schema = manifest.get("schema")
    if schema != SCHEMA:
        raise UnsupportedSchema(f"{where} has manifest schema {schema!r}; this Kiln reads only {SCHEMA!r}. "
                                "Resume it with the Kiln version that wrote it, or start a new run")
    kind = manifest.get("checkpoint_type")
    if kind not in CHECKPOINT_TYPES:
        raise UnsupportedType(f"{where} has checkpoint_type {kind!r}; supported types are "
                              f"{', '.join(CHECKPOINT_TYPES)}")
    missing = [key for key in OUTER_FIELDS if key not in manifest]
    if missing:
        raise BadField(f"{where}: manifest lacks required field(s) {', '.join(missing)}")
    if allowed_manifest_fields is not None:
        known = set(OUTER_FIELDS) | set(allowed_manifest_fields)
        unknown = sorted(set(manifest) - known)
        if unknown:
            raise UnknownField(f"{where}: manifest holds unknown field(s) {', '.join(map(repr, unknown))}; "
                               f"known fields are {', '.join(sorted(known))}. It was written by another "
                               "Kiln version or edited")
    adapter, step = manifest["adapter"], manifest["step"]
    if not isinstance(adapter, str) or not _ADAPTER.match(adapter):
        raise BadField(f"{where}: manifest field 'adapter' must be an adapter name, got {adapter!r}")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise BadField(f"{where}: manifest field 'step' must be a non-negative integer, got {step!r}")
    checkpoint_id = manifest["checkpoint_id"]
    if not isinstance(checkpoint_id, str) or not _HEX64.match(checkpoint_id):
        raise BadField(f"{where}: manifest field 'checkpoint_id' must be 64 lowercase hex digits")
    files = manifest["files"]
    if not isinstance(files, dict):
        raise BadField(f"{where}: manifest field 'files' must be an object of path -> {{size, sha256}}")
    if len(files) > MAX_FILES:
        raise BadField(f"{where}: manifest declares {len(files)} files; at most {MAX_FILES} are allowed")
    for path, entry in files.items():
        _check_artifact_path(path, where)
        if not isinstance(entry, dict) or set(entry) != {"size", "sha256"}:
            raise BadField(f"{where}: files[{path!r}] must be exactly {{\"size\", \"sha256\"}}")
        size, digest = entry["size"], entry["sha256"]
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise BadField(f"{where}: files[{path!r}].size must be a non-negative integer, got {size!r}")
        if not isinstance(digest, str) or not _HEX64.match(digest):
            raise BadField(f"{where}: files[{path!r}].sha256 must be 64 lowercase hex digits")
    _check_path_set(list(files), where)
    if _checkpoint_id(manifest) != checkpoint_id:
        raise ChecksumMismatch(f"{where}: checkpoint_id does not match the manifest's content: the manifest was "
                               "edited after publication. Do not edit checkpoints; resume from an unedited one")
    progress = manifest.get("progress")
    if progress is not None:
        if not isinstance(progress, dict):
            raise BadField(f"{where}: manifest field 'progress' must be an object")
        clash = sorted(set(progress) & set(SUMMARY_FIELDS))
        if clash:
            raise BadField(f"{where}: progress must not hold {', '.join(clash)} (they come from the manifest itself)")
        committed = progress.get("committed_step", step)
        if committed != step or isinstance(committed, bool):
            raise InconsistentState(f"{where}: progress.committed_step is {committed!r} but the checkpoint is "
                                    f"for step {step}")
        total = progress.get("total_steps")
        if isinstance(total, int) and not isinstance(total, bool) and step > total:
            raise InconsistentState(f"{where}: step {step} is beyond progress.total_steps {total}")
        if "complete" in progress and not isinstance(progress["complete"], bool):
            raise BadField(f"{where}: progress.complete must be true or false")
    return adapter, step


# ---------------------------------------------------------------------------------------------
# publication


def _load_renameat2():
    try:
        function = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return None
    function.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint)
    function.restype = ctypes.c_int
    return function


_RENAMEAT2 = _load_renameat2()  # read-only after import; None where libc lacks it


def _rename_noreplace(source: Path, target: Path):
    """Rename a directory to a name that must not exist; NameExists otherwise, never an overwrite."""
    if _RENAMEAT2 is not None:
        if _RENAMEAT2(_AT_FDCWD, os.fsencode(source), _AT_FDCWD, os.fsencode(target), _RENAME_NOREPLACE) == 0:
            return
        code = ctypes.get_errno()
        if code == errno.EEXIST:
            raise FileExistsError(code, os.strerror(code), str(target))
        if code not in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
            raise OSError(code, os.strerror(code), str(source))
    # no RENAME_NOREPLACE on this filesystem: check, then rename; rename(2) itself refuses a
    # non-empty target, so only an empty directory created in between could be replaced
    if os.path.lexists(target):
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(target))
    os.rename(source, target)


def _fsync_dir(path):
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_all(fd: int, view: memoryview):
    offset, size = 0, view.nbytes
    while offset < size:
        offset += os.write(fd, view[offset:offset + IO_CHUNK])


_pools: dict[str, ThreadPoolExecutor] = {}
_pools_lock = threading.Lock()


def _pool(name: str, workers: int) -> ThreadPoolExecutor:
    """A process-wide thread pool, started on first use and kept: starting threads is a visible
    part of a small checkpoint's time. A forked child starts its own."""
    with _pools_lock:
        pool = _pools.get(name)
        if pool is None:
            pool = _pools[name] = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=f"kiln-ckpt-{name}")
        return pool


def _forget_pools_after_fork() -> None:
    global _pools_lock
    _pools.clear()  # their threads are not in the child
    _pools_lock = threading.Lock()  # another thread may have held it at the fork


os.register_at_fork(after_in_child=_forget_pools_after_fork)


def _sha256(view: memoryview) -> tuple[str, float]:
    started = time.perf_counter()
    digest = hashlib.sha256(view).hexdigest()  # releases the GIL: overlaps the writes
    return digest, time.perf_counter() - started


def _byte_views(files) -> dict[str, memoryview]:
    if not isinstance(files, dict):
        raise BadField("files must be a dict of relative path -> bytes")
    if len(files) > MAX_FILES:
        raise BadField(f"{len(files)} files; a checkpoint holds at most {MAX_FILES}")
    views = {}
    for path in sorted(files):
        _check_artifact_path(path, "publication")
        data = files[path]
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise BadField(f"files[{path!r}] must be bytes, got {type(data).__name__}")
        view = memoryview(data)
        if not view.c_contiguous:
            raise BadField(f"files[{path!r}] must be a contiguous buffer")
        views[path] = view.cast("B") if (view.format, view.ndim) != ("B", 1) else view
    _check_path_set(list(views), "publication")
    return views


def _caller_manifest(manifest) -> dict:
    if not isinstance(manifest, dict):
        raise BadField("manifest must be a dict of the caller's fields")
    reserved = sorted(set(map(str, manifest)) & set(OUTER_FIELDS))
    if reserved:
        raise BadField(f"manifest field(s) {', '.join(reserved)} are written by publish_checkpoint; remove them")
    try:
        encoded = _canonical(manifest)
        parsed = _strict_json(encoded)
    except (TypeError, ValueError) as error:
        raise BadField(f"manifest is not strict JSON ({error}); use str keys, finite floats and integers "
                       "that fit 64 bits") from None
    if len(encoded) > MAX_MANIFEST_BYTES // 2:
        raise BadField(f"manifest is {len(encoded)} bytes; keep it under {MAX_MANIFEST_BYTES // 2}")
    return parsed


def publish_checkpoint(registry, adapter: str, step: int, *, checkpoint_type: str, files: dict,
                       manifest: dict, on_timing=None, on_stage=None) -> Path:
    """Publish files and manifest as `registry/{checkpoint_basename(adapter, step)}`; returns that path.

    Stages in a hidden sibling, writes an .incomplete sentinel, writes and fsyncs every file
    (hashing in parallel threads while writing), writes and fsyncs the manifest (its fsync
    beside the files'), removes the sentinel once all of them have returned, fsyncs the staging
    directory, renames into place without replacing anything (NameExists if the name
    exists, before or during publication) and fsyncs the registry. Identical inputs give
    byte-identical directories. `on_timing(dict)` receives hash/write/fsync/rename seconds
    and bytes; `on_stage(name)` is called after each step (crash tests kill the process there).
    """
    basename = checkpoint_basename(adapter, step)
    if checkpoint_type not in CHECKPOINT_TYPES:
        raise UnsupportedType(f"checkpoint_type {checkpoint_type!r} is not one of {', '.join(CHECKPOINT_TYPES)}")
    views = _byte_views(files)
    body = _caller_manifest(manifest)
    registry = Path(registry)
    if not registry.is_dir():
        registry.mkdir(parents=True, exist_ok=True)
        _fsync_dir(registry.parent)  # the registry's own entry is durable before anything inside it
    target = registry / basename
    exists_message = (f"checkpoint {basename} already exists in {registry}; checkpoint names are immutable and "
                      "never overwritten. To continue from an older checkpoint, first archive later "
                      f"{adapter} checkpoints outside the registry")
    if os.path.lexists(target):
        raise NameExists(exists_message, path=target)
    stage = on_stage or (lambda name: None)
    timing = {"hash_seconds": 0.0, "write_seconds": 0.0, "fsync_seconds": 0.0, "rename_seconds": 0.0,
              "bytes": sum(v.nbytes for v in views.values())}
    started = time.perf_counter()
    staging = registry / f".{basename}.staging-{secrets.token_hex(8)}"
    os.mkdir(staging)
    try:
        stage("staging")
        os.close(os.open(staging / SENTINEL, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
        stage("sentinel")
        # Hashing is the CPU work; writing is a memcpy into the page cache. One core writes while
        # the others hash, largest file first; once its writes are done the writing thread takes
        # over every hash no worker has started yet.
        pool = _pool("hash", max(1, (os.cpu_count() or 1) - 1))
        syncer = _pool("sync", SYNC_THREADS)
        hashes = {path: pool.submit(_sha256, views[path])
                  for path in sorted(views, key=lambda path: -views[path].nbytes)}
        try:
            subdirs = sorted({"/".join(p.split("/")[:i]) for p in views for i in range(1, p.count("/") + 1)},
                             key=lambda d: (d.count("/"), d))
            for subdir in subdirs:
                os.mkdir(staging / subdir)
            descriptors, syncs = [], []
            try:
                for path, view in views.items():
                    t = time.perf_counter()
                    fd = os.open(staging / path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                    descriptors.append(fd)
                    _write_all(fd, view)
                    syncs.append(syncer.submit(os.fsync, fd))  # overlaps the next file's write
                    timing["write_seconds"] += time.perf_counter() - t
                    stage(f"file:{path}")
                for subdir in reversed(subdirs):
                    syncs.append(syncer.submit(_fsync_dir, staging / subdir))
                entries = {}
                for path in views:
                    future = hashes[path]
                    digest, seconds = _sha256(views[path]) if future.cancel() else future.result()
                    timing["hash_seconds"] += seconds
                    entries[path] = {"size": views[path].nbytes, "sha256": digest}
                full = {**body, "schema": SCHEMA, "checkpoint_type": checkpoint_type, "adapter": adapter,
                        "step": step, "files": entries}
                full["checkpoint_id"] = _checkpoint_id(full)
                encoded = _canonical(full) + b"\n"
                if len(encoded) > MAX_MANIFEST_BYTES:
                    raise BadField(f"manifest would be {len(encoded)} bytes; the loader accepts {MAX_MANIFEST_BYTES}")
                _check_manifest(full, basename, None)  # never publish what the loader would refuse
                # The manifest is written while the files' fsyncs are still in flight and synced
                # beside them: the sentinel, removed only after every sync below has returned, is
                # what makes the directory complete, so this order publishes nothing earlier and
                # saves one serial device flush.
                t = time.perf_counter()
                fd = os.open(staging / MANIFEST, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                descriptors.append(fd)
                _write_all(fd, memoryview(encoded))
                syncs.append(syncer.submit(os.fsync, fd))
                timing["write_seconds"] += time.perf_counter() - t
                stage("manifest")
                t = time.perf_counter()
                for future in syncs:
                    future.result()
                timing["fsync_seconds"] += time.perf_counter() - t
            finally:
                for future in syncs:
                    future.exception()  # never close an fd a sync is still using
                for fd in descriptors:
                    os.close(fd)
        finally:
            for future in hashes.values():
                future.cancel() or future.exception()  # nothing reads the caller's buffers after return
        stage("synced")
        os.unlink(staging / SENTINEL)
        t = time.perf_counter()
        _fsync_dir(staging)
        timing["fsync_seconds"] += time.perf_counter() - t
        stage("sentinel_removed")
        t = time.perf_counter()
        try:
            _rename_noreplace(staging, target)
        except (FileExistsError, IsADirectoryError, NotADirectoryError) as error:
            raise NameExists(exists_message, path=target) from error
        except OSError as error:
            if error.errno in (errno.ENOTEMPTY, errno.EEXIST):
                raise NameExists(exists_message, path=target) from error
            raise
        timing["rename_seconds"] = time.perf_counter() - t
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    stage("renamed")
    t = time.perf_counter()
    _fsync_dir(registry)
    timing["fsync_seconds"] += time.perf_counter() - t
    timing["total_seconds"] = time.perf_counter() - started
    stage("published")
    if on_timing is not None:
        on_timing(timing)
    return target


# ---------------------------------------------------------------------------------------------
# loading


@dataclass(frozen=True)
class LoadedCheckpoint:
    """A fully validated checkpoint: its manifest, identity and (for a full load) every file's bytes."""

    path: Path
    manifest: dict
    checkpoint_id: str
    manifest_digest: str  # SHA-256 of checkpoint_manifest.json's bytes
    files: dict = field(default_factory=dict)  # path -> bytes; empty for a light (full=False) load

    @property
    def checkpoint_type(self) -> str:
        return self.manifest["checkpoint_type"]

    @property
    def adapter(self) -> str:
        return self.manifest["adapter"]

    @property
    def step(self) -> int:
        return self.manifest["step"]

    def read(self, name: str) -> bytes | memoryview:
        """One declared file's bytes; after a light load they are read now and verified (size, SHA-256).

        Files up to 4 MiB are `bytes`; larger ones a read-only memoryview over a private buffer
        (`trainer.tensorfiles.tensors_from_buffer` parses either; `read_json` parses JSON).
        """
        entry = self.manifest["files"].get(name)
        if entry is None:
            raise KeyError(f"{name!r} is not declared in checkpoint {self.path.name}")
        if name in self.files:
            return self.files[name]
        root = _open_dir(self.path)
        try:
            return _read_verified(root, name, entry, None, self.path.name)
        finally:
            os.close(root)


    def read_json(self, name: str):
        """One declared file, verified as `read` does, parsed as JSON."""
        data = self.read(name)
        return json.loads(data if isinstance(data, bytes) else bytes(data))


def _open_dir(path) -> int:
    """An fd on the checkpoint directory itself; everything beneath is opened relative to it."""
    try:
        st = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        raise CheckpointNotFound(f"no checkpoint at {path}", path=path) from None
    if stat.S_ISLNK(st.st_mode):
        raise SymlinkRefused(f"{path} is a symlink; a checkpoint must be a real directory", path=path)
    if not stat.S_ISDIR(st.st_mode):
        raise NotACheckpoint(f"{path} is not a directory", path=path)
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as error:
        if error.errno in (errno.ELOOP, errno.ENOTDIR):
            raise SymlinkRefused(f"{path} was replaced by a symlink or file", path=path) from None
        raise


def _open_beneath(root: int, relpath: str) -> int:
    """Open a declared file beneath the checkpoint, refusing a symlink at every level."""
    parts = relpath.split("/")
    fd, owned = root, False
    try:
        for part in parts[:-1]:
            try:
                next_fd = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            except OSError as error:
                if error.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise SymlinkRefused(f"{relpath!r}: {part!r} is a symlink or not a directory") from None
                raise
            if owned:
                os.close(fd)
            fd, owned = next_fd, True
        try:  # O_NONBLOCK: a FIFO swapped in after the walk must not block the open
            return os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=fd)
        except OSError as error:
            if error.errno == errno.ELOOP:
                raise SymlinkRefused(f"{relpath!r} is a symlink") from None
            if error.errno == errno.ENOENT:
                raise MissingFile(f"declared artifact {relpath!r} is missing") from None
            raise
    finally:
        if owned:
            os.close(fd)


def _read_exact(fd: int, size: int) -> bytes:
    data = os.read(fd, size) if size else b""  # one syscall below 2 GiB: no copy, no join
    if len(data) < size:
        chunks = [data]
        got = len(data)
        while got < size:
            chunk = os.read(fd, min(size - got, 1 << 30))
            if not chunk:
                break
            chunks.append(chunk)
            got += len(chunk)
        data = b"".join(chunks)
    return data


def _new_buffer(size: int) -> mmap.mmap:
    """A private anonymous mapping of `size` bytes for one artifact, on transparent huge pages
    where the kernel offers them.

    A reader thread lands chunks in it while this thread hashes the ones before, so a full
    validation costs about max(read, hash) instead of read + hash. A plain `bytearray` of a
    large file costs a page fault per 4 KiB while the kernel copies into it (for 1 GB that is
    as slow as the read itself); huge pages take one fault per 2 MiB.
    """
    buffer = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        buffer.madvise(mmap.MADV_HUGEPAGE)
    except (AttributeError, OSError):  # no THP on this kernel: 4 KiB pages, same bytes
        pass
    return buffer


def _read_hashed(fd: int, size: int) -> tuple[bytes | memoryview, str, int]:
    """Read up to `size` bytes once; returns (data, sha256 hex, bytes read), hashing while reading.

    Files up to PIPELINE_MIN come back as `bytes`; larger ones as a read-only memoryview of a
    private buffer nothing else can write to.
    """
    if size <= PIPELINE_MIN:
        data = _read_exact(fd, size)
        return data, hashlib.sha256(data).hexdigest(), len(data)
    buffer = _new_buffer(size)
    view = memoryview(buffer)
    landed = queue.SimpleQueue()

    def reader():
        offset = 0
        try:
            while offset < size:
                count = os.readv(fd, [view[offset:offset + READ_CHUNK]])  # releases the GIL
                if count == 0:
                    break
                landed.put((offset, count))
                offset += count
        except BaseException as error:
            landed.put(error)
        landed.put(None)

    thread = threading.Thread(target=reader, name="kiln-ckpt-read", daemon=True)
    thread.start()
    digest, done = hashlib.sha256(), 0
    failure = None
    try:
        while (item := landed.get()) is not None:
            if isinstance(item, BaseException):
                failure = item
                continue
            offset, count = item
            digest.update(view[offset:offset + count])  # releases the GIL
            done += count
    finally:
        thread.join()
    if failure is not None:
        raise failure  # the buffer goes with the last reference to it
    return view.toreadonly(), digest.hexdigest(), done


def _read_verified(root: int, relpath: str, entry: dict, expected_stat, name: str) -> bytes:
    """Read one artifact once, check it is the same regular single-link file, its size and SHA-256."""
    where = f"checkpoint {name}: artifact {relpath!r}"
    fd = _open_beneath(root, relpath)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UntrackedFile(f"{where} is not a regular file")
        if st.st_nlink > 1:
            raise HardLinkRefused(f"{where} has {st.st_nlink} hard links; checkpoint files must have exactly one")
        if expected_stat is not None and (st.st_ino, st.st_dev) != expected_stat:
            raise InconsistentState(f"{where} was replaced while the checkpoint was being validated")
        if st.st_size != entry["size"]:
            raise SizeMismatch(f"{where} holds {st.st_size} bytes; the manifest declares {entry['size']}")
        data, digest, count = _read_hashed(fd, entry["size"])
        if count != entry["size"] or os.read(fd, 1):
            raise SizeMismatch(f"{where} changed size while being read")
    finally:
        os.close(fd)
    if digest != entry["sha256"]:
        raise ChecksumMismatch(f"{where} has SHA-256 {digest}; the manifest declares {entry['sha256']}. "
                               "The file changed after publication: do not edit checkpoints")
    return data


def _walk(root: int, name: str, declared: set) -> tuple[dict, set]:
    """Every entry beneath the checkpoint: {relpath: (size, ino, dev)} for files, and directories."""
    ancestors = {"/".join(p.split("/")[:i]) for p in declared for i in range(1, p.count("/") + 1)}
    files, dirs = {}, set()
    pending = [(root, "", False)]
    try:
        while pending:
            fd, prefix, owned = pending.pop()
            try:
                with os.scandir(fd) as entries:
                    listing = sorted(entries, key=lambda e: e.name)
                for entry in listing:
                    rel = prefix + entry.name
                    if not prefix and entry.name == MANIFEST:
                        continue
                    if len(files) + len(dirs) > MAX_FILES + len(ancestors) + 1:
                        raise ExtraFile(f"checkpoint {name} holds more entries than its manifest declares")
                    if entry.is_symlink():
                        raise SymlinkRefused(f"checkpoint {name}: {rel!r} is a symlink; checkpoints hold only "
                                             "regular files")
                    if entry.is_dir(follow_symlinks=False):
                        if rel in declared:
                            raise UntrackedFile(f"checkpoint {name}: declared artifact {rel!r} is a directory, "
                                                "not a regular file")
                        if rel not in ancestors:
                            raise ExtraFile(f"checkpoint {name} holds undeclared directory {rel!r}")
                        dirs.add(rel)
                        sub = _open_beneath_dir(fd, entry.name, name, rel)
                        pending.append((sub, rel + "/", True))
                        continue
                    st = entry.stat(follow_symlinks=False)
                    if not stat.S_ISREG(st.st_mode):
                        raise UntrackedFile(f"checkpoint {name}: {rel!r} is not a regular file or directory "
                                            "(FIFO, socket or device); checkpoints hold only regular files")
                    if st.st_nlink > 1:
                        raise HardLinkRefused(f"checkpoint {name}: {rel!r} has {st.st_nlink} hard links; "
                                              "checkpoint files must have exactly one")
                    files[rel] = (st.st_size, st.st_ino, st.st_dev)
            finally:
                if owned:
                    os.close(fd)
    except BaseException:
        for fd, _, owned in pending:
            if owned:
                os.close(fd)
        raise
    return files, dirs


def _open_beneath_dir(fd: int, part: str, name: str, rel: str) -> int:
    try:
        return os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
    except OSError as error:
        if error.errno in (errno.ELOOP, errno.ENOTDIR):
            raise SymlinkRefused(f"checkpoint {name}: {rel!r} changed into a symlink during validation") from None
        raise


def _read_manifest(root: int, name: str) -> bytes:
    try:  # O_NONBLOCK: opening a FIFO planted as the manifest must not wait for a writer
        fd = os.open(MANIFEST, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=root)
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise SymlinkRefused(f"checkpoint {name}: {MANIFEST} is a symlink") from None
        if error.errno != errno.ENOENT:
            raise
        try:
            os.stat(PEFT_MARKER, dir_fd=root, follow_symlinks=False)
        except FileNotFoundError:
            raise MissingManifest(f"checkpoint {name} has no {MANIFEST}; it is not a Kiln checkpoint "
                                  "(or was copied incompletely)") from None
        raise NotACheckpoint(_peft_message(name)) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UntrackedFile(f"checkpoint {name}: {MANIFEST} is not a regular file")
        if st.st_nlink > 1:
            raise HardLinkRefused(f"checkpoint {name}: {MANIFEST} has {st.st_nlink} hard links")
        if st.st_size > MAX_MANIFEST_BYTES:
            raise BadField(f"checkpoint {name}: {MANIFEST} is {st.st_size} bytes; the limit is {MAX_MANIFEST_BYTES}")
        data = _read_exact(fd, st.st_size)
        if os.read(fd, 1):
            raise BadField(f"checkpoint {name}: {MANIFEST} grew while being read")
        return data
    finally:
        os.close(fd)


def _is_peft_snapshot(path: Path) -> bool:
    """A real directory holding adapter_config.json and no checkpoint manifest."""
    return (os.path.isdir(path) and not os.path.islink(path) and os.path.lexists(path / PEFT_MARKER)
            and not os.path.lexists(path / MANIFEST))


def _peft_message(name: str) -> str:
    return (f"{name} is a PEFT adapter snapshot (it holds {PEFT_MARKER}), not a resumable .kiln-checkpoint: it "
            "has the weights only, no optimizer, scheduler, cursor or RNG state. Pass a "
            f"*-checkpoint-step-NNNNNNNN{SUFFIX} name to resume, or use base_adapter for a weights-only warm start")


def load_checkpoint(path, *, full: bool = True, expected_type=None, expected_adapter=None,
                    allowed_manifest_fields=None) -> LoadedCheckpoint:
    """Validate the checkpoint at `path` completely, then return it; a CheckpointError otherwise.

    full=True (admission, dequeue) reads every declared file once and checks its size and
    SHA-256; full=False (status) checks everything else, sizes by stat, and hashes nothing.
    `allowed_manifest_fields`: the caller's top-level manifest fields; any other field is
    refused (None accepts any caller field). expected_type / expected_adapter refuse a
    checkpoint of another training kind or adapter.
    """
    path = Path(path)
    name = path.name
    if _is_peft_snapshot(path):
        raise NotACheckpoint(_peft_message(name), path=path)
    parse_basename(name)
    root = _open_dir(path)
    try:
        try:
            os.stat(SENTINEL, dir_fd=root, follow_symlinks=False)
        except FileNotFoundError:
            pass
        else:
            raise IncompleteCheckpoint(f"checkpoint {name} holds an {SENTINEL} sentinel: its publication never "
                                       "finished. Resume from an earlier checkpoint", path=path)
        raw = _read_manifest(root, name)
        try:
            manifest = _strict_json(raw)
        except ValueError as error:
            raise BadField(f"checkpoint {name}: {MANIFEST} is not strict JSON: {error}", path=path) from None
        if not isinstance(manifest, dict):
            raise BadField(f"checkpoint {name}: {MANIFEST} must hold a JSON object", path=path)
        adapter, step = _check_manifest(manifest, name, allowed_manifest_fields)
        if _canonical(manifest) + b"\n" != raw:
            raise BadField(f"checkpoint {name}: {MANIFEST} is not in canonical form (sorted keys, fixed "
                           "separators); it was rewritten after publication", path=path)
        if (adapter, step) != parse_basename(name):
            raise InconsistentState(f"checkpoint {name}: its name says adapter {parse_basename(name)[0]!r} step "
                                    f"{parse_basename(name)[1]}, its manifest says adapter {adapter!r} step {step}; "
                                    "it was renamed", path=path)
        if expected_type is not None and manifest["checkpoint_type"] != expected_type:
            raise WrongKind(f"checkpoint {name} is a {manifest['checkpoint_type']} checkpoint; this request is "
                            f"{expected_type}. Resume it with the same training kind", path=path)
        if expected_adapter is not None and adapter != expected_adapter:
            raise WrongAdapter(f"checkpoint {name} belongs to adapter {adapter!r}; this request trains "
                               f"{expected_adapter!r}. Resume with output adapter {adapter!r}", path=path)
        declared = manifest["files"]
        found, _ = _walk(root, name, set(declared))
        missing = sorted(set(declared) - set(found))
        if missing:
            raise MissingFile(f"checkpoint {name} lacks declared artifact(s) {', '.join(map(repr, missing))}",
                              path=path)
        extra = sorted(set(found) - set(declared))
        if extra:
            raise ExtraFile(f"checkpoint {name} holds undeclared file(s) {', '.join(map(repr, extra))}; "
                            "nothing may be added to a checkpoint", path=path)
        for rel in sorted(declared):
            if found[rel][0] != declared[rel]["size"]:
                raise SizeMismatch(f"checkpoint {name}: artifact {rel!r} holds {found[rel][0]} bytes; the manifest "
                                   f"declares {declared[rel]['size']}", path=path)
        data = {}
        if full and declared:
            order = sorted(declared, key=lambda rel: -declared[rel]["size"])  # largest first
            pool = _pool("verify", os.cpu_count() or 1)  # a file a core: hashing is the work, reads are memcpy
            futures = {rel: pool.submit(_read_verified, root, rel, declared[rel], found[rel][1:], name)
                       for rel in order}
            errors = []
            for rel in sorted(futures):
                try:
                    data[rel] = futures[rel].result()
                except CheckpointError as error:
                    errors.append(error)
            if errors:
                errors[0].path = path
                raise errors[0]
            if _walk(root, name, set(declared))[0] != found:
                raise InconsistentState(f"checkpoint {name} changed while being validated", path=path)
    finally:
        os.close(root)
    return LoadedCheckpoint(path=path, manifest=manifest, checkpoint_id=manifest["checkpoint_id"],
                            manifest_digest=hashlib.sha256(raw).hexdigest(), files=data)


def checkpoint_summary(loaded: LoadedCheckpoint) -> dict:
    """What job status reports as latest_checkpoint: the resume basename, identity and progress."""
    m = loaded.manifest
    return {**(m.get("progress") or {}), "resume_checkpoint": loaded.path.name,
            "training_kind": m["checkpoint_type"], "adapter": m["adapter"], "step": m["step"],
            "checkpoint_id": loaded.checkpoint_id}


# ---------------------------------------------------------------------------------------------
# the registry


def resolve_checkpoint(registry, reference: str) -> Path:
    """The checkpoint a resume request names: a basename in the registry, or an absolute path directly in it."""
    registry_real = Path(os.path.realpath(registry))
    if not isinstance(reference, str) or not reference or "\x00" in reference:
        raise NoncanonicalName(f"resume_checkpoint {reference!r} must be a checkpoint basename")
    if os.path.isabs(reference):
        if os.path.normpath(reference) != reference:
            raise OutsideRegistry(f"resume_checkpoint {reference!r} is not a normalized path ('.', '..', repeated "
                                  f"or trailing '/'); pass the basename of a checkpoint in {registry_real}")
        parent, base = os.path.split(reference)
        try:
            inside = os.path.samefile(os.path.realpath(parent), registry_real)
        except OSError:
            inside = False
        if not inside:
            raise OutsideRegistry(f"resume_checkpoint {reference!r} is not directly inside the adapter registry "
                                  f"{registry_real}; checkpoints are only resumed from there")
    else:
        if "/" in reference or "\\" in reference or reference in (".", ".."):
            raise OutsideRegistry(f"resume_checkpoint {reference!r} is a nested or relative path; pass a single "
                                  f"checkpoint basename from {registry_real}")
        base = reference
    candidate = registry_real / base
    try:
        st = os.lstat(candidate)
    except (FileNotFoundError, NotADirectoryError):
        st = None
    if st is not None and stat.S_ISDIR(st.st_mode) and _is_peft_snapshot(candidate):
        raise NotACheckpoint(_peft_message(base), path=candidate)
    parse_basename(base)
    if st is None:
        raise CheckpointNotFound(f"checkpoint {base} does not exist in {registry_real}; job status reports the "
                                 "available latest_checkpoint", path=candidate)
    if stat.S_ISLNK(st.st_mode):
        raise SymlinkRefused(f"{candidate} is a symlink; a checkpoint must be a real directory in the registry",
                             path=candidate)
    if not stat.S_ISDIR(st.st_mode):
        raise NotACheckpoint(f"{candidate} is not a directory", path=candidate)
    return candidate


def _entries(registry):
    try:
        with os.scandir(registry) as entries:
            return [(e.name, e.is_dir(follow_symlinks=False)) for e in entries]
    except FileNotFoundError:
        return []


def list_checkpoints(registry, adapter: str | None = None) -> list[Path]:
    """Canonically named checkpoint directories (not validated), sorted by step; staging orphans ignored."""
    if adapter is not None:
        check_adapter_name(adapter)
    found = []
    for name, is_dir in _entries(registry):
        if not is_dir:
            continue  # symlinks and files with a canonical name are never offered
        try:
            owner, step = parse_basename(name)
        except NoncanonicalName:
            continue
        if adapter is None or owner == adapter:
            found.append((step, name))
    return [Path(registry) / name for _, name in sorted(found)]


def latest_checkpoint(registry, adapter: str) -> Path | None:
    """The highest-step checkpoint directory of the adapter, or None (validate it with load_checkpoint)."""
    paths = list_checkpoints(registry, adapter)
    return paths[-1] if paths else None


def list_staging_orphans(registry, adapter: str | None = None) -> list[Path]:
    """Hidden staging directories left by interrupted publications (or in progress right now)."""
    if adapter is not None:
        check_adapter_name(adapter)
    found = []
    for name, _ in _entries(registry):
        basename = _staging_basename(name)
        if basename is not None and (adapter is None or parse_basename(basename)[0] == adapter):
            found.append(Path(registry) / name)
    return sorted(found)


def remove_staging_orphans(registry, older_than: float, now: float | None = None) -> list[Path]:
    """Remove hidden staging directories untouched for `older_than` seconds; returns what was removed.

    A publication in progress touches its staging directory as each file is written, so an age of
    an hour or more is only ever an interrupted publication's leftovers. Nothing else is touched: a
    link or file squatting on a staging name is unlinked, never followed.
    """
    if not older_than >= 0:
        raise ValueError("older_than must be a number of seconds, 0 or more")
    now = time.time() if now is None else now
    removed = []
    for path in list_staging_orphans(registry):
        try:
            info = os.lstat(path)
            if now - info.st_mtime < older_than:
                continue
            if stat.S_ISDIR(info.st_mode):
                shutil.rmtree(path)
            else:
                os.unlink(path)
        except FileNotFoundError:
            continue  # gone meanwhile (its publication finished and renamed it, or another cleaner)
        removed.append(path)
    if removed:
        _fsync_dir(registry)
    return removed


def delete_adapter_checkpoints(registry, adapter: str) -> list[Path]:
    """Remove this adapter's checkpoints and staging orphans, and nothing else; returns what was removed."""
    check_adapter_name(adapter)
    removed = []
    for name, _ in sorted(_entries(registry)):
        basename = _staging_basename(name) or name
        try:
            owner, _ = parse_basename(basename)
        except NoncanonicalName:
            continue
        if owner != adapter:  # exact owner, so "bot" never removes "bot-2-checkpoint-step-..."
            continue
        path = Path(registry) / name
        if os.path.islink(path) or not path.is_dir():
            os.unlink(path)  # a link or file squatting on the name: remove it, never follow it
        else:
            shutil.rmtree(path)
        removed.append(path)
    if removed:
        _fsync_dir(registry)
    return removed
