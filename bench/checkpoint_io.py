""".kiln-checkpoint I/O: publication and full-validation throughput against this machine's raw limits.

For checkpoints of 10 MB, 100 MB and 1 GB of random bytes (a third adapter, two thirds
optimizer, plus a small state.json), one run prints side by side, in MB/s (10^6 bytes):

- raw write+fsync: one file of the same bytes written in 64 MiB calls and fsynced once;
- raw SHA-256: hashlib.sha256 over the same bytes in one thread;
- publish: publish_checkpoint into an existing registry (staging, sentinel, write, fsync, manifest,
  rename, parent fsync);
- validate: load_checkpoint(full=True) straight after publication (warm page cache);
- cold validate: the same after posix_fadvise(DONTNEED) evicts the (clean) files;
- light: load_checkpoint(full=False), in milliseconds;

and the ratio of publish and validate to the slower of the two raw figures (target >= 80%),
each ratio taken against the baselines measured in the same repeat, because a shared
machine's throughput drifts between repeats. Each figure is the median of --repeats runs.
Files go to a temporary folder under $KILN_HOME when it is set, otherwise under /tmp (the
output says which, and its filesystem):

    python bench/checkpoint_io.py [--sizes 10,100,1000] [--repeats 5] [--dir PATH]
"""

import argparse
import hashlib
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from trainer.runs import checkpoint_dir as cd

MB = 1_000_000


def _files(total: int) -> dict:
    adapter = total // 3
    return {"adapter.safetensors": os.urandom(adapter), "optimizer.safetensors": os.urandom(total - adapter),
            "state.json": b'{"step": 1}'}


def _raw_write_fsync(folder: Path, data: bytes) -> float:
    path = folder / "raw.bin"
    view = memoryview(data)
    started = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        offset = 0
        while offset < len(data):
            offset += os.write(fd, view[offset:offset + cd.IO_CHUNK])
        os.fsync(fd)
    finally:
        os.close(fd)
    seconds = time.perf_counter() - started
    path.unlink()
    return seconds


def _sha256(data: bytes) -> float:
    started = time.perf_counter()
    hashlib.sha256(data).hexdigest()
    return time.perf_counter() - started


def _evict(path: Path):
    for file in path.rglob("*"):
        fd = os.open(file, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def measure(folder: Path, size_mb: int, repeats: int) -> dict:
    files = _files(size_mb * MB)
    joined = b"".join(files.values())
    total = len(joined)
    runs = {"raw_write_fsync": [], "raw_sha256": [], "publish": [], "validate": [], "cold_validate": [],
            "light_ms": [], "publish_pct": [], "validate_pct": []}
    timings = []
    for repeat in range(repeats):
        raw = total / _raw_write_fsync(folder, joined) / MB, total / _sha256(joined) / MB
        runs["raw_write_fsync"].append(raw[0])
        runs["raw_sha256"].append(raw[1])
        registry = folder / f"registry-{size_mb}-{repeat}"
        registry.mkdir()  # a run publishes into its existing registry; creating one is not publishing
        started = time.perf_counter()
        path = cd.publish_checkpoint(registry, "bench", 1, checkpoint_type="sft", files=files,
                                     manifest={"progress": {"committed_step": 1}}, on_timing=timings.append)
        runs["publish"].append(total / (time.perf_counter() - started) / MB)
        started = time.perf_counter()
        loaded = cd.load_checkpoint(path, full=True)
        runs["validate"].append(total / (time.perf_counter() - started) / MB)
        runs["publish_pct"].append(100 * runs["publish"][-1] / min(raw))  # against this repeat's own baselines
        runs["validate_pct"].append(100 * runs["validate"][-1] / min(raw))
        del loaded
        _evict(path)
        started = time.perf_counter()
        loaded = cd.load_checkpoint(path, full=True)
        runs["cold_validate"].append(total / (time.perf_counter() - started) / MB)
        del loaded
        started = time.perf_counter()
        cd.load_checkpoint(path, full=False)
        runs["light_ms"].append((time.perf_counter() - started) * 1000)
        shutil.rmtree(registry)
    out = {key: statistics.median(values) for key, values in runs.items()}
    out["timing"] = {key: statistics.median(t[key] for t in timings) for key in timings[0]}
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10,100,1000", help="checkpoint sizes in MB")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", help="parent folder for the temporary files")
    args = parser.parse_args()
    parent = args.dir or os.environ.get("KILN_HOME") or "/tmp"
    where = "--dir" if args.dir else ("$KILN_HOME" if os.environ.get("KILN_HOME") else "/tmp")
    folder = Path(tempfile.mkdtemp(prefix="kiln-checkpoint-io-", dir=parent))
    try:
        df = subprocess.run(["df", "-T", str(folder)], capture_output=True, text=True).stdout.splitlines()
        print(f"files in {folder} ({where}); filesystem: {df[-1] if df else 'unknown'}")
        print(f"cpus: {os.cpu_count()}; median of {args.repeats}; MB/s = 10^6 bytes/s")
        header = ("size MB", "raw w+fsync", "raw sha256", "publish", "pub %", "validate", "val %",
                  "cold val", "light ms")
        print(" ".join(f"{h:>11}" for h in header))
        for size in (int(s) for s in args.sizes.split(",")):
            r = measure(folder, size, args.repeats)
            row = (size, r["raw_write_fsync"], r["raw_sha256"], r["publish"], r["publish_pct"],
                   r["validate"], r["validate_pct"], r["cold_validate"], r["light_ms"])
            print(" ".join(f"{v:>11.0f}" if i not in (8,) else f"{v:>11.2f}" for i, v in enumerate(row)))
            t = r["timing"]
            print(f"{'':>11} publish split (s): hash {t['hash_seconds']:.3f} (in threads, overlapping), "
                  f"write {t['write_seconds']:.3f}, fsync {t['fsync_seconds']:.3f}, "
                  f"rename {t['rename_seconds']:.4f}, total {t['total_seconds']:.3f}")
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
