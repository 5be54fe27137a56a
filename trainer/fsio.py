"""Durable file-system I/O shared by both checkpoint formats: fsync, no-replace rename, confined opens, hashed reads, staged publication and the worker thread pools.

Nothing here knows a checkpoint format: refusals are plain exceptions (OSError or `Refused`),
which each format turns into its own errors. It imports nothing of the project.
"""

import ctypes
import errno
import hashlib
import mmap
import os
import queue
import secrets
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor

from native_ext.validate import file_sha256  # noqa: F401  (one copy; trainer's modules read it here)

IO_CHUNK = 64 << 20  # one write() call; large enough that syscall overhead vanishes
READ_CHUNK = 4 << 20  # reads land in chunks this size (cache-sized), each hashed while the next is read
PIPELINE_MIN = 4 << 20  # below this a file is read, then hashed, in one thread

_RENAME_NOREPLACE = 1  # linux/fs.h
_AT_FDCWD = -100


# -- durability ---------------------------------------------------------------------------------


def fsync_dir(directory) -> None:
    """fsync a directory, so the entries created, removed or renamed in it are durable."""
    if not hasattr(os, "O_DIRECTORY"):  # Windows: directories cannot be opened for fsync
        return
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_all(fd: int, view) -> None:
    """Write every byte of `view` to `fd`, IO_CHUNK bytes per write() call."""
    offset, size = 0, view.nbytes
    while offset < size:
        offset += os.write(fd, view[offset:offset + IO_CHUNK])


def _load_renameat2():
    try:
        function = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return None
    function.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint)
    function.restype = ctypes.c_int
    return function


_RENAMEAT2 = _load_renameat2()  # read-only after import; None where libc lacks it


def rename_noreplace(source, target) -> None:
    """Rename `source` to a name that must not exist; FileExistsError otherwise, never an overwrite."""
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


def publish_file(path, write) -> None:
    """Publish one file atomically: `write(handle)` fills a new hidden sibling, which is fsynced,
    renamed over `path` and made durable by an fsync of the directory. OSError on failure, with
    nothing left behind but what `path` held before."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    temporary = os.path.join(directory, f".{os.path.basename(path)}.{os.getpid()}.{secrets.token_hex(6)}.tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
    try:
        with os.fdopen(fd, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        try:
            os.unlink(temporary)
        except FileNotFoundError:
            pass
        raise
    fsync_dir(directory)


# -- confined opens -----------------------------------------------------------------------------


class Refused(Exception):
    """open_beneath refused a path: `reason` is "link_on_path" (a component on the way is a symlink
    or not a directory), "link" (the file itself is a symlink) or "missing" (the file is absent)."""

    def __init__(self, reason: str, relpath: str, part: str):
        super().__init__(f"{relpath!r}: {reason} at {part!r}")
        self.reason, self.relpath, self.part = reason, relpath, part


def open_beneath(root: int, relpath: str) -> int:
    """Open `relpath` ("a/b/c") read-only beneath the directory fd `root`, following no symlink at
    any level (and not blocking on a FIFO); Refused names what stood in the way."""
    parts = relpath.split("/")
    fd, owned = root, False
    try:
        for part in parts[:-1]:
            try:
                next_fd = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            except OSError as error:
                if error.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise Refused("link_on_path", relpath, part) from None
                raise
            if owned:
                os.close(fd)
            fd, owned = next_fd, True
        try:  # O_NONBLOCK: a FIFO swapped in after a check must not block the open
            return os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=fd)
        except OSError as error:
            if error.errno == errno.ELOOP:
                raise Refused("link", relpath, parts[-1]) from None
            if error.errno == errno.ENOENT:
                raise Refused("missing", relpath, parts[-1]) from None
            raise
    finally:
        if owned:
            os.close(fd)


# -- hashed reads -------------------------------------------------------------------------------


def read_exact(fd: int, size: int) -> bytes:
    """Up to `size` bytes from `fd` (fewer only at end of file)."""
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


def new_buffer(size: int) -> mmap.mmap:
    """A private anonymous mapping of `size` bytes for one file, on transparent huge pages
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


def read_hashed(fd: int, size: int) -> tuple:
    """Read up to `size` bytes once; returns (data, sha256 hex, bytes read), hashing while reading.

    Files up to PIPELINE_MIN come back as `bytes`; larger ones as a read-only memoryview of a
    private buffer nothing else can write to.
    """
    if size <= PIPELINE_MIN:
        data = read_exact(fd, size)
        return data, hashlib.sha256(data).hexdigest(), len(data)
    buffer = new_buffer(size)
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


def sha256_timed(view) -> tuple:
    """(SHA-256 hex of `view`, seconds it took); hashlib releases the GIL, so threads overlap it."""
    started = time.perf_counter()
    digest = hashlib.sha256(view).hexdigest()
    return digest, time.perf_counter() - started


# -- worker threads -----------------------------------------------------------------------------


class ThreadPools:
    """Named thread pools, each started on first use and kept: starting threads is a visible part
    of a small checkpoint's time. A forked child starts its own (the parent's threads are not in
    it, and another thread may have held the lock at the fork)."""

    def __init__(self, prefix: str):
        self._prefix = prefix
        self._pools: dict[str, ThreadPoolExecutor] = {}
        self._lock = threading.Lock()
        owner = weakref.ref(self)
        os.register_at_fork(after_in_child=lambda: (pools := owner()) is not None and pools._forget())

    def get(self, name: str, workers: int) -> ThreadPoolExecutor:
        """The pool called `name`, started with `workers` threads if this process has none yet."""
        with self._lock:
            pool = self._pools.get(name)
            if pool is None:
                pool = self._pools[name] = ThreadPoolExecutor(max_workers=workers,
                                                              thread_name_prefix=f"{self._prefix}-{name}")
            return pool

    def _forget(self) -> None:
        self._pools = {}
        self._lock = threading.Lock()
