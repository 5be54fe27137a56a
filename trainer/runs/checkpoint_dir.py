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

This module is the format's public face; the work is done in checkpoint_dir_names (constants,
errors, names), checkpoint_dir_manifest (manifest rules), checkpoint_dir_publish,
checkpoint_dir_load and checkpoint_dir_registry, over trainer.fsio and trainer.jsonio.
"""

from trainer.fsio import IO_CHUNK, PIPELINE_MIN, READ_CHUNK  # bench and tests read them here
from trainer.runs.checkpoint_dir_load import LoadedCheckpoint, checkpoint_summary, load_checkpoint
from trainer.runs.checkpoint_dir_manifest import content_id
from trainer.runs.checkpoint_dir_names import (
    CHECKPOINT_TYPES, ERRORS, MANIFEST, MAX_FILES, MAX_INT, MAX_JSON_DEPTH, MAX_MANIFEST_BYTES, MAX_PATH_DEPTH,
    OUTER_FIELDS, PEFT_MARKER, SCHEMA, SENTINEL, SUFFIX, SUMMARY_FIELDS, BadField, BadPath, CheckpointError,
    CheckpointNotFound, ChecksumMismatch, ExtraFile, HardLinkRefused, IncompleteCheckpoint, InconsistentState,
    MissingFile, MissingManifest, NameExists, NoncanonicalName, NotACheckpoint, OutsideRegistry, SizeMismatch,
    SymlinkRefused, UnknownField, UnsupportedSchema, UnsupportedType, UntrackedFile, WrongAdapter, WrongKind,
    check_adapter_name, checkpoint_basename, parse_basename)
from trainer.runs.checkpoint_dir_publish import SYNC_THREADS, publish_checkpoint
from trainer.runs.checkpoint_dir_registry import (
    checkpoint_not_found, delete_adapter_checkpoints, later_checkpoints, latest_checkpoint, list_checkpoints,
    list_staging_orphans, remove_staging_orphans, resolve_checkpoint)

__all__ = [
    "IO_CHUNK", "PIPELINE_MIN", "READ_CHUNK", "CHECKPOINT_TYPES", "ERRORS", "MANIFEST", "MAX_FILES", "MAX_INT", "MAX_JSON_DEPTH", "MAX_MANIFEST_BYTES",
    "MAX_PATH_DEPTH", "OUTER_FIELDS", "PEFT_MARKER", "SCHEMA", "SENTINEL", "SUFFIX", "SUMMARY_FIELDS",
    "SYNC_THREADS", "BadField", "BadPath", "CheckpointError", "CheckpointNotFound", "ChecksumMismatch",
    "ExtraFile", "HardLinkRefused", "IncompleteCheckpoint", "InconsistentState", "LoadedCheckpoint",
    "MissingFile", "MissingManifest", "NameExists", "NoncanonicalName", "NotACheckpoint", "OutsideRegistry",
    "SizeMismatch", "SymlinkRefused", "UnknownField", "UnsupportedSchema", "UnsupportedType", "UntrackedFile",
    "WrongAdapter", "WrongKind", "check_adapter_name", "checkpoint_basename",
    "checkpoint_not_found", "checkpoint_summary", "content_id",
    "delete_adapter_checkpoints", "later_checkpoints", "latest_checkpoint", "list_checkpoints", "list_staging_orphans",
    "load_checkpoint", "parse_basename", "publish_checkpoint", "remove_staging_orphans", "resolve_checkpoint",
]
