"""What setup.py's CUDA build leaves: the built libkiln_cuda.so carries machine code for every `code=sm_XX` and PTX
for every `code=compute_XX` of setup.py's CUDA_ARCHITECTURES (read from setup.py, so the two cannot drift), as
cuobjdump lists them; and setup.py writes what became of the library (built, or why not) beside it, for ./dev and
bench/cuda_check.sh to print (pip -q hides setup.py's stderr)."""

import ast
import collections
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LIBRARY = ROOT / "native_ext" / "libkiln_cuda.so"


def setup_namespace(*names) -> dict:
    """setup.py's top-level assignments and functions NAMES, run with the standard library alone (its module code
    imports Cython, which only the build environment has)."""
    def standard(node):
        modules = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]
        return all(module.split(".")[0] in sys.stdlib_module_names for module in modules)

    tree = ast.parse((ROOT / "setup.py").read_text())
    nodes = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom)) and standard(n)]
    nodes += [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in names
              or isinstance(n, ast.Assign) and any(getattr(t, "id", None) in names for t in n.targets)]
    namespace = {"__file__": str(ROOT / "setup.py")}
    exec(compile(ast.Module(nodes, type_ignores=[]), "setup.py", "exec"), namespace)
    missing = [name for name in names if name not in namespace]
    assert not missing, f"setup.py defines no {missing}"
    return namespace


def expected_targets() -> tuple:
    """({sm_XX with machine code}, {sm_XX with PTX}) from setup.py's -gencode arch=compute_XX,code=Y pairs."""
    flags = setup_namespace("CUDA_ARCHITECTURES")["CUDA_ARCHITECTURES"]
    codes = [flag.split("code=", 1)[1] for flag in flags if flag.startswith("arch=")]
    assert codes and len(codes) == flags.count("-gencode"), flags
    machine = {code for code in codes if code.startswith("sm_")}
    ptx = {"sm_" + code.removeprefix("compute_") for code in codes if code.startswith("compute_")}
    assert machine | {"compute_" + p.removeprefix("sm_") for p in ptx} == set(codes), codes
    return machine, ptx


def find_cuobjdump(nvcc: str):
    """cuobjdump on PATH, in nvcc's toolkit, or from the nvidia-cuda-cuobjdump wheel; None when absent."""
    toolkit = Path(os.path.realpath(nvcc)).parent
    candidates = [shutil.which("cuobjdump"), toolkit / "cuobjdump"]
    for key in ("purelib", "platlib"):
        candidates += sorted(Path(sysconfig.get_paths()[key]).glob("nvidia/*/bin/cuobjdump"))
    return next((str(c) for c in candidates if c and os.path.isfile(c) and os.access(c, os.X_OK)), None)


def listed(cuobjdump: str, what: str, suffix: str) -> collections.Counter:
    """How many embedded files of each sm_XX `cuobjdump --list-WHAT` shows in the library."""
    result = subprocess.run([cuobjdump, f"--list-{what}", str(LIBRARY)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, f"cuobjdump --list-{what} {LIBRARY}: {result.stderr}"
    return collections.Counter(re.findall(rf"\.(sm_\d+[a-z]?)\.{suffix}\b", result.stdout))


def test_the_library_holds_machine_code_and_ptx_for_setup_pys_architectures():
    nvcc = setup_namespace("find_nvcc")["find_nvcc"]()
    if nvcc is None:
        pytest.skip("nvcc is not installed (setup.py's rule), so the install builds no libkiln_cuda.so")
    cuobjdump = find_cuobjdump(nvcc)
    if cuobjdump is None:
        pytest.skip("cuobjdump is not installed (it comes with the CUDA toolkit, or pip install nvidia-cuda-cuobjdump)")
    note = LIBRARY.with_name("libkiln_cuda.build.txt")
    why = note.read_text().strip() if note.is_file() else "setup.py left no note"
    assert LIBRARY.is_file(), f"nvcc ({nvcc}) is here but {LIBRARY} is not: {why}; run `pip install -e .`"
    machine, ptx = expected_targets()
    elf, listed_ptx = listed(cuobjdump, "elf", "cubin"), listed(cuobjdump, "ptx", "ptx")
    rebuild = f"rebuild with `pip install -e .` (setup.py: {sorted(machine)} machine code, {sorted(ptx)} PTX)"
    assert machine <= set(elf), f"machine code for {sorted(machine - set(elf))} is missing: {dict(elf)}; {rebuild}"
    # every translation unit carries every target (others may come from the static CUDA runtime: sm_75 does)
    assert len({elf[sm] for sm in machine}) == 1, f"a unit lacks a target: {dict(elf)}; {rebuild}"
    assert set(listed_ptx) == ptx, f"PTX for {dict(listed_ptx)}, setup.py asks for {sorted(ptx)}; {rebuild}"
    assert set(listed_ptx.values()) == {elf[min(machine)]}, f"a unit lacks PTX: {dict(listed_ptx)}; {rebuild}"


def test_setup_writes_why_it_did_not_build_the_library_beside_it(tmp_path, monkeypatch):
    namespace = setup_namespace("CUDA_DIR", "CUDA_LIBRARY", "CUDA_BUILD_NOTE", "CUDA_ARCHITECTURES", "NVCC_FLAGS",
                                "say", "find_nvcc", "find_cublas", "build_cuda_library", "_build_cuda_library")
    monkeypatch.delenv("KILN_SKIP_CUDA", raising=False)
    namespace["find_nvcc"] = lambda: None
    namespace["build_cuda_library"](tmp_path / "native_ext")
    note = (tmp_path / "native_ext" / "libkiln_cuda.build.txt").read_text()
    assert note.startswith("nvcc not found (KILN_NVCC, PATH, $CUDA_HOME, $CUDA_PATH, /usr/local/cuda)")
    namespace["find_nvcc"] = lambda: "/usr/bin/true"
    namespace["find_cublas"] = lambda nvcc: None
    namespace["build_cuda_library"](tmp_path / "native_ext")
    assert "pip install nvidia-cublas" in (tmp_path / "native_ext" / "libkiln_cuda.build.txt").read_text()
    monkeypatch.setenv("KILN_SKIP_CUDA", "1")
    namespace["build_cuda_library"](tmp_path / "native_ext")
    assert (tmp_path / "native_ext" / "libkiln_cuda.build.txt").read_text() == \
        "KILN_SKIP_CUDA=1: the CUDA library is not built\n"
    assert not (tmp_path / "native_ext" / "libkiln_cuda.so").exists()


def test_setup_writes_a_failed_compile_beside_the_library(tmp_path, monkeypatch):
    namespace = setup_namespace("CUDA_DIR", "CUDA_LIBRARY", "CUDA_BUILD_NOTE", "CUDA_ARCHITECTURES", "NVCC_FLAGS",
                                "say", "find_nvcc", "find_cublas", "build_cuda_library", "_build_cuda_library")
    monkeypatch.delenv("KILN_SKIP_CUDA", raising=False)
    monkeypatch.delenv("KILN_REQUIRE_CUDA", raising=False)
    monkeypatch.chdir(ROOT)  # CUDA_DIR is relative to the checkout, as when pip runs setup.py
    namespace["find_nvcc"] = lambda: "/bin/false"  # every compile fails
    namespace["find_cublas"] = lambda nvcc: (str(tmp_path), str(tmp_path), "libcublas.so")
    namespace["build_cuda_library"](tmp_path)
    assert (tmp_path / "libkiln_cuda.build.txt").read_text().startswith("the CUDA library failed to build (")
    monkeypatch.setenv("KILN_REQUIRE_CUDA", "1")
    (tmp_path / "libkiln_cuda.build.txt").unlink()
    with pytest.raises(subprocess.CalledProcessError):
        namespace["build_cuda_library"](tmp_path)
    assert (tmp_path / "libkiln_cuda.build.txt").read_text().startswith("the CUDA library failed to build (")
