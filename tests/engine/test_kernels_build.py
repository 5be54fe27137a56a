"""The row kernels compile to vector code on every instruction set they are cloned for.

kiln_kernels.h's loops are written to vectorise without -ffast-math (a branch-free exp, explicit
lanes for reductions), but GCC only if-converts a float comparison inside a loop when floating-point
traps are off: without setup.py's -fno-trapping-math the AVX2 and default clones of every loop that
computes an exponential stayed scalar (the attention tiles, SwiGLU), which made a LoRA step about 1.6x
slower on AVX2-only CPUs while the AVX-512 clone (masked instructions) was vectorised. This compiles
the header with setup.py's own flags and GCC's vectoriser report, and fails on any loop the report
says stayed scalar for control flow.
"""

import ast
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HEADER = ROOT / "native_ext" / "kiln_kernels.h"


def setup_compile_args():
    """COMPILE_ARGS as setup.py assigns it (setup.py itself imports Cython, which only the build has)."""
    for node in ast.parse((ROOT / "setup.py").read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "COMPILE_ARGS" for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError("setup.py assigns no COMPILE_ARGS")


def vectoriser_report(tmp_path, flags):
    """GCC's -fopt-info-vec-missed lines for a unit that takes the address of every kernel (so each is
    compiled, with all its target clones)."""
    names = re.findall(r"^static (?:inline )?\w+ \*?(kiln_\w+)\(", HEADER.read_text(), re.M)
    assert len(names) >= 10, names
    unit = tmp_path / "every_kernel.c"
    unit.write_text(f'#include "{HEADER.name}"\nvoid *kiln_every_kernel[] = {{{", ".join(names)}}};\n')
    result = subprocess.run(["gcc", *flags, "-fopt-info-vec-missed", f"-I{HEADER.parent}", "-c", str(unit),
                             "-o", str(tmp_path / "every_kernel.o")], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return result.stderr.splitlines()


def scalar_loops(lines):
    return sorted({line for line in lines if HEADER.name in line and "control flow in loop" in line})


@pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc is not installed (it builds the kernels)")
def test_every_kernel_loop_vectorises_with_setup_flags(tmp_path):
    flags = setup_compile_args()
    assert scalar_loops(vectoriser_report(tmp_path, flags)) == []


@pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc is not installed (it builds the kernels)")
def test_report_finds_scalar_loops_without_the_trap_flag(tmp_path):
    """The check above can fail: dropping -fno-trapping-math leaves the exponential loops scalar."""
    flags = [flag for flag in setup_compile_args() if flag != "-fno-trapping-math"]
    assert scalar_loops(vectoriser_report(tmp_path, flags)) != []
