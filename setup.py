"""Build the Cython kernels in native_ext/ and, where nvcc and cuBLAS are found, the CUDA library
native_ext/libkiln_cuda.so from native_ext/cuda (pyproject.toml holds everything else)."""

import concurrent.futures
import glob
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

# No OpenMP: its threads spinning beside OpenBLAS's made every kernel many times slower on a
# 2-core machine. The parallel kernels run on native_ext/pool.h's pthreads, which OpenBLAS's jobs
# also run on (native_ext/blas.py registers it).
# -O3 without -march=native: the build must give the same float results on every
# machine of one architecture, and no -ffast-math, which would reorder reductions.
# -fno-trapping-math changes no value; without it GCC leaves every loop with a float
# comparison (the branch-free exp's clamps) scalar in the AVX2 and default clones
# (tests/engine/test_kernels_build.py).
COMPILE_ARGS = ["-O3", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=off", "-fopenmp-simd"]

# module, the C header its row kernels live in
KERNELS = [("_kernels", "rows.h"), ("_nf4", "nf4_parallel.h"), ("_attention", "attention.h")]

extensions = [
    Extension(
        f"native_ext.{module}",
        [f"native_ext/{module}.pyx"],
        include_dirs=[numpy.get_include(), "native_ext"],
        depends=[f"native_ext/{header}", "native_ext/kiln_kernels.h", "native_ext/nf4.h", "native_ext/parallel.h",
                 "native_ext/pool.h", "native_ext/isa.h", "native_ext/attention_rows.h",
                 "native_ext/attention_rows_body.h"],
        extra_compile_args=COMPILE_ARGS,
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
    )
    for module, header in KERNELS
]

# The CUDA library: the Ampere and Hopper binaries and Hopper PTX (for newer GPUs to JIT), -O3,
# --fmad=false so a*b+c rounds twice as in the CPU kernels (-ffp-contract=off), no fast math
# (IEEE division and sqrt), the CUDA runtime linked statically (only libcuda.so.1 is needed at run
# time, and a machine without a driver can still load the library and say so), cuBLAS from the
# nvidia-cublas wheel found through an rpath.
CUDA_DIR = Path("native_ext/cuda")
CUDA_LIBRARY = "libkiln_cuda.so"
# beside the library, one line: built, up to date, or why not (pip -q hides this script's stderr; ./dev prints it)
CUDA_BUILD_NOTE = "libkiln_cuda.build.txt"
CUDA_ARCHITECTURES = ["-gencode", "arch=compute_80,code=sm_80", "-gencode", "arch=compute_90,code=sm_90",
                      "-gencode", "arch=compute_90,code=compute_90"]
NVCC_FLAGS = ["-O3", "--fmad=false", "-std=c++17", "-Xcompiler", "-fPIC", "-cudart", "static"]


def say(message):
    print(f"kiln build: {message}", file=sys.stderr, flush=True)
    return message


def find_nvcc():
    candidates = [os.environ.get("KILN_NVCC"), shutil.which("nvcc")]
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home:
            candidates.append(os.path.join(home, "bin", "nvcc"))
    return next((c for c in candidates if c and os.path.isfile(c) and os.access(c, os.X_OK)), None)


def find_cublas(nvcc):
    """(include dir, lib dir, library file name) of cuBLAS: $KILN_CUBLAS_HOME, the nvidia-cublas wheel
    in this environment (CUDA 13 and 12 layouts), then the toolkit beside nvcc; None when absent."""
    homes = [os.environ.get("KILN_CUBLAS_HOME")]
    for key in ("purelib", "platlib"):
        site = sysconfig.get_paths()[key]  # the target environment's site-packages, also under build isolation
        homes += [os.path.join(site, "nvidia", "cu13"), os.path.join(site, "nvidia", "cublas")]
    toolkit = os.path.dirname(os.path.dirname(nvcc))
    homes.append(toolkit)
    for home in filter(None, homes):
        header = os.path.join(home, "include", "cublas_v2.h")
        for lib in ("lib", "lib64"):
            found = sorted(glob.glob(os.path.join(home, lib, "libcublas.so*")))
            if os.path.isfile(header) and found:
                return os.path.join(home, "include"), os.path.join(home, lib), os.path.basename(found[0])
    return None


def build_cuda_library(target_dir):
    """Compile native_ext/cuda/*.cu into TARGET_DIR/libkiln_cuda.so, or say why not and return; either way the
    outcome is also written to TARGET_DIR/libkiln_cuda.build.txt. A failed compile is reported and leaves the
    Cython build standing (KILN_REQUIRE_CUDA=1 makes it fatal); tests/engine/test_cuda_library.py fails where
    nvcc and cuBLAS are present but the library is not."""
    note = Path(target_dir) / CUDA_BUILD_NOTE
    note.parent.mkdir(parents=True, exist_ok=True)
    try:
        outcome = _build_cuda_library(target_dir)
    except (OSError, subprocess.CalledProcessError) as error:
        outcome = say(f"the CUDA library failed to build ({error}); the CPU backend is unaffected")
        if os.environ.get("KILN_REQUIRE_CUDA") == "1":
            note.write_text(outcome + "\n")
            raise
    note.write_text(outcome + "\n")


def _build_cuda_library(target_dir):
    if os.environ.get("KILN_SKIP_CUDA") == "1":
        return say("KILN_SKIP_CUDA=1: the CUDA library is not built")
    nvcc = find_nvcc()
    if nvcc is None:
        return say("nvcc not found (KILN_NVCC, PATH, $CUDA_HOME, $CUDA_PATH, /usr/local/cuda): the CUDA library "
                   "is not built; the CPU backend is unaffected")
    cublas = find_cublas(nvcc)
    if cublas is None:
        return say("cuBLAS headers not found: install the wheel (pip install nvidia-cublas) or set "
                   "KILN_CUBLAS_HOME; the CUDA library is not built")
    include, lib, library_file = cublas
    sources = sorted(CUDA_DIR.glob("*.cu"))
    target = Path(target_dir) / CUDA_LIBRARY
    inputs = sources + sorted(CUDA_DIR.glob("*.h")) + [Path(__file__)]
    if target.exists() and all(p.stat().st_mtime <= target.stat().st_mtime for p in inputs):
        return say(f"{target} is up to date")
    say(f"building {target} with {nvcc} (cuBLAS from {lib})")
    with tempfile.TemporaryDirectory(prefix="kiln-cuda-") as scratch:
        def compile_one(source):
            obj = os.path.join(scratch, source.stem + ".o")
            subprocess.run([nvcc, "-c", str(source), "-o", obj, "-I", str(CUDA_DIR), "-I", include,
                            *NVCC_FLAGS, *CUDA_ARCHITECTURES], check=True)
            return obj

        with concurrent.futures.ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:
            objects = list(pool.map(compile_one, sources))
        staged = os.path.join(scratch, CUDA_LIBRARY)
        subprocess.run([nvcc, "-shared", "-o", staged, *objects, "-cudart", "static", "-L", lib,
                        f"-l:{library_file}", "-Xlinker", f"-rpath,{lib}"], check=True)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(staged, str(target) + ".tmp")
        os.chmod(str(target) + ".tmp", 0o755)
        os.replace(str(target) + ".tmp", target)  # a process that has the old file open keeps it
    return say(f"built {target} with {nvcc} (cuBLAS from {lib})")


class BuildWithCuda(build_ext):
    """The Cython extensions as before, then the CUDA library beside them (skipped with a reason)."""

    def run(self):
        super().run()
        in_place = self.inplace or getattr(self, "editable_mode", False)
        build_cuda_library("native_ext" if in_place else os.path.join(self.build_lib, "native_ext"))


setup(
    cmdclass={"build_ext": BuildWithCuda},
    ext_modules=cythonize(
        extensions,
        language_level=3,
        compiler_directives={
            "boundscheck": False,
            "wraparound": False,
            "cdivision": True,
            "initializedcheck": False,
        },
    )
)
