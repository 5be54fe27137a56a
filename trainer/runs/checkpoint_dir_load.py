"""Strict loading of a `.kiln-checkpoint`: every refusal before anything is returned, each file read once, hashed while read, beneath the checkpoint only."""

import errno
import hashlib
import json
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

from trainer import fsio
from trainer.jsonio import canonical_bytes, strict_loads
from trainer.runs.checkpoint_dir_manifest import check_manifest
from trainer.runs.checkpoint_dir_names import (
    MANIFEST, MAX_FILES, MAX_MANIFEST_BYTES, PEFT_MARKER, SENTINEL, SUFFIX, BadField, CheckpointError,
    CheckpointNotFound, ChecksumMismatch, ExtraFile, HardLinkRefused, InconsistentState, IncompleteCheckpoint,
    MissingFile, MissingManifest, NotACheckpoint, SizeMismatch, SymlinkRefused, UntrackedFile, WrongAdapter,
    WrongKind, parse_basename)
from trainer.runs.checkpoint_dir_publish import POOLS


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
        root = open_dir(self.path)
        try:
            return read_verified(root, name, entry, None, self.path.name)
        finally:
            os.close(root)

    def read_json(self, name: str):
        """One declared file, verified as `read` does, parsed as JSON."""
        data = self.read(name)
        return json.loads(data if isinstance(data, bytes) else bytes(data))


def open_dir(path) -> int:
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
    try:
        return fsio.open_beneath(root, relpath)
    except fsio.Refused as refused:
        if refused.reason == "link_on_path":
            raise SymlinkRefused(f"{relpath!r}: {refused.part!r} is a symlink or not a directory") from None
        if refused.reason == "link":
            raise SymlinkRefused(f"{relpath!r} is a symlink") from None
        raise MissingFile(f"declared artifact {relpath!r} is missing") from None


def _single_file(fd: int, where: str) -> os.stat_result:
    """The stat of an open checkpoint file, refused unless it is a regular file with exactly one link."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise UntrackedFile(f"{where} is not a regular file")
    if st.st_nlink > 1:
        raise HardLinkRefused(f"{where} has {st.st_nlink} hard links; checkpoint files must have exactly one")
    return st


def read_verified(root: int, relpath: str, entry: dict, expected_stat, name: str) -> bytes:
    """Read one artifact once, check it is the same regular single-link file, its size and SHA-256."""
    where = f"checkpoint {name}: artifact {relpath!r}"
    fd = _open_beneath(root, relpath)
    try:
        st = _single_file(fd, where)
        if expected_stat is not None and (st.st_ino, st.st_dev) != expected_stat:
            raise InconsistentState(f"{where} was replaced while the checkpoint was being validated")
        if st.st_size != entry["size"]:
            raise SizeMismatch(f"{where} holds {st.st_size} bytes; the manifest declares {entry['size']}")
        data, digest, count = fsio.read_hashed(fd, entry["size"])
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
        raise NotACheckpoint(peft_message(name)) from None
    try:
        st = _single_file(fd, f"checkpoint {name}: {MANIFEST}")
        if st.st_size > MAX_MANIFEST_BYTES:
            raise BadField(f"checkpoint {name}: {MANIFEST} is {st.st_size} bytes; the limit is {MAX_MANIFEST_BYTES}")
        data = fsio.read_exact(fd, st.st_size)
        if os.read(fd, 1):
            raise BadField(f"checkpoint {name}: {MANIFEST} grew while being read")
        return data
    finally:
        os.close(fd)


def is_peft_snapshot(path: Path) -> bool:
    """A real directory holding adapter_config.json and no checkpoint manifest."""
    return (os.path.isdir(path) and not os.path.islink(path) and os.path.lexists(path / PEFT_MARKER)
            and not os.path.lexists(path / MANIFEST))


def peft_message(name: str) -> str:
    return (f"{name} is a PEFT adapter snapshot (it holds {PEFT_MARKER}), not a resumable .kiln-checkpoint: it "
            "has the weights only, no optimizer, scheduler, cursor or RNG state. Pass a "
            f"*-checkpoint-step-NNNNNNNN{SUFFIX} name to resume, or use base_adapter for a weights-only warm start")


def load_checkpoint(path, *, full: bool = True, expected_type=None, expected_adapter=None,
                    allowed_manifest_fields=None) -> LoadedCheckpoint:
    """Validate the checkpoint at `path` completely, then return it; a CheckpointError otherwise.

    full=True (admission, dequeue) reads every declared file once and checks its size and
    SHA-256, then runs its training kind's semantic state validation (`check_run_state`);
    full=False (status) checks everything else, sizes by stat, and hashes nothing.
    `allowed_manifest_fields`: the caller's top-level manifest fields; any other field is
    refused (None accepts any caller field). expected_type / expected_adapter refuse a
    checkpoint of another training kind or adapter.
    """
    path = Path(path)
    name = path.name
    if is_peft_snapshot(path):
        raise NotACheckpoint(peft_message(name), path=path)
    parse_basename(name)
    root = open_dir(path)
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
            manifest = strict_loads(raw)
        except ValueError as error:
            raise BadField(f"checkpoint {name}: {MANIFEST} is not strict JSON: {error}", path=path) from None
        if not isinstance(manifest, dict):
            raise BadField(f"checkpoint {name}: {MANIFEST} must hold a JSON object", path=path)
        adapter, step = check_manifest(manifest, name, allowed_manifest_fields)
        if canonical_bytes(manifest) + b"\n" != raw:
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
            pool = POOLS.get("verify", os.cpu_count() or 1)  # a file a core: hashing is the work, reads are memcpy
            futures = {rel: pool.submit(read_verified, root, rel, declared[rel], found[rel][1:], name)
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
    if full:
        check_run_state(manifest, data, path)
    return LoadedCheckpoint(path=path, manifest=manifest, checkpoint_id=manifest["checkpoint_id"],
                            manifest_digest=hashlib.sha256(raw).hexdigest(), files=data)


def check_run_state(manifest: dict, files: dict, path=None) -> None:
    """The semantic validation of a run's checkpoint, by its training kind (RunKind.check_state); no I/O.

    It applies to what the SFT, GRPO and OPD runs publish: a manifest with a `planning` identity. A
    manifest without one (a format test's payload, a stand-in runner's) is not exact-resume authority:
    admission refuses it (planning_schema), so there is no run state to prove. A validator that fails
    in an unforeseen way refuses the checkpoint too (inconsistent_state), never an internal error.
    """
    if "planning" not in manifest:
        return
    from trainer.runs import run_kind
    check = run_kind(manifest["checkpoint_type"]).check_state
    if check is None:
        return
    try:
        check(manifest, files)
    except CheckpointError as error:
        error.path = path
        raise
    except (ArithmeticError, AttributeError, IndexError, KeyError, TypeError, ValueError) as error:
        raise InconsistentState(f"checkpoint {Path(path).name if path else manifest.get('adapter')}: its state "
                                f"cannot be validated ({type(error).__name__}: {error}); it was edited or written "
                                "by another program. Resume from an unedited checkpoint", path=path) from None


def checkpoint_summary(loaded: LoadedCheckpoint) -> dict:
    """What job status reports as latest_checkpoint: the resume basename, identity and progress."""
    m = loaded.manifest
    return {**(m.get("progress") or {}), "resume_checkpoint": loaded.path.name,
            "training_kind": m["checkpoint_type"], "adapter": m["adapter"], "step": m["step"],
            "checkpoint_id": loaded.checkpoint_id, "manifest_sha256": loaded.manifest_digest}
