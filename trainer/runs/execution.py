"""The execution identity: what must be the same for a resumed run to continue bit for bit.

It is computed by the process that trains (each worker, once at start, cached per process) and
recorded in every checkpoint that process writes; at dequeue a worker refuses to resume a
checkpoint whose identity differs from its own, field by field. Fields:

backend        the training backend (cpu, cuda)
device         the machine, and the CPU's model and instruction-set flags (/proc/cpuinfo where present)
blas           numpy's BLAS: library, version, kernel architecture and its thread count
numpy, python  their versions
native_builds  SHA-256 of each built native_ext library
kiln           the installed distribution's version
code           SHA-256 over the trainer/ and native_ext/ sources and built libraries that run
precision      float32, or the precision a LoRA run's frozen base computes at (config.precision): bfloat16 on the
               cpu backend adds onednn, the library's version and SHA-256 and its thread count
               (native_ext.onednn.identity); bfloat16 or tfloat32 on cuda are cuBLAS's tensor-core compute types,
               whose library the gpu field names
kernel_contract
gpu            cuda only: the device's name and compute capability, the driver, runtime and cuBLAS versions
               and the SHA-256 of the CUDA library (native_ext.cuda.probe); a cpu identity has no such field

The cpu identity's fields and values are those every existing checkpoint records: change them and no
checkpoint resumes.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
from importlib import metadata
from pathlib import Path

from trainer.fsio import file_sha256

KERNEL_CONTRACT = "kiln-cpu-kernels-v1"
KERNEL_CONTRACTS = {"cpu": KERNEL_CONTRACT, "cuda": "kiln-cuda-kernels-v1"}
CPUINFO = Path("/proc/cpuinfo")
# instruction-set flags whose presence changes which kernels BLAS and numpy dispatch to (shown in full;
# every flag is also bound through cpu_flags_sha256)
SIMD_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq",
              "avx512_vnni", "avx512_bf16", "amx_tile", "asimd", "sve", "sve2")
CODE_SUFFIXES = (".py", ".so", ".pyd", ".dylib")  # the sources and the built libraries that run


def execution_identity(backend: str, precision: str | None = None) -> dict:
    """This process's identity for BACKEND (and PRECISION, None: float32), computed once (a worker computes it at
    start). A cuda identity is kept only once the device is found (its gpu fields are then the device's): whether
    a cuda run may start is the probe's answer at that moment (trainer.runs.backend.require_cuda), never this
    cache's."""
    if backend == "cuda":
        from trainer.runs.backend import cuda_unavailable, probe_cuda
        if cuda_unavailable(probe_cuda()) is not None:
            return with_precision(compute_execution_identity(backend), precision)
    return with_precision(dict(_cached(backend)), precision)


def with_precision(identity: dict, precision: str | None) -> dict:
    """IDENTITY of a float32 run (unchanged), or of another precision's: the precision, and on the cpu backend the
    oneDNN it computes on."""
    if precision in (None, "float32"):
        return identity
    if identity.get("backend") == "cuda":
        return {**identity, "precision": precision}
    from native_ext import onednn
    return {**identity, "precision": precision, "onednn": onednn.identity()}


@functools.cache
def _cached(backend: str) -> dict:
    return compute_execution_identity(backend)


# a child forked without exec may compute on another library than its parent (native_ext.blas): ask it afresh
os.register_at_fork(after_in_child=_cached.cache_clear)


def compute_execution_identity(backend: str) -> dict:
    """The identity as it is now (not cached): tests and `kiln doctor`-like checks read it fresh."""
    import numpy as np

    import native_ext
    import trainer

    native = Path(native_ext.__file__).parent
    gpu = gpu_identity() if backend == "cuda" else None
    identity = {
        "backend": backend,
        "device": device_identity(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "libraries": library_versions(),
        "blas": blas_identity(),
        "native_builds": {p.name: file_sha256(p) for p in sorted(native.glob("_*.so"))},
        "kiln": kiln_version(),
        "code": code_digest((Path(trainer.__file__).parent, native)),
        "precision": "float32",
        "kernel_contract": KERNEL_CONTRACTS.get(backend, KERNEL_CONTRACT),
    }
    if gpu is not None:
        identity["gpu"] = gpu
    return identity


def gpu_identity() -> dict:
    """The CUDA device a run uses and the evidence of its stack (free memory is no part of it: it varies); every
    field None when the loader finds no usable device (such a process cannot start a cuda run). The opt-in shared
    memory per block chooses the attention kernels' tiles (64 or 32 rows), so it is part of what gives the bits."""
    from trainer.runs.backend import cuda_device, cuda_unavailable, probe_cuda

    probe = probe_cuda()
    device = (cuda_device(probe) if cuda_unavailable(probe) is None else None) or {}
    return {"name": device.get("name"), "compute_capability": device.get("compute_capability"),
            "total_memory": device.get("total_memory"),
            "shared_memory_per_block": device.get("shared_memory_per_block"),
            # cuBLAS reads it: 0 turns TF32 off even where a tfloat32 run asks for it
            "tf32_override": os.environ.get("NVIDIA_TF32_OVERRIDE") if device else None,
            "driver_version": _text(probe.get("driver_version")),
            "runtime_version": _text(probe.get("runtime_version")),
            "cublas_version": _text(probe.get("cublas_version")),
            "library_sha256": probe.get("library_sha256")}


# the libraries besides numpy whose version can change a run's bytes: tokenisation and chat templates (the token ids
# trained on), and the adapter files written (safetensors)
BIT_LIBRARIES = ("tokenizers", "jinja2", "safetensors")


def library_versions() -> dict:
    """{name: installed version (None where absent)} of BIT_LIBRARIES."""
    versions = {}
    for name in BIT_LIBRARIES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def kiln_version() -> str:
    """The version of the installed `kiln` distribution ("0+unknown" from a checkout never installed)."""
    try:
        return metadata.version("kiln")
    except metadata.PackageNotFoundError:
        return "0+unknown"


def device_identity(cpuinfo: Path = CPUINFO) -> dict:
    """The machine and the evidence of its capabilities: CPU model and flags where /proc/cpuinfo exists."""
    device = {"machine": platform.machine(), "cpu_model": None, "cpu_flags": None, "cpu_flags_sha256": None}
    try:
        text = cpuinfo.read_text(errors="replace")
    except OSError:
        return device
    fields = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        key = key.strip()
        if sep and key not in fields:  # the first processor's; a pool machine's CPUs are alike
            fields[key] = value.strip()
    device["cpu_model"] = fields.get("model name") or fields.get("CPU part") or fields.get("cpu model")
    flags = sorted(set((fields.get("flags") or fields.get("Features") or "").split()))
    if flags:
        device["cpu_flags"] = [flag for flag in SIMD_FLAGS if flag in flags]
        device["cpu_flags_sha256"] = hashlib.sha256(" ".join(flags).encode()).hexdigest()
    return device


def blas_identity() -> dict:
    """numpy's BLAS (others loaded in the process, torch's or scipy's, do not touch training arithmetic):
    {library, version, architecture, threading_layer}; threads, how many threads the engine's products and
    kernels compute on (OpenBLAS's, or oneDNN's where it computes the float32 products); and float32_gemm, the
    library of those products: "openblas", or "onednn" with its version and SHA-256 as `onednn`."""
    from threadpoolctl import threadpool_info

    from native_ext import blas as engine_blas
    from native_ext import onednn

    gemm = {"float32_gemm": engine_blas.FLOAT32_GEMM}
    if engine_blas.FLOAT32_GEMM == "onednn":
        gemm["onednn"] = {k: v for k, v in onednn.identity().items() if k != "threads"}  # threads: above
    for info in threadpool_info():
        if info.get("user_api") == "blas" and str(engine_blas.LIBRARY_PATH) == info.get("filepath"):
            threads = engine_blas.threads() if engine_blas.FLOAT32_GEMM == "onednn" else info.get("num_threads")
            return {"library": info.get("internal_api"), "version": _text(info.get("version")),
                    "architecture": _text(info.get("architecture")),
                    "threading_layer": _text(info.get("threading_layer")), "threads": threads, **gemm}
    return {"library": None, "version": None, "architecture": None, "threading_layer": None,
            "threads": engine_blas.threads() if engine_blas.FLOAT32_GEMM == "onednn" else None, **gemm}


def code_digest(roots) -> dict:
    """{sha256, files}: one digest over every source and built library under ROOTS, in a fixed order
    (root name, then relative path); caches (__pycache__) and build folders are skipped."""
    digest = hashlib.sha256()
    count = 0
    for root in roots:
        root = Path(root)
        paths = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in CODE_SUFFIXES
                       and not {"__pycache__", "build"} & set(p.relative_to(root).parts))
        for path in paths:
            name = f"{root.name}/{path.relative_to(root).as_posix()}"
            digest.update(f"{name}\0{file_sha256(path)}\n".encode())
            count += 1
    return {"sha256": digest.hexdigest(), "files": count}


def _text(value):
    return None if value is None else str(value)


