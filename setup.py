"""Build the Cython kernels in native_ext/ (pyproject.toml holds everything else)."""

import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup

# Rows are split over OpenMP threads; each row's arithmetic is independent of the split.
# -O3 without -march=native: the build must give the same float results on every
# machine of one architecture, and no -ffast-math, which would reorder reductions.
COMPILE_ARGS = ["-O3", "-fno-math-errno", "-ffp-contract=off", "-fopenmp"]

extensions = [
    Extension(
        "native_ext._kernels",
        ["native_ext/_kernels.pyx"],
        include_dirs=[numpy.get_include()],
        extra_compile_args=COMPILE_ARGS,
        extra_link_args=["-fopenmp"],
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
