"""The `.kiln-checkpoint` manifest's rules: its content id, artifact paths, field checks, and the caller's files and fields a publication accepts."""

import re

from trainer.jsonio import canonical_bytes, content_sha256, strict_loads
from trainer.runs.checkpoint_dir_names import (
    ADAPTER_NAME, CHECKPOINT_TYPES, HEX64, MANIFEST, MAX_FILES, MAX_MANIFEST_BYTES, MAX_PATH_DEPTH, OUTER_FIELDS,
    SCHEMA, SUMMARY_FIELDS, BadField, BadPath, ChecksumMismatch, InconsistentState, UnknownField, UnsupportedSchema,
    UnsupportedType)

_PATH_PART = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+=-]{0,254}\Z")  # no leading dot: nothing hidden


def content_id(manifest: dict) -> str:
    """SHA-256 of the canonical manifest without its own checkpoint_id: the checkpoint's identity."""
    return content_sha256(manifest, "checkpoint_id")


# ---------------------------------------------------------------------------------------------
# artifact paths and manifest fields


def check_artifact_path(path, where: str) -> str:
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


def check_path_set(paths, where: str):
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


def check_manifest(manifest: dict, name: str, allowed_manifest_fields) -> tuple[str, int]:
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
    if not isinstance(adapter, str) or not ADAPTER_NAME.match(adapter):
        raise BadField(f"{where}: manifest field 'adapter' must be an adapter name, got {adapter!r}")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise BadField(f"{where}: manifest field 'step' must be a non-negative integer, got {step!r}")
    checkpoint_id = manifest["checkpoint_id"]
    if not isinstance(checkpoint_id, str) or not HEX64.match(checkpoint_id):
        raise BadField(f"{where}: manifest field 'checkpoint_id' must be 64 lowercase hex digits")
    files = manifest["files"]
    if not isinstance(files, dict):
        raise BadField(f"{where}: manifest field 'files' must be an object of path -> {{size, sha256}}")
    if len(files) > MAX_FILES:
        raise BadField(f"{where}: manifest declares {len(files)} files; at most {MAX_FILES} are allowed")
    for path, entry in files.items():
        check_artifact_path(path, where)
        if not isinstance(entry, dict) or set(entry) != {"size", "sha256"}:
            raise BadField(f"{where}: files[{path!r}] must be exactly {{\"size\", \"sha256\"}}")
        size, digest = entry["size"], entry["sha256"]
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise BadField(f"{where}: files[{path!r}].size must be a non-negative integer, got {size!r}")
        if not isinstance(digest, str) or not HEX64.match(digest):
            raise BadField(f"{where}: files[{path!r}].sha256 must be 64 lowercase hex digits")
    check_path_set(list(files), where)
    if content_id(manifest) != checkpoint_id:
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



def byte_views(files) -> dict[str, memoryview]:
    if not isinstance(files, dict):
        raise BadField("files must be a dict of relative path -> bytes")
    if len(files) > MAX_FILES:
        raise BadField(f"{len(files)} files; a checkpoint holds at most {MAX_FILES}")
    views = {}
    for path in sorted(files):
        check_artifact_path(path, "publication")
        data = files[path]
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise BadField(f"files[{path!r}] must be bytes, got {type(data).__name__}")
        view = memoryview(data)
        if not view.c_contiguous:
            raise BadField(f"files[{path!r}] must be a contiguous buffer")
        views[path] = view.cast("B") if (view.format, view.ndim) != ("B", 1) else view
    check_path_set(list(views), "publication")
    return views


def caller_manifest(manifest) -> dict:
    if not isinstance(manifest, dict):
        raise BadField("manifest must be a dict of the caller's fields")
    reserved = sorted(set(map(str, manifest)) & set(OUTER_FIELDS))
    if reserved:
        raise BadField(f"manifest field(s) {', '.join(reserved)} are written by publish_checkpoint; remove them")
    try:
        encoded = canonical_bytes(manifest)
        parsed = strict_loads(encoded)
    except (TypeError, ValueError) as error:
        raise BadField(f"manifest is not strict JSON ({error}); use str keys, finite floats and integers "
                       "that fit 64 bits") from None
    if len(encoded) > MAX_MANIFEST_BYTES // 2:
        raise BadField(f"manifest is {len(encoded)} bytes; keep it under {MAX_MANIFEST_BYTES // 2}")
    return parsed
