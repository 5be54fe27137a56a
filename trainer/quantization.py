"""NF4 quantization of frozen Linear weights (the QLoRA base): the packed format, bit for bit
that of bitsandbytes quantize_4bit(quant_type="nf4"), and its dequantization.

The arithmetic is in the C kernels behind native_ext.nf4 (numpy twins beside them);
docs/quantization.md lists the bitsandbytes facts matched and how they are tested.
N is the element count of the original array, blocks = ceil(N / block_size).
"""

from dataclasses import dataclass

import numpy as np

from native_ext import nf4

BLOCK_SIZES = (32, 64, 128, 256, 512, 1024, 2048, 4096)  # what bitsandbytes accepts on CPU
DEFAULT_BLOCK_SIZE = 64  # bitsandbytes' default, and QLoRA's
ABSMAX_BLOCK_SIZE = nf4.ABSMAX_BLOCK_SIZE  # fixed by bitsandbytes' double quantization
NF4_CODE = nf4.NF4_CODE

F32 = np.float32
U8 = np.uint8


def _frozen(name, array, dtype, length):
    if not isinstance(array, np.ndarray) or array.dtype != dtype:
        got = array.dtype if isinstance(array, np.ndarray) else type(array).__name__
        raise TypeError(f"NF4Tensor.{name} must be a {np.dtype(dtype).name} array, got {got}")
    if array.shape != (length,):
        raise ValueError(f"NF4Tensor.{name} has shape {array.shape}, expected ({length},)")
    view = np.ascontiguousarray(array).view()
    view.flags.writeable = False  # the stored state never changes; the caller's array may
    return view


@dataclass(frozen=True, eq=False)
class NF4Tensor:
    """One quantized array: either plain FP32 absmax per block, or (double quantization)
    8-bit absmax codes with FP32 scales per 256 codes and an FP32 offset."""

    packed: np.ndarray  # uint8 [ceil(N/2)]: element 2i in the high nibble of byte i
    shape: tuple  # of the original array
    block_size: int  # elements per absmax block of the flattened (row-major) array
    absmax: np.ndarray | None = None  # float32 [blocks]
    absmax_codes: np.ndarray | None = None  # uint8 [blocks], indices into nf4.DYNAMIC_MAP
    absmax_scales: np.ndarray | None = None  # float32 [ceil(blocks/256)]
    offset: np.float32 | None = None  # mean(absmax), added back after decoding the codes
    absmax_block_size: int = ABSMAX_BLOCK_SIZE

    def __post_init__(self):
        shape = tuple(int(d) for d in self.shape)
        if any(d < 0 for d in shape) or int(np.prod(shape)) == 0:
            raise ValueError(f"NF4Tensor.shape must describe a non-empty array, got {shape}")
        _check_block_size(self.block_size)
        object.__setattr__(self, "shape", shape)
        n = self.numel
        blocks = -(-n // self.block_size)
        object.__setattr__(self, "packed", _frozen("packed", self.packed, U8, (n + 1) // 2))
        double = (self.absmax_codes, self.absmax_scales, self.offset)
        if self.absmax is not None:
            if any(part is not None for part in double):
                raise ValueError("NF4Tensor holds either absmax or the double-quantized "
                                 "absmax_codes/absmax_scales/offset, not both")
            object.__setattr__(self, "absmax", _frozen("absmax", self.absmax, F32, blocks))
            return
        if any(part is None for part in double):
            raise ValueError("NF4Tensor needs absmax, or all of absmax_codes, absmax_scales "
                             "and offset")
        if self.absmax_block_size != ABSMAX_BLOCK_SIZE:
            raise ValueError(f"absmax_block_size must be {ABSMAX_BLOCK_SIZE} (bitsandbytes), "
                             f"got {self.absmax_block_size}")
        object.__setattr__(self, "absmax_codes",
                           _frozen("absmax_codes", self.absmax_codes, U8, blocks))
        object.__setattr__(self, "absmax_scales",
                           _frozen("absmax_scales", self.absmax_scales, F32,
                                   -(-blocks // ABSMAX_BLOCK_SIZE)))
        offset = F32(self.offset)
        if not np.isfinite(offset):
            raise ValueError(f"NF4Tensor.offset must be finite, got {offset}")
        object.__setattr__(self, "offset", offset)

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape))

    @property
    def double_quantized(self) -> bool:
        return self.absmax is None

    @property
    def nbytes(self) -> int:
        """Resident bytes: packed nibbles plus scales (codes, scales and the FP32 offset)."""
        if self.double_quantized:
            return self.packed.nbytes + self.absmax_codes.nbytes + self.absmax_scales.nbytes + 4
        return self.packed.nbytes + self.absmax.nbytes


def _check_block_size(block_size):
    if isinstance(block_size, bool) or block_size not in BLOCK_SIZES:
        raise ValueError(f"block_size must be one of {BLOCK_SIZES} (bitsandbytes' CPU block "
                         f"sizes), got {block_size!r}")


def quantize_nf4(array, block_size=DEFAULT_BLOCK_SIZE, double_quantization=False) -> NF4Tensor:
    """Quantize a float32 array of any shape, as bitsandbytes quantize_4bit(quant_type="nf4",
    blocksize=block_size, compress_statistics=double_quantization)."""
    if not isinstance(array, np.ndarray):
        raise TypeError(f"quantize_nf4 takes a numpy array, got {type(array).__name__}")
    if array.dtype != F32:
        raise TypeError(f"quantize_nf4 takes float32, got {array.dtype}; convert with "
                        ".astype(np.float32) first")
    _check_block_size(block_size)
    if array.size == 0:
        raise ValueError(f"cannot quantize an empty array (shape {array.shape})")
    flat = np.ascontiguousarray(array).reshape(-1)  # [N], a view when already contiguous
    n = flat.shape[0]
    blocks = -(-n // block_size)
    packed = np.empty((n + 1) // 2, U8)
    absmax = np.empty(blocks, F32)
    bad = nf4.quantize(flat, block_size, packed, absmax)
    if bad >= 0:
        where = np.unravel_index(bad, array.shape)
        raise ValueError(f"cannot quantize a non-finite value: element {tuple(map(int, where))} "
                         f"is {flat[bad]}")
    if not double_quantization:
        return NF4Tensor(packed, array.shape, block_size, absmax=absmax)
    offset = nf4.absmax_mean(absmax)
    if not np.isfinite(offset):
        raise ValueError("double quantization overflows float32: the mean of the block absmax "
                         "values is not finite; quantize with double_quantization=False")
    codes = np.empty(blocks, U8)
    scales = np.empty(-(-blocks // ABSMAX_BLOCK_SIZE), F32)
    nf4.quantize_absmax(absmax, offset, codes, scales)
    return NF4Tensor(packed, array.shape, block_size, absmax_codes=codes, absmax_scales=scales,
                     offset=offset)


def _decode(tensor, start, flat_out):
    """flat_out [M] = elements start .. start+M-1 of the flattened dequantized tensor."""
    if tensor.double_quantized:
        nf4.dequantize_double(tensor.packed, tensor.block_size, start, flat_out,
                              tensor.absmax_codes, tensor.absmax_scales, tensor.offset)
    else:
        nf4.dequantize(tensor.packed, tensor.block_size, start, flat_out, tensor.absmax)


def _check_out(out, shape):
    if not isinstance(out, np.ndarray) or out.dtype != F32:
        raise TypeError(f"out must be a float32 numpy array, got "
                        f"{getattr(out, 'dtype', type(out).__name__)}")
    if out.shape != tuple(shape):
        raise ValueError(f"out has shape {out.shape}, expected {tuple(shape)}")
    if not out.flags.c_contiguous or not out.flags.writeable:
        raise ValueError("out must be C-contiguous and writable")


def dequantize_nf4(tensor, out=None) -> np.ndarray:
    """The float32 array of tensor.shape, as bitsandbytes dequantize_4bit gives it."""
    if not isinstance(tensor, NF4Tensor):
        raise TypeError(f"dequantize_nf4 takes an NF4Tensor, got {type(tensor).__name__}")
    if out is None:
        out = np.empty(tensor.shape, F32)
    _check_out(out, tensor.shape)
    _decode(tensor, 0, out.reshape(-1))
    return out


def dequantize_rows(tensor, row_start, row_end, out) -> np.ndarray:
    """Rows row_start .. row_end-1 of a 2-D quantized weight [R,C] into out [row_end -
    row_start, C], block by block straight into out: no full FP32 weight, no scratch.
    A row may begin or end inside a block (blocks run over the flattened weight)."""
    if not isinstance(tensor, NF4Tensor):
        raise TypeError(f"dequantize_rows takes an NF4Tensor, got {type(tensor).__name__}")
    if len(tensor.shape) != 2:
        raise ValueError(f"dequantize_rows needs a 2-D weight, got shape {tensor.shape}")
    rows, cols = tensor.shape
    if not 0 <= row_start <= row_end <= rows:
        raise ValueError(f"rows {row_start}..{row_end} are outside 0..{rows}")
    _check_out(out, (row_end - row_start, cols))
    _decode(tensor, row_start * cols, out.reshape(-1))
    return out
