"""The validating layer over the NF4 kernels in native_ext._nf4, and their numpy twins.

Each kernel function checks dtypes, shapes and contiguity, then calls the Cython wrapper,
which releases the GIL. The `reference_*` functions below take the same arguments, write
the same outputs and are plain numpy; the tests hold the two to identical bytes.
Positions are flat indices into the row-major tensor: blocks run over the flattened
tensor, so one block can span two rows.
"""

import numpy as np

from native_ext import blas
from native_ext.validate import built, check_array

_nf4 = built("_nf4", "the NF4 kernels")
# dequantizing runs on the process's one thread pool (native_ext/pool.h, shared with OpenBLAS), on as many
# threads as OpenBLAS computes on at the call, in fixed element chunks: the bytes do not depend on it
_nf4.use_pool(blas.POOL_RUN)

F32 = np.float32
U8 = np.uint8

# bitsandbytes get_4bit_type("nf4"), the list in DESIGN.md.
NF4_CODE = np.array([
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
], dtype=F32)
NF4_CODE.flags.writeable = False

# The 127 positive entries below 1.0 of bitsandbytes create_dynamic_map(signed=True), as
# float32 bit patterns; the map is those, their negatives, 0.0 and 1.0, sorted.
_DYNAMIC_POSITIVE = np.array([
    0x3513a3b7, 0x365a1a94, 0x370205ff, 0x37b24206, 0x38378034, 0x388aefb3, 0x38ba1f4b,
    0x3923d70b, 0x398ce705, 0x39c7e283, 0x3a016f01, 0x3a1eecc1, 0x3a3c6a80, 0x3a59e83e,
    0x3a7765ff, 0x3aa7ef9d, 0x3af1a9fc, 0x3b1db22d, 0x3b428f5c, 0x3b676c8a, 0x3b8624dd,
    0x3b989374, 0x3bab020d, 0x3bbd70a4, 0x3bcfdf3b, 0x3be24dd3, 0x3bf4bc6a, 0x3c039581,
    0x3c0ccccd, 0x3c160418, 0x3c1f3b64, 0x3c3ae148, 0x3c68f5c3, 0x3c8b851f, 0x3ca28f5d,
    0x3cb9999a, 0x3cd0a3d7, 0x3ce7ae15, 0x3cfeb852, 0x3d0ae148, 0x3d166667, 0x3d21eb85,
    0x3d2d70a3, 0x3d38f5c3, 0x3d447ae1, 0x3d500000, 0x3d5b851f, 0x3d670a3d, 0x3d728f5d,
    0x3d7e147b, 0x3d84cccd, 0x3d8a8f5d, 0x3d9051eb, 0x3d96147b, 0x3d9bd70a, 0x3da1999a,
    0x3da75c2a, 0x3dad1eb8, 0x3db2e148, 0x3db8a3d7, 0x3dbe6667, 0x3dc428f7, 0x3dc9eb85,
    0x3ddb3334, 0x3df80000, 0x3e0a6666, 0x3e18cccd, 0x3e273333, 0x3e35999a, 0x3e440000,
    0x3e526666, 0x3e60cccd, 0x3e6f3333, 0x3e7d9999, 0x3e860000, 0x3e8d3334, 0x3e946666,
    0x3e9b999a, 0x3ea2cccc, 0x3eaa0000, 0x3eb13333, 0x3eb86666, 0x3ebf999a, 0x3ec6cccc,
    0x3ece0000, 0x3ed53333, 0x3edc6666, 0x3ee3999a, 0x3eeacccc, 0x3ef20000, 0x3ef93332,
    0x3f003333, 0x3f03cccc, 0x3f076666, 0x3f0b0000, 0x3f0e999a, 0x3f123334, 0x3f15cccd,
    0x3f196666, 0x3f1d0000, 0x3f20999a, 0x3f243334, 0x3f27cccd, 0x3f2b6666, 0x3f2f0000,
    0x3f32999a, 0x3f363334, 0x3f39cccd, 0x3f3d6666, 0x3f410000, 0x3f44999a, 0x3f483333,
    0x3f4bcccd, 0x3f4f6666, 0x3f530000, 0x3f56999a, 0x3f5a3333, 0x3f5dcccd, 0x3f616666,
    0x3f650000, 0x3f68999a, 0x3f6c3333, 0x3f6fcccd, 0x3f736666, 0x3f770000, 0x3f7a999a,
    0x3f7e3333,
], dtype=np.uint32).view(F32)
DYNAMIC_MAP = np.sort(np.concatenate(
    [-_DYNAMIC_POSITIVE, [0.0, 1.0], _DYNAMIC_POSITIVE]).astype(F32))  # [256]
DYNAMIC_MAP.flags.writeable = False

ABSMAX_BLOCK_SIZE = 256  # bitsandbytes' block for the second-level (absmax) quantization
_TINY = F32(1e-38)  # torch clamps a zero absmax to this before the reciprocal
_SUM_LANES = 8  # float32 lanes of PyTorch's vectorised CPU sum (AVX2 kernel on x86)


def _check(name, array, dtype, writable=False):
    check_array(name, array, dtype, 1, writable)  # every NF4 array is flat


def _length(name, array, expected):
    if array.shape[0] != expected:
        raise ValueError(f"{name} has {array.shape[0]} entries, expected {expected}")


def _blocks(n, block_size):
    return -(-n // block_size)


def _check_quantize(x, block_size, packed, absmax):
    _check("x", x, F32)
    _check("packed", packed, U8, True)
    _check("absmax", absmax, F32, True)
    if block_size <= 0 or block_size % 2:
        raise ValueError(f"block_size must be a positive even number, got {block_size}")
    if x.shape[0] == 0:
        raise ValueError("cannot quantize an empty array")
    _length("packed", packed, (x.shape[0] + 1) // 2)
    _length("absmax", absmax, _blocks(x.shape[0], block_size))


def _check_dequantize(packed, block_size, start, out, blocks):
    _check("packed", packed, U8)
    _check("out", out, F32, True)
    if block_size <= 0 or block_size % 2:
        raise ValueError(f"block_size must be a positive even number, got {block_size}")
    n = 2 * packed.shape[0]  # capacity; an odd tensor leaves the last nibble unused
    if start < 0 or start + out.shape[0] > n:
        raise ValueError(f"elements {start}..{start + out.shape[0]} exceed the {n} packed nibbles")
    if start + out.shape[0] > blocks * block_size:
        raise ValueError(f"elements up to {start + out.shape[0]} need more than {blocks} blocks")


# -- kernels -----------------------------------------------------------------------------


def quantize(x, block_size, packed, absmax):
    """x [N] -> packed [ceil(N/2)], absmax [ceil(N/block_size)]; returns -1, or the index
    of the first non-finite element of x (the outputs are then incomplete)."""
    _check_quantize(x, block_size, packed, absmax)
    return int(_nf4.quantize(x, int(block_size), packed, absmax))


def dequantize(packed, block_size, start, out, absmax):
    """out [M] = elements start .. start+M-1 of the tensor, scaled by absmax [blocks]."""
    _check("absmax", absmax, F32)
    _check_dequantize(packed, block_size, start, out, absmax.shape[0])
    _nf4.dequantize(packed, int(block_size), int(start), out, absmax, blas.threads())


def dequantize_double(packed, block_size, start, out, absmax_codes, absmax_scales, offset):
    """As dequantize, with absmax decoded from the double-quantized state per block."""
    _check("absmax_codes", absmax_codes, U8)
    _check("absmax_scales", absmax_scales, F32)
    _length("absmax_scales", absmax_scales, _blocks(absmax_codes.shape[0], ABSMAX_BLOCK_SIZE))
    _check_dequantize(packed, block_size, start, out, absmax_codes.shape[0])
    _nf4.dequantize_double(packed, int(block_size), int(start), out, absmax_codes,
                           absmax_scales, DYNAMIC_MAP, F32(offset), blas.threads())


def absmax_mean(absmax):
    """torch.mean(absmax) on one thread, to the bit: the double-quantization offset."""
    _check("absmax", absmax, F32)
    if absmax.shape[0] == 0:
        raise ValueError("absmax is empty")
    return F32(_nf4.absmax_mean(absmax))


def quantize_absmax(absmax, offset, codes, scales):
    """absmax - offset [B] -> codes [B] (8-bit dynamic map), scales [ceil(B/256)]."""
    _check("absmax", absmax, F32)
    _check("codes", codes, U8, True)
    _check("scales", scales, F32, True)
    _length("codes", codes, absmax.shape[0])
    _length("scales", scales, _blocks(absmax.shape[0], ABSMAX_BLOCK_SIZE))
    if absmax.shape[0]:
        _nf4.quantize_absmax(absmax, F32(offset), DYNAMIC_MAP, codes, scales)


# -- numpy twins -------------------------------------------------------------------------


def _nf4_bounds():
    return (NF4_CODE[:-1] + NF4_CODE[1:]) / F32(2)  # [15] midpoints, float32


def reference_quantize(x, block_size, packed, absmax):
    _check_quantize(x, block_size, packed, absmax)
    finite = np.isfinite(x)
    if not finite.all():
        return int(np.argmin(finite))
    n = x.shape[0]
    full = n - n % block_size
    blocks = x[:full].reshape(-1, block_size)  # [blocks, block_size]
    absmax[:full // block_size] = np.abs(blocks).max(axis=1, initial=F32(0))
    reciprocal = F32(1) / np.maximum(absmax[:full // block_size], _TINY)
    scaled = [(blocks * reciprocal[:, None]).reshape(-1)]
    if full < n:  # torch's remainder branch: clamped absmax stored, true division
        last = np.maximum(np.abs(x[full:]).max(), _TINY)
        absmax[-1] = last
        scaled.append(x[full:] / last)
    scaled = np.concatenate(scaled + [np.zeros(n % 2, F32)])  # pad an odd count with 0.0
    nibbles = np.searchsorted(_nf4_bounds(), scaled, side="left").astype(U8)  # ties low
    packed[:] = (nibbles[0::2] << 4) | nibbles[1::2]
    return -1


def reference_dequantize(packed, block_size, start, out, absmax):
    _check("absmax", absmax, F32)
    _check_dequantize(packed, block_size, start, out, absmax.shape[0])
    _reference_decode(packed, block_size, start, out, absmax)


def reference_dequantize_double(packed, block_size, start, out, absmax_codes, absmax_scales,
                                offset):
    _check("absmax_codes", absmax_codes, U8)
    _check("absmax_scales", absmax_scales, F32)
    _check_dequantize(packed, block_size, start, out, absmax_codes.shape[0])
    decoded = DYNAMIC_MAP[absmax_codes] * np.repeat(absmax_scales, ABSMAX_BLOCK_SIZE)[
        :absmax_codes.shape[0]]  # [blocks]
    _reference_decode(packed, block_size, start, out, decoded + F32(offset))


def _reference_decode(packed, block_size, start, out, absmax):
    index = np.arange(start, start + out.shape[0])  # flat element positions
    byte = packed[index >> 1]
    nibble = np.where(index & 1, byte & 15, byte >> 4)
    out[:] = NF4_CODE[nibble] * absmax[index // block_size]


def _reference_cascade(rows):
    """ATen's multi_row_sum: rows [size, 4, lanes] -> [4, lanes] float32."""
    size = rows.shape[0]
    power = max(4, (1 if size <= 2 else int(size - 1).bit_length()) // 4)
    step, mask = 1 << power, (1 << power) - 1
    acc = np.zeros((4,) + rows.shape[1:], F32)  # [level, 4, lanes]
    i = 0
    while i + step <= size:
        for row in rows[i:i + step]:
            acc[0] += row
        i += step
        for j in range(1, 4):
            acc[j] += acc[j - 1]
            acc[j - 1] = 0
            if i & (mask << (j * power)):
                break
    for row in rows[i:]:
        acc[0] += row
    for j in range(1, 4):
        acc[0] += acc[j]
    return acc[0]


def _reference_row_sum(elements):
    """ATen's row_sum: elements [count, lanes] -> [lanes], four interleaved partials."""
    count = elements.shape[0]
    rows = count // 4
    part = _reference_cascade(elements[:rows * 4].reshape((rows, 4) + elements.shape[1:]))
    for element in elements[rows * 4:]:
        part[0] += element
    for k in range(1, 4):
        part[0] += part[k]
    return part[0]


def reference_absmax_mean(absmax):
    _check("absmax", absmax, F32)
    n = absmax.shape[0]
    if n == 0:
        raise ValueError("absmax is empty")
    if n >= _SUM_LANES:
        vectors = n // _SUM_LANES
        lanes = _reference_row_sum(absmax[:vectors * _SUM_LANES].reshape(vectors, _SUM_LANES))
        total = F32(0)
        for value in np.concatenate([absmax[vectors * _SUM_LANES:], lanes]):
            total = F32(total + value)
    else:
        total = F32(_reference_row_sum(absmax.reshape(n, 1))[0])
    return F32(F32(F32(0) + total) / F32(n))


def _reference_lut():
    """bitsandbytes' 65536-entry quantize table for DYNAMIC_MAP."""
    midpoints = (DYNAMIC_MAP[:-1] + DYNAMIC_MAP[1:]) * F32(0.5)  # [255]
    grid = (F32(2) * np.arange(65536, dtype=F32)) / F32(65535) - F32(1)
    return np.searchsorted(midpoints, grid, side="left").astype(U8)  # midpoints below


def reference_quantize_absmax(absmax, offset, codes, scales):
    _check("absmax", absmax, F32)
    _check("codes", codes, U8, True)
    _check("scales", scales, F32, True)
    lut = _reference_lut()
    centred = absmax - F32(offset)  # [B]
    for b, start in enumerate(range(0, absmax.shape[0], ABSMAX_BLOCK_SIZE)):
        block = centred[start:start + ABSMAX_BLOCK_SIZE]
        scale = np.abs(block).max()
        scales[b] = scale
        if scale == 0:
            codes[start:start + block.shape[0]] = 0
            continue
        with np.errstate(over="ignore", invalid="ignore"):
            v = np.clip(block * (F32(1) / scale), F32(-1), F32(1))  # NaN stays NaN
            t = (v + F32(1)) * F32(0.5)
            # one rounding of the exact t * 65535 + 0.5, as fmaf; NaN indexes entry 0
            r = (t.astype(np.float64) * 65535.0 + 0.5).astype(F32)
        index = np.where(np.isnan(r), F32(0), r).astype(np.int64) & 0xFFFF
        codes[start:start + block.shape[0]] = lut[index]
