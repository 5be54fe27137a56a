"""Build the Cython kernels in native_ext/ (pyproject.toml holds everything else)."""

import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup

# Kernels are single-threaded: BLAS owns the cores, and OpenMP threads spinning beside
# OpenBLAS's own made every kernel many times slower on a 2-core machine.
# -O3 without -march=native: the build must give the same float results on every
# machine of one architecture, and no -ffast-math, which would reorder reductions.
COMPILE_ARGS = ["-O3", "-fno-math-errno", "-ffp-contract=off", "-fopenmp-simd"]

extensions = [
    Extension(
        "native_ext._kernels",
        ["native_ext/_kernels.pyx"],
        include_dirs=[numpy.get_include(), "native_ext"],
        depends=["native_ext/kiln_kernels.h"],
        extra_compile_args=COMPILE_ARGS,
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
    ),
    Extension(
        "native_ext._nf4",
        ["native_ext/_nf4.pyx"],
        include_dirs=[numpy.get_include(), "native_ext"],
        depends=["native_ext/nf4.h"],
        extra_compile_args=COMPILE_ARGS,
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
    ),
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
