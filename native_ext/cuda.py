"""The one ctypes loader of the CUDA library (libkiln_cuda.so, built from native_ext/cuda by setup.py).

It finds the file (the KILN_CUDA_LIBRARY environment variable first, then this package's
directory), declares restype/argtypes for every exported symbol in one table (SYMBOLS), and
raises CudaUnavailable naming the path, a machine-readable code and the reason when the
library, a symbol, the driver or a capable device is missing. `probe()` never raises: it is
what `kiln doctor` and backend selection read. DeviceArray is a thin owner of device memory
so that tests can run a kernel against its numpy twin.

Every C function returns an int status: 0, else a cudaError_t (below 1000) or 1000 + a
cublasStatus_t, or 2000 + a Kiln argument check; kiln_cuda_last_error() says which.
Dimension letters as in native_ext.reference.
"""

import ctypes
import functools
import os
import struct
from ctypes import POINTER, c_char_p, c_double, c_float, c_int, c_int64, c_size_t, c_void_p
from pathlib import Path

import numpy as np

from native_ext.validate import file_sha256

LIBRARY_NAME = "libkiln_cuda.so"
ENVIRONMENT_VARIABLE = "KILN_CUDA_LIBRARY"
ABI_VERSION = 2  # kiln_cuda_abi_version() of the library this table describes
NORM_BLOCKS = 256  # doubles of the workspace kiln_cuda_sum_squares reduces through (KILN_CUDA_NORM_BLOCKS)
ATTENTION_MAX_HEAD = 128  # the largest head size the attention kernels take (KILN_CUDA_ATTENTION_MAX_HEAD)
DRIVER_LIBRARY = "libcuda.so.1"

CODES = ("library_missing", "symbol_missing", "driver_missing", "no_device", "device_too_old",
         "out_of_memory", "load_failed")

_CUDA_ERROR_MEMORY_ALLOCATION = 2
_CUDA_ERROR_INSUFFICIENT_DRIVER = 35
_CUDA_ERROR_NO_DEVICE = 100

# argument type shorthands: P a device pointer (or a stream, event or BLAS handle), I int64, F float
P, I, F, D = c_void_p, c_int64, c_float, c_double
_INT_OUT, _SIZE_OUT, _PTR_OUT = POINTER(c_int), POINTER(c_size_t), POINTER(c_void_p)

# name: (restype, [argtypes]); the C declarations are in native_ext/cuda/kiln_cuda.h
SYMBOLS = {
    # errors, versions, devices
    "kiln_cuda_last_error": (c_char_p, []),
    "kiln_cuda_abi_version": (c_int, [_INT_OUT]),
    "kiln_cuda_device_count": (c_int, [_INT_OUT]),
    # device, name buffer, its bytes, major, minor, total memory, multiprocessors
    "kiln_cuda_device_properties": (c_int, [c_int, c_char_p, c_int, _INT_OUT, _INT_OUT, _SIZE_OUT, _INT_OUT]),
    "kiln_cuda_driver_version": (c_int, [_INT_OUT]),
    "kiln_cuda_runtime_version": (c_int, [_INT_OUT]),
    "kiln_cuda_cublas_version": (c_int, [_INT_OUT]),
    "kiln_cuda_set_device": (c_int, [c_int]),
    "kiln_cuda_mem_info": (c_int, [_SIZE_OUT, _SIZE_OUT]),  # free, total
    "kiln_cuda_device_synchronize": (c_int, []),
    "kiln_cuda_device_shared_memory": (c_int, [c_int, _SIZE_OUT]),  # device, opt-in shared memory per block out
    # memory: dst, src, bytes, stream
    "kiln_cuda_malloc": (c_int, [_PTR_OUT, c_size_t]),
    "kiln_cuda_free": (c_int, [P]),
    "kiln_cuda_memcpy_h2d": (c_int, [P, P, c_size_t, P]),
    "kiln_cuda_memcpy_d2h": (c_int, [P, P, c_size_t, P]),
    "kiln_cuda_memcpy_d2d": (c_int, [P, P, c_size_t, P]),
    "kiln_cuda_memset": (c_int, [P, c_int, c_size_t, P]),
    # streams and events
    "kiln_cuda_stream_create": (c_int, [_PTR_OUT]),
    "kiln_cuda_stream_destroy": (c_int, [P]),
    "kiln_cuda_stream_synchronize": (c_int, [P]),
    "kiln_cuda_event_create": (c_int, [_PTR_OUT]),
    "kiln_cuda_event_destroy": (c_int, [P]),
    "kiln_cuda_event_record": (c_int, [P, P]),  # event, stream
    "kiln_cuda_event_synchronize": (c_int, [P]),
    "kiln_cuda_event_elapsed_ms": (c_int, [POINTER(c_float), P, P]),  # out, start, end
    # cuBLAS: handle out, stream, workspace bytes (fixed, allocated once)
    "kiln_cuda_blas_create": (c_int, [_PTR_OUT, P, c_size_t]),
    "kiln_cuda_blas_destroy": (c_int, [P]),
    "kiln_cuda_blas_set_stream": (c_int, [P, P]),
    # row-major C[M,N] = alpha op(A) op(B) + beta C: handle, trans_a, trans_b, M, N, K, alpha,
    # A, lda, B, ldb, beta, C, ldc, precision (0 FP32, 1 TF32 only when asked)
    "kiln_cuda_gemm": (c_int, [P, c_int, c_int, I, I, I, F, P, I, P, I, F, P, I, c_int]),
    # as gemm with a stride after each matrix and the batch count before precision
    "kiln_cuda_gemm_strided_batched": (c_int, [P, c_int, c_int, I, I, I, F, P, I, I, P, I, I, F, P, I, I, I,
                                              c_int]),
    # tokens [N] int64, table [V,C], out [N,C], N, C, V, stream
    "kiln_cuda_embedding_forward": (c_int, [P, P, P, I, I, I, P]),
    # dout [N,C], tokens [N], dtable [V,C] (accumulated in token order), N, C, V, stream
    "kiln_cuda_embedding_backward": (c_int, [P, P, P, I, I, I, P]),
    # x [N,C], weight [C], eps, out [N,C], rstd [N], N, C, stream
    "kiln_cuda_rmsnorm_forward": (c_int, [P, P, F, P, P, I, I, P]),
    "kiln_cuda_rmsnorm_backward_workspace": (c_int, [I, I, _SIZE_OUT]),  # N, C, bytes out
    # dout, x, weight, rstd, dx (+=), dweight (+=), workspace, N, C, stream
    "kiln_cuda_rmsnorm_backward": (c_int, [P, P, P, P, P, P, P, I, I, P]),
    # x [B,T,NH,D] with strides (b, t, h), cos [P,D/2], sin, positions P, offset, out [B,KV,T,g,D],
    # B, T, KV, g, D, stream
    "kiln_cuda_rope_forward": (c_int, [P, I, I, I, P, P, I, I, P, I, I, I, I, I, P]),
    # dout [B,KV,T,g,D], cos, sin, positions, offset, dx [B,T,NH,D] (written) with strides (b, t, h),
    # B, T, KV, g, D, stream
    "kiln_cuda_rope_backward": (c_int, [P, P, P, I, I, P, I, I, I, I, I, I, I, I, P]),
    # gate_up [N,2F], out [N,F], N, F, stream
    "kiln_cuda_swiglu_forward": (c_int, [P, P, I, I, P]),
    # dout [N,F], gate_up [N,2F], dgate_up [N,2F] (written), N, F, stream
    "kiln_cuda_swiglu_backward": (c_int, [P, P, P, I, I, P]),
    # q [G,T*g,D], k [G,S,D], v, out [G,T*g,D], logsumexp [G,T*g], G, T, g, S, D, past, window, scale,
    # tile (0: the device's choice, or 32 or 64 rows and keys), stream
    "kiln_cuda_attention_forward": (c_int, [P, P, P, P, P, I, I, I, I, I, I, I, F, I, P]),
    # dout, q, k, v, out, logsumexp, dq, dk, dv (written), delta workspace [G,T*g],
    # G, T, g, S, D, past, window, scale, tile, stream
    "kiln_cuda_attention_backward": (c_int, [P, P, P, P, P, P, P, P, P, P, I, I, I, I, I, I, I, F, I, P]),
    # head size D, then the least dynamic shared memory per block out (32-row tiles): forward (decoding too), backward
    "kiln_cuda_attention_shared_bytes": (c_int, [I, _SIZE_OUT, _SIZE_OUT]),
    "kiln_cuda_attention_probabilities": (c_int, [P, P, c_int, I, I, I, I, I, I, P]),
    "kiln_cuda_attention_dscores": (c_int, [P, P, P, P, P, I, I, I, I, I, F, P]),
    # logits [N,V] (in place -> dlogits unless mode 0), targets [N], per_row [N], mode
    # (0 log p, 1 grad_scale, 2 row_scales), grad_scale, row_scales [N] or NULL, ignore_index, N, V, stream
    "kiln_cuda_cross_entropy_rows": (c_int, [P, P, P, c_int, F, P, I, I, I, P]),
    # handle, hidden [N,C], weight [V,C], targets [N], N, C, V, chunk, mode, grad_scale, row_scales,
    # ignore_index, per_row [N], dhidden [N,C] or NULL, dhead [V,C] (+=) or NULL, logits workspace
    # [chunk,V], precision
    "kiln_cuda_fused_linear_cross_entropy": (c_int, [P, P, P, P, I, I, I, I, c_int, F, P, I, P, P, P, P,
                                                    c_int]),
    # packed [ceil(n/2)] uint8, absmax [blocks], out [count], start, count, block_size, stream
    "kiln_cuda_nf4_dequantize": (c_int, [P, P, P, I, I, I, P]),
    # codes [blocks] uint8, scales [ceil(blocks/256)], dynamic map [256], offset, absmax out [blocks],
    # blocks, stream
    "kiln_cuda_nf4_decode_absmax": (c_int, [P, P, P, F, P, I, P]),
    # handle, x [N,K], packed weight [M,K] NF4, absmax, block_size, out [N,M], beta, tile workspace
    # [tile_rows,K], tile_rows, N, K, M, precision
    "kiln_cuda_nf4_linear": (c_int, [P, P, P, P, I, P, F, P, I, I, I, I, c_int]),
    # handle, x [N,K], A [r,K], B [M,r], scaling, xa [N,r] (written), out [N,M] (+=), N, K, M, r, precision
    "kiln_cuda_lora_forward": (c_int, [P, P, P, P, F, P, P, I, I, I, I, c_int]),
    # handle, x, A, B, xa, dout [N,M], scaling, dA [r,K] (+=), dB [M,r] (+=), dx [N,K] (+=) or NULL,
    # dxa workspace [N,r], N, K, M, r, precision
    "kiln_cuda_lora_backward": (c_int, [P, P, P, P, P, P, F, P, P, P, P, I, I, I, I, c_int]),
    # param, grad, m, v [n], n, learning_rate, beta1, beta2, epsilon, weight_decay, bias corrections 1/2, stream
    "kiln_cuda_adam_update": (c_int, [P, P, P, P, I, D, D, D, D, D, D, D, P]),
    # x [n] float, n, workspace [NORM_BLOCKS] double, out (one double on the device), stream
    "kiln_cuda_sum_squares": (c_int, [P, I, P, P, P]),
    # sums [count] double (device), count, norm out (one double, device) = sqrt(sum in order), stream
    "kiln_cuda_global_norm": (c_int, [P, I, P, P]),
    # x [n] *= factor, n, factor, stream
    "kiln_cuda_scale": (c_int, [P, I, F, P]),
}


class CudaUnavailable(RuntimeError):
    """The CUDA backend cannot run here; `code` is one of CODES, `path` the library file (or None)."""

    def __init__(self, code: str, path, reason: str):
        assert code in CODES, code
        self.code = code
        self.path = None if path is None else str(path)
        self.reason = reason
        where = f" ({self.path})" if self.path else ""
        super().__init__(f"CUDA backend unavailable [{code}]{where}: {reason}")


def library_path():
    """The library file to load: $KILN_CUDA_LIBRARY when set (even if missing), else the package's copy, else None."""
    override = os.environ.get(ENVIRONMENT_VARIABLE)
    if override:
        return Path(override)
    candidate = Path(__file__).resolve().parent / LIBRARY_NAME
    return candidate if candidate.exists() else None


def _missing_reason(path) -> str:
    if path is None:
        return (f"{LIBRARY_NAME} is not built: install Kiln with `pip install -e .` on a machine with nvcc and "
                f"the nvidia-cublas wheel (./dev does both), or set {ENVIRONMENT_VARIABLE}")
    source = f"{ENVIRONMENT_VARIABLE} names" if os.environ.get(ENVIRONMENT_VARIABLE) else "expected"
    return f"no file at {path} ({source} it); build it with `pip install -e .` on a machine with nvcc"


@functools.lru_cache(maxsize=8)
def _open(path_text: str):
    path = Path(path_text)
    if not path.is_file():
        raise CudaUnavailable("library_missing", path, _missing_reason(path))
    try:
        library = ctypes.CDLL(str(path), mode=os.RTLD_LAZY | os.RTLD_LOCAL)
    except OSError as error:
        hint = (" (a library it links, such as the nvidia-cublas wheel's libcublas, moved or is gone: rebuild "
                "with `pip install -e .`)" if "cannot open shared object file" in str(error) else "")
        raise CudaUnavailable("load_failed", path, f"dlopen failed: {error}{hint}") from error
    missing = [name for name in SYMBOLS if not hasattr(library, name)]
    if missing:
        raise CudaUnavailable("symbol_missing", path, f"{len(missing)} declared symbol(s) not exported: "
                              f"{', '.join(missing[:8])}{'...' if len(missing) > 8 else ''}; rebuild the library")
    for name, (restype, argtypes) in SYMBOLS.items():
        function = getattr(library, name)
        function.restype = restype
        function.argtypes = argtypes
    return library


def open_library(path=None):
    """The library with every symbol bound (no device needed), or CudaUnavailable (library_missing,
    load_failed, symbol_missing)."""
    path = library_path() if path is None else Path(path)
    if path is None:
        raise CudaUnavailable("library_missing", None, _missing_reason(None))
    return _open(str(path))


def last_error(library) -> str:
    text = library.kiln_cuda_last_error()
    return text.decode(errors="replace") if text else ""


def check(library, status: int, what: str):
    """Raise RuntimeError naming WHAT and the library's last error when STATUS is not 0."""
    if status != 0:
        raise RuntimeError(f"{what} failed with status {status}: {last_error(library)}")


def _driver_installed() -> bool:
    try:
        ctypes.CDLL(DRIVER_LIBRARY, mode=os.RTLD_LAZY | os.RTLD_LOCAL)
    except OSError:
        return False
    return True


def _versions(library) -> dict:
    versions = {}
    for key, name in (("driver_version", "kiln_cuda_driver_version"), ("runtime_version", "kiln_cuda_runtime_version"),
                      ("cublas_version", "kiln_cuda_cublas_version")):
        value = c_int(0)
        status = getattr(library, name)(ctypes.byref(value))
        versions[key] = value.value if status == 0 and value.value else None
    return versions


def attention_shared_memory(library) -> list:
    """What the attention kernels ask of a block's shared memory, as the library answers for each head size 1..
    ATTENTION_MAX_HEAD (kiln_cuda_attention_shared_bytes): a list of tiers, each the head sizes up to `head_size` that
    need the same `forward` (training, and cached decoding) and `backward` (training) bytes, smallest first."""
    tiers = []
    for head_size in range(1, ATTENTION_MAX_HEAD + 1):
        forward, backward = c_size_t(0), c_size_t(0)
        check(library, library.kiln_cuda_attention_shared_bytes(head_size, ctypes.byref(forward),
                                                                ctypes.byref(backward)),
              "kiln_cuda_attention_shared_bytes")
        if tiers and (tiers[-1]["forward"], tiers[-1]["backward"]) == (forward.value, backward.value):
            tiers[-1]["head_size"] = head_size
        else:
            tiers.append({"head_size": head_size, "forward": int(forward.value), "backward": int(backward.value)})
    return tiers


def attention_head_size_limit(tiers: list, per_block: int) -> dict:
    """The largest head size whose attention kernels fit PER_BLOCK bytes of shared memory per block (a device's opt-in
    limit), given TIERS (attention_shared_memory): {"training": forward and backward fit, "decoding": the forward
    alone fits}; 0 where no head size does."""
    return {workload: max([tier["head_size"] for tier in tiers if tier[key] <= per_block], default=0)
            for workload, key in (("training", "backward"), ("decoding", "forward"))}


def _devices(library, path):
    """The visible devices as dicts, or CudaUnavailable with driver_missing, no_device or out_of_memory."""
    count = c_int(0)
    status = library.kiln_cuda_device_count(ctypes.byref(count))
    driver = c_int(0)
    library.kiln_cuda_driver_version(ctypes.byref(driver))
    if status == _CUDA_ERROR_INSUFFICIENT_DRIVER or (status != 0 and not driver.value):
        if not _driver_installed():
            raise CudaUnavailable("driver_missing", path, f"the CUDA driver ({DRIVER_LIBRARY}) is not installed: no "
                                  f"NVIDIA GPU driver on this machine")
        if not driver.value:  # e.g. a stub libcuda.so.1 (cudaErrorStubLibrary): no version to call too old
            raise CudaUnavailable("driver_missing", path, f"the installed CUDA driver ({DRIVER_LIBRARY}) reports no "
                                  f"version (cudaGetDeviceCount failed with {status}): {last_error(library)}")
        raise CudaUnavailable("driver_missing", path, f"the installed CUDA driver (version {driver.value}) is older "
                              f"than this library's runtime needs: {last_error(library)}")
    if status == _CUDA_ERROR_NO_DEVICE or (status == 0 and count.value == 0):
        raise CudaUnavailable("no_device", path, "the CUDA driver is installed but sees no GPU (check "
                              "CUDA_VISIBLE_DEVICES and nvidia-smi)")
    if status == _CUDA_ERROR_MEMORY_ALLOCATION:
        raise CudaUnavailable("out_of_memory", path, f"the CUDA context could not be created: {last_error(library)}")
    if status != 0:
        raise CudaUnavailable("no_device", path, f"cudaGetDeviceCount failed with {status}: {last_error(library)}")
    try:
        tiers = attention_shared_memory(library)
    except RuntimeError as error:
        raise CudaUnavailable("load_failed", path, str(error)) from None
    devices = []
    for index in range(count.value):
        name = ctypes.create_string_buffer(256)
        major, minor, multiprocessors = c_int(0), c_int(0), c_int(0)
        total = c_size_t(0)
        status = library.kiln_cuda_device_properties(index, name, 256, ctypes.byref(major), ctypes.byref(minor),
                                                     ctypes.byref(total), ctypes.byref(multiprocessors))
        if status != 0:
            raise CudaUnavailable("no_device", path, f"device {index} properties failed: {last_error(library)}")
        per_block = c_size_t(0)
        if library.kiln_cuda_device_shared_memory(index, ctypes.byref(per_block)) != 0:
            raise CudaUnavailable("no_device", path, f"device {index} shared memory per block failed: "
                                  f"{last_error(library)}")
        free_bytes, total_bytes = c_size_t(0), c_size_t(0)
        status = library.kiln_cuda_set_device(index) or library.kiln_cuda_mem_info(ctypes.byref(free_bytes),
                                                                                    ctypes.byref(total_bytes))
        if status == _CUDA_ERROR_MEMORY_ALLOCATION:
            raise CudaUnavailable("out_of_memory", path, f"device {index}: no memory left for a CUDA context")
        devices.append({"index": index, "name": name.value.decode(errors="replace"),
                        "compute_capability": f"{major.value}.{minor.value}", "total_memory": int(total.value),
                        "free_memory": int(free_bytes.value) if status == 0 else None,
                        "multiprocessors": multiprocessors.value, "shared_memory_per_block": int(per_block.value),
                        "attention_head_size_limit": attention_head_size_limit(tiers, per_block.value)})
    if devices:
        library.kiln_cuda_set_device(0)
    return devices


def _capable(devices, min_capability):
    return [d for d in devices if tuple(int(p) for p in d["compute_capability"].split(".")) >= tuple(min_capability)]


def load(min_capability=(8, 0)):
    """The bound library once a device of at least MIN_CAPABILITY is usable (cached), else CudaUnavailable."""
    return _load(tuple(min_capability), str(library_path()) if library_path() else None)


@functools.lru_cache(maxsize=8)
def _load(min_capability, path_text):
    library = open_library(path_text)
    devices = _devices(library, path_text)
    if not _capable(devices, min_capability):
        raise CudaUnavailable("device_too_old", path_text, _too_old(devices, min_capability))
    return library


def _too_old(devices, min_capability):
    seen = ", ".join(f"{d['name']} ({d['compute_capability']})" for d in devices)
    return f"every GPU is below compute capability {min_capability[0]}.{min_capability[1]}: {seen}"


def elf_dynamic_symbols(path) -> set:
    """The defined global function names in the ELF dynamic symbol table of PATH (no dlopen, so it works
    on a machine where the library's dependencies cannot load)."""
    data = Path(path).read_bytes()
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError(f"{path} is not a little-endian 64-bit ELF file")
    section_offset, = struct.unpack_from("<Q", data, 0x28)
    entry_size, count = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, section_offset + i * entry_size) for i in range(count)]
    names = set()
    for _, kind, _, _, offset, size, link, _, _, symbol_size in sections:
        if kind != 11:  # SHT_DYNSYM
            continue
        strings_offset = sections[link][4]
        for at in range(offset, offset + size, symbol_size):
            name_index, info, _, section_index, _, _ = struct.unpack_from("<IBBHQQ", data, at)
            if section_index == 0 or (info >> 4) not in (1, 2):  # undefined, or not GLOBAL/WEAK
                continue
            end = data.index(b"\0", strings_offset + name_index)
            names.add(data[strings_offset + name_index:end].decode())
    return names


def probe(min_capability=(8, 0), isolated=False) -> dict:
    """What the CUDA backend can do here; never raises. `available` is True only with the library
    loaded, every symbol bound and a device of at least MIN_CAPABILITY. `attention_shared_memory` is the
    attention kernels' shared memory per block by head size (attention_shared_memory); each device reports its
    opt-in `shared_memory_per_block` and the `attention_head_size_limit` that gives it for training and for
    decoding, which backend selection compares with a workload's head size.

    On a GPU machine the probe initialises CUDA in the calling process and creates a context on each
    device (for its free memory); a process that forks afterwards cannot use CUDA in the child. With
    isolated=True the probe runs in a fresh interpreter instead, so the caller never touches CUDA."""
    if isolated:
        return _probe_in_subprocess(min_capability)
    path = library_path()
    result = {"library": str(path) if path else None, "library_sha256": None,
              "symbols": {"declared": len(SYMBOLS), "resolved": 0, "missing": []},
              "available": False, "reason": None, "code": None, "devices": [],
              "driver_version": None, "runtime_version": None, "cublas_version": None,
              "attention_shared_memory": [], "min_capability": f"{min_capability[0]}.{min_capability[1]}"}
    try:
        if path is not None and path.is_file():
            result["library_sha256"] = file_sha256(path)
            try:
                exported = elf_dynamic_symbols(path)
                missing = [name for name in SYMBOLS if name not in exported]
                result["symbols"].update(resolved=len(SYMBOLS) - len(missing), missing=missing)
            except (OSError, ValueError, IndexError, struct.error):
                pass
        library = open_library(path)
        result["symbols"].update(resolved=len(SYMBOLS), missing=[])
        result.update(_versions(library))
        result["attention_shared_memory"] = attention_shared_memory(library)
        devices = _devices(library, path)
        result["devices"] = devices
        if not _capable(devices, min_capability):
            raise CudaUnavailable("device_too_old", path, _too_old(devices, min_capability))
        result["available"] = True
    except CudaUnavailable as error:
        result["reason"], result["code"] = error.reason, error.code
    except Exception as error:  # noqa: BLE001 - a probe reports, it never raises
        result["reason"], result["code"] = f"unexpected {type(error).__name__}: {error}", "load_failed"
    return result


def _probe_in_subprocess(min_capability) -> dict:
    import json
    import subprocess
    import sys

    code = ("import json, sys; from native_ext.cuda import probe; "
            "print(json.dumps(probe(tuple(json.loads(sys.argv[1])))))")
    environment = dict(os.environ)
    package_root = str(Path(__file__).resolve().parent.parent)
    environment["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, environment.get("PYTHONPATH")]))
    try:
        completed = subprocess.run([sys.executable, "-c", code, json.dumps(list(min_capability))],
                                   capture_output=True, text=True, timeout=120, env=environment)
        return json.loads(completed.stdout.strip().splitlines()[-1])
    except Exception as error:  # noqa: BLE001 - a probe reports, it never raises
        detail = locals().get("completed")
        tail = (detail.stderr.strip().splitlines() or [""])[-1] if detail is not None else ""
        path = library_path()
        return {"library": str(path) if path else None, "library_sha256": None,
                "symbols": {"declared": len(SYMBOLS), "resolved": 0, "missing": []}, "available": False,
                "reason": f"the probe subprocess failed ({type(error).__name__}: {error}) {tail}".strip(),
                "code": "load_failed", "devices": [], "driver_version": None, "runtime_version": None,
                "cublas_version": None, "attention_shared_memory": [],
                "min_capability": f"{min_capability[0]}.{min_capability[1]}"}


class DeviceArray:
    """A float32/int64/uint8/float64 array in device memory: from_host, to_host, free (or `with`)."""

    def __init__(self, library, shape, dtype):
        self.library = library
        self.shape = tuple(int(n) for n in shape)
        self.dtype = np.dtype(dtype)
        self.nbytes = int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize
        pointer = c_void_p(0)
        check(library, library.kiln_cuda_malloc(ctypes.byref(pointer), max(self.nbytes, 1)), "kiln_cuda_malloc")
        self.ptr = pointer.value

    @classmethod
    def from_host(cls, library, array):
        array = np.ascontiguousarray(array)
        device = cls(library, array.shape, array.dtype)
        if device.nbytes:
            check(library, library.kiln_cuda_memcpy_h2d(device.ptr, array.ctypes.data, device.nbytes, None),
                  "kiln_cuda_memcpy_h2d")
        return device

    @classmethod
    def zeros(cls, library, shape, dtype=np.float32):
        device = cls(library, shape, dtype)
        check(library, library.kiln_cuda_memset(device.ptr, 0, max(device.nbytes, 1), None), "kiln_cuda_memset")
        return device

    def to_host(self):
        out = np.empty(self.shape, self.dtype)
        if self.nbytes:
            check(self.library, self.library.kiln_cuda_memcpy_d2h(out.ctypes.data, self.ptr, self.nbytes, None),
                  "kiln_cuda_memcpy_d2h")
        return out

    def free(self):
        if self.ptr:
            self.library.kiln_cuda_free(self.ptr)
            self.ptr = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.free()

    def __del__(self):
        try:
            self.free()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass
