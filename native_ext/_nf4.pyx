# cython: language_level=3
"""Cython wrappers of the NF4 kernels in nf4.h (quantize, dequantize, double quantization).

Private module: the validating entry points and the numpy twins are in native_ext.nf4.
Each wrapper takes C-contiguous typed memoryviews and releases the GIL; dequantizing runs on the
threads it is given (nf4_parallel.h, on native_ext._attention's pool), the rest on one.
"""

from libc.stdint cimport int64_t, uint8_t
from libc.stdlib cimport malloc, free

ctypedef float f32


cdef extern from "nf4_parallel.h" nogil:
    void kiln_rows_use_pool(void *run)
    void kiln_nf4_dequantize_parallel(const uint8_t *packed, const float *absmax, const uint8_t *absmax_codes,
                                      const float *absmax_scales, const float *absmax_map, float offset,
                                      int64_t block, int64_t start, int64_t count, float *out, int threads)


def use_pool(size_t run):
    """Dequantize on native_ext._attention's thread pool (the address of its kiln_pool_run)."""
    kiln_rows_use_pool(<void *>run)


cdef extern from "nf4.h" nogil:
    int64_t kiln_nf4_quantize(const float *x, int64_t n, int64_t block, uint8_t *packed,
                              float *absmax)
    void kiln_nf4_dequantize(const uint8_t *packed, const float *absmax,
                             const uint8_t *absmax_codes, const float *absmax_scales,
                             const float *absmax_map, float offset, int64_t block,
                             int64_t start, int64_t count, float *out)
    float kiln_nf4_torch_mean(const float *x, int64_t n)
    void kiln_nf4_quantize_absmax(const float *absmax, int64_t n, float offset,
                                  const float *map, uint8_t *lut, uint8_t *codes,
                                  float *scales)
    enum: KILN_NF4_LUT_SIZE


def quantize(const f32[::1] x, Py_ssize_t block_size, uint8_t[::1] packed, f32[::1] absmax):
    cdef int64_t bad
    with nogil:
        bad = kiln_nf4_quantize(&x[0], x.shape[0], block_size, &packed[0], &absmax[0])
    return bad


def dequantize(const uint8_t[::1] packed, Py_ssize_t block_size, Py_ssize_t start,
               f32[::1] out, const f32[::1] absmax, int threads=1):
    if out.shape[0] == 0:
        return
    with nogil:
        kiln_nf4_dequantize_parallel(&packed[0], &absmax[0], NULL, NULL, NULL, 0.0, block_size, start,
                                     out.shape[0], &out[0], threads)


def dequantize_double(const uint8_t[::1] packed, Py_ssize_t block_size, Py_ssize_t start,
                      f32[::1] out, const uint8_t[::1] absmax_codes,
                      const f32[::1] absmax_scales, const f32[::1] absmax_map, float offset,
                      int threads=1):
    if out.shape[0] == 0:
        return
    with nogil:
        kiln_nf4_dequantize_parallel(&packed[0], NULL, &absmax_codes[0], &absmax_scales[0],
                                     &absmax_map[0], offset, block_size, start, out.shape[0], &out[0], threads)


def absmax_mean(const f32[::1] absmax):
    cdef float mean
    with nogil:
        mean = kiln_nf4_torch_mean(&absmax[0], absmax.shape[0])
    return mean


def quantize_absmax(const f32[::1] absmax, float offset, const f32[::1] absmax_map,
                    uint8_t[::1] codes, f32[::1] scales):
    cdef uint8_t *lut = <uint8_t *>malloc(KILN_NF4_LUT_SIZE)
    if lut == NULL:
        raise MemoryError("quantize_absmax lookup table")
    with nogil:
        kiln_nf4_quantize_absmax(&absmax[0], absmax.shape[0], offset, &absmax_map[0], lut,
                                 &codes[0], &scales[0])
    free(lut)
