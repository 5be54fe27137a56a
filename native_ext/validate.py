"""What every validating wrapper in native_ext shares: the import of a built kernel module and the
dtype, shape and contiguity check of an array before it is handed to a Cython kernel; and the SHA-256 of a
file (a loaded library's, in the execution identity)."""

import hashlib
import importlib

import numpy as np


def built(module: str, what: str):
    """native_ext.MODULE; when it was never compiled, an ImportError naming the command that builds WHAT."""
    try:
        return importlib.import_module(f"native_ext.{module}")
    except ImportError as error:  # pragma: no cover - only on a broken install
        raise ImportError(
            f"native_ext.{module} is not built. Install Kiln with `pip install -e .` (needs gcc and the "
            f"Python headers) so that setup.py compiles {what}."
        ) from error


def check_array(name, array, dtype, ndim, writable=False):
    """ARRAY is a C-contiguous numpy array of DTYPE with NDIM axes (and writable, when asked)."""
    if not isinstance(array, np.ndarray):
        raise TypeError(f"{name} must be a numpy array, got {type(array).__name__}")
    if array.dtype != dtype:
        raise TypeError(f"{name} must be {np.dtype(dtype).name}, got {array.dtype}")
    if array.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {array.shape}")
    if not array.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous")
    if writable and not array.flags.writeable:
        raise ValueError(f"{name} must be writable")


def file_sha256(path) -> str:
    """SHA-256 hex of a file's bytes, read in 1 MiB pieces."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()
