"""Build the Cython kernels in native_ext/ (pyproject.toml holds everything else)."""

import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup

# Kernels are single-threaded: BLAS owns the cores, and OpenMP threads spinning beside
# OpenBLAS's own made every kernel many times slower on a 2-core machine.
# -O3 without -march=native: the build must give the same float results on every
# machine of one architecture, and no -ffast-math, which would reorder reductions.
COMPILE_ARGS = ["-O3", "-fno-math-errno", "-ffp-contract=off", "-fopenmp-simd"]

# module, the C header its row kernels live in
KERNELS = [("_kernels", "kiln_kernels.h"), ("_nf4", "nf4.h")]

extensions = [
    Extension(
        f"native_ext.{module}",
        [f"native_ext/{module}.pyx"],
        include_dirs=[numpy.get_include(), "native_ext"],
        depends=[f"native_ext/{header}"],
        extra_compile_args=COMPILE_ARGS,
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
    )
    for module, header in KERNELS
]

setup(
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
