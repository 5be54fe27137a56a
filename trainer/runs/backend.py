"""The training backend a run computes on: `auto`, `cpu` or `cuda`, resolved from capabilities, never from names.

cuda is usable when the CUDA loader's probe (native_ext.cuda.probe) loads the library and finds a device of
compute capability >= 8.0 (with free memory for the run's planned need, when that is known, and shared memory per
block for the attention kernels at the head sizes the need names: device_plan.DeviceNeed). `cuda` asked for
explicitly needs that; without it the request is refused (`backend_unavailable`, with the loader's reason).
Every workload computes on either: training runs (trainer.runs.device), evaluations and serving (trainer.serving).
`auto` picks cuda only when it is usable AND a passing `kiln qualify --backend cuda` receipt
($KILN_HOME/qualification/latest-cuda.json) holds for this exact execution envelope; otherwise cpu, and the
choice records why. Device and vendor names never enter the decision.
"""

from __future__ import annotations

import copy
import functools
import json
from dataclasses import asdict, dataclass
from pathlib import Path

BACKENDS = ("auto", "cpu", "cuda")
MIN_CAPABILITY = (8, 0)  # the CUDA kernels' floor (Ampere's 8.0: TF32-free FP32 paths, cp.async)
RECEIPT_SCHEMA = "kiln.qualification-receipt.v1"  # what trainer.qualify writes (kiln_web.dashboard.readers checks it)



class BackendUnavailable(RuntimeError):
    """The backend a run needs cannot run in this process; `reason` is the loader's."""

    code = "backend_unavailable"

    def __init__(self, backend: str, reason: str):
        self.backend, self.reason = backend, reason
        self.message = f"backend {backend} is unavailable here: {reason}"
        super().__init__(self.message)


@dataclass(frozen=True)
class BackendChoice:
    """What a request asked for (after the server default), what it resolved to, and why."""

    requested: str
    resolved: str
    reason: str

    def to_dict(self) -> dict:
        return asdict(self)


STATIC_CODES = ("library_missing", "driver_missing")  # absences that last as long as the process: building the
# library or installing a driver takes a restart to be seen (CUDA cannot be initialised again in a process)


def probe_cuda() -> dict:
    """The CUDA loader's probe (never raises); a build without the loader reads as library_missing. Where there is a
    library to load, the probe runs in a fresh interpreter (native_ext.cuda.probe(isolated=True)): probing
    initialises CUDA, and a process that forks afterwards (a web server, a Celery prefork parent) could not use it
    in its children. A static absence (no library, no driver) is answered from the first probe of the process."""
    absent = _absent_for_this_process()
    return copy.deepcopy(absent) if absent is not None else _probe()


@functools.cache
def _absent_for_this_process() -> dict | None:
    result = _probe()
    return result if result.get("code") in STATIC_CODES else None


def _probe() -> dict:
    try:
        from native_ext import cuda
    except ImportError as error:
        return {"library": None, "library_sha256": None, "available": False, "code": "library_missing",
                "reason": f"the CUDA loader native_ext.cuda is not in this build ({error})", "devices": []}
    path = cuda.library_path() if hasattr(cuda, "library_path") else None
    if path is not None and Path(path).is_file():
        return cuda.probe(min_capability=MIN_CAPABILITY, isolated=True)
    return cuda.probe(min_capability=MIN_CAPABILITY)


def _capability(device: dict) -> tuple:
    try:
        return tuple(int(part) for part in str(device.get("compute_capability")).split(".")[:2])
    except ValueError:
        return (0, 0)


def cuda_device(probe: dict) -> dict | None:
    """The device a run uses: the first one of compute capability >= MIN_CAPABILITY, or None."""
    return next((d for d in probe.get("devices") or () if _capability(d) >= MIN_CAPABILITY), None)


def cuda_unavailable(probe: dict, need_bytes: int | None = None) -> str | None:
    """Why the device cannot run here (the loader's reason), or None when it can."""
    if not probe.get("available"):
        return probe.get("reason") or probe.get("code") or "the CUDA loader reports no usable device"
    device = cuda_device(probe)
    if device is None:
        return f"no device of compute capability >= {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]}"
    unplanned = getattr(need_bytes, "reason", None)  # device_plan.Unplannable: refused whatever the device reports
    if unplanned:
        return f"the run's device memory cannot be planned: {unplanned}"
    short = attention_unsupported(probe, device, getattr(need_bytes, "attention", ()))
    if short:
        return short
    free = device.get("free_memory")
    if need_bytes and isinstance(free, int) and free < need_bytes:
        return f"device {device.get('index')} has {free} bytes free; the run plans {need_bytes}"
    return None


def _kib(nbytes) -> str:
    return f"{nbytes / 1024:g} KiB"


def attention_unsupported(probe: dict, device: dict, attention) -> str | None:
    """Why DEVICE cannot run the tiled attention kernels for ATTENTION ((head size, training) pairs:
    device_plan.DeviceNeed.attention), or None when it can: the kernels' shared memory per block at that head size
    (the probe's attention_shared_memory, from the library) against the device's opt-in limit (its
    shared_memory_per_block, and the attention_head_size_limit that gives). A device the probe reports without a limit
    (a probe from before the library exported one) is not refused here."""
    limits = device.get("attention_head_size_limit")
    if not attention or not isinstance(limits, dict):
        return None
    tiers = probe.get("attention_shared_memory") or ()
    for head_size, training in sorted(attention, key=lambda pair: (-pair[0], not pair[1])):  # the most demanding
        workload = "training" if training else "decoding"
        limit = int(limits.get(workload) or 0)
        if head_size <= limit:
            continue
        tier = next((t for t in tiers if t.get("head_size", 0) >= head_size), None)
        if tier is None:
            largest = tiers[-1]["head_size"] if tiers else limit
            return f"head size {head_size}: the CUDA attention kernels take head sizes up to {largest}"
        takes = " and ".join(f"up to {limits[w]} to {verb}" if limits.get(w) else f"none to {verb}"
                             for w, verb in (("training", "train"), ("decoding", "decode")))
        needed = _kib(tier["backward" if training else "forward"])
        allowed = _kib(device.get("shared_memory_per_block") or 0)
        return (f"head size {head_size}: the CUDA attention kernels need {needed} of shared memory per block for "
                f"{workload}, and device {device.get('index')} allows {allowed} per block (it takes head sizes "
                f"{takes})")
    return None


def require_cuda(need_bytes: int | None = None) -> dict:
    """The probe, when the device can run here; else BackendUnavailable with the loader's reason. The device alone:
    a worker's recheck at dequeue (admission chose the backend for the job's kind, and the run rechecks its kind
    before it allocates)."""
    probe = probe_cuda()
    reason = cuda_unavailable(probe, need_bytes)
    if reason is not None:
        raise BackendUnavailable("cuda", reason)
    return probe


def receipt_stem(backend: str, precision: str | None = None) -> str:
    """What names a backend's receipts (latest-STEM.json, receipt-STEM-TIME.json): the backend, then a precision
    other than float32 (each precision is qualified apart: `kiln qualify --precision`)."""
    return backend if precision in (None, "float32") else f"{backend}-{precision}"


def receipt_path(home, precision: str | None = None) -> Path:
    """The cuda receipt a run of PRECISION (None: float32) needs for `auto`."""
    return Path(home) / "qualification" / f"latest-{receipt_stem('cuda', precision)}.json"


def qualify_command(precision: str | None = None) -> str:
    return "kiln qualify --backend cuda" + ("" if precision in (None, "float32") else f" --precision {precision}")


def _differing(prefix: str, held, now, out: list) -> None:
    if isinstance(held, dict) and isinstance(now, dict):
        for key in sorted(set(held) | set(now)):
            _differing(f"{prefix}.{key}", held.get(key), now.get(key), out)
    elif held != now:
        out.append(prefix)


def unqualified(home, identity: dict) -> str | None:
    """Why no passing cuda qualification receipt holds for IDENTITY (this process's cuda execution identity, of
    the run's precision: each precision has its own receipt), or None when one does."""
    precision = identity.get("precision") if isinstance(identity, dict) else None
    path, command = receipt_path(home, precision), qualify_command(precision)
    try:
        receipt = json.loads(path.read_text())
    except FileNotFoundError:
        return f"no qualification receipt ({path}); run: {command}"
    except (OSError, ValueError) as error:
        return f"the qualification receipt {path} cannot be read ({error})"
    if not isinstance(receipt, dict) or receipt.get("schema") != RECEIPT_SCHEMA or receipt.get("backend") != "cuda":
        return f"{path} is not a cuda qualification receipt ({RECEIPT_SCHEMA})"
    if receipt.get("passed") is not True:
        return f"the qualification receipt {path} failed; run: {command}"
    held = (receipt.get("envelope") or {}).get("execution")
    fields: list = []
    _differing("execution", held, identity, fields)
    if fields:
        shown = ", ".join(fields[:4]) + (", ..." if len(fields) > 4 else "")
        return f"the qualification receipt {path} holds for another envelope ({shown} differ); run: {command}"
    return None


def resolve_backend(requested: str | None, default: str, home, cuda_identity,
                    need_bytes: int | None = None, cuda_only: str | None = None) -> BackendChoice:
    """REQUESTED (a request's backend; None: DEFAULT, the server's KILN_TRAINING_BACKEND) resolved to cpu or cuda;
    CUDA_IDENTITY() is this process's cuda execution identity, of the run's precision, which a receipt must hold
    for (auto only). CUDA_ONLY names why a run computes on cuda or nowhere (a tensor-core precision): auto then
    needs cuda available and qualified like any auto run, and raises instead of falling back to cpu.
    ValueError on a name that is not a backend; BackendUnavailable (the loader's reason) when cuda is asked for
    and cannot run."""
    wanted = requested if requested is not None else default
    if wanted not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {wanted!r}")
    source = "requested" if requested is not None else "the server default (KILN_TRAINING_BACKEND)"
    if wanted == "cpu":
        return BackendChoice("cpu", "cpu", f"cpu: {source}")
    if wanted == "cuda":
        require_cuda(need_bytes)
        return BackendChoice("cuda", "cuda", f"cuda: {source}")
    reason = cuda_unavailable(probe_cuda(), need_bytes)
    if reason is not None:
        if cuda_only:
            raise BackendUnavailable("cuda", f"{cuda_only} computes on cuda only, and {reason}")
        return BackendChoice("auto", "cpu", f"auto: cuda unavailable: {reason}")
    reason = unqualified(home, cuda_identity())
    if reason is not None:
        if cuda_only:
            raise BackendUnavailable("cuda", f"{cuda_only} computes on cuda only, and auto needs a passing "
                                             f"qualification: {reason}")
        return BackendChoice("auto", "cpu", f"auto: cuda not qualified: {reason}")
    return BackendChoice("auto", "cuda", "auto: cuda available and qualified for this envelope"
                         + (f" ({cuda_only} computes on cuda only)" if cuda_only else ""))
