"""Safetensors files with numpy only, and the atomic, fsynced writes the registry relies on.

Reading parses the header itself and memory-maps the data, so BF16 (which numpy lacks)
widens to FP32 and a 135M-parameter base loads without torch. Writing goes through the
`safetensors` library, so what Kiln writes is what every other reader expects.
"""

import json
import os
import shutil
import struct
import uuid
from pathlib import Path

import numpy as np
from safetensors.numpy import save as _safetensors_save

from trainer import fsio

MAX_HEADER_BYTES = 100 << 20  # the limit the safetensors library itself enforces
_DTYPES = {"F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"),
           "BF16": np.dtype("<u2"), "I64": np.dtype("<i8"), "I32": np.dtype("<i4"),
           "I16": np.dtype("<i2"), "I8": np.dtype("i1"), "U8": np.dtype("u1"),
           "BOOL": np.dtype("?")}
FLOATS = ("F64", "F32", "F16", "BF16")


def parse_header(header_bytes, data_size: int, where: str) -> tuple[dict, dict]:
    """(metadata, {name: (dtype, shape, begin, end)}) from a safetensors JSON header.

    Every tensor's dtype must be one Kiln reads and its data offsets must lie inside the
    `data_size` bytes after the header and match its shape; ValueError names what is wrong.
    """
    try:
        header = json.loads(header_bytes)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{where}: unreadable safetensors header ({exc})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{where}: the safetensors header is not an object")
    metadata = header.pop("__metadata__", None) or {}
    tensors = {}
    for name, info in header.items():
        try:
            dtype, shape, (begin, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
            if not all(isinstance(v, int) and v >= 0 for v in (*shape, begin, end)):
                raise ValueError
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"{where}: malformed header entry for {name!r}") from None
        if dtype not in _DTYPES:
            raise ValueError(f"{where}: {name} has dtype {dtype}, which Kiln does not read")
        count = int(np.prod(shape, dtype=np.int64))
        if not 0 <= begin <= end <= data_size or end - begin != count * _DTYPES[dtype].itemsize:
            raise ValueError(f"{where}: {name} has data offsets {begin}..{end} that do not "
                             f"fit its shape {shape} and dtype {dtype} in {data_size} data bytes")
        tensors[name] = (dtype, shape, begin, end)
    return metadata, tensors


def tensors_from_buffer(data, where: str = "safetensors data") -> dict:
    """{name: new array} from a whole safetensors file held in any buffer (bytes, bytearray,
    memoryview over a mapping), without first copying the buffer into `bytes`.

    Arrays keep their stored dtype (as `safetensors.numpy.load` does), so BF16, which numpy
    lacks, is refused here; each array is a fresh, writable, C-contiguous copy.
    """
    view = memoryview(data).cast("B")
    if view.nbytes < 8:
        raise ValueError(f"{where}: not a safetensors file (shorter than 8 bytes)")
    (header_size,) = struct.unpack("<Q", view[:8])
    if header_size > min(MAX_HEADER_BYTES, view.nbytes - 8):
        raise ValueError(f"{where}: not a safetensors file (header of {header_size} bytes)")
    start = 8 + header_size
    _, tensors = parse_header(bytes(view[8:start]), view.nbytes - start, where)
    out = {}
    for name, (dtype, shape, begin, end) in tensors.items():
        if dtype == "BF16":
            raise ValueError(f"{where}: {name} is BF16, which has no numpy dtype; Kiln writes state in FP32")
        out[name] = np.frombuffer(view[start + begin:start + end], dtype=_DTYPES[dtype]).reshape(shape).copy()
    return out


class SafetensorsFile:
    """One .safetensors file: `names`, `info(name)` and `float32(name)` (a fresh FP32 array)."""

    def __init__(self, path):
        self.path = Path(path)
        size = self.path.stat().st_size
        with open(self.path, "rb") as handle:
            prefix = handle.read(8)
            if len(prefix) != 8:
                raise ValueError(f"{self.path}: not a safetensors file (shorter than 8 bytes)")
            (header_size,) = struct.unpack("<Q", prefix)
            if header_size > min(MAX_HEADER_BYTES, size - 8):
                raise ValueError(f"{self.path}: not a safetensors file (header of {header_size} bytes)")
            header_bytes = handle.read(header_size)
        self.metadata, self._tensors = parse_header(header_bytes, size - 8 - header_size, str(self.path))
        self._data_start = 8 + header_size
        self._map = None

    @property
    def names(self):
        return list(self._tensors)

    def info(self, name):
        """(dtype name, shape)."""
        dtype, shape, _, _ = self._tensors[name]
        return dtype, shape

    def _raw(self, name):
        dtype, shape, begin, end = self._tensors[name]
        if self._map is None:
            self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        data = self._map[self._data_start + begin:self._data_start + end]
        return data.view(_DTYPES[dtype]).reshape(shape)

    def array(self, name) -> np.ndarray:
        """A read-only view into the mapped file for F32 tensors, else float32(name)."""
        if self._tensors[name][0] == "F32":
            return self._raw(name)
        return self.float32(name)

    def float32(self, name) -> np.ndarray:
        """The tensor as a new C-contiguous float32 array (BF16 and F16 widen exactly)."""
        dtype, _, _, _ = self._tensors[name]
        if dtype not in FLOATS:
            raise ValueError(f"{self.path}: {name} is {dtype}, not a floating-point tensor")
        raw = self._raw(name)
        if dtype == "BF16":
            return (raw.astype(np.uint32) << 16).view(np.float32)
        return np.array(raw, dtype=np.float32, order="C")

    def close(self):
        self._map = None


def safetensors_bytes(tensors: dict, metadata: dict | None = None) -> bytes:
    """The safetensors serialisation of {name: array}, the same bytes for equal input.

    The safetensors library writes the metadata from a hash map, in an order that changes from
    call to call; with more than one metadata key the header is rewritten with them sorted (the
    same keys and values in the same compact JSON, so the header keeps its length).
    """
    data = _safetensors_save({k: np.ascontiguousarray(v) for k, v in tensors.items()}, metadata=metadata)
    if not metadata or len(metadata) < 2:
        return data
    (size,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + size])
    header["__metadata__"] = dict(sorted(header["__metadata__"].items()))
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    if len(text) != len(data[8:8 + size].rstrip(b" ")):
        raise AssertionError("rewriting the safetensors header changed its length")
    return data[:8] + text.ljust(size, b" ") + data[8 + size:]


def write_synced(path, data: bytes):
    """Write `data` to a new file at `path` and fsync it (the caller publishes by rename)."""
    with open(path, "xb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


fsync_directory = fsio.fsync_dir  # the name PEFT export and the base registry import


def staging_directory(target) -> Path:
    """A new hidden directory beside `target` to build it in (same filesystem, so rename is atomic)."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.parent / f".staging-{target.name}-{uuid.uuid4().hex[:12]}"
    staging.mkdir()
    return staging


def publish_directory(staging, target):
    """fsync `staging`, then rename it to `target`, which must not exist (or be empty)."""
    staging, target = Path(staging), Path(target)
    fsync_directory(staging)
    if target.exists() and any(target.iterdir()):
        raise FileExistsError(f"{target} already exists")
    os.rename(staging, target)
    fsync_directory(target.parent)


def discard(staging):
    shutil.rmtree(staging, ignore_errors=True)
