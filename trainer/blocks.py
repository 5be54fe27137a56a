"""One decoder block: its weights and the forward/backward pair of its math (RMSNorm, projections, rotary, attention, SwiGLU MLP, residuals).

Dimension letters: B batch, T time, N = B*T rows, C model width, H query heads, KV
key/value heads, g = H/KV, D head size, G = B*KV head groups, P positions of the rotary
table, F feed-forward width, r LoRA rank.
The q/k/v projections of a block share one fused [(H+2KV)*D, C] matrix and gate/up share
one [2F, C] matrix; the named parameters are row views into them, so one matrix product
serves three (or two) projections. The family options add Qwen2's q/k/v biases (one fused
[(H+2KV)*D] vector), Qwen3's per-head q/k RMSNorm before rotary, Llama 3's rotary
frequency scaling and a sliding attention window (Mistral, Phi-3). Backward accumulates into the gradient buffers and
marks them pending; a frozen (quantized or LoRA-wrapped) base gets no weight gradients.
"""

from dataclasses import dataclass

import numpy as np

from native_ext import bf16, blas, kernels, onednn
from trainer import attention, quantization
from trainer.parameters import Parameter

NF4_SCRATCH_ELEMENTS = 1 << 17  # the CUDA backend's tile: at most 512 KiB of dequantized rows at a time
# the CPU's NF4 tiles: at most 8 MiB of a projection group's dequantized rows at a time (Block._tiles), one
# product per tile; the SmolLM2 shape's groups fit in one tile each, as its float32 products do. Measured there
# (2-core AMX Xeon, QLoRA step): 512 KiB tiles per projection took 1,001-1,013 ms at context 256 and 3,667-3,855
# at 1024; 8 MiB tiles of at most half a projection 918-949 and 3,597-3,735
NF4_TILE_ELEMENTS = 1 << 21
# floats after each row of a fused group's matrix (Block.fuse_adapters): a row stride of in + 16 floats. With rows
# 2,304 or 6,144 bytes apart (SmolLM2's 576 and 1,536 inputs) the rows OpenBLAS packs together for the input
# gradient's product share a few cache sets; 64 bytes more per row spreads them. The products' bytes are the same
# (OpenBLAS packs the same values); on the 2-core AMX Xeon the input gradient's products took 6-8% less time
# (bench/packed_gemm.py, docs/engine.md), for 64 bytes more per weight row
WEIGHT_ROW_PAD = 16
GROUPS = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",),
          "gate_up": ("gate_proj", "up_proj"), "down": ("down_proj",)}


def accumulate_weight_grad(grad, dy, x, accumulate):
    """grad [M,K] (=|+=) dy.T [M,N] @ x [N,K], in place through numpy's BLAS when accumulating."""
    if accumulate:
        blas.accumulate_at_b(grad, dy, x)
    else:
        blas.matmul(dy.T, x, out=grad)


def rope_tables(config):
    """cos and sin [P, D/2] float32 of the rotary angles, computed in float64."""
    D = config.head_dimension
    inv_freq = 1.0 / (config.rope_theta ** (np.arange(0, D, 2, dtype=np.float64) / D))
    if config.rope_scaling is not None:
        inv_freq = llama3_frequencies(inv_freq, *config.rope_scaling[1:])
    angles = np.outer(np.arange(config.maximum_context, dtype=np.float64), inv_freq)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)  # [P, D/2]


def llama3_frequencies(inv_freq, factor, low_freq_factor, high_freq_factor, original_context):
    """Llama 3.1's rotary scaling (transformers' _compute_llama3_parameters): long wavelengths are
    divided by `factor`, short ones kept, those between interpolated smoothly."""
    low_wavelength = original_context / low_freq_factor
    high_wavelength = original_context / high_freq_factor
    wavelength = 2 * np.pi / inv_freq
    scaled = np.where(wavelength > low_wavelength, inv_freq / factor, inv_freq)
    smooth = (original_context / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelength < high_wavelength) & ~(wavelength > low_wavelength)
    return np.where(medium, smoothed, scaled)


class Block:
    """The arrays of one decoder block; the named Parameters are views into them."""

    def __init__(self, index, config):
        C, F, D = config.model_width, config.feed_forward_width, config.head_dimension
        H, KV = config.head_count, config.kv_heads
        prefix = f"model.layers.{index}."
        self.qkv = np.zeros(((H + 2 * KV) * D, C), dtype=np.float32)  # [(H+2KV)D, C]
        self.gate_up = np.zeros((2 * F, C), dtype=np.float32)  # [2F, C]
        self.o = Parameter(prefix + "self_attn.o_proj.weight", np.zeros((C, H * D), np.float32), None)
        self.down = Parameter(prefix + "mlp.down_proj.weight", np.zeros((C, F), np.float32), None)
        self.ln1 = Parameter(prefix + "input_layernorm.weight", np.ones(C, np.float32), None)
        self.ln2 = Parameter(prefix + "post_attention_layernorm.weight", np.ones(C, np.float32), None)
        q_rows, kv_rows = H * D, KV * D
        self.q = Parameter(prefix + "self_attn.q_proj.weight", self.qkv[:q_rows], None)
        self.k = Parameter(prefix + "self_attn.k_proj.weight", self.qkv[q_rows:q_rows + kv_rows], None)
        self.v = Parameter(prefix + "self_attn.v_proj.weight", self.qkv[q_rows + kv_rows:], None)
        self.gate = Parameter(prefix + "mlp.gate_proj.weight", self.gate_up[:F], None)
        self.up = Parameter(prefix + "mlp.up_proj.weight", self.gate_up[F:], None)
        self.qkv_bias = self.q_bias = self.k_bias = self.v_bias = None
        if config.attention_bias:  # Qwen2: one fused bias vector, the named biases are views
            self.qkv_bias = np.zeros((H + 2 * KV) * D, dtype=np.float32)
            self.q_bias = Parameter(prefix + "self_attn.q_proj.bias", self.qkv_bias[:q_rows], None)
            self.k_bias = Parameter(prefix + "self_attn.k_proj.bias", self.qkv_bias[q_rows:q_rows + kv_rows], None)
            self.v_bias = Parameter(prefix + "self_attn.v_proj.bias", self.qkv_bias[q_rows + kv_rows:], None)
        self.q_norm = self.k_norm = None
        if config.qk_norm:  # Qwen3: RMSNorm over each head's D values of q and k
            self.q_norm = Parameter(prefix + "self_attn.q_norm.weight", np.ones(D, np.float32), None)
            self.k_norm = Parameter(prefix + "self_attn.k_norm.weight", np.ones(D, np.float32), None)
        self.qkv_grad = None
        self.qkv_bias_grad = None
        self.gate_up_grad = None
        self.bf16 = None  # {group: bfloat16 bits of its frozen weight} under base_precision "bfloat16"
        # projection -> (fused output it writes, output columns); the input is the
        # fused product's input
        self.layout = {
            "q_proj": ("qkv", slice(0, q_rows)),
            "k_proj": ("qkv", slice(q_rows, q_rows + kv_rows)),
            "v_proj": ("qkv", slice(q_rows + kv_rows, q_rows + 2 * kv_rows)),
            "o_proj": ("o", slice(0, C)),
            "gate_proj": ("gate_up", slice(0, F)),
            "up_proj": ("gate_up", slice(F, 2 * F)),
            "down_proj": ("down", slice(0, C)),
        }
        self.lora = {}  # projection name -> LoraAdapter
        # group -> [out + n*r, in] with padded rows: a dense float32 group's frozen weight and, below its rows, a copy
        # of its adapters' A matrices; the base's named parameters are views into it (fuse_adapters)
        self.fused = {}
        self.widen = True  # False: the adapters' down products and input gradient as separate products

    def projection(self, name):
        return {"q_proj": self.q, "k_proj": self.k, "v_proj": self.v, "o_proj": self.o,
                "gate_proj": self.gate, "up_proj": self.up, "down_proj": self.down}[name]

    def dense_weight(self, group):
        """The FP32 matrix behind `group`, or None once the block is quantized."""
        return {"qkv": self.qkv, "o": self.o.value, "gate_up": self.gate_up,
                "down": self.down.value}[group]

    def _tiles(self, group, extra=None):
        """The group's rows in tiles of at most NF4_TILE_ELEMENTS: (first output column, scratch [rows, in]
        holding those rows dequantized). The projections' rows follow each other in the group's output columns
        (q, k, v; gate, up), so a tile may span two projections: one product per tile, as wide as the scratch.
        With extra [e, in] (the adapters' stacked A) the last tile's scratch carries those rows after its own:
        [rows + e, in], so its product also gives x @ extra.T in the e columns after the group's."""
        names = GROUPS[group]
        cols = self.projection(names[0]).quantized.shape[1]
        total = sum(self.projection(name).quantized.shape[0] for name in names)
        tile = max(1, min(NF4_TILE_ELEMENTS // cols, total))
        extra_rows = 0 if extra is None else extra.shape[0]
        scratch = np.empty((tile + extra_rows, cols), np.float32)
        for first in range(0, total, tile):
            last = min(first + tile, total)
            for name in names:
                nf4, columns = self.projection(name).quantized, self.layout[name][1]
                start, end = max(first, columns.start), min(last, columns.stop)
                if start < end:
                    quantization.dequantize_rows(nf4, start - columns.start, end - columns.start,
                                                 scratch[start - first:end - first])
            rows = last - first
            if last == total and extra_rows:
                scratch[rows:rows + extra_rows] = extra
                rows += extra_rows
            yield first, scratch[:rows]

    def fuse_adapters(self, row_pad=WEIGHT_ROW_PAD):
        """Keep each adapted group's frozen float32 weight and a copy of its adapters' A matrices in one matrix, the
        base's rows first and then A_1; ..; A_n, each row followed by row_pad unused floats (WEIGHT_ROW_PAD), the
        base's named parameters becoming views into it. One product x @ M.T then computes the projection and every
        adapter's x @ A_i.T in one pass over x, and one [dy | du] @ M the input gradient through both (project,
        project_backward). The A rows are copied in from the adapters' own arrays before each forward product
        (_stacked_adapters), so the optimizer and checkpoint loads keep updating contiguous arrays of their own.
        For a dense float32 base; an NF4 group's last tile carries the A rows instead (_tiles), and bfloat16
        copies keep separate products."""
        for group in GROUPS:
            adapters = self._group_adapters(group)
            weight = self.dense_weight(group)
            if not adapters or weight is None or group in self.fused:
                continue
            out, width = weight.shape
            rows = out + sum(adapter.A.value.shape[0] for _, adapter, _ in adapters)
            fused = np.empty((rows, width + row_pad), np.float32)[:, :width]  # a row stride of width + row_pad
            fused[:out] = weight
            for name in GROUPS[group]:
                self.projection(name).value = fused[self.layout[name][1]]
            if group in ("qkv", "gate_up"):
                setattr(self, group, fused[:out])
            self.fused[group] = fused
            self._stacked_adapters(group)

    def _stacked_adapters(self, group):
        """[A_1; ..; A_n] of a fused group: its matrix's last rows, refreshed from the adapters' arrays."""
        fused = self.fused[group]
        row = fused.shape[0] - self._adapter_rows(group)
        stacked = fused[row:]
        for _, adapter, _ in self._group_adapters(group):
            rank = adapter.A.value.shape[0]
            fused[row:row + rank] = adapter.A.value
            row += rank
        return stacked

    def separate_adapter_products(self):
        """Compute the adapters' down products and input gradient as products of their own from here on (dense
        and NF4 alike): the path before the fusion, for bench/lora_fusion.py and the tests that compare the two."""
        self._unfuse_adapters()
        self.widen = False

    def _unfuse_adapters(self):
        """Products without the fused matrices from here on (the adapters' A arrays were always their own)."""
        self.fused = {}

    def _fused(self, group):
        """The group's fused matrix when its products go through it, else None."""
        return self.fused.get(group) if self.bf16 is None else None

    def _widened(self, group):
        """Whether the group's products carry its adapters' A rows: a fused dense group, or NF4 tiles (the last
        tile's scratch gets them). Then its output and output gradient have n*r columns more, the adapters'."""
        if self.bf16 is not None or not self.widen or not self._group_adapters(group):
            return False
        return group in self.fused or self.projection(GROUPS[group][0]).quantized is not None

    def _adapter_rows(self, group):
        return sum(adapter.A.value.shape[0] for _, adapter, _ in self._group_adapters(group))

    def output_grad(self, group, rows):
        """An uninitialised [rows, out] array for the gradient at the group's output. For a widened group it is
        the first columns of a [rows, out + n*r] array, where project_backward writes du with no copy of dy."""
        out = sum(self.projection(name).shape[0] for name in GROUPS[group])
        if not self._widened(group):
            return np.empty((rows, out), np.float32)
        return np.empty((rows, out + self._adapter_rows(group)), np.float32)[:, :out]

    def project(self, group, x, bias=None):
        """(y [N,out], saved): x [N,in] @ W.T (+ bias) plus the group's adapters, and what project_backward needs.
        For a widened group y is the first columns of an [N, out + n*r] output whose last columns the same
        product (or the last NF4 tile's) filled with u = x @ [A_1; ..].T (rows strided)."""
        if not self._widened(group):
            y = self._biased(self.base_forward(group, x), bias)
            return y, self.lora_forward(group, x, y)
        fused = self._fused(group)
        if fused is not None:
            stacked = self._stacked_adapters(group)  # the A rows as they are now, which the backward reads too
            wide = blas.matmul(x, fused.T)  # [N, out + n*r]
        else:
            stacked = np.concatenate([adapter.A.value for _, adapter, _ in self._group_adapters(group)])
            wide = self.base_forward(group, x, stacked)
        out = wide.shape[1] - stacked.shape[0]
        y, u = wide[:, :out], np.ascontiguousarray(wide[:, out:])
        self._biased(y, bias)
        return y, self.lora_forward(group, x, y, u, stacked)

    @staticmethod
    def _biased(y, bias):
        if bias is not None:
            y += bias
        return y

    def project_backward(self, group, x, dy, saved):
        """dx [N,in] from dy [N,out], the gradient at project(group, x)'s output, through the base and the
        group's adapters, whose gradients accumulate. dy from output_grad(group) needs no copy when widened."""
        if saved is None or not self._widened(group):
            dx = self.base_input_grad(group, dy)
            self.lora_backward(group, x, dy, dx, saved)
            return dx
        N, out = dy.shape
        width = out + self._adapter_rows(group)
        wide = dy.base
        if not (wide is not None and wide.shape == (N, width) and wide.flags.c_contiguous
                and wide.__array_interface__["data"][0] == dy.__array_interface__["data"][0]):
            wide = np.empty((N, width), np.float32)
            wide[:, :out] = dy
        self.lora_backward(group, x, dy, None, saved, du=wide[:, out:])
        fused = self._fused(group)
        if fused is not None:
            return blas.matmul(wide, fused)  # dy @ W + du @ [A_1; ..; A_n]
        return self.base_input_grad(group, wide, saved[1])  # the A the forward used (no step in between)

    def freeze_bf16(self):
        """Keep the bfloat16 bits of each frozen group weight: base products read them from here on."""
        self.bf16 = {group: bf16.to_bf16(self.dense_weight(group)) for group in GROUPS}

    def base_forward(self, group, x, extra=None):
        """x [N,in] @ W.T for the projections writing `group`: one fused product (float32, or from
        bfloat16 operands under base_precision "bfloat16"), or NF4 tiles. For NF4 tiles, extra [e,in] (the
        adapters' stacked A) adds e columns to the output, x @ extra.T, from the last tile's product."""
        if self.bf16 is not None:
            weight = self.bf16[group]  # [out,in]
            y = np.empty((x.shape[0], weight.shape[0]), np.float32)
            onednn.gemm(y, bf16.to_bf16(x), weight, trans_b=True)
            return y
        weight = self.dense_weight(group)
        if weight is not None:
            return blas.matmul(x, weight.T)
        total = sum(self.projection(name).shape[0] for name in GROUPS[group])
        y = np.empty((x.shape[0], total + (0 if extra is None else extra.shape[0])), np.float32)  # [N,out(+e)]
        for first, scratch in self._tiles(group, extra):
            # the product lands in y's columns directly (no temporary, no copy)
            blas.gemm(y[:, first:first + scratch.shape[0]], x, scratch, trans_b=True)
        return y

    def base_input_grad(self, group, dy, extra=None):
        """dy [N,out] @ W: the input gradient through the frozen (or trainable) base. For NF4 tiles with extra
        [e,in], dy is [N, out + e] and its last e columns multiply extra (the last tile's product)."""
        if self.bf16 is not None:
            weight = self.bf16[group]  # [out,in]
            dx = np.empty((dy.shape[0], weight.shape[1]), np.float32)
            onednn.gemm(dx, bf16.to_bf16(dy), weight)
            return dx
        weight = self.dense_weight(group)
        if weight is not None:
            return blas.matmul(dy, weight)
        dx = None
        for first, scratch in self._tiles(group, extra):
            if dx is None:
                dx = np.empty((dy.shape[0], scratch.shape[1]), np.float32)  # [N,in], written by the first tile
            blas.gemm(dx, dy[:, first:first + scratch.shape[0]], scratch, beta=0.0 if first == 0 else 1.0)
        return dx

    def quantize(self, block_size, double_quantization):
        self._unfuse_adapters()
        for name in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
            p = self.projection(name)
            p.quantized = quantization.quantize_nf4(np.ascontiguousarray(p.value), block_size=block_size,
                                                    double_quantization=double_quantization)
            p.value = None
            p.grad = None
        self.qkv = self.gate_up = None

    def _group_adapters(self, group):
        """[(projection, adapter, output columns)] of the adapters whose projection writes `group`."""
        return [(name, adapter, self.layout[name][1]) for name, adapter in self.lora.items()
                if self.layout[name][0] == group]

    def lora_forward(self, group, x, y, u=None, stacked=None):
        """Add the adapters of the projections writing `group` to y; returns (adapters, [A_1; ..], u).

        u = x @ [A_1; ..; A_n].T [N, n*r], one product that reads x once for every adapter of the group,
        unless the caller computed it with the stacked A it used (a widened group's product, project), and
        each s * u_i @ B_i.T is accumulated by BLAS straight into its columns of y (alpha = s, beta = 1): no
        [N, out] temporary and no element-wise pass over y.
        """
        adapters = self._group_adapters(group)
        if not adapters:
            return None
        if stacked is None:
            stacked = np.concatenate([adapter.A.value for _, adapter, _ in adapters])  # [n*r, in]
        if u is None:
            u = blas.matmul(x, stacked.T)  # [N, n*r]
        r = adapters[0][1].A.value.shape[0]
        for j, (_, adapter, columns) in enumerate(adapters):
            blas.gemm(y[:, columns], u[:, j * r:(j + 1) * r], adapter.B.value, trans_b=True,
                      alpha=adapter.scaling, beta=1.0)
        return adapters, stacked, u

    def lora_backward(self, group, x, dy, dx, saved, du=None):
        """Adapter gradients of `group` from dy [N,out_total]; adds their input gradient to dx.

        Per adapter, BLAS reads dy's columns in place with alpha = s: dB (=|+=) s * dy_i.T @ u_i and
        du_i = s * dy_i @ B_i; then one product each for every adapter of the group:
        [dA_1; ..] = du.T @ x and dx += du @ [A_1; ..]. du [N, n*r] may be given (columns beside a fused
        group's dy, project_backward), and dx None: the caller's product adds du @ [A_1; ..] then.
        """
        if saved is None:
            return
        adapters, stacked, u = saved
        r = stacked.shape[0] // len(adapters)
        if du is None:
            du = np.empty((dy.shape[0], stacked.shape[0]), np.float32)  # [N, n*r]
        for j, (_, adapter, columns) in enumerate(adapters):
            rank = slice(j * r, (j + 1) * r)
            blas.gemm(adapter.B.grad, dy[:, columns], u[:, rank], trans_a=True, alpha=adapter.scaling,
                      beta=1.0 if adapter.B.pending else 0.0)  # [out,r]
            adapter.B.pending = True
            blas.gemm(du[:, rank], dy[:, columns], adapter.B.value, alpha=adapter.scaling)  # [N,r]
        dA = blas.matmul(du.T, x)  # [n*r, in]
        for j, (_, adapter, _) in enumerate(adapters):
            if adapter.A.pending:
                adapter.A.grad += dA[j * r:(j + 1) * r]
            else:
                adapter.A.grad[...] = dA[j * r:(j + 1) * r]
            adapter.A.pending = True
        if dx is not None:
            blas.gemm(dx, du, stacked, beta=1.0)  # dx += du @ [A_1; ..]

    def parameters(self):
        # Hugging Face Llama order within a block (trainer.checkpoint_format.parameter_signature)
        extra = [p for p in (self.q_bias, self.k_bias, self.v_bias, self.q_norm, self.k_norm) if p is not None]
        return [self.q, self.k, self.v, self.o, *extra, self.gate, self.up, self.down, self.ln1, self.ln2]

    def allocate_grads(self):
        H = self.q.value.shape[0]
        KVD = self.k.value.shape[0]
        F = self.gate.value.shape[0]
        self.qkv_grad = np.zeros_like(self.qkv)
        self.gate_up_grad = np.zeros_like(self.gate_up)
        self.q.grad = self.qkv_grad[:H]
        self.k.grad = self.qkv_grad[H:H + KVD]
        self.v.grad = self.qkv_grad[H + KVD:]
        self.gate.grad = self.gate_up_grad[:F]
        self.up.grad = self.gate_up_grad[F:]
        for p in (self.o, self.down, self.ln1, self.ln2):
            p.grad = np.zeros_like(p.value)
        if self.qkv_bias is not None:
            self.qkv_bias_grad = np.zeros_like(self.qkv_bias)
            self.q_bias.grad = self.qkv_bias_grad[:H]
            self.k_bias.grad = self.qkv_bias_grad[H:H + KVD]
            self.v_bias.grad = self.qkv_bias_grad[H + KVD:]
        for p in (self.q_norm, self.k_norm):
            if p is not None:
                p.grad = np.zeros_like(p.value)


@dataclass
class BlockActivations:
    """What block_forward saves for block_backward (one block, one batch)."""

    batch: int  # B
    time: int  # T
    x: np.ndarray  # [N,C] block input
    h1: np.ndarray  # [N,C] input_layernorm output
    rstd1: np.ndarray  # [N] its reciprocal RMS
    q: np.ndarray  # [G,T*g,D] rotated queries
    k: np.ndarray  # [G,S,D] rotated keys (S = T, or the cached prefix and T)
    v: np.ndarray  # [G,S,D] values
    att: np.ndarray  # [G,T*g,D] attention output per head group
    saved: np.ndarray  # dense: probabilities [G,T*g,S]; tiled: logsumexp [G,T*g]
    attn: np.ndarray  # [N,H*D] attention output in projection layout
    x_mid: np.ndarray  # [N,C] residual after attention
    h2: np.ndarray  # [N,C] post_attention_layernorm output
    rstd2: np.ndarray  # [N] its reciprocal RMS
    gate_up: np.ndarray  # [N,2F] gate and up projections
    act: np.ndarray  # [N,F] SwiGLU output
    lora_qkv: tuple  # (adapters, stacked A, x @ A.T [N, n*r]) of the group's adapters, or None
    lora_o: tuple
    lora_gate_up: tuple
    lora_down: tuple
    q_normed: tuple = None  # qk_norm: (pre-norm queries [N*H,D], reciprocal RMS [N*H])
    k_normed: tuple = None  # qk_norm: (pre-norm keys [N*KV,D], reciprocal RMS [N*KV])


def _head_norm_forward(heads, norm, epsilon):
    """RMSNorm over each head's D values: heads [B,T,h,D] (a view) -> (normed [B,T,h,D], (input, rstd))."""
    B, T, h, D = heads.shape
    raw = np.ascontiguousarray(heads).reshape(B * T * h, D)  # [N*h,D]
    normed = np.empty_like(raw)
    rstd = np.empty(raw.shape[0], np.float32)
    kernels.rmsnorm_forward(raw, norm.value, epsilon, normed, rstd)
    return normed.reshape(B, T, h, D), (raw, rstd)


def _head_norm_backward(dnormed, saved, norm, trainable, out):
    """dnormed [B,T,h,D] -> the pre-norm gradient written to out (a [B,T,h,D] view)."""
    raw, rstd = saved
    draw = np.zeros_like(raw)
    rmsnorm_backward(dnormed.reshape(raw.shape), raw, norm, rstd, draw, trainable)
    out[...] = draw.reshape(out.shape)


def _residual(y, x):
    """y + x as a C-contiguous [N,C] array: y itself, in place, unless y is the first columns of a fused group's
    wider product output; then a new array (the same sums: IEEE addition commutes)."""
    if y.flags.c_contiguous:
        y += x
        return y
    return np.add(y, x)


def window_limits(config, past, T):
    """The sliding window when it hides any key from a query at positions past..past+T-1, else None."""
    window = config.sliding_window
    return window if window is not None and past + T > window else None


def block_forward(block, x, config, rope, B, T, kv=None):
    """One block on x [N,C] -> (output [N,C], BlockActivations).

    rope is (cos, sin) from rope_tables. With kv (keys [G,P,D], values [G,P,D], past) the
    new keys and values are written at positions past.. and attention reads the whole prefix.
    """
    past = 0 if kv is None else kv[2]
    H, KV, D = config.head_count, config.kv_heads, config.head_dimension
    g, N = H // KV, B * T
    assert x.shape == (N, config.model_width), f"block input {x.shape} is not [B*T, C] = [{N}, {config.model_width}]"
    cos, sin = rope
    h1 = np.empty_like(x)  # [N,C]
    rstd1 = np.empty(N, np.float32)
    kernels.rmsnorm_forward(x, block.ln1.value, config.norm_epsilon, h1, rstd1)
    qkv, lora_qkv = block.project("qkv", h1, block.qkv_bias)  # [N,(H+2KV)D]
    qkv4 = qkv.reshape(B, T, H + 2 * KV, D)
    q = np.empty((B, KV, T, g, D), np.float32)
    k = np.empty((B, KV, T, 1, D), np.float32)
    q_in, k_in, q_normed, k_normed = qkv4[:, :, :H], qkv4[:, :, H:H + KV], None, None
    if block.q_norm is not None:
        q_in, q_normed = _head_norm_forward(q_in, block.q_norm, config.norm_epsilon)
        k_in, k_normed = _head_norm_forward(k_in, block.k_norm, config.norm_epsilon)
    kernels.rope_forward(q_in, cos, sin, past, q)
    kernels.rope_forward(k_in, cos, sin, past, k)
    v = np.ascontiguousarray(qkv4[:, :, H + KV:].transpose(0, 2, 1, 3))  # [B,KV,T,D]
    q3, k3, v3 = q.reshape(B * KV, T * g, D), k.reshape(B * KV, T, D), v.reshape(B * KV, T, D)
    if kv is not None:
        keys, values, _ = kv  # [G,P,D] caches
        keys[:, past:past + T] = k3
        values[:, past:past + T] = v3
        k3, v3 = keys[:, :past + T], values[:, :past + T]
    scale = 1.0 / np.sqrt(D)
    window = window_limits(config, past, T)
    if config.attention_algorithm == "dense":
        att, saved = attention.dense_forward(q3, k3, v3, scale, g, past, window)
    else:
        att, saved = attention.tiled_forward(q3, k3, v3, scale, g, config.attention_block_size, past, window)
    attn = att.reshape(B, KV, T, g, D).transpose(0, 2, 1, 3, 4).reshape(N, H * D)  # [N,HD]
    o_out, lora_o = block.project("o", attn)  # [N,C]
    x_mid = _residual(o_out, x)
    h2 = np.empty_like(x)
    rstd2 = np.empty(N, np.float32)
    kernels.rmsnorm_forward(x_mid, block.ln2.value, config.norm_epsilon, h2, rstd2)
    gate_up, lora_gate_up = block.project("gate_up", h2)  # [N,2F]
    act = np.empty((N, config.feed_forward_width), np.float32)
    kernels.swiglu_forward(gate_up, act)
    down_out, lora_down = block.project("down", act)  # [N,C]
    x_out = _residual(down_out, x_mid)
    saved_activations = BlockActivations(
        batch=B, time=T, x=x, h1=h1, rstd1=rstd1, q=q3, k=k3, v=v3, att=att, saved=saved,
        attn=attn, x_mid=x_mid, h2=h2, rstd2=rstd2, gate_up=gate_up, act=act,
        lora_qkv=lora_qkv, lora_o=lora_o, lora_gate_up=lora_gate_up, lora_down=lora_down,
        q_normed=q_normed, k_normed=k_normed)
    return x_out, saved_activations


def rmsnorm_backward(dout, x, weight, rstd, dx, trainable):
    """dx [N,C] += the input gradient of RMSNorm; weight.grad [C] accumulates when trainable."""
    if trainable:
        if not weight.pending:
            weight.grad.fill(0.0)
        kernels.rmsnorm_backward(dout, x, weight.value, rstd, dx, weight.grad)
        weight.pending = True
    else:
        scratch = np.zeros_like(weight.value)
        kernels.rmsnorm_backward(dout, x, weight.value, rstd, dx, scratch)


def _weight_grad(params, grad, dy, x, trainable):
    """The fused grad [out,in] of params (=|+=) dy.T @ x when trainable; marks them pending."""
    if trainable:
        accumulate_weight_grad(grad, dy, x, params[0].pending)
        for p in params:
            p.pending = True


def block_backward(block, acts, d, config, rope, trainable):
    """d [N,C]: gradient at the block output, turned in place into the input gradient.

    Weight gradients of a trainable base and of the block's adapters accumulate into
    their buffers; `acts` is what block_forward saved for this block and batch.
    """
    assert isinstance(acts, BlockActivations), "forward before backward: no saved activations"
    B, T = acts.batch, acts.time
    H, KV, D = config.head_count, config.kv_heads, config.head_dimension
    g, N = H // KV, B * T
    assert d.shape == acts.x.shape, f"output gradient {d.shape} does not match the block input {acts.x.shape}"
    cos, sin = rope
    # MLP
    dact = block.project_backward("down", acts.act, d, acts.lora_down)  # [N,F]
    _weight_grad([block.down], block.down.grad, d, acts.act, trainable)
    dgate_up = block.output_grad("gate_up", N)  # [N,2F]
    kernels.swiglu_backward(dact, acts.gate_up, dgate_up)
    _weight_grad([block.gate, block.up], block.gate_up_grad, dgate_up, acts.h2, trainable)
    dh2 = block.project_backward("gate_up", acts.h2, dgate_up, acts.lora_gate_up)  # [N,C]
    rmsnorm_backward(dh2, acts.x_mid, block.ln2, acts.rstd2, d, trainable)
    # attention
    dattn = block.project_backward("o", acts.attn, d, acts.lora_o)  # [N,HD]
    _weight_grad([block.o], block.o.grad, d, acts.attn, trainable)
    datt = np.ascontiguousarray(
        dattn.reshape(B, T, KV, g, D).transpose(0, 2, 1, 3, 4)).reshape(B * KV, T * g, D)  # [G,T*g,D]
    scale = 1.0 / np.sqrt(D)
    if config.attention_algorithm == "dense":
        dq, dk, dv = attention.dense_backward(datt, acts.q, acts.k, acts.v, acts.saved, scale)
    else:
        dq, dk, dv = attention.tiled_backward(datt, acts.q, acts.k, acts.v, acts.att, acts.saved,
                                              scale, g, config.attention_block_size, 0,
                                              window_limits(config, 0, T))
    dqkv = block.output_grad("qkv", N)  # [N,(H+2KV)D]
    dqkv4 = dqkv.reshape(B, T, H + 2 * KV, D)
    if block.q_norm is None:
        kernels.rope_backward(dq.reshape(B, KV, T, g, D), cos, sin, 0, dqkv4[:, :, :H])
        kernels.rope_backward(dk.reshape(B, KV, T, 1, D), cos, sin, 0, dqkv4[:, :, H:H + KV])
    else:
        dq_normed = np.empty((B, T, H, D), np.float32)
        dk_normed = np.empty((B, T, KV, D), np.float32)
        kernels.rope_backward(dq.reshape(B, KV, T, g, D), cos, sin, 0, dq_normed)
        kernels.rope_backward(dk.reshape(B, KV, T, 1, D), cos, sin, 0, dk_normed)
        _head_norm_backward(dq_normed, acts.q_normed, block.q_norm, trainable, dqkv4[:, :, :H])
        _head_norm_backward(dk_normed, acts.k_normed, block.k_norm, trainable, dqkv4[:, :, H:H + KV])
    dqkv4[:, :, H + KV:] = dv.reshape(B, KV, T, D).transpose(0, 2, 1, 3)
    _weight_grad([block.q, block.k, block.v], block.qkv_grad, dqkv, acts.h1, trainable)
    if trainable and block.qkv_bias is not None:
        bias_sum = np.sum(dqkv, axis=0, dtype=np.float32)  # [(H+2KV)D]
        if block.q_bias.pending:
            block.qkv_bias_grad += bias_sum
        else:
            block.qkv_bias_grad[...] = bias_sum
        for p in (block.q_bias, block.k_bias, block.v_bias):
            p.pending = True
    dh1 = block.project_backward("qkv", acts.h1, dqkv, acts.lora_qkv)  # [N,C]
    rmsnorm_backward(dh1, acts.x, block.ln1, acts.rstd1, d, trainable)
