"""Atomic publication of a `.kiln-checkpoint`: stage, write and hash in parallel, fsync, remove the sentinel, rename into place without replacing."""

import errno
import os
import secrets
import shutil
import time
from pathlib import Path

from trainer import fsio
from trainer.jsonio import canonical_bytes
from trainer.runs.checkpoint_dir_manifest import byte_views, caller_manifest, check_manifest, content_id
from trainer.runs.checkpoint_dir_names import (
    CHECKPOINT_TYPES, MANIFEST, MAX_MANIFEST_BYTES, SCHEMA, SENTINEL, BadField, NameExists, UnsupportedType,
    checkpoint_basename)

SYNC_THREADS = 4  # fsyncs in flight at once; they wait on the device, not the CPU
POOLS = fsio.ThreadPools("kiln-ckpt")  # "hash" and "sync" here, "verify" for loading


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
    views = byte_views(files)
    body = caller_manifest(manifest)
    registry = Path(registry)
    if not registry.is_dir():
        registry.mkdir(parents=True, exist_ok=True)
        fsio.fsync_dir(registry.parent)  # the registry's own entry is durable before anything inside it
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
        pool = POOLS.get("hash", max(1, (os.cpu_count() or 1) - 1))
        syncer = POOLS.get("sync", SYNC_THREADS)
        hashes = {path: pool.submit(fsio.sha256_timed, views[path])
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
                    fsio.write_all(fd, view)
                    syncs.append(syncer.submit(os.fsync, fd))  # overlaps the next file's write
                    timing["write_seconds"] += time.perf_counter() - t
                    stage(f"file:{path}")
                for subdir in reversed(subdirs):
                    syncs.append(syncer.submit(fsio.fsync_dir, staging / subdir))
                entries = {}
                for path in views:
                    future = hashes[path]
                    digest, seconds = fsio.sha256_timed(views[path]) if future.cancel() else future.result()
                    timing["hash_seconds"] += seconds
                    entries[path] = {"size": views[path].nbytes, "sha256": digest}
                full = {**body, "schema": SCHEMA, "checkpoint_type": checkpoint_type, "adapter": adapter,
                        "step": step, "files": entries}
                full["checkpoint_id"] = content_id(full)
                encoded = canonical_bytes(full) + b"\n"
                if len(encoded) > MAX_MANIFEST_BYTES:
                    raise BadField(f"manifest would be {len(encoded)} bytes; the loader accepts {MAX_MANIFEST_BYTES}")
                check_manifest(full, basename, None)  # never publish what the loader would refuse
                # The manifest is written while the files' fsyncs are still in flight and synced
                # beside them: the sentinel, removed only after every sync below has returned, is
                # what makes the directory complete, so this order publishes nothing earlier and
                # saves one serial device flush.
                t = time.perf_counter()
                fd = os.open(staging / MANIFEST, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                descriptors.append(fd)
                fsio.write_all(fd, memoryview(encoded))
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
        fsio.fsync_dir(staging)
        timing["fsync_seconds"] += time.perf_counter() - t
        stage("sentinel_removed")
        t = time.perf_counter()
        try:
            fsio.rename_noreplace(staging, target)
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
    fsio.fsync_dir(registry)
    timing["fsync_seconds"] += time.perf_counter() - t
    timing["total_seconds"] = time.perf_counter() - started
    stage("published")
    if on_timing is not None:
        on_timing(timing)
    return target
