"""KV-cached forward passes of a CudaModel: what trainer.generation samples from on the cuda backend.

DecoderOnlyTransformer.forward_cached's arithmetic (trainer.blocks.block_forward with a cache) on the CUDA library:
the new tokens' q/k/v products (NF4 tiles, Qwen2's bias, LoRA), Qwen3's q/k norm, rotary at positions past..,
the rotated keys and values written into the device cache at those positions, and attention of the new queries
over the whole cached prefix. The cache of block i is one [G,P,D] array for keys and one for values (G = B*KV
head groups, P the cache's positions, at most maximum_context), so a single attention call per block reads it:
the kernel is given S = P keys per group and, being causal, never looks past a query's own position; slots not
yet written are zeros from the cache's creation and enter no sum (their probability is exactly 0).

Each cache owns its device arrays (freed by close(), or when it is collected), so concurrent requests on one
served model keep independent caches, as on the CPU; the decoding scratch is the model's, used by one pass at a
time (the serving pool's TurnLock).
"""

import numpy as np

from native_ext import cuda
from trainer.blocks import window_limits
from trainer.generation import check_cache_room, check_cache_size

F32, I64 = np.float32, np.int64


class DeviceKVCache:
    """Rotated keys and values of every block for B sequences on the device: `positions` slots, `length` filled."""

    def __init__(self, model, batch_size, positions):
        config = model.config
        shape = (batch_size * config.kv_heads, positions, config.head_dimension)  # [G,P,D]
        self.batch_size, self.positions, self.length = batch_size, positions, 0
        self._model = model
        self.keys, self.values = [], []
        try:
            for _ in range(config.block_count):
                self.keys.append(cuda.DeviceArray.zeros(model.lib, shape))
                self.values.append(cuda.DeviceArray.zeros(model.lib, shape))
        except BaseException:
            self.close()
            raise

    def close(self):
        """Free the device arrays; the cache cannot be used afterwards."""
        for array in self.keys + self.values:
            array.free()
        self.keys, self.values, self._model = [], [], None


class DeviceDecoding:
    """forward_cached and kv_cache for CudaModel (a mixin: it uses the model's buffers, GEMMs and kernels)."""

    def kv_cache(self, batch_size=1, positions=None) -> DeviceKVCache:
        """A new, empty cache for BATCH_SIZE sequences of up to POSITIONS tokens (default maximum_context)."""
        self._check_open()
        batch_size, positions = check_cache_size(self.config, batch_size, positions)
        return DeviceKVCache(self, batch_size, positions)

    def _rows(self, key, rows, width, dtype=F32):
        """A decoding scratch of at least ROWS rows of WIDTH (grown, never shrunk, so steps reuse it)."""
        device = self._scratch.get(key)
        if device is None or device.shape[0] < rows or device.shape[1:] != (width,) or device.dtype != dtype:
            device = self._buffer(key, (rows, width), dtype)
        return device

    def forward_cached(self, tokens, cache, last_only=False) -> np.ndarray:
        """Logits [B,T,V] of new tokens [B,T] after the cache's prefix; extends the cache.

        As DecoderOnlyTransformer.forward_cached: no gradients; with last_only only the last position's logits
        ([B,1,V]) are computed and downloaded.
        """
        self._check_open()
        if not isinstance(cache, DeviceKVCache) or cache._model is not self:
            raise ValueError("the cache was not made by this model's kv_cache() (or it was closed)")
        tokens = self._check_tokens(tokens)
        B, T = tokens.shape
        check_cache_room(self.config, cache, B, T)
        hidden = self._decode(tokens, cache)
        cache.length += T
        C, V = self.config.model_width, self.config.vocabulary_size
        if last_only:  # rows T-1, 2T-1, ...: a strided A operand
            logits = self._rows("dec.logits", B, V)
            self._gemm(0, 1, B, V, C, 1.0, hidden.ptr + 4 * (T - 1) * C, T * C, self._head.ptr, C, 0.0, logits.ptr, V,
                       self._base_code)
            return self._download(logits, 0, (B, 1, V))
        logits = self._rows("dec.logits", B * T, V)
        self._gemm(0, 1, B * T, V, C, 1.0, hidden.ptr, C, self._head.ptr, C, 0.0, logits.ptr, V, self._base_code)
        return self._download(logits, 0, (B, T, V))

    def _decode(self, tokens, cache):
        """The final normed hidden [N,C] (a device scratch) of new tokens after the cache's prefix; fills it."""
        config = self.config
        B, T = tokens.shape
        past, P = cache.length, cache.positions
        N, C, F = B * T, config.model_width, config.feed_forward_width
        H, KV, D = config.head_count, config.kv_heads, config.head_dimension
        g, G, W3 = H // KV, B * KV, (H + 2 * KV) * D
        window = window_limits(config, past, T) or 0
        scale = 1.0 / np.sqrt(D)
        eps = config.norm_epsilon
        dtokens = self._rows("dec.tokens", N, 1, I64)
        self._upload_into(dtokens, 0, tokens.reshape(-1))
        x, h = self._rows("dec.x", N, C), self._rows("dec.h", N, C)
        rstd = self._rows("dec.rstd", N * max(H, 1), 1)
        qkv, gate_up = self._rows("dec.qkv", N, W3), self._rows("dec.gate_up", N, 2 * F)
        q, att = self._rows("dec.q", N * H, D), self._rows("dec.att", N * H, D)
        lse, attn = self._rows("dec.lse", N * H, 1), self._rows("dec.attn", N, H * D)
        act = self._rows("dec.act", N, F)
        self._call("kiln_cuda_embedding_forward", dtokens.ptr, self._embed.ptr, x.ptr, N, C, config.vocabulary_size,
                   None)
        for i, block in enumerate(self._blocks):
            keys, values = cache.keys[i], cache.values[i]
            self._call("kiln_cuda_rmsnorm_forward", x.ptr, block.vectors["ln1"].ptr, eps, h.ptr, rstd.ptr, N, C, None)
            self._base_forward(block, "qkv", h.ptr, qkv.ptr, N, 0.0)
            if "qkv_bias" in block.vectors:  # qkv += ones [N,1] @ bias [1,W3]
                self._gemm(0, 0, N, W3, 1, 1.0, self._ones(N).ptr, 1, block.vectors["qkv_bias"].ptr, W3, 1.0,
                           qkv.ptr, W3)
            self._lora_forward(block, i, "qkv", h.ptr, qkv.ptr, N, keep=False)
            strides = (T * W3, W3, D)
            q_in, q_strides, k_in, k_strides = qkv.ptr, strides, qkv.ptr + 4 * H * D, strides
            if config.qk_norm:
                normed = []
                for name, heads, source in (("q", H, q_in), ("k", KV, k_in)):
                    raw, out = self._rows(f"dec.{name}_raw", N * heads, D), self._rows(f"dec.{name}_normed",
                                                                                        N * heads, D)
                    self._gather_heads(source, W3, heads, raw.ptr, N)
                    self._call("kiln_cuda_rmsnorm_forward", raw.ptr, block.vectors[f"{name}_norm"].ptr, eps, out.ptr,
                               rstd.ptr, N * heads, D, None)
                    normed.append((out.ptr, (T * heads * D, heads * D, D)))
                (q_in, q_strides), (k_in, k_strides) = normed
            self._rope_forward(q_in, q_strides, q.ptr, B, T, KV, g, offset=past)  # [G, T*g, D]
            v_in = qkv.ptr + 4 * (H + KV) * D
            for b in range(B):  # this step's keys and values into the cache rows past.. of each group
                for head in range(KV):
                    slot = 4 * (((b * KV + head) * P + past) * D)
                    self._rope_forward(k_in + 4 * (b * k_strides[0] + head * D), k_strides, keys.ptr + slot,
                                       1, T, 1, 1, offset=past)
                    self._rope_forward(v_in + 4 * (b * strides[0] + head * D), strides, values.ptr + slot,
                                       1, T, 1, 1, identity=True)
            self._call("kiln_cuda_attention_forward", q.ptr, keys.ptr, values.ptr, att.ptr, lse.ptr, G, T, g, P, D,
                       past, window, scale, 0, None)
            self._rope_backward(att.ptr, attn.ptr, (T * H * D, H * D, D), B, T, KV, g, identity=True)
            self._base_forward(block, "o", attn.ptr, x.ptr, N, 1.0)  # x += attn @ o.T, in place
            self._lora_forward(block, i, "o", attn.ptr, x.ptr, N, keep=False)
            self._call("kiln_cuda_rmsnorm_forward", x.ptr, block.vectors["ln2"].ptr, eps, h.ptr, rstd.ptr, N, C, None)
            self._base_forward(block, "gate_up", h.ptr, gate_up.ptr, N, 0.0)
            self._lora_forward(block, i, "gate_up", h.ptr, gate_up.ptr, N, keep=False)
            self._call("kiln_cuda_swiglu_forward", gate_up.ptr, act.ptr, N, F, None)
            self._base_forward(block, "down", act.ptr, x.ptr, N, 1.0)  # x += act @ down.T
            self._lora_forward(block, i, "down", act.ptr, x.ptr, N, keep=False)
        hidden = self._rows("dec.hidden", N, C)
        self._call("kiln_cuda_rmsnorm_forward", x.ptr, self._norm.ptr, eps, hidden.ptr, rstd.ptr, N, C, None)
        return hidden
