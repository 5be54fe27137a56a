"""CudaModel: one DecoderOnlyTransformer's training step resident on the CUDA library (libkiln_cuda.so).

Dimension letters: B batch, T time, N = B*T rows, C model width, H query heads, KV key/value heads,
g = H/KV, D head size, G = B*KV head groups, F feed-forward width, V vocabulary, P positions
(maximum_context), W3 = (H+2KV)*D the fused q/k/v width, r LoRA rank.
The math is trainer.blocks' and trainer.model's, step for step, on the library's kernels: embedding,
per block RMSNorm, the fused q/k/v product (NF4 row tiles on a quantized base; Qwen2's bias as a GEMM
with a ones column; LoRA as GEMMs writing the group's output columns in place), Qwen3's per-head
q/k RMSNorm over [N*h, D] rows, rotary, GQA attention with the sliding window (the tiled kernels, or the dense
algorithm's batched GEMMs: CudaModel's attention), the o product
and residual, RMSNorm, gate/up, SwiGLU, down and residual; then the final RMSNorm and the fused
linear cross-entropy (chunk rows: all N on the full-logits route, loss_chunk_tokens on kt_tape_flce).
Layout changes between [B,T,h,D] projection rows and [B,KV,T,g,D] head groups go through the
rotary kernels with identity tables (cos 1, sin 0: x*1 - y*0 == x exactly), so no copy kernel is
needed. Everything runs on the legacy default stream in FP32 (no TF32) without atomics: the same
inputs give the same bits on one device. A LoRA model's frozen base may compute at a precision of its own
(CudaModel's `precision`: tfloat32 or bfloat16 tensor cores for the base's products and the output projection,
FP32 accumulation; adapters, norms and the loss kernels stay FP32, and so does the attention unless it is dense),
as the CPU's bfloat16 route does.
Gradients accumulate on the device until adam_step (or zero_gradients) consumes them; the host receives them
only through gradients().
KV-cached sampling passes (forward_cached, kv_cache) are trainer.cuda_decode's.
It is proven against the CPU engine (tests/engine/test_cuda_model.py, test_cuda_decode.py). Runs on the cuda
backend train on it (trainer.runs.device).
"""

from ctypes import byref, c_size_t, c_void_p

import numpy as np

from native_ext import cuda
from native_ext import nf4 as nf4_codes
from trainer.blocks import NF4_SCRATCH_ELEMENTS, rope_tables, window_limits
from trainer.crossentropy import IGNORE_INDEX
from trainer.lifetime import Closeable
from trainer.model import DecoderOnlyTransformer, check_batch, check_normalizer, check_tokens
from trainer.cuda_decode import DeviceDecoding
from trainer.cuda_optim import DeviceOptimizer
from trainer.quantization import dequantize_nf4

F32, I64 = np.float32, np.int64
FP32 = 0  # the precision argument of every GEMM but a frozen base's: IEEE FP32, no TF32
# a frozen base's product precisions (kiln_cuda.h's KILN_CUDA_PRECISION_*): float32, TF32 tensor cores, bfloat16
# tensor cores from bfloat16-rounded operands; FP32 accumulation in all three
BASE_PRECISION_CODES = {"float32": 0, "tfloat32": 1, "bfloat16": 2}
BLAS_WORKSPACE_BYTES = 32 << 20
ATTENTION_MAX_HEAD = 128  # KILN_CUDA_ATTENTION_MAX_HEAD
# CudaModel's attention: the fused tiled kernels, or the dense algorithm (the six products as batched cuBLAS GEMMs
# at the model's precision, the masked softmax and its gradient as row kernels)
ATTENTION_ALGORITHMS = ("tiled", "dense")
DENSE_SCORES_BYTES = 256 << 20  # each dense score buffer holds as many head groups as fit (at least one)
# group -> the projections writing its fused output, in column order
GROUPS = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",),
          "gate_up": ("gate_proj", "up_proj"), "down": ("down_proj",)}
MODULES = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


class _Projection:
    """Where one projection lives in its group: output columns, and its NF4 state when quantized."""

    def __init__(self, name, column, rows, cols):
        self.name, self.column, self.rows, self.cols = name, column, rows, cols
        self.packed = self.absmax = None  # device uint8 [ceil(rows*cols/2)], float32 [blocks]
        self.block_size = self.tile_rows = None


class _Adapter:
    """The device (A, B) pair of one projection and its gradients."""

    def __init__(self, prefix, projection, rank, scaling):
        self.prefix, self.projection, self.rank, self.scaling = prefix, projection, rank, F32(scaling)
        self.A = self.B = self.dA = self.dB = None  # device [r,in], [out,r]


class _Block:
    """The device arrays of one decoder block (fused groups as in trainer.blocks.Block)."""

    def __init__(self):
        self.dense = {}  # group -> device [out,in] (absent once quantized)
        self.grads = {}  # group -> device [out,in] (trainable base only)
        self.projections = {}  # group -> [_Projection]
        self.adapters = {}  # group -> [_Adapter] in column order
        self.vectors = {}  # ln1, ln2, qkv_bias, q_norm, k_norm -> device array
        self.vector_grads = {}


class CudaModel(DeviceDecoding, DeviceOptimizer, Closeable):
    """A DecoderOnlyTransformer's weights and training step on the CUDA library; a context manager.

    Construct it from a CPU model (its config, FP32 base, attached LoRA adapters and packed NF4 bases
    are copied; the CPU model is not kept) and a library handle: native_ext.cuda.load() by default,
    or an explicit one such as the host emulation the tests build. PRECISION (BASE_PRECISION_CODES) is how a
    frozen base's products and the output projection compute: float32, or tfloat32 / bfloat16 for a LoRA model.
    ATTENTION (ATTENTION_ALGORITHMS) is how the training passes compute attention: "tiled", the fused kernels in
    FP32 whatever the precision; or "dense", the scores [groups, T*g, T] materialised (as many groups as
    DENSE_SCORES_BYTES holds; the backward holds the scores' gradient too) and the six products on cuBLAS at
    PRECISION, so on tensor cores under tfloat32 and bfloat16 (the operands rounded as the base's are, FP32
    accumulation; the softmax and its gradient in FP32). Cached decoding always runs the tiled kernel.
    """

    closed_message = "the CUDA model has been closed; construct a new one"

    def __init__(self, model, library=None, precision="float32", attention="tiled"):
        if not isinstance(model, DecoderOnlyTransformer):
            raise TypeError(f"CudaModel takes a DecoderOnlyTransformer, got {type(model).__name__}")
        model._check_open()
        config = model.config
        self._check_supported(config)
        if precision not in BASE_PRECISION_CODES:
            raise ValueError(f"precision must be one of {', '.join(BASE_PRECISION_CODES)}, got {precision!r}")
        if precision != "float32" and model.lora_config is None:
            raise ValueError(f"precision {precision} computes a frozen LoRA base; this model trains its base (or "
                             "has nothing to train)")
        if attention not in ATTENTION_ALGORITHMS:
            raise ValueError(f"attention must be one of {', '.join(ATTENTION_ALGORITHMS)}, got {attention!r}")
        self.precision = precision
        self.attention = attention
        self._base_code = BASE_PRECISION_CODES[precision]
        self.config = config
        self.lib = cuda.load() if library is None else library
        self._arrays = []  # every DeviceArray this model owns, freed by close()
        self._scratch = {}  # key -> DeviceArray reused across calls while its shape holds
        self._closed = False
        self._blas = None
        self._dynamic_map = None  # the 8-bit dynamic map of double-quantized absmax, uploaded once
        try:
            self._build(model)
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _check_supported(config):
        if config.base_precision != "float32":
            raise ValueError(f"base_precision {config.base_precision!r} is a CPU route (oneDNN); on the cuda "
                             "backend a precision is CudaModel's precision=, with a float32 CPU model")
        D = config.head_dimension
        if D > ATTENTION_MAX_HEAD:
            raise NotImplementedError(f"head_size {D}: the CUDA attention kernels take head sizes up to "
                                      f"{ATTENTION_MAX_HEAD}")

    # -- device memory ----------------------------------------------------------------

    def _call(self, name, *args):
        cuda.check(self.lib, getattr(self.lib, name)(*args), name)

    def _own(self, device):
        self._arrays.append(device)
        return device

    def _put(self, array, dtype=F32):
        return self._own(cuda.DeviceArray.from_host(self.lib, np.ascontiguousarray(array, dtype=dtype)))

    def _zeros(self, shape, dtype=F32):
        return self._own(cuda.DeviceArray.zeros(self.lib, shape, dtype))

    def _buffer(self, key, shape, dtype=F32):
        """A scratch device array named key, reallocated only when its shape or dtype changes."""
        shape = tuple(int(n) for n in shape)
        device = self._scratch.get(key)
        if device is None or device.shape != shape or device.dtype != np.dtype(dtype):
            if device is not None:
                self._arrays.remove(device)
                device.free()
            device = self._scratch[key] = self._own(cuda.DeviceArray(self.lib, shape, dtype))
        return device

    def _clear(self, device):
        self._call("kiln_cuda_memset", device.ptr, 0, max(device.nbytes, 1), None)

    @staticmethod
    def _at(device, offset=0):
        """The device address of element `offset` of a device array (a float32/int64/uint8 view)."""
        return device.ptr + offset * device.dtype.itemsize

    def _download(self, device, offset, shape):
        out = np.empty(shape, device.dtype)
        if out.nbytes:
            self._call("kiln_cuda_memcpy_d2h", out.ctypes.data, self._at(device, offset), out.nbytes, None)
        return out

    def _upload_into(self, device, offset, array):
        array = np.ascontiguousarray(array, dtype=device.dtype)
        if array.nbytes:
            self._call("kiln_cuda_memcpy_h2d", self._at(device, offset), array.ctypes.data, array.nbytes, None)

    def _gemm(self, trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, precision=FP32):
        """Row-major C[M,N] = alpha op(A) @ op(B) + beta C on device addresses, in FP32 (or PRECISION)."""
        self._call("kiln_cuda_gemm", self._blas, trans_a, trans_b, M, N, K, float(alpha), A, lda, B, ldb,
                   float(beta), C, ldc, precision)

    def _gemm_batched(self, trans_a, trans_b, M, N, K, alpha, A, lda, stride_a, B, ldb, stride_b, C, ldc, stride_c,
                      batch, precision):
        """C[i] = alpha op(A[i]) @ op(B[i]) for BATCH matrices (row-major, strides in elements), beta 0."""
        self._call("kiln_cuda_gemm_strided_batched", self._blas, trans_a, trans_b, M, N, K, float(alpha), A, lda,
                   stride_a, B, ldb, stride_b, 0.0, C, ldc, stride_c, batch, precision)

    # -- attention -------------------------------------------------------------------------

    def _attention_forward(self, q, k, v, att, lse, G, T, g, D, window, scale):
        """att [G,T*g,D] and lse [G,T*g] of causal GQA attention over q [G,T*g,D], k/v [G,T,D] (device arrays)."""
        if self.attention == "tiled":
            self._call("kiln_cuda_attention_forward", q.ptr, k.ptr, v.ptr, att.ptr, lse.ptr, G, T, g, T, D, 0, window,
                       scale, 0, None)  # tile 0: the device's choice
            return
        R, code = T * g, self._base_code
        chunk = dense_chunk(G, R, T)
        scores = self._buffer("scores", (chunk, R, T))
        for first in range(0, G, chunk):
            n = min(chunk, G - first)
            self._gemm_batched(0, 1, R, T, D, scale, self._at(q, first * R * D), D, R * D, self._at(k, first * T * D),
                               D, T * D, scores.ptr, T, R * T, n, code)
            self._call("kiln_cuda_attention_probabilities", scores.ptr, self._at(lse, first * R), 0, n, T, g, T, 0,
                       window, None)
            self._gemm_batched(0, 0, R, D, T, 1.0, scores.ptr, T, R * T, self._at(v, first * T * D), D, T * D,
                               self._at(att, first * R * D), D, R * D, n, code)

    def _attention_backward(self, datt, q, k, v, att, lse, dq, dk, dv, delta, G, T, g, D, window, scale):
        """dq [G,T*g,D], dk, dv [G,T,D] from datt, what _attention_forward read and wrote, and a delta workspace."""
        if self.attention == "tiled":
            self._call("kiln_cuda_attention_backward", datt.ptr, q.ptr, k.ptr, v.ptr, att.ptr, lse.ptr, dq.ptr, dk.ptr,
                       dv.ptr, delta.ptr, G, T, g, T, D, 0, window, scale, 0, None)
            return
        R, code = T * g, self._base_code
        chunk = dense_chunk(G, R, T)
        scores, dscores = self._buffer("scores", (chunk, R, T)), self._buffer("dscores", (chunk, R, T))
        for first in range(0, G, chunk):
            n = min(chunk, G - first)
            at_q, at_k, at_v = (self._at(a, first * rows * D) for a, rows in ((q, R), (k, T), (v, T)))
            at_do, at_o = self._at(datt, first * R * D), self._at(att, first * R * D)
            self._gemm_batched(0, 1, R, T, D, scale, at_q, D, R * D, at_k, D, T * D, scores.ptr, T, R * T, n, code)
            self._call("kiln_cuda_attention_probabilities", scores.ptr, self._at(lse, first * R), 1, n, T, g, T, 0,
                       window, None)
            # dv = p^T dout, dP = dout v^T -> dS, dq = dS k, dk = dS^T q
            self._gemm_batched(1, 0, T, D, R, 1.0, scores.ptr, T, R * T, at_do, D, R * D,
                               self._at(dv, first * T * D), D, T * D, n, code)
            self._gemm_batched(0, 1, R, T, D, 1.0, at_do, D, R * D, at_v, D, T * D, dscores.ptr, T, R * T, n, code)
            self._call("kiln_cuda_attention_dscores", dscores.ptr, scores.ptr, at_do, at_o, self._at(delta, first * R),
                       n, T, g, T, D, scale, None)
            self._gemm_batched(0, 0, R, D, T, 1.0, dscores.ptr, T, R * T, at_k, D, T * D,
                               self._at(dq, first * R * D), D, R * D, n, code)
            self._gemm_batched(1, 0, T, D, R, 1.0, dscores.ptr, T, R * T, at_q, D, R * D,
                               self._at(dk, first * T * D), D, T * D, n, code)

    # -- construction -------------------------------------------------------------------

    def _build(self, model):
        config = self.config
        C, F, V, D = config.model_width, config.feed_forward_width, config.vocabulary_size, config.head_dimension
        H, KV = config.head_count, config.kv_heads
        W3 = (H + 2 * KV) * D
        handle = c_void_p(0)
        self._call("kiln_cuda_blas_create", byref(handle), None, BLAS_WORKSPACE_BYTES)
        self._blas = handle.value
        self.lora_config = model.lora_config
        self.quantization = None if model.quantization is None else dict(model.quantization)
        self._base_trainable = self.lora_config is None and self.quantization is None
        dense = model.fp32_state_dict()
        packed = model.packed_state() if self.quantization is not None else {}
        adapters = model.adapter_state_dict() if self.lora_config is not None else {}
        self._base_names = [p.name for p in model._base]  # the CPU engine's parameter order
        self._params = {}  # name -> (device array, element offset, shape): views into fused buffers
        self._grads = {}  # name -> (device array, element offset, shape) of the trainable parameters
        self._packed = packed  # host NF4 tensors, immutable, for state_dict's inspection copies
        self._embed = self._put(dense["model.embed_tokens.weight"])  # [V,C]
        self._norm = self._put(dense["model.norm.weight"])  # [C]
        self._lm_head = None if config.tie_embeddings else self._put(dense["lm_head.weight"])  # [V,C]
        self._register("model.embed_tokens.weight", self._embed, 0, (V, C))
        self._register("model.norm.weight", self._norm, 0, (C,))
        if self._lm_head is not None:
            self._register("lm_head.weight", self._lm_head, 0, (V, C))
        shapes = {"q_proj": (H * D, C), "k_proj": (KV * D, C), "v_proj": (KV * D, C), "o_proj": (C, H * D),
                  "gate_proj": (F, C), "up_proj": (F, C), "down_proj": (C, F)}
        self._group_shapes = {"qkv": (W3, C), "o": (C, H * D), "gate_up": (2 * F, C), "down": (C, F)}
        self._blocks = []
        for index in range(config.block_count):
            prefix = f"model.layers.{index}."
            block = _Block()
            for group, names in GROUPS.items():
                column, projections = 0, []
                for name in names:
                    rows, cols = shapes[name]
                    projections.append(_Projection(name, column, rows, cols))
                    column += rows
                block.projections[group] = projections
                if self.quantization is None:
                    fused = np.concatenate([dense[f"{prefix}{MODULES[n]}.{n}.weight"] for n in names])
                    block.dense[group] = self._put(fused)  # [out,in]
                    for projection in projections:
                        self._register(f"{prefix}{MODULES[projection.name]}.{projection.name}.weight",
                                       block.dense[group], projection.column * projection.cols,
                                       (projection.rows, projection.cols))
                else:
                    for projection in projections:
                        self._upload_nf4(projection, packed[f"{prefix}{MODULES[projection.name]}."
                                                            f"{projection.name}.weight"])
            vectors = {"ln1": prefix + "input_layernorm.weight", "ln2": prefix + "post_attention_layernorm.weight"}
            if config.qk_norm:
                vectors.update(q_norm=prefix + "self_attn.q_norm.weight", k_norm=prefix + "self_attn.k_norm.weight")
            for key, name in vectors.items():
                block.vectors[key] = self._put(dense[name])
                self._register(name, block.vectors[key], 0, dense[name].shape)
            if config.attention_bias:
                biases = [dense[f"{prefix}self_attn.{n}.bias"] for n in GROUPS["qkv"]]
                block.vectors["qkv_bias"] = self._put(np.concatenate(biases))  # [W3]
                offset = 0
                for n, bias in zip(GROUPS["qkv"], biases):
                    self._register(f"{prefix}self_attn.{n}.bias", block.vectors["qkv_bias"], offset, bias.shape)
                    offset += bias.shape[0]
            if self.lora_config is not None:
                for group, names in GROUPS.items():
                    block.adapters[group] = []
                    for projection in block.projections[group]:
                        if projection.name not in self.lora_config.targets:
                            continue
                        adapter = _Adapter(f"{prefix}{MODULES[projection.name]}.{projection.name}", projection,
                                           self.lora_config.rank, self.lora_config.scaling)
                        adapter.A = self._put(adapters[adapter.prefix + ".lora_A.weight"])  # [r,in]
                        adapter.B = self._put(adapters[adapter.prefix + ".lora_B.weight"])  # [out,r]
                        adapter.dA, adapter.dB = self._zeros(adapter.A.shape), self._zeros(adapter.B.shape)
                        block.adapters[group].append(adapter)
            self._blocks.append(block)
        self._adapter_names = list(adapters)  # the CPU engine's adapter order
        self._adapter_params = {}
        for block in self._blocks:
            for group_adapters in block.adapters.values():
                for adapter in group_adapters:
                    for part, value, grad in (("A", adapter.A, adapter.dA), ("B", adapter.B, adapter.dB)):
                        name = f"{adapter.prefix}.lora_{part}.weight"
                        self._adapter_params[name] = (value, 0, value.shape)
                        self._grads[name] = (grad, 0, value.shape)
        if self._base_trainable:
            self._allocate_base_grads()
        cos, sin = rope_tables(config)  # [P, D/2], Llama 3 scaling included
        self._cos, self._sin = self._put(cos), self._put(sin)
        self._identity_cos = self._put(np.ones_like(cos))
        self._identity_sin = self._put(np.zeros_like(sin))
        self._pending = False
        self._adam = None

    def _register(self, name, device, offset, shape):
        self._params[name] = (device, int(offset), tuple(int(n) for n in shape))

    def _upload_nf4(self, projection, tensor):
        """The packed bytes and FP32 absmax of one NF4 weight (double-quantized absmax decoded on the device)."""
        projection.packed = self._put(tensor.packed, np.uint8)
        projection.block_size = tensor.block_size
        blocks = -(-tensor.numel // tensor.block_size)
        if tensor.double_quantized:
            if self._dynamic_map is None:
                self._dynamic_map = self._put(nf4_codes.DYNAMIC_MAP)
            projection.absmax = self._zeros((blocks,))
            with cuda.DeviceArray.from_host(self.lib, tensor.absmax_codes) as codes, \
                    cuda.DeviceArray.from_host(self.lib, tensor.absmax_scales) as scales:
                self._call("kiln_cuda_nf4_decode_absmax", codes.ptr, scales.ptr, self._dynamic_map.ptr,
                           float(tensor.offset), projection.absmax.ptr, blocks, None)
                self._call("kiln_cuda_device_synchronize")
        else:
            projection.absmax = self._put(tensor.absmax)
        # bounded scratch, and never a whole weight's rows at once (trainer.blocks.Block._tiles)
        projection.tile_rows = max(1, min(NF4_SCRATCH_ELEMENTS // projection.cols, (projection.rows + 1) // 2))

    def _allocate_base_grads(self):
        """Zeroed gradient buffers in the parameters' own layouts (fused groups stay fused)."""
        by_buffer = {}
        for name, (device, offset, shape) in self._params.items():
            if id(device) not in by_buffer:
                by_buffer[id(device)] = self._zeros(device.shape)
            self._grads[name] = (by_buffer[id(device)], offset, shape)
        self._grad_of = {id(device): by_buffer[id(device)] for device, _, _ in self._params.values()}

    def _grad(self, device):
        """The gradient buffer of a base parameter buffer (trainable base only)."""
        return self._grad_of[id(device)]

    # -- lifetime ---------------------------------------------------------------------------

    def close(self):
        """Free every device buffer and the cuBLAS handle; the model cannot be used afterwards."""
        for device in getattr(self, "_arrays", []):
            device.free()
        self._arrays, self._scratch = [], {}
        if getattr(self, "_blas", None):
            self.lib.kiln_cuda_blas_destroy(self._blas)
            self._blas = None
        super().close()

    # -- inputs ----------------------------------------------------------------------------

    def _check_tokens(self, tokens, name="tokens"):
        return check_tokens(self.config, tokens, name)

    # -- layout moves through identity rotary tables ------------------------------------------

    def _rope_forward(self, x, strides, out, B, T, KV, g, identity=False, offset=0):
        """out [B,KV,T,g,D] = rotary at positions offset.. (or, with identity, a copy) of x [B,T,KV*g,D] at
        element strides."""
        cos, sin = (self._identity_cos, self._identity_sin) if identity else (self._cos, self._sin)
        self._call("kiln_cuda_rope_forward", x, *strides, cos.ptr, sin.ptr, self.config.maximum_context, offset, out,
                   B, T, KV, g, self.config.head_dimension, None)

    def _rope_backward(self, dout, dx, strides, B, T, KV, g, identity=False):
        """dx [B,T,KV*g,D] at element strides (written) = the rotary input gradient (or a copy) of dout."""
        cos, sin = (self._identity_cos, self._identity_sin) if identity else (self._cos, self._sin)
        self._call("kiln_cuda_rope_backward", dout, cos.ptr, sin.ptr, self.config.maximum_context, 0, dx,
                   *strides, B, T, KV, g, self.config.head_dimension, None)

    def _gather_heads(self, src, row_stride, heads, dst, N):
        """dst [N,heads,D] contiguous = heads D-vectors per row of a strided [N, row_stride] source."""
        self._rope_forward(src, (row_stride, 0, self.config.head_dimension), dst, N, 1, heads, 1, identity=True)

    def _scatter_heads(self, src, dst, row_stride, heads, N):
        """The inverse of _gather_heads: src [N,heads,D] written into the strided rows of dst."""
        self._rope_backward(src, dst, (row_stride, 0, self.config.head_dimension), N, 1, heads, 1, identity=True)

    # -- the base products: dense, or NF4 row tiles dequantized on the device ----------------

    def _tile(self):
        """The one scratch that NF4 row tiles are dequantized into (trainer.blocks' bound)."""
        return self._buffer("nf4_tile", (NF4_SCRATCH_ELEMENTS,))

    def _base_forward(self, block, group, x, out, N, beta):
        """out [N,out] = x [N,in] @ W.T + beta * out for the projections writing `group`."""
        total, K = self._group_shapes[group]
        if group in block.dense:
            self._gemm(0, 1, N, total, K, 1.0, x, K, block.dense[group].ptr, K, beta, out, total, self._base_code)
            return
        for p in block.projections[group]:
            tile = self._tile()
            for start in range(0, p.rows, p.tile_rows):
                rows = min(p.tile_rows, p.rows - start)
                self._call("kiln_cuda_nf4_dequantize", p.packed.ptr, p.absmax.ptr, tile.ptr, start * p.cols,
                           rows * p.cols, p.block_size, None)
                self._gemm(0, 1, N, rows, K, 1.0, x, K, tile.ptr, K, beta, out + 4 * (p.column + start), total,
                           self._base_code)

    def _base_input_grad(self, block, group, dy, dx, N):
        """dx [N,in] = dy [N,out] @ W (written)."""
        total, K = self._group_shapes[group]
        if group in block.dense:
            self._gemm(0, 0, N, K, total, 1.0, dy, total, block.dense[group].ptr, K, 0.0, dx, K, self._base_code)
            return
        beta = 0.0
        for p in block.projections[group]:
            tile = self._tile()
            for start in range(0, p.rows, p.tile_rows):
                rows = min(p.tile_rows, p.rows - start)
                self._call("kiln_cuda_nf4_dequantize", p.packed.ptr, p.absmax.ptr, tile.ptr, start * p.cols,
                           rows * p.cols, p.block_size, None)
                self._gemm(0, 0, N, K, rows, 1.0, dy + 4 * (p.column + start), total, tile.ptr, K, beta, dx, K,
                           self._base_code)
                beta = 1.0

    def _weight_grad(self, block, group, dy, x, N):
        """The fused weight gradient [out,in] += dy.T @ x (trainable base only)."""
        if self._base_trainable:
            total, K = self._group_shapes[group]
            self._gemm(1, 0, total, K, N, 1.0, dy, total, x, K, 1.0, self._grad(block.dense[group]).ptr, K)

    # -- LoRA: GEMMs reading and writing the group's output columns in place -----------------

    def _lora_forward(self, block, index, group, x, out, N, keep=True):
        """out [N,out] += each adapter's scaling * (x @ A.T) @ B.T in its columns; x @ A.T is kept for backward
        (or, without KEEP, computed in one shared decoding scratch)."""
        total, K = self._group_shapes[group]
        for j, adapter in enumerate(block.adapters.get(group, ())):
            p, r = adapter.projection, adapter.rank
            u = self._buffer(f"lora_u.{index}.{group}.{j}", (N, r)) if keep else self._rows("dec.lora_u", N, r)
            self._gemm(0, 1, N, r, K, 1.0, x, K, adapter.A.ptr, K, 0.0, u.ptr, r)
            self._gemm(0, 1, N, p.rows, r, adapter.scaling, u.ptr, r, adapter.B.ptr, r, 1.0, out + 4 * p.column,
                       total)

    def _lora_backward(self, block, index, group, x, dy, dx, N):
        """Adapter gradients from dy [N,out]; their input gradient is added to dx [N,in]."""
        total, K = self._group_shapes[group]
        for j, adapter in enumerate(block.adapters.get(group, ())):
            p, r, s = adapter.projection, adapter.rank, adapter.scaling
            u = self._scratch[f"lora_u.{index}.{group}.{j}"]
            du = self._buffer("lora_du", (N, r))
            dy_columns = dy + 4 * p.column
            self._gemm(1, 0, p.rows, r, N, s, dy_columns, total, u.ptr, r, 1.0, adapter.dB.ptr, r)  # dB += s dy.T u
            self._gemm(0, 0, N, r, p.rows, s, dy_columns, total, adapter.B.ptr, r, 0.0, du.ptr, r)  # du = s dy B
            self._gemm(1, 0, r, K, N, 1.0, du.ptr, r, x, K, 1.0, adapter.dA.ptr, K)  # dA += du.T x
            self._gemm(0, 0, N, K, r, 1.0, du.ptr, r, adapter.A.ptr, K, 1.0, dx, K)  # dx += du A

    # -- norms ----------------------------------------------------------------------------------

    def _rmsnorm_backward(self, dout, x, weight, rstd, dx, rows, width):
        """dx [rows,width] += RMSNorm's input gradient; the weight's gradient accumulates when trainable."""
        size = c_size_t(0)
        self._call("kiln_cuda_rmsnorm_backward_workspace", rows, width, byref(size))
        workspace = self._scratch.get("rms_workspace")
        if workspace is None or workspace.nbytes < size.value:  # one workspace, grown to the largest asked
            workspace = self._buffer("rms_workspace", (max(int(size.value), 1),), np.uint8)
        if self._base_trainable:
            dweight = self._grad(weight)
        else:
            dweight = self._buffer(f"rms_dweight_scratch.{width}", (width,))  # frozen: accumulated, never read
        self._call("kiln_cuda_rmsnorm_backward", dout, x, weight.ptr, rstd, dx, dweight.ptr, workspace.ptr, rows,
                   width, None)

    # -- forward ----------------------------------------------------------------------------------

    def _forward(self, tokens):
        """Token ids [B,T] -> the final normed hidden [N,C] on the device; activations kept in scratch."""
        config = self.config
        B, T = tokens.shape
        N, C, F = B * T, config.model_width, config.feed_forward_width
        H, KV, D = config.head_count, config.kv_heads, config.head_dimension
        g, G, W3 = H // KV, B * KV, (H + 2 * KV) * D
        window = window_limits(config, 0, T) or 0
        scale = 1.0 / np.sqrt(D)
        dtokens = self._buffer("tokens", (N,), I64)
        self._upload_into(dtokens, 0, tokens.reshape(-1))
        x = self._buffer("x.0", (N, C))
        self._call("kiln_cuda_embedding_forward", dtokens.ptr, self._embed.ptr, x.ptr, N, C,
                   config.vocabulary_size, None)
        eps = config.norm_epsilon
        for i, block in enumerate(self._blocks):
            h1, rstd1 = self._buffer(f"h1.{i}", (N, C)), self._buffer(f"rstd1.{i}", (N,))
            self._call("kiln_cuda_rmsnorm_forward", x.ptr, block.vectors["ln1"].ptr, eps, h1.ptr, rstd1.ptr, N, C,
                       None)
            qkv = self._buffer(f"qkv.{i}", (N, W3))
            self._base_forward(block, "qkv", h1.ptr, qkv.ptr, N, 0.0)
            if "qkv_bias" in block.vectors:  # qkv += ones [N,1] @ bias [1,W3]
                self._gemm(0, 0, N, W3, 1, 1.0, self._ones(N).ptr, 1, block.vectors["qkv_bias"].ptr, W3, 1.0,
                           qkv.ptr, W3)
            self._lora_forward(block, i, "qkv", h1.ptr, qkv.ptr, N)
            q, k, v = (self._buffer(f"{n}.{i}", shape) for n, shape in
                       (("q", (G, T * g, D)), ("k", (G, T, D)), ("v", (G, T, D))))
            strides = (T * W3, W3, D)
            q_in, k_in = qkv.ptr, qkv.ptr + 4 * H * D
            if config.qk_norm:
                normed = []
                for name, heads, source in (("q", H, q_in), ("k", KV, k_in)):
                    raw = self._buffer(f"{name}_raw.{i}", (N * heads, D))  # pre-norm heads, kept for backward
                    out = self._buffer(f"{name}_normed.{i}", (N * heads, D))
                    rstd = self._buffer(f"{name}_rstd.{i}", (N * heads,))
                    self._gather_heads(source, W3, heads, raw.ptr, N)
                    self._call("kiln_cuda_rmsnorm_forward", raw.ptr, block.vectors[f"{name}_norm"].ptr, eps,
                               out.ptr, rstd.ptr, N * heads, D, None)
                    normed.append((out.ptr, (T * heads * D, heads * D, D)))
                (q_in, q_strides), (k_in, k_strides) = normed
            else:
                q_strides = k_strides = strides
            self._rope_forward(q_in, q_strides, q.ptr, B, T, KV, g)
            self._rope_forward(k_in, k_strides, k.ptr, B, T, KV, 1)
            self._rope_forward(qkv.ptr + 4 * (H + KV) * D, strides, v.ptr, B, T, KV, 1, identity=True)
            att, lse = self._buffer(f"att.{i}", (G, T * g, D)), self._buffer(f"lse.{i}", (G, T * g))
            self._attention_forward(q, k, v, att, lse, G, T, g, D, window, scale)
            attn = self._buffer(f"attn.{i}", (N, H * D))  # [B,T,H,D]
            self._rope_backward(att.ptr, attn.ptr, (T * H * D, H * D, D), B, T, KV, g, identity=True)
            x_mid = self._buffer(f"x_mid.{i}", (N, C))
            self._call("kiln_cuda_memcpy_d2d", x_mid.ptr, x.ptr, x.nbytes, None)
            self._base_forward(block, "o", attn.ptr, x_mid.ptr, N, 1.0)  # x_mid = x + attn @ o.T
            self._lora_forward(block, i, "o", attn.ptr, x_mid.ptr, N)
            h2, rstd2 = self._buffer(f"h2.{i}", (N, C)), self._buffer(f"rstd2.{i}", (N,))
            self._call("kiln_cuda_rmsnorm_forward", x_mid.ptr, block.vectors["ln2"].ptr, eps, h2.ptr, rstd2.ptr, N,
                       C, None)
            gate_up = self._buffer(f"gate_up.{i}", (N, 2 * F))
            self._base_forward(block, "gate_up", h2.ptr, gate_up.ptr, N, 0.0)
            self._lora_forward(block, i, "gate_up", h2.ptr, gate_up.ptr, N)
            act = self._buffer(f"act.{i}", (N, F))
            self._call("kiln_cuda_swiglu_forward", gate_up.ptr, act.ptr, N, F, None)
            x_out = self._buffer(f"x.{i + 1}", (N, C))
            self._call("kiln_cuda_memcpy_d2d", x_out.ptr, x_mid.ptr, x_mid.nbytes, None)
            self._base_forward(block, "down", act.ptr, x_out.ptr, N, 1.0)  # x_out = x_mid + act @ down.T
            self._lora_forward(block, i, "down", act.ptr, x_out.ptr, N)
            x = x_out
        hidden, rstd = self._buffer("hidden", (N, C)), self._buffer("final_rstd", (N,))
        self._call("kiln_cuda_rmsnorm_forward", x.ptr, self._norm.ptr, eps, hidden.ptr, rstd.ptr, N, C, None)
        return hidden

    def _ones(self, N):
        """A device vector of at least N ones (grown, never shrunk: training and decoding share it)."""
        ones = self._scratch.get("ones")
        if ones is None or ones.shape[0] < N:
            ones = self._buffer("ones", (N,))
            self._upload_into(ones, 0, np.ones(N, F32))
        return ones

    @property
    def _head(self):
        return self._lm_head if self._lm_head is not None else self._embed

    def logits(self, tokens) -> np.ndarray:
        """Float32 logits [B,T,V] for int token ids [B,T]."""
        self._check_open()
        tokens = self._check_tokens(tokens)
        B, T = tokens.shape
        N, C, V = B * T, self.config.model_width, self.config.vocabulary_size
        hidden = self._forward(tokens)
        logits = self._buffer("logits", (N, V))
        self._gemm(0, 1, N, V, C, 1.0, hidden.ptr, C, self._head.ptr, C, 0.0, logits.ptr, V, self._base_code)
        return logits.to_host().reshape(B, T, V)

    # -- forward + backward ---------------------------------------------------------------------------

    def forward_backward(self, inputs, targets, normalizer=None) -> float:
        """Mean cross-entropy over non-ignored targets; gradients accumulate on the device (divided by
        `normalizer`, as DecoderOnlyTransformer.forward_backward's)."""
        self._check_open()
        inputs, targets, flat = check_batch(self.config, inputs, targets)
        valid = int(np.count_nonzero(flat != IGNORE_INDEX))
        normalizer = check_normalizer(normalizer, valid)
        hidden = self._forward(inputs)
        losses = self._loss(hidden, flat, 1, grad_scale=1.0 / normalizer)
        self._backward_from_hidden(inputs.shape)
        return float(np.sum(losses, dtype=np.float64)) / valid

    def token_losses(self, inputs, targets) -> np.ndarray:
        """Per-token cross-entropy [B,T] (0 where the target is IGNORE_INDEX); no gradients."""
        self._check_open()
        inputs, targets, _ = check_batch(self.config, inputs, targets, trained=False)
        logp = self._loss(self._forward(inputs), targets.reshape(-1), 0, chunk=self.config.loss_chunk_tokens)
        return (-logp).reshape(targets.shape) + F32(0)  # -0.0 at ignored targets becomes 0.0

    def forward_backward_weighted(self, inputs, targets, coefficient_fn) -> np.ndarray:
        """Backpropagate sum_t c_t * log p(target_t) and return log p [B,T] (0 where ignored).

        As DecoderOnlyTransformer.forward_backward_weighted: coefficient_fn(logp [B,T] float32) -> c [B,T],
        the derivative of the caller's loss with respect to each token's log-probability.
        """
        self._check_open()
        inputs, targets, flat = check_batch(self.config, inputs, targets)
        valid = flat != IGNORE_INDEX
        hidden = self._forward(inputs)
        logp = self._loss(hidden, flat, 0, chunk=self.config.loss_chunk_tokens)  # [N], 0 where ignored
        coefficients = np.asarray(coefficient_fn(logp.reshape(targets.shape)), dtype=np.float64)
        if coefficients.shape != targets.shape or not np.all(np.isfinite(coefficients)):
            raise ValueError(f"coefficient_fn must return finite values of shape {targets.shape}")
        # d(c*logp)/dlogits = (softmax - onehot) * (-c)
        row_scales = np.where(valid, -coefficients.reshape(-1), 0.0).astype(F32)
        self._loss(hidden, flat, 2, row_scales=row_scales)
        self._backward_from_hidden(inputs.shape)
        return logp.reshape(targets.shape)

    def _loss(self, hidden, flat, mode, grad_scale=1.0, row_scales=None, chunk=None):
        """The fused linear cross-entropy over hidden [N,C]: mode 0 log p [N] (no gradients), mode 1 losses
        with dhidden of grad_scale * sum of losses, mode 2 with row_scales; the head gradient accumulates on a
        trainable base. Returns the per-row values downloaded."""
        config = self.config
        N, C, V = flat.shape[0], config.model_width, config.vocabulary_size
        if chunk is None:
            chunk = N if config.loss_route == "full_logits" else config.loss_chunk_tokens
        chunk = min(chunk, N)
        dtargets = self._buffer("targets", (N,), I64)
        self._upload_into(dtargets, 0, flat)
        per_row = self._buffer("per_row", (N,))
        dhidden = self._buffer("dhidden", (N, C)) if mode else None
        scales = None
        if mode == 2:
            scales = self._buffer("row_scales", (N,))
            self._upload_into(scales, 0, row_scales)
        workspace = self._buffer("loss_logits", (chunk, V))
        dhead = self._grad(self._head).ptr if mode and self._base_trainable else None
        self._call("kiln_cuda_fused_linear_cross_entropy", self._blas, hidden.ptr, self._head.ptr, dtargets.ptr, N,
                   C, V, chunk, mode, float(F32(grad_scale)), scales.ptr if scales else None, IGNORE_INDEX,
                   per_row.ptr, dhidden.ptr if dhidden else None, dhead, workspace.ptr, self._base_code)
        return per_row.to_host()

    def _backward_from_hidden(self, shape):
        """Backward from the loss's dhidden down to the embedding, when anything is trainable."""
        if self._trainable_names():
            self._backward(self._scratch["dhidden"], self._scratch["tokens"], *shape)
            self._pending = True

    def _backward(self, dhidden, dtokens, B, T):
        config = self.config
        N, C, F = B * T, config.model_width, config.feed_forward_width
        H, KV, D = config.head_count, config.kv_heads, config.head_dimension
        g, G, W3 = H // KV, B * KV, (H + 2 * KV) * D
        window = window_limits(config, 0, T) or 0
        scale = 1.0 / np.sqrt(D)
        d = self._buffer("d", (N, C))  # the gradient at the residual stream, turned block by block
        self._clear(d)
        last = self._scratch[f"x.{len(self._blocks)}"]
        self._rmsnorm_backward(dhidden.ptr, last.ptr, self._norm, self._scratch["final_rstd"].ptr, d.ptr, N, C)
        dact, dgate_up = self._buffer("dact", (N, F)), self._buffer("dgate_up", (N, 2 * F))
        dh, dattn = self._buffer("dh", (N, C)), self._buffer("dattn", (N, H * D))
        datt, delta = self._buffer("datt", (G, T * g, D)), self._buffer("delta", (G, T * g))
        dq, dk, dv = (self._buffer(n, shape) for n, shape in
                      (("dq", (G, T * g, D)), ("dk", (G, T, D)), ("dv", (G, T, D))))
        dqkv = self._buffer("dqkv", (N, W3))
        for i in range(len(self._blocks) - 1, -1, -1):
            block = self._blocks[i]
            saved = {name: self._scratch[f"{name}.{i}"] for name in
                     ("h1", "rstd1", "qkv", "q", "k", "v", "att", "lse", "attn", "x_mid", "h2", "rstd2", "gate_up",
                      "act")}
            x = self._scratch[f"x.{i}"]
            # MLP
            self._base_input_grad(block, "down", d.ptr, dact.ptr, N)
            self._weight_grad(block, "down", d.ptr, saved["act"].ptr, N)
            self._lora_backward(block, i, "down", saved["act"].ptr, d.ptr, dact.ptr, N)
            self._call("kiln_cuda_swiglu_backward", dact.ptr, saved["gate_up"].ptr, dgate_up.ptr, N, F, None)
            self._weight_grad(block, "gate_up", dgate_up.ptr, saved["h2"].ptr, N)
            self._base_input_grad(block, "gate_up", dgate_up.ptr, dh.ptr, N)
            self._lora_backward(block, i, "gate_up", saved["h2"].ptr, dgate_up.ptr, dh.ptr, N)
            self._rmsnorm_backward(dh.ptr, saved["x_mid"].ptr, block.vectors["ln2"], saved["rstd2"].ptr, d.ptr, N, C)
            # attention
            self._base_input_grad(block, "o", d.ptr, dattn.ptr, N)
            self._weight_grad(block, "o", d.ptr, saved["attn"].ptr, N)
            self._lora_backward(block, i, "o", saved["attn"].ptr, d.ptr, dattn.ptr, N)
            self._rope_forward(dattn.ptr, (T * H * D, H * D, D), datt.ptr, B, T, KV, g, identity=True)
            self._attention_backward(datt, saved["q"], saved["k"], saved["v"], saved["att"], saved["lse"], dq, dk, dv,
                                     delta, G, T, g, D, window, scale)
            strides = (T * W3, W3, D)
            if not config.qk_norm:
                self._rope_backward(dq.ptr, dqkv.ptr, strides, B, T, KV, g)
                self._rope_backward(dk.ptr, dqkv.ptr + 4 * H * D, strides, B, T, KV, 1)
            else:
                for name, heads, source, group_size, column in (("q", H, dq, g, 0), ("k", KV, dk, 1, H * D)):
                    dnormed = self._buffer(f"d{name}_normed", (N * heads, D))
                    draw = self._buffer(f"d{name}_raw", (N * heads, D))
                    self._rope_backward(source.ptr, dnormed.ptr, (T * heads * D, heads * D, D), B, T, KV,
                                        group_size)
                    self._clear(draw)
                    self._rmsnorm_backward(dnormed.ptr, self._scratch[f"{name}_raw.{i}"].ptr,
                                           block.vectors[f"{name}_norm"], self._scratch[f"{name}_rstd.{i}"].ptr,
                                           draw.ptr, N * heads, D)
                    self._scatter_heads(draw.ptr, dqkv.ptr + 4 * column, W3, heads, N)
            self._rope_backward(dv.ptr, dqkv.ptr + 4 * (H + KV) * D, strides, B, T, KV, 1, identity=True)
            self._weight_grad(block, "qkv", dqkv.ptr, saved["h1"].ptr, N)
            if self._base_trainable and "qkv_bias" in block.vectors:  # dbias [1,W3] += ones [1,N] @ dqkv
                self._gemm(1, 0, 1, W3, N, 1.0, self._ones(N).ptr, 1, dqkv.ptr, W3, 1.0,
                           self._grad(block.vectors["qkv_bias"]).ptr, W3)
            self._base_input_grad(block, "qkv", dqkv.ptr, dh.ptr, N)
            self._lora_backward(block, i, "qkv", saved["h1"].ptr, dqkv.ptr, dh.ptr, N)
            self._rmsnorm_backward(dh.ptr, x.ptr, block.vectors["ln1"], saved["rstd1"].ptr, d.ptr, N, C)
        if self._base_trainable:
            self._call("kiln_cuda_embedding_backward", d.ptr, dtokens.ptr, self._grad(self._embed).ptr, N, C,
                       config.vocabulary_size, None)

    # -- uploads and downloads ------------------------------------------------------------------------

    def load_adapter_state_dict(self, mapping: dict):
        """Set the device adapters by name (every name and shape is checked first)."""
        self._check_open()
        if self.lora_config is None:
            raise ValueError("no LoRA adapter is attached")
        missing = [name for name in self._adapter_names if name not in mapping]
        unknown = sorted(set(mapping) - set(self._adapter_names))
        if missing or unknown:
            raise KeyError(f"adapter state mismatch: missing {missing[:5]}, unknown {unknown[:5]}")
        for name in self._adapter_names:
            if np.shape(mapping[name]) != self._adapter_params[name][2]:
                raise ValueError(f"{name}: shape {np.shape(mapping[name])} does not match "
                                 f"{self._adapter_params[name][2]}")
        for name in self._adapter_names:
            device, offset, _ = self._adapter_params[name]
            self._upload_into(device, offset, mapping[name])

    def state_dict(self) -> dict:
        """{name: downloaded value} of every base parameter in the CPU engine's order.

        Packed NF4 weights appear dequantized on the host (an inspection copy; the base is frozen).
        """
        self._check_open()
        return {name: self._download(*self._params[name]) if name in self._params
                else dequantize_nf4(self._packed[name]) for name in self._base_names}

    def adapter_state_dict(self) -> dict:
        self._check_open()
        if self.lora_config is None:
            raise ValueError("no LoRA adapter is attached")
        return {name: self._download(*self._adapter_params[name]) for name in self._adapter_names}


# -- planning -----------------------------------------------------------------------------------------


def dense_chunk(G, R, S):
    """How many head groups' scores [R,S] the dense attention computes at once: as many as DENSE_SCORES_BYTES holds,
    at least one, at most G."""
    return max(1, min(G, DENSE_SCORES_BYTES // max(4 * R * S, 1)))


def planned_device_bytes(config, batch: int, positions: int, lora=None, quantization=None, *, training=True,
                         logits=False, sampling=None, attention="tiled") -> int:
    """The device bytes CudaModel allocates for CONFIG (a TransformerConfig) computing on batches of BATCH rows of
    POSITIONS tokens: the resident weights (FP32, or NF4 codes with decoded FP32 block scales and the one tile
    scratch), the gradient buffers _build allocates (the adapters', or a dense base's when no adapter is attached),
    the rope tables, the activations every block keeps (for backward; _forward keeps them whatever the call), and
    the cuBLAS workspace. LORA is a trainer.lora.LoraConfig (or None: the whole base trains, unless QUANTIZATION,
    {"block_size": ...}, freezes it).

    TRAINING (the default) adds a training step's: Adam's moments, the loss's and the backward's scratch.
    training=False plans a model that never steps (a native OPD teacher, a served or evaluated model): no moments,
    no loss or backward scratch, and no forward at all when BATCH is 0 (the gradient buffers are still counted:
    _build allocates them whatever the model is used for). LOGITS adds CudaModel.logits' whole [N,V] logits over
    the same rows. SAMPLING, (prompt, positions), adds what trainer.generation.generate allocates to sample one
    sequence: a KV cache of POSITIONS positions (trainer.cuda_decode.DeviceKVCache) and the decoding scratch,
    grown to the prefill of PROMPT rows (each later token takes one row, and the scratch never shrinks).
    ATTENTION "dense" adds the dense algorithm's score buffer, and its gradient's in training: each as large as the
    longest batch's (dense_chunk groups), and no smaller than a shorter batch's can be (a shorter one may fit more
    groups into DENSE_SCORES_BYTES).

    It follows _build, _forward, logits, _loss, _backward and cuda_decode buffer by buffer;
    tests/engine/test_cuda_model.py holds it to the emulation's allocations. The CUDA context itself is not
    counted (trainer.runs.device_plan.CUDA_CONTEXT_BYTES is the allowance admission adds once per process)."""
    if attention not in ATTENTION_ALGORITHMS:
        raise ValueError(f"attention must be one of {', '.join(ATTENTION_ALGORITHMS)}, got {attention!r}")
    C, F, V, D = config.model_width, config.feed_forward_width, config.vocabulary_size, config.head_dimension
    H, KV, L = config.head_count, config.kv_heads, config.block_count
    N, W3 = batch * positions, (H + 2 * KV) * D
    shapes = config.projection_shapes()
    linear = sum(rows * cols for rows, cols in shapes.values())
    vectors = 2 * C + (2 * D if config.qk_norm else 0) + (W3 if config.attention_bias else 0)
    dense = (1 if config.tie_embeddings else 2) * V * C + C + L * vectors  # embeddings, norms, biases
    rope = 2 * config.maximum_context * (D // 2) * 2  # rope tables and their identity twins
    floats = dense + rope
    nbytes = BLAS_WORKSPACE_BYTES
    if quantization is None:
        floats += L * linear
    else:
        block = quantization["block_size"]
        nbytes += L * sum(rows * cols // 2 + 4 * -(-rows * cols // block) for rows, cols in shapes.values())
        floats += NF4_SCRATCH_ELEMENTS
    r = 0 if lora is None else lora.rank
    adapted = 0 if lora is None else sum(name in lora.targets for name in shapes)  # adapted projections a block
    trainable = 0
    if lora is not None:
        trainable = L * sum(r * (rows + cols) for name, (rows, cols) in shapes.items() if name in lora.targets)
        floats += 2 * trainable  # values and gradients
    elif quantization is None:
        trainable = floats - rope
        floats += trainable  # gradients in the parameters' layouts
    if training:
        floats += 2 * trainable  # Adam's moments
    if N:
        # kept by every block: h1, qkv, q, k, v, att, attn, x_mid, h2, gate_up, act, the block's output, and rstd1,
        # rstd2, lse (qk_norm: the raw and normed heads and their rstd); LoRA's u of each adapted projection
        heads = N * (H + 2 * KV) * D
        saved = 4 * N * C + N * W3 + heads + 2 * N * H * D + 3 * N * F + 2 * N + N * H + N * r * adapted
        if config.qk_norm:
            saved += 2 * N * (H + KV) * D + N * (H + KV)
        floats += L * saved
        floats += 2 * N * C + 4 * N  # x.0 and hidden; the final rstd, ones and the int64 tokens
        if training:
            chunk = N if config.loss_route == "full_logits" else min(config.loss_chunk_tokens, N)
            # dhidden; per-row losses, row scales and the int64 targets; the loss's logits chunk; LoRA's du
            floats += N * C + 4 * N + chunk * V + N * r
            # backward: d, dh, dact, dgate_up, dattn, datt, delta, dq, dk, dv, dqkv; RMSNorm's double partial sums
            floats += 2 * N * C + 3 * N * F + 3 * N * H * D + N * H + 2 * N * KV * D + N * W3
            floats += 2 * -(-N // 64) * C + C + D
            if config.qk_norm:
                floats += 2 * N * (H + KV) * D
        if attention == "dense":
            G, scores = batch * KV, positions * (H // KV) * positions
            floats += (2 if training else 1) * min(G * scores, max(scores, DENSE_SCORES_BYTES // 4))
        if logits:
            floats += N * V
    if sampling is not None:
        prompt, cached = sampling
        floats += 2 * L * KV * cached * D  # the cache's keys and values of every block, one sequence
        # dec.*: tokens (int64), x, h, hidden, rstd, qkv, gate_up, act, q, att, attn, lse, LoRA's u, ones; one
        # row of logits (the prefill's last position, then each new token's)
        floats += prompt * (2 + 3 * C + H + W3 + 3 * F + 3 * H * D + H + r + 1) + V
        if config.qk_norm:
            floats += 2 * prompt * (H + KV) * D  # dec.q_raw, dec.q_normed, dec.k_raw, dec.k_normed
    return nbytes + 4 * floats
