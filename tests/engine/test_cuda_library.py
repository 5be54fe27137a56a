"""The CUDA library without a GPU: it is built where nvcc and cuBLAS are, every symbol the loader declares is
exported, the loader's coded reasons (library_missing, load_failed, symbol_missing, and driver_missing, no_device,
device_too_old or out_of_memory from gcc-built stub libraries whose device query answers as a test says),
`kiln doctor --json`, setup.py's skip messages, and the index helpers of kiln_cuda_index.h compiled for the host
against numpy. The kernels themselves are tested on a GPU in test_cuda_kernels.py.
"""

import ctypes
import glob
import hashlib
import json
import os
import re
import shutil
import subprocess
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from native_ext import cuda, nf4, reference

ROOT = Path(__file__).resolve().parents[2]
CUDA_DIR = ROOT / "native_ext" / "cuda"


def _nvcc():
    for candidate in (os.environ.get("KILN_NVCC"), shutil.which("nvcc"),
                      os.path.join(os.environ.get("CUDA_HOME") or "/usr/local/cuda", "bin", "nvcc"),
                      "/usr/local/cuda/bin/nvcc"):
        if candidate and os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    return None


def _cublas_header():
    homes = [os.environ.get("KILN_CUBLAS_HOME")]
    for key in ("purelib", "platlib"):
        site = sysconfig.get_paths()[key]
        homes += [os.path.join(site, "nvidia", "cu13"), os.path.join(site, "nvidia", "cublas")]
    if _nvcc():
        homes.append(os.path.dirname(os.path.dirname(_nvcc())))
    return next((h for h in homes if h and os.path.isfile(os.path.join(h, "include", "cublas_v2.h"))), None)


def _built_library():
    """The installed library; skips (with the reason) only where the install could not build it."""
    if _nvcc() is None:
        pytest.skip("nvcc is not installed, so the install does not build libkiln_cuda.so")
    if _cublas_header() is None:
        pytest.skip("the cuBLAS headers (nvidia-cublas wheel) are not installed, so libkiln_cuda.so is not built")
    path = ROOT / "native_ext" / cuda.LIBRARY_NAME
    assert path.is_file(), f"nvcc and cuBLAS are here but {path} was not built: run `pip install -e .`"
    return path


@pytest.fixture
def no_override(monkeypatch):
    monkeypatch.delenv(cuda.ENVIRONMENT_VARIABLE, raising=False)


def test_the_install_builds_the_library_where_nvcc_and_cublas_are(no_override):
    path = _built_library()
    assert cuda.library_path() == path
    newest_source = max(p.stat().st_mtime for p in CUDA_DIR.glob("*.cu"))
    assert path.stat().st_mtime >= newest_source, "libkiln_cuda.so is older than a .cu source: rebuild"


def test_every_declared_symbol_is_exported_and_every_export_is_declared():
    path = _built_library()
    exported = cuda.elf_dynamic_symbols(path)
    missing = sorted(set(cuda.SYMBOLS) - exported)
    assert not missing, f"declared in SYMBOLS but not exported: {missing}"
    undeclared = sorted(exported - set(cuda.SYMBOLS))
    assert not undeclared, f"exported but not declared in SYMBOLS (or not prefixed kiln_cuda_): {undeclared}"
    if shutil.which("nm"):  # the ELF reader agrees with binutils
        listing = subprocess.run(["nm", "-D", "--defined-only", str(path)], capture_output=True, text=True,
                                 check=True).stdout
        assert {line.split()[-1] for line in listing.splitlines() if line.strip()} == exported


def test_every_c_declaration_has_a_symbols_entry_with_its_argument_count():
    header = (CUDA_DIR / "kiln_cuda.h").read_text()
    text = " ".join(header.split())
    for name, (_, argtypes) in cuda.SYMBOLS.items():
        at = text.index(f" {name}(")
        parameters = text[at + len(name) + 2:text.index(")", at)].strip()
        count = 0 if parameters in ("", "void") else parameters.count(",") + 1
        assert count == len(argtypes), f"{name}: {count} C parameters, {len(argtypes)} argtypes in SYMBOLS"


def test_the_loader_binds_every_symbol(no_override):
    path = _built_library()
    try:
        library = cuda.open_library(path)
    except cuda.CudaUnavailable as error:  # e.g. libcublas not found: the coded reason, then stop here
        assert error.code == "load_failed" and str(path) in str(error)
        pytest.skip(f"the library does not load on this machine: {error}")
    for name, (restype, argtypes) in cuda.SYMBOLS.items():
        function = getattr(library, name)
        assert function.restype is restype and list(function.argtypes) == argtypes, name
    version = ctypes.c_int(0)
    assert library.kiln_cuda_abi_version(ctypes.byref(version)) == 0 and version.value == cuda.ABI_VERSION
    # an argument check fails with KILN_CUDA_BAD_ARGUMENT and says why, without touching a device
    assert library.kiln_cuda_swiglu_forward(None, None, 4, 0, None) == 2001
    assert "F positive" in cuda.last_error(library)


def _driver_present():
    try:
        ctypes.CDLL(cuda.DRIVER_LIBRARY)
    except OSError:
        return False
    return True


def test_probe_says_plainly_why_there_is_no_gpu(no_override):
    _built_library()
    result = cuda.probe()
    if result["available"]:
        pytest.skip("a usable GPU is here; test_cuda_kernels.py covers it")
    assert result["symbols"] == {"declared": len(cuda.SYMBOLS), "resolved": len(cuda.SYMBOLS), "missing": []}
    assert result["library_sha256"] == hashlib.sha256(Path(result["library"]).read_bytes()).hexdigest()
    if not _driver_present():
        assert result["code"] == "driver_missing"
        assert "libcuda.so.1" in result["reason"] and "not installed" in result["reason"]
    else:
        assert result["code"] in ("no_device", "device_too_old", "driver_missing")
    assert result["devices"] == [] or result["code"] == "device_too_old"
    assert result["runtime_version"], "the statically linked CUDA runtime reports its version without a driver"
    with pytest.raises(cuda.CudaUnavailable) as raised:
        cuda.load()
    assert raised.value.code == result["code"] and raised.value.path == result["library"]


def test_an_isolated_probe_reports_the_same_from_a_fresh_interpreter(monkeypatch, tmp_path):
    monkeypatch.setenv(cuda.ENVIRONMENT_VARIABLE, str(tmp_path / "absent.so"))
    assert cuda.probe(isolated=True) == cuda.probe()
    monkeypatch.delenv(cuda.ENVIRONMENT_VARIABLE)
    here, there = cuda.probe(), cuda.probe(isolated=True)
    assert {k: here[k] for k in ("library", "available", "code", "symbols")} == \
        {k: there[k] for k in ("library", "available", "code", "symbols")}


def test_a_missing_override_file_is_library_missing_naming_the_path(monkeypatch, tmp_path):
    missing = tmp_path / "nowhere" / "libkiln_cuda.so"
    monkeypatch.setenv(cuda.ENVIRONMENT_VARIABLE, str(missing))
    assert cuda.library_path() == missing
    result = cuda.probe()
    assert (result["available"], result["code"], result["library"]) == (False, "library_missing", str(missing))
    assert str(missing) in result["reason"] and cuda.ENVIRONMENT_VARIABLE in result["reason"]
    with pytest.raises(cuda.CudaUnavailable) as raised:
        cuda.load()
    assert raised.value.code == "library_missing" and raised.value.path == str(missing)
    assert str(missing) in str(raised.value)


def test_no_library_at_all_is_library_missing_with_the_build_command(monkeypatch):
    monkeypatch.delenv(cuda.ENVIRONMENT_VARIABLE, raising=False)
    monkeypatch.setattr(cuda, "library_path", lambda: None)
    result = cuda.probe()
    assert result["code"] == "library_missing" and "pip install -e ." in result["reason"]


def _tiny_library(tmp_path, names, file_name="libpartial.so"):
    if shutil.which("gcc") is None:
        pytest.skip("gcc is not installed")
    source = tmp_path / "partial.c"
    source.write_text("".join(f"int {name}(void) {{ return 0; }}\n" for name in names))
    output = tmp_path / file_name
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(output), str(source)], check=True)
    return output


def test_a_library_lacking_a_symbol_is_symbol_missing_naming_it(monkeypatch, tmp_path):
    dropped = "kiln_cuda_attention_backward"
    path = _tiny_library(tmp_path, [name for name in cuda.SYMBOLS if name != dropped])
    monkeypatch.setenv(cuda.ENVIRONMENT_VARIABLE, str(path))
    result = cuda.probe()
    assert (result["available"], result["code"]) == (False, "symbol_missing")
    assert dropped in result["reason"]
    assert result["symbols"]["missing"] == [dropped]
    assert result["symbols"]["resolved"] == len(cuda.SYMBOLS) - 1
    with pytest.raises(cuda.CudaUnavailable) as raised:
        cuda.open_library()
    assert raised.value.code == "symbol_missing" and raised.value.path == str(path) and dropped in str(raised.value)


def test_a_file_that_is_not_a_library_is_load_failed(monkeypatch, tmp_path):
    path = tmp_path / "libkiln_cuda.so"
    path.write_text("not an ELF file\n")
    monkeypatch.setenv(cuda.ENVIRONMENT_VARIABLE, str(path))
    result = cuda.probe()
    assert (result["available"], result["code"]) == (False, "load_failed")
    assert str(path) in str(cuda.CudaUnavailable(result["code"], path, result["reason"]))


# -- the device query's coded reasons, through stub libraries whose device functions answer as told -------------

# the least dynamic shared memory per block the attention kernels run with, their 32-row tiles
# (kiln_cuda_attention_shared_bytes): head sizes up to 32, 64 and 128 run the kernels for 32, 64 and 128 columns; the
# backward's figure is the larger of its two kernels'
ATTENTION_TIERS = [{"head_size": 32, "forward": 20096, "backward": 25856},      # 19.6 and 25.25 KiB
                   {"head_size": 64, "forward": 32384, "backward": 42240},      # 31.6 and 41.25 KiB
                   {"head_size": 128, "forward": 56960, "backward": 75008}]     # 55.6 and 73.25 KiB

_C_TYPES = {ctypes.c_int: "int", ctypes.c_int64: "int64_t", ctypes.c_float: "float", ctypes.c_double: "double",
            ctypes.c_size_t: "size_t", ctypes.c_void_p: "void *", ctypes.c_char_p: "char *"}
# the stub's device functions; every other symbol of SYMBOLS returns 0. Each STUB_* is a -D of the scenario.
_STUB_BODIES = {
    "kiln_cuda_last_error": "return stub_error;",
    "kiln_cuda_device_count": "*a0 = STUB_COUNT; return stub_fail(STUB_COUNT_STATUS, \"cudaGetDeviceCount\");",
    "kiln_cuda_driver_version": "*a0 = STUB_DRIVER; return 0;",
    "kiln_cuda_runtime_version": "*a0 = 13000; return 0;",
    "kiln_cuda_cublas_version": "*a0 = 130100; return 0;",
    "kiln_cuda_device_properties": "snprintf(a1, (size_t)a2, \"Kiln Stub Device\"); *a3 = STUB_MAJOR; "
                                   "*a4 = STUB_MINOR; *a5 = (size_t)16 << 30; *a6 = 40; "
                                   "return stub_fail(STUB_PROPERTIES_STATUS, \"cudaGetDeviceProperties\");",
    "kiln_cuda_set_device": "return a0 == 0 ? stub_fail(STUB_SET_STATUS, \"cudaSetDevice\") : 0;",
    "kiln_cuda_mem_info": "*a0 = (size_t)15 << 30; *a1 = (size_t)16 << 30; return 0;",
    "kiln_cuda_device_shared_memory": "*a1 = STUB_SHARED; return stub_fail(STUB_SHARED_STATUS, "
                                      "\"cudaDeviceGetAttribute\");",
    # the attention kernels' shared memory per block as the real library answers (test_the_attention_tiers_are_...)
    "kiln_cuda_attention_shared_bytes": "if (a0 < 1 || a0 > 128) return 2001; " + " ".join(
        f"if (a0 <= {t['head_size']}) {{ *a1 = {t['forward']}; *a2 = {t['backward']}; return 0; }}"
        for t in ATTENTION_TIERS) + " return 2001;",
}
_STUB_DEFAULTS = {"STUB_COUNT": 1, "STUB_COUNT_STATUS": 0, "STUB_DRIVER": 12040, "STUB_MAJOR": 8, "STUB_MINOR": 0,
                  "STUB_PROPERTIES_STATUS": 0, "STUB_SET_STATUS": 0, "STUB_SHARED": 163 << 10,
                  "STUB_SHARED_STATUS": 0}


def _c_type(kind) -> str:
    if kind in _C_TYPES:
        return _C_TYPES[kind]
    return f"{_c_type(kind._type_)}*"  # POINTER(x)


def _stub_source() -> str:
    """C for every symbol of cuda.SYMBOLS, with its declared return and argument types (generated from the table, so
    a symbol added there is in the stub too)."""
    lines = ["#include <stdint.h>", "#include <stddef.h>", "#include <stdio.h>", "static char stub_error[256];",
             "static int stub_fail(int status, const char *where) {",
             "    if (status) snprintf(stub_error, sizeof stub_error, \"%s: stub status %d\", where, status);",
             "    return status;", "}"]
    for name, (restype, argtypes) in cuda.SYMBOLS.items():
        returns = "const char *" if restype is ctypes.c_char_p else _c_type(restype)
        parameters = ", ".join(f"{_c_type(kind)} a{i}" for i, kind in enumerate(argtypes)) or "void"
        lines.append(f"{returns} {name}({parameters}) {{ {_STUB_BODIES.get(name, 'return 0;')} }}")
    return "\n".join(lines) + "\n"


def _stub_library(tmp_path, **defines):
    """A libkiln_cuda.so stand-in in TMP_PATH whose device query answers as DEFINES (over _STUB_DEFAULTS) say."""
    if shutil.which("gcc") is None:
        pytest.skip("gcc is not installed")
    source = tmp_path / "stub.c"
    source.write_text(_stub_source())
    output = tmp_path / "libkiln_cuda_stub.so"
    flags = [f"-D{key}={value}" for key, value in {**_STUB_DEFAULTS, **defines}.items()]
    subprocess.run(["gcc", "-shared", "-fPIC", "-Wall", "-Werror", *flags, "-o", str(output), str(source)],
                   check=True)
    return output


STUB_DEVICE = {"index": 0, "name": "Kiln Stub Device", "compute_capability": "8.0", "total_memory": 16 << 30,
               "free_memory": 15 << 30, "multiprocessors": 40, "shared_memory_per_block": 163 << 10,
               "attention_head_size_limit": {"training": 128, "decoding": 128}}
# scenario: (stub defines, libcuda.so.1 installed?, code, reason, devices listed)
DEVICE_QUERY_FAILURES = {
    "zero devices": (dict(STUB_COUNT=0), True, "no_device",
                     "the CUDA driver is installed but sees no GPU (check CUDA_VISIBLE_DEVICES and nvidia-smi)", []),
    "cudaErrorNoDevice": (dict(STUB_COUNT=0, STUB_COUNT_STATUS=100), True, "no_device",
                          "the CUDA driver is installed but sees no GPU (check CUDA_VISIBLE_DEVICES and nvidia-smi)",
                          []),
    "compute capability 7.5": (dict(STUB_MAJOR=7, STUB_MINOR=5), True, "device_too_old",
                               "every GPU is below compute capability 8.0: Kiln Stub Device (7.5)",
                               [{**STUB_DEVICE, "compute_capability": "7.5"}]),
    "context out of memory": (dict(STUB_COUNT=0, STUB_COUNT_STATUS=2), True, "out_of_memory",
                              "the CUDA context could not be created: cudaGetDeviceCount: stub status 2", []),
    "device out of memory": (dict(STUB_SET_STATUS=2), True, "out_of_memory",
                             "device 0: no memory left for a CUDA context", []),
    "driver too old": (dict(STUB_COUNT=0, STUB_COUNT_STATUS=35, STUB_DRIVER=11040), True, "driver_missing",
                       "the installed CUDA driver (version 11040) is older than this library's runtime needs: "
                       "cudaGetDeviceCount: stub status 35", []),
    "no driver": (dict(STUB_COUNT=0, STUB_COUNT_STATUS=35, STUB_DRIVER=0), False, "driver_missing",
                  "the CUDA driver (libcuda.so.1) is not installed: no NVIDIA GPU driver on this machine", []),
    "stub driver without a version": (dict(STUB_COUNT=0, STUB_COUNT_STATUS=34, STUB_DRIVER=0), True,
                                      "driver_missing", "the installed CUDA driver (libcuda.so.1) reports no version "
                                      "(cudaGetDeviceCount failed with 34): cudaGetDeviceCount: stub status 34", []),
    "other driver error": (dict(STUB_COUNT=0, STUB_COUNT_STATUS=999), True, "no_device",
                           "cudaGetDeviceCount failed with 999: cudaGetDeviceCount: stub status 999", []),
    "properties fail": (dict(STUB_PROPERTIES_STATUS=1), True, "no_device",
                        "device 0 properties failed: cudaGetDeviceProperties: stub status 1", []),
    "shared memory query fails": (dict(STUB_SHARED_STATUS=1), True, "no_device",
                                  "device 0 shared memory per block failed: cudaDeviceGetAttribute: stub status 1",
                                  []),
}


def test_the_stub_library_is_generated_from_symbols_and_a_capable_stub_device_is_available(monkeypatch, tmp_path):
    """The control for the failures below: the same stub with a compute capability 8.0 device is a usable CUDA
    backend, every declared symbol bound, its device and versions reported as the library answers them."""
    path = _stub_library(tmp_path)
    assert cuda.elf_dynamic_symbols(path) == set(cuda.SYMBOLS)
    monkeypatch.setenv(cuda.ENVIRONMENT_VARIABLE, str(path))
    result = cuda.probe()
    assert result["available"] is True and (result["code"], result["reason"]) == (None, None)
    assert result["symbols"] == {"declared": len(cuda.SYMBOLS), "resolved": len(cuda.SYMBOLS), "missing": []}
    assert result["devices"] == [STUB_DEVICE]
    assert result["attention_shared_memory"] == ATTENTION_TIERS
    assert (result["driver_version"], result["runtime_version"], result["cublas_version"]) == (12040, 13000, 130100)
    assert result["library"] == str(path) and result["library_sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    assert cuda.load() is cuda.open_library(path)


def test_the_attention_tiers_are_what_the_library_answers(no_override, emulated_library):
    """ATTENTION_TIERS (what the stub answers) is what kiln_cuda_attention_shared_bytes answers for each head size, in
    the host emulation and in the nvcc-built library; a head size outside 1..128 is an argument error."""
    libraries = [cuda.open_library(emulated_library)]
    if _nvcc() and _cublas_header():  # where the install builds it
        try:
            libraries.append(cuda.open_library(_built_library()))
        except cuda.CudaUnavailable as error:  # it does not load here (load_failed): the emulation only
            assert error.code == "load_failed"
    for library in libraries:
        assert cuda.attention_shared_memory(library) == ATTENTION_TIERS
        forward, backward = ctypes.c_size_t(0), ctypes.c_size_t(0)
        for head_size in (0, cuda.ATTENTION_MAX_HEAD + 1):
            status = library.kiln_cuda_attention_shared_bytes(head_size, ctypes.byref(forward), ctypes.byref(backward))
            assert status == 2001 and "1..128" in cuda.last_error(library)
    assert cuda.ATTENTION_MAX_HEAD == int(re.search(r"#define KILN_CUDA_ATTENTION_MAX_HEAD (\d+)",
                                                    (CUDA_DIR / "kiln_cuda.h").read_text()).group(1))


# a device's opt-in shared memory per block -> the largest head size the attention kernels run there, to train and to
# decode: 99 KiB (compute 8.6, 8.9, 12.0), 163 KiB (8.0, 8.7), 227 KiB (9.0), and smaller devices than any of those
# (none of compute 8.0 or later) to show the limits: one between the 128 kernels, and two below
SHARED_MEMORY_LIMITS = {99 << 10: {"training": 128, "decoding": 128}, 163 << 10: {"training": 128, "decoding": 128},
                        227 << 10: {"training": 128, "decoding": 128}, 64 << 10: {"training": 64, "decoding": 128},
                        48 << 10: {"training": 64, "decoding": 64}, 24 << 10: {"training": 0, "decoding": 32}}


@pytest.mark.parametrize("per_block", sorted(SHARED_MEMORY_LIMITS))
@pytest.mark.django_db  # kiln doctor reports the database too
def test_the_probe_reports_each_devices_shared_memory_and_the_head_sizes_it_runs(capsys, monkeypatch, tmp_path,
                                                                                 per_block):
    """Each device's opt-in shared memory per block, as the library answers it, and the largest head size whose
    attention kernels fit it (the library's own byte counts): a 99 KiB device takes every head size (with tiles of 32
    past 64), a smaller one stays available for the head sizes it runs; `kiln doctor --json` shows both, and its text
    says them."""
    from kiln_web.cli import main

    monkeypatch.setenv(cuda.ENVIRONMENT_VARIABLE, str(_stub_library(tmp_path, STUB_SHARED=per_block)))
    limits = SHARED_MEMORY_LIMITS[per_block]
    result = cuda.probe()
    assert result["available"] is True
    assert result["devices"] == [{**STUB_DEVICE, "shared_memory_per_block": per_block,
                                  "attention_head_size_limit": limits}]
    assert cuda.attention_head_size_limit(result["attention_shared_memory"], per_block) == limits
    main(["doctor", "--json"])
    device = json.loads(capsys.readouterr().out)["cuda"]["devices"][0]
    assert (device["shared_memory_per_block"], device["attention_head_size_limit"]) == (per_block, limits)
    main(["doctor"])
    text = capsys.readouterr().out
    assert f"{per_block / 1024:g} KiB shared memory per block" in text, text
    assert f"head sizes up to {limits['training']} to train, {limits['decoding']} to decode" in text, text


def test_a_device_of_compute_capability_7_5_is_enough_only_for_a_lower_floor(monkeypatch, tmp_path):
    monkeypatch.setenv(cuda.ENVIRONMENT_VARIABLE, str(_stub_library(tmp_path, STUB_MAJOR=7, STUB_MINOR=5)))
    assert cuda.probe()["code"] == "device_too_old"
    lower = cuda.probe(min_capability=(7, 5))
    assert lower["available"] is True and lower["min_capability"] == "7.5"
    assert lower["devices"][0]["compute_capability"] == "7.5"
    cuda.load((7, 5))


@pytest.mark.parametrize("scenario", list(DEVICE_QUERY_FAILURES))
def test_each_device_query_failure_is_its_coded_reason_naming_the_library(monkeypatch, tmp_path, scenario):
    defines, driver_installed, code, reason, devices = DEVICE_QUERY_FAILURES[scenario]
    path = _stub_library(tmp_path, **defines)
    monkeypatch.setenv(cuda.ENVIRONMENT_VARIABLE, str(path))
    monkeypatch.setattr(cuda, "_driver_installed", lambda: driver_installed)  # whatever this machine has
    result = cuda.probe()
    assert (result["available"], result["code"], result["reason"]) == (False, code, reason)
    assert result["library"] == str(path) and result["devices"] == devices
    assert result["symbols"]["missing"] == [] and result["runtime_version"] == 13000  # loaded; the device failed
    with pytest.raises(cuda.CudaUnavailable) as raised:
        cuda.load()
    assert (raised.value.code, raised.value.path, raised.value.reason) == (code, str(path), reason)
    assert str(raised.value) == f"CUDA backend unavailable [{code}] ({path}): {reason}"


@pytest.mark.parametrize("scenario", ["zero devices", "compute capability 7.5", "context out of memory",
                                      "driver too old"])
@pytest.mark.django_db  # kiln doctor reports the database too
def test_kiln_doctor_json_reports_the_device_query_failure(capsys, monkeypatch, tmp_path, scenario):
    from kiln_web.cli import main

    defines, driver_installed, code, reason, _ = DEVICE_QUERY_FAILURES[scenario]
    path = _stub_library(tmp_path, **defines)
    monkeypatch.setenv(cuda.ENVIRONMENT_VARIABLE, str(path))
    monkeypatch.setattr(cuda, "_driver_installed", lambda: driver_installed)
    main(["doctor", "--json"])
    probe = json.loads(capsys.readouterr().out)["cuda"]
    assert (probe["available"], probe["code"], probe["reason"], probe["library"]) == (False, code, reason, str(path))
    main(["doctor"])
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("cuda")]
    assert lines == [f"cuda       unavailable [{code}]: {reason}"]


@pytest.mark.django_db  # kiln doctor reports the database too
def test_kiln_doctor_json_has_the_cuda_object(capsys, no_override):
    from kiln_web.cli import main

    status = main(["doctor", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert status == 0 or not report["native_ext"]["imports"]
    probe = report["cuda"]
    for key in ("library", "symbols", "available", "reason", "code", "devices", "driver_version", "runtime_version",
                "cublas_version", "library_sha256"):
        assert key in probe, key
    assert probe["symbols"]["declared"] == len(cuda.SYMBOLS)
    assert probe["available"] == cuda.probe()["available"]


@pytest.mark.django_db  # kiln doctor reports the database too
def test_kiln_doctor_text_names_the_cuda_reason(capsys, monkeypatch, tmp_path):
    from kiln_web.cli import main

    monkeypatch.setenv(cuda.ENVIRONMENT_VARIABLE, str(tmp_path / "absent.so"))
    main(["doctor"])
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("cuda")]
    assert len(lines) == 1 and "unavailable [library_missing]" in lines[0] and "absent.so" in lines[0]


# -- setup.py's CUDA step --------------------------------------------------------------------------------


def _setup_cuda_namespace():
    """The CUDA part of setup.py (setup.py itself imports Cython, which only the build environment has)."""
    import concurrent.futures
    import sys
    import tempfile

    text = (ROOT / "setup.py").read_text()
    namespace = {"concurrent": concurrent, "glob": glob, "os": os, "shutil": shutil, "subprocess": subprocess,
                 "sys": sys, "sysconfig": sysconfig, "tempfile": tempfile, "Path": Path,
                 "__file__": str(ROOT / "setup.py")}
    exec(compile(text[text.index("CUDA_DIR ="):text.index("class BuildWithCuda")], "setup.py", "exec"), namespace)
    return namespace


def test_setup_skips_the_cuda_library_with_a_reason_without_nvcc(tmp_path, capsys):
    namespace = _setup_cuda_namespace()
    namespace["find_nvcc"] = lambda: None
    namespace["build_cuda_library"](tmp_path)
    assert "nvcc not found" in capsys.readouterr().err
    assert not (tmp_path / cuda.LIBRARY_NAME).exists()


def test_setup_skips_the_cuda_library_with_a_reason_without_cublas(tmp_path, capsys):
    namespace = _setup_cuda_namespace()
    namespace["find_nvcc"] = lambda: "/usr/bin/true"
    namespace["find_cublas"] = lambda nvcc: None
    namespace["build_cuda_library"](tmp_path)
    assert "pip install nvidia-cublas" in capsys.readouterr().err
    assert not (tmp_path / cuda.LIBRARY_NAME).exists()


# -- the index helpers, compiled for the host ----------------------------------------------------------------


@pytest.fixture(scope="module")
def index(tmp_path_factory):
    compiler = shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        pytest.skip("no C++ compiler (g++) to build the host index helpers")
    output = tmp_path_factory.mktemp("index") / "libkiln_index.so"
    subprocess.run([compiler, "-O2", "-Wall", "-Werror", "-shared", "-fPIC", "-o", str(output),
                    str(CUDA_DIR / "index_host.cpp")], check=True)
    return ctypes.CDLL(str(output))


def _p(array):
    return array.ctypes.data_as(ctypes.c_void_p)


I64 = ctypes.c_int64


@pytest.mark.parametrize("g,past,key_start,window", [(1, 0, 0, 0), (2, 0, 4, 0), (3, 5, 2, 0), (2, 3, 0, 4)])
def test_attention_mask_matches_numpy(index, g, past, key_start, window):
    R, S = 12, 9
    mask = np.zeros((R, S), np.uint8)
    index.kiln_index_mask(I64(R), I64(S), I64(g), I64(past), I64(key_start), I64(window), _p(mask))
    query = past + np.arange(R)[:, None] // g  # [R,1]
    keys = key_start + np.arange(S)[None, :]  # [1,S]
    expected = keys <= query
    if window:
        expected &= query - keys < window
    else:
        np.testing.assert_array_equal(expected, reference._causal_mask(R, S, g, past, key_start))
    np.testing.assert_array_equal(mask.astype(bool), expected)


def test_tile_bounds_last_key_and_first_row_match_the_mask(index):
    T, g, past, tile = 11, 3, 4, 4
    R, S = T * g, past + T
    starts = np.arange(0, R, tile, dtype=np.int64)
    ends = np.empty_like(starts)
    index.kiln_index_tile_end(_p(starts), I64(tile), I64(R), _p(ends), I64(len(starts)))
    np.testing.assert_array_equal(ends, np.minimum(starts + tile, R))
    counts = np.arange(0, 40, dtype=np.int64)
    blocks = np.empty_like(counts)
    index.kiln_index_ceil_div(_p(counts), I64(7), _p(blocks), I64(len(counts)))
    np.testing.assert_array_equal(blocks, -(-counts // 7))
    mask = reference._causal_mask(R, S, g, past, 0)  # [R,S]
    last = np.empty_like(ends)
    index.kiln_index_last_key(I64(S), _p(ends), I64(g), I64(past), _p(last), I64(len(ends)))
    for end, last_key in zip(ends, last):  # keys seen by any row before `end`
        assert last_key == np.flatnonzero(mask[:end].any(axis=0)).max() + 1
    key_starts = np.arange(S, dtype=np.int64)
    first = np.empty_like(key_starts)
    index.kiln_index_first_row(_p(key_starts), I64(g), I64(past), _p(first), I64(S))
    for key, row in zip(key_starts, first):  # the first row that sees `key` (or any later key)
        assert row == np.flatnonzero(mask[:, key:].any(axis=1)).min()


@pytest.mark.parametrize("g,past,window", [(1, 0, 0), (3, 4, 0), (1, 0, 5), (3, 4, 5), (2, 7, 1), (2, 0, 40)])
def test_window_bounds_first_key_and_row_end_match_the_mask(index, g, past, window):
    """The attention kernels' window skipping: the first key a tile of rows can see, and the rows a tile of keys
    is seen by, against the mask (no window: key 0 and every row)."""
    T = 13
    R, S = T * g, past + T
    query = past + np.arange(R)[:, None] // g
    keys = np.arange(S)[None, :]
    mask = (keys <= query) & ((query - keys < window) if window else True)  # [R,S]
    row_starts = np.arange(R, dtype=np.int64)
    first = np.empty_like(row_starts)
    index.kiln_index_first_key(_p(row_starts), I64(g), I64(past), I64(window), _p(first), I64(R))
    for row, key in zip(row_starts, first):  # the first key any row from `row` on sees
        assert key == np.flatnonzero(mask[row:].any(axis=0)).min()
    key_ends = np.arange(1, S + 1, dtype=np.int64)
    ends = np.empty_like(key_ends)
    index.kiln_index_row_end(_p(key_ends), I64(R), I64(g), I64(past), I64(window), _p(ends), I64(S))
    for key_end, end in zip(key_ends, ends):  # one past the last row that sees a key before key_end
        seen = np.flatnonzero(mask[:, :key_end].any(axis=1))
        assert end == (seen.max() + 1 if len(seen) else 0 if window else R)


def test_rope_output_layout_and_gqa_heads_match_the_cpu_kernel(index):
    B, T, KV, g, D = 2, 3, 2, 3, 4
    flat = np.empty(B * T * KV * g * D, np.int64)
    index.kiln_index_rope_out(I64(B), I64(T), I64(KV), I64(g), I64(D), _p(flat))
    # reference.rope_forward's layout: [B,T,NH,D] reshaped to [B,T,KV,g,D] and moved to [B,KV,T,g,D]
    positions = np.arange(B * KV * T * g * D).reshape(B, KV, T, g, D)
    expected = positions.transpose(0, 2, 1, 3, 4).reshape(-1)  # out index of each (b, t, h, d)
    np.testing.assert_array_equal(flat, expected)
    heads = np.arange(KV * g, dtype=np.int64)
    kv_head, slot = np.empty_like(heads), np.empty_like(heads)
    index.kiln_index_gqa(_p(heads), I64(g), _p(kv_head), _p(slot), I64(len(heads)))
    np.testing.assert_array_equal(kv_head, heads // g)
    np.testing.assert_array_equal(slot, heads % g)


def _strided(index, view):
    """kiln_strided_index over every (b, t, h, d) of the numpy view [B,T,H,D], with the view's strides in elements."""
    B, T, H, D = view.shape
    assert view.strides[3] == view.itemsize, "the helper needs a contiguous last axis"
    stride_b, stride_t, stride_h = (s // view.itemsize for s in view.strides[:3])
    flat = np.empty(view.size, np.int64)
    index.kiln_index_strided(I64(B), I64(T), I64(H), I64(D), I64(stride_b), I64(stride_t), I64(stride_h), _p(flat))
    return flat.reshape(view.shape)


@pytest.mark.parametrize("layout", ["contiguous", "q of fused qkv", "k of fused qkv", "heads before time"])
def test_strided_index_matches_numpys_strides(index, layout):
    """The rotary kernels read x [B,T,H,D] through (b, t, h) strides from the view's first element: each
    element's flat index equals where numpy's view of the same buffer puts it."""
    B, T, NH, KV, D = 2, 3, 4, 2, 6
    if layout == "heads before time":  # [B,H,T,D] in memory, read as [B,T,H,D]
        buffer = np.arange(B * NH * T * D, dtype=np.int64).reshape(B, NH, T, D)
        view = buffer.transpose(0, 2, 1, 3)  # [B,T,H,D]
    else:
        buffer = np.arange(B * T * (NH + 2 * KV) * D, dtype=np.int64).reshape(B, T, NH + 2 * KV, D)
        view = {"contiguous": np.arange(B * T * NH * D, dtype=np.int64).reshape(B, T, NH, D),
                "q of fused qkv": buffer[:, :, :NH], "k of fused qkv": buffer[:, :, NH:NH + KV]}[layout]
    # every value of the buffer is its own flat index: the view's values, less its first one, are the offsets
    np.testing.assert_array_equal(_strided(index, view), view - view[0, 0, 0, 0])


def test_strided_index_is_int64_past_two_to_the_31(index):
    B, T, H, D = 2, 3, 2, 4
    stride_b, stride_t, stride_h = (3 << 31) + 5, (1 << 31) + 7, 1 << 20
    flat = np.empty(B * T * H * D, np.int64)
    index.kiln_index_strided(I64(B), I64(T), I64(H), I64(D), I64(stride_b), I64(stride_t), I64(stride_h), _p(flat))
    expected = [b * stride_b + t * stride_t + h * stride_h + d  # Python integers: no overflow
                for b in range(B) for t in range(T) for h in range(H) for d in range(D)]
    assert flat.tolist() == expected and max(expected) > 2**32


@pytest.mark.parametrize("n,block_size,start", [(130, 64, 0), (130, 64, 5), (97, 32, 33)])
def test_nf4_byte_nibble_and_block_match_the_quantizer(index, n, block_size, start):
    x = np.random.default_rng(n).standard_normal(n).astype(np.float32)
    packed = np.zeros((n + 1) // 2, np.uint8)
    absmax = np.zeros(-(-n // block_size), np.float32)
    nf4.quantize(x, block_size, packed, absmax)
    count = n - start
    byte, nibble, block = (np.empty(count, np.int64) for _ in range(3))
    index.kiln_index_nf4(_p(packed), I64(start), I64(count), I64(block_size), _p(byte), _p(nibble), _p(block))
    decoded = nf4.NF4_CODE[nibble] * absmax[block]
    expected = np.empty(count, np.float32)
    nf4.reference_dequantize(packed, block_size, start, expected, absmax)
    np.testing.assert_array_equal(decoded, expected)
    positions = np.arange(start, n)
    np.testing.assert_array_equal(byte, positions // 2)
    np.testing.assert_array_equal(block, positions // block_size)
    repacked = np.zeros_like(packed)
    codes = np.empty(n, np.int64)
    scratch = np.empty(n, np.int64)
    index.kiln_index_nf4(_p(packed), I64(0), I64(n), I64(block_size), _p(scratch), _p(codes), _p(scratch))
    index.kiln_index_nf4_pack(_p(codes), I64(n), _p(repacked))
    np.testing.assert_array_equal(repacked, packed)  # high nibble first, a lone last element padded with code 7 (0.0)


def test_absmax_scale_index_matches_the_double_quantization_layout(index):
    blocks = np.arange(1000, dtype=np.int64)
    out = np.empty_like(blocks)
    index.kiln_index_absmax_scale(_p(blocks), _p(out), I64(len(blocks)))
    scales = np.arange(-(-len(blocks) // nf4.ABSMAX_BLOCK_SIZE))
    np.testing.assert_array_equal(out, np.repeat(scales, nf4.ABSMAX_BLOCK_SIZE)[:len(blocks)])
