"""Queries and clean-up over the adapter registry's checkpoints: resolve a resume reference, list by step, find staging orphans, delete an adapter's checkpoints."""

import errno
import os
import shutil
import stat
import time
from pathlib import Path

from trainer import fsio
from trainer.runs.checkpoint_dir_load import is_peft_snapshot, peft_message
from trainer.runs.checkpoint_dir_names import (
    CheckpointNotFound, NoncanonicalName, NotACheckpoint, OutsideRegistry, SymlinkRefused, check_adapter_name,
    parse_basename, staging_basename)


def checkpoint_not_found(registry, base: str) -> CheckpointNotFound:
    """The refusal for a checkpoint basename the registry does not hold; the control plane gives the same one for
    a checkpoint of an adapter the caller may not see."""
    registry_real = Path(os.path.realpath(registry))
    return CheckpointNotFound(f"checkpoint {base} does not exist in {registry_real}; job status reports the "
                              "available latest_checkpoint", path=registry_real / base)


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
    except OSError as error:  # absent; or a name too long to exist, which parse_basename refuses below
        if error.errno not in (errno.ENOENT, errno.ENOTDIR, errno.ENAMETOOLONG):
            raise
        st = None
    if st is not None and stat.S_ISDIR(st.st_mode) and is_peft_snapshot(candidate):
        raise NotACheckpoint(peft_message(base), path=candidate)
    parse_basename(base)
    if st is None:
        raise checkpoint_not_found(registry, base)
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


def later_checkpoints(registry, adapter: str, step: int) -> list[Path]:
    """The adapter's checkpoint directories after STEP, sorted by step (what a run resumed from STEP would reach)."""
    return [path for path in list_checkpoints(registry, adapter) if parse_basename(path.name)[1] > step]


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
        basename = staging_basename(name)
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
        fsio.fsync_dir(registry)
    return removed


def delete_adapter_checkpoints(registry, adapter: str) -> list[Path]:
    """Remove this adapter's checkpoints and staging orphans, and nothing else; returns what was removed."""
    check_adapter_name(adapter)
    removed = []
    for name, _ in sorted(_entries(registry)):
        basename = staging_basename(name) or name
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
        fsio.fsync_dir(registry)
    return removed
