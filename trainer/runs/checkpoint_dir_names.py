"""The `.kiln-checkpoint` format's constants, its refusals (each a `CheckpointError` with a stable `code`) and its canonical names."""

import re

from trainer import jsonio

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
MAX_JSON_DEPTH = jsonio.MAX_DEPTH  # manifest nesting; real ones nest 4 deep, and json/deepcopy recurse per level
MAX_INT = jsonio.MAX_INT  # JSON integers must fit a signed 64-bit value
MIN_INT = jsonio.MIN_INT

LINEAGE_SUFFIXES = (".lineage.json", ".lineage.lock")  # trainer.lineage's files beside the adapters' snapshots
ADAPTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}\Z")
_BASENAME = re.compile(r"(?P<adapter>.+)-checkpoint-step-(?P<step>[0-9]{8,19})" + re.escape(SUFFIX) + r"\Z")
_STAGING = re.compile(r"\.(?P<basename>.+" + re.escape(SUFFIX) + r")\.staging-[0-9a-f]{16}\Z")
_PATH_PART = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+=-]{0,254}\Z")  # no leading dot: nothing hidden
HEX64 = re.compile(r"[0-9a-f]{64}\Z")


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




def check_adapter_name(adapter) -> str:
    """The adapter name unchanged, or NoncanonicalName saying what is wrong with it."""
    if not isinstance(adapter, str) or not ADAPTER_NAME.match(adapter):
        raise NoncanonicalName(
            f"adapter name {adapter!r} is not valid: use 1-100 characters from A-Z a-z 0-9 . _ -, "
            "starting with a letter or digit")
    if ".." in adapter:
        raise NoncanonicalName(f"adapter name {adapter!r} must not contain '..'")
    if "-checkpoint-step-" in adapter or adapter.endswith(SUFFIX):
        raise NoncanonicalName(f"adapter name {adapter!r} must not contain '-checkpoint-step-' or end in "
                               f"{SUFFIX!r}: it would make checkpoint names ambiguous")
    if adapter.endswith(LINEAGE_SUFFIXES):
        raise NoncanonicalName(f"adapter name {adapter!r} must not end in {' or '.join(LINEAGE_SUFFIXES)}: the "
                               "registry keeps each adapter's lineage under such names")
    return adapter


def check_step(step) -> int:
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= MAX_INT:
        raise NoncanonicalName(f"checkpoint step {step!r} must be an integer from 0 to {MAX_INT}")
    return step


def checkpoint_basename(adapter: str, step: int) -> str:
    """`{adapter}-checkpoint-step-{step:08d}.kiln-checkpoint`, after validating both parts."""
    return f"{check_adapter_name(adapter)}-checkpoint-step-{check_step(step):08d}{SUFFIX}"


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


def staging_basename(name: str) -> str | None:
    """The canonical basename a hidden staging directory was publishing, or None."""
    match = _STAGING.match(name)
    if match is None:
        return None
    try:
        parse_basename(match["basename"])
    except NoncanonicalName:
        return None
    return match["basename"]
