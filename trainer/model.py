"""DecoderOnlyTransformer: one Llama-family decoder with explicit forward/backward passes.

Dimension letters: B batch, T time, N = B*T rows, C model width, H query heads, KV
key/value heads, g = H/KV, D head size, F feed-forward width, V vocabulary.
Parameter names are Hugging Face Llama's. The q/k/v projections of a block share one
fused [(H+2KV)*D, C] matrix and gate/up share one [2F, C] matrix; the named parameters
are row views into them, so one matrix product serves three (or two) projections.
"""

import numpy as np

from native_ext import blas, kernels
from trainer import attention
from trainer.config import TransformerConfig
from trainer.lora import LoraAdapter, LoraConfig
from trainer.parameters import Parameter, ParameterList
from trainer.quantization import NF4Tensor, dequantize_nf4, dequantize_rows, quantize_nf4
from trainer.runtime import tune_allocator


IGNORE_INDEX = -100  # target id that contributes no loss (padding, prompt tokens)
NF4_SCRATCH_ELEMENTS = 1 << 17  # at most 512 KiB of dequantized rows at a time
GROUPS = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",),
          "gate_up": ("gate_proj", "up_proj"), "down": ("down_proj",)}


def accumulate_weight_grad(grad, dy, x, accumulate):
    """grad [M,K] (=|+=) dy.T [M,N] @ x [N,K], in place through numpy's BLAS when accumulating."""
    if accumulate:
        blas.accumulate_at_b(grad, dy, x)
    else:
        np.matmul(dy.T, x, out=grad)


class _Block:
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
        self.qkv_grad = None
        self.gate_up_grad = None
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

    def projection(self, name):
        return {"q_proj": self.q, "k_proj": self.k, "v_proj": self.v, "o_proj": self.o,
                "gate_proj": self.gate, "up_proj": self.up, "down_proj": self.down}[name]

    def dense_weight(self, group):
        """The FP32 matrix behind `group`, or None once the block is quantized."""
        return {"qkv": self.qkv, "o": self.o.value, "gate_up": self.gate_up,
                "down": self.down.value}[group]

    def _tiles(self, group):
        """(projection offset in the group's output, NF4 weight, row tile) per projection."""
        for name in GROUPS[group]:
            weight = self.projection(name).quantized
            rows, cols = weight.shape
            # bounded scratch, and never a whole weight's rows at once
            tile = max(1, min(NF4_SCRATCH_ELEMENTS // cols, (rows + 1) // 2))
            yield self.layout[name][1].start, weight, tile

    def base_forward(self, group, x):
        """x [N,in] @ W.T for the projections writing `group`: one fused product, or NF4 tiles."""
        weight = self.dense_weight(group)
        if weight is not None:
            return np.matmul(x, weight.T)
        total = sum(self.projection(name).shape[0] for name in GROUPS[group])
        y = np.empty((x.shape[0], total), np.float32)  # [N,out]
        for offset, nf4, tile in self._tiles(group):
            rows, cols = nf4.shape
            scratch = np.empty((tile, cols), np.float32)
            for start in range(0, rows, tile):
                end = min(start + tile, rows)
                dequantize_rows(nf4, start, end, scratch[:end - start])
                y[:, offset + start:offset + end] = np.matmul(x, scratch[:end - start].T)
        return y

    def base_input_grad(self, group, dy):
        """dy [N,out] @ W: the input gradient through the frozen (or trainable) base."""
        weight = self.dense_weight(group)
        if weight is not None:
            return np.matmul(dy, weight)
        dx = None
        for offset, nf4, tile in self._tiles(group):
            rows, cols = nf4.shape
            if dx is None:
                dx = np.zeros((dy.shape[0], cols), np.float32)  # [N,in]
            scratch = np.empty((tile, cols), np.float32)
            for start in range(0, rows, tile):
                end = min(start + tile, rows)
                dequantize_rows(nf4, start, end, scratch[:end - start])
                dx += np.matmul(dy[:, offset + start:offset + end], scratch[:end - start])
        return dx

    def quantize(self, block_size, double_quantization):
        for name in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
            p = self.projection(name)
            p.quantized = quantize_nf4(np.ascontiguousarray(p.value), block_size=block_size,
                                       double_quantization=double_quantization)
            p.value = None
            p.grad = None
        self.qkv = self.gate_up = None

    def lora_forward(self, group, x, y):
        """Add the adapters of the projections writing `group` to y; returns x @ A.T per adapter."""
        saved = {}
        for name, adapter in self.lora.items():
            target, columns = self.layout[name]
            if target != group:
                continue
            u = np.matmul(x, adapter.A.value.T)  # [N,r]
            delta = np.matmul(u, adapter.B.value.T)  # [N,out]
            delta *= adapter.scaling
            y[:, columns] += delta
            saved[name] = u
        return saved

    def lora_backward(self, group, x, dy, dx, saved):
        """Adapter gradients of `group` from dy [N,out_total]; adds their input gradient to dx."""
        for name, u in saved.items():
            adapter = self.lora[name]
            _, columns = self.layout[name]
            dy_scaled = dy[:, columns] * adapter.scaling  # [N,out]
            accumulate_weight_grad(adapter.B.grad, dy_scaled, u, adapter.B.pending)  # [out,r]
            adapter.B.pending = True
            du = np.matmul(dy_scaled, adapter.B.value)  # [N,r]
            accumulate_weight_grad(adapter.A.grad, du, x, adapter.A.pending)  # [r,in]
            adapter.A.pending = True
            dx += np.matmul(du, adapter.A.value)

    def parameters(self):
        # Hugging Face Llama order within a block
        return [self.q, self.k, self.v, self.o, self.gate, self.up, self.down, self.ln1, self.ln2]

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


class DecoderOnlyTransformer:
    """A Llama-family decoder that owns its buffers; use it as a context manager."""

    def __init__(self, config: TransformerConfig, initialize: bool = True):
        """initialize=False skips the seeded random init (for a caller that loads every weight)."""
        if not isinstance(config, TransformerConfig):
            raise TypeError("config must be a TransformerConfig")
        tune_allocator()
        self.config = config
        C, V = config.model_width, config.vocabulary_size
        self._embed = Parameter("model.embed_tokens.weight", np.zeros((V, C), np.float32), None)
        self._blocks = [_Block(i, config) for i in range(config.block_count)]
        self._norm = Parameter("model.norm.weight", np.ones(C, np.float32), None)
        self._lm_head = None if config.tie_embeddings else Parameter(
            "lm_head.weight", np.zeros((V, C), np.float32), None)
        self._base = [self._embed]
        for block in self._blocks:
            self._base.extend(block.parameters())
        self._base.append(self._norm)
        if self._lm_head is not None:
            self._base.append(self._lm_head)
        self._by_name = {p.name: p for p in self._base}
        self._base_trainable = True
        self._grads_allocated = False
        self.lora_config = None
        self._adapters = []
        self._quantization = None
        self._closed = False
        if initialize:
            self._initialize(config.initializer_seed)
        self._rope_cos, self._rope_sin = self._rope_tables()

    # -- lifetime -------------------------------------------------------------------

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()
        return False

    def close(self):
        """Release every buffer; the model cannot be used afterwards."""
        self._closed = True
        self._blocks = []
        self._base = []
        self._by_name = {}

    def _check_open(self):
        if self._closed:
            raise RuntimeError("the model has been closed; construct a new one")

    # -- parameters -----------------------------------------------------------------

    def _initialize(self, seed):
        rng = np.random.default_rng(seed)  # before quantization every value is FP32
        std = self.config.initializer_range
        for p in self._base:
            if p.value.ndim == 2:
                p.value[...] = rng.standard_normal(p.shape, dtype=np.float32) * np.float32(std)

    def _rope_tables(self):
        D = self.config.head_dimension
        inv_freq = 1.0 / (self.config.rope_theta ** (np.arange(0, D, 2, dtype=np.float64) / D))
        angles = np.outer(np.arange(self.config.maximum_context, dtype=np.float64), inv_freq)
        return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)  # [P, D/2]

    def parameters(self) -> ParameterList:
        """The complete, ordered base parameter list (a context manager)."""
        self._check_open()
        self._ensure_base_grads()
        return ParameterList(self._base, owner=self, kind="base")

    def _ensure_base_grads(self):
        if self._grads_allocated or not self._base_trainable:
            return
        for block in self._blocks:
            block.allocate_grads()
        for p in (self._embed, self._norm, self._lm_head):
            if p is not None:
                p.grad = np.zeros_like(p.value)
        self._grads_allocated = True

    def _optimizable(self, kind):
        """The complete list an optimizer of `kind` ("base" or "adapter") must own."""
        if kind == "base":
            if self._quantization is not None:
                raise ValueError("a quantized base is frozen; attach LoRA and optimise "
                                 "model.adapter_parameters()")
            if self.lora_config is not None:
                raise ValueError("the base is frozen while a LoRA adapter is attached; "
                                 "optimise model.adapter_parameters()")
            return self._base
        if kind == "adapter":
            if self.lora_config is None:
                raise ValueError("no LoRA adapter is attached (call model.attach_lora first)")
            return self._adapters
        raise ValueError(f"unknown parameter kind {kind!r}")

    # -- LoRA ----------------------------------------------------------------------------

    def attach_lora(self, config: LoraConfig):
        """Attach one LoRA adapter per targeted projection and freeze the base."""
        self._check_open()
        if not isinstance(config, LoraConfig):
            raise TypeError("config must be a LoraConfig")
        if self.lora_config is not None:
            raise ValueError("a LoRA adapter is already attached")
        if self.gradient_pending:
            raise RuntimeError("a base gradient is pending; step or zero_gradients first")
        rng = np.random.default_rng(config.initializer_seed)
        adapters = []
        for index, block in enumerate(self._blocks):
            for name in config.targets:
                weight = block.projection(name)
                out_features, in_features = weight.shape
                prefix = weight.name[: -len(".weight")]
                adapter = LoraAdapter(prefix, config.rank, in_features, out_features,
                                      config.scaling, rng)
                block.lora[name] = adapter
                adapters.extend([adapter.A, adapter.B])
        self._adapters = adapters
        self._adapter_by_name = {p.name: p for p in adapters}
        self.lora_config = config
        self._base_trainable = False
        self._release_base_grads()

    # -- QLoRA: packed NF4 Linear bases --------------------------------------------------

    @property
    def quantization(self):
        """None, or {"block_size", "double_quantization"} as requested at quantize()."""
        return self._quantization

    def quantize(self, block_size=64, double_quantization=False):
        """Replace every Linear base weight of the blocks (q/k/v/o, gate/up/down) with NF4.

        Embeddings, norms and the output projection stay FP32, as in QLoRA. The base is
        frozen from here on; forward and backward dequantize bounded row tiles.
        """
        self._check_open()
        if self._quantization is not None:
            raise ValueError("the model is already quantized")
        if self.gradient_pending:
            raise RuntimeError("a gradient is pending; step or zero_gradients first")
        for block in self._blocks:
            block.quantize(block_size, double_quantization)
        self._quantization = {"block_size": block_size, "double_quantization": bool(double_quantization)}
        self._base_trainable = False
        self._release_base_grads()

    def _quantized_parameters(self):
        return [p for p in self._base if p.quantized is not None]

    def packed_state(self) -> dict:
        """{name: NF4 tensor} for every quantized weight (packed nibbles, shapes, scales)."""
        self._check_open()
        return {p.name: p.quantized for p in self._quantized_parameters()}

    def load_packed_state(self, mapping: dict):
        """Replace the packed NF4 bases by name; names and weight shapes are checked first.

        The replacements may use another block size or scale encoding than the current
        ones; no FP32 copy of any weight is made.
        """
        self._check_open()
        current = self._quantized_parameters()
        if not current:
            raise ValueError("the model is not quantized; call model.quantize() first")
        names = {p.name for p in current}
        if set(mapping) != names:
            missing = sorted(names - set(mapping))[:5]
            unknown = sorted(set(mapping) - names)[:5]
            raise KeyError(f"packed state mismatch: missing {missing}, unknown {unknown}")
        for p in current:
            if not isinstance(mapping[p.name], NF4Tensor):
                raise TypeError(f"{p.name}: expected an NF4Tensor, got {type(mapping[p.name]).__name__}")
            if tuple(mapping[p.name].shape) != p.shape:
                raise ValueError(f"{p.name}: packed shape {tuple(mapping[p.name].shape)} "
                                 f"does not match {p.shape}")
        block_sizes = {mapping[p.name].block_size for p in current}
        double = {mapping[p.name].double_quantized for p in current}
        quantization = {"block_size": block_sizes.pop() if len(block_sizes) == 1 else None,
                        "double_quantization": double.pop() if len(double) == 1 else None}
        for p in current:
            p.quantized = mapping[p.name]
        self._quantization = quantization

    def resident_memory(self) -> dict:
        """Bytes held by packed NF4 bases, their FP32 equivalent, FP32 base and adapters."""
        self._check_open()
        quantized = self._quantized_parameters()
        return {
            "packed_bytes": int(sum(p.quantized.nbytes for p in quantized)),
            "fp32_equivalent_bytes": int(sum(p.size * 4 for p in quantized)),
            "dense_base_bytes": int(sum(p.value.nbytes for p in self._base if p.value is not None)),
            "adapter_bytes": int(sum(p.value.nbytes for p in self._adapters)),
        }

    def _release_base_grads(self):
        for p in self._base:
            p.grad = None
            p.pending = False
        for block in self._blocks:
            block.qkv_grad = block.gate_up_grad = None
        self._grads_allocated = False

    def adapter_parameters(self) -> ParameterList:
        """The complete, ordered adapter list (lora_A, lora_B per projection; a context manager)."""
        self._check_open()
        if self.lora_config is None:
            raise ValueError("no LoRA adapter is attached (call model.attach_lora first)")
        return ParameterList(self._adapters, owner=self, kind="adapter")

    def adapter_state_dict(self) -> dict:
        self._check_open()
        return {p.name: p.value.copy() for p in self._adapters}

    def load_adapter_state_dict(self, mapping: dict):
        """Set adapter values by name; every name and shape is checked first."""
        self._check_open()
        if self.lora_config is None:
            raise ValueError("no LoRA adapter is attached")
        missing = [p.name for p in self._adapters if p.name not in mapping]
        unknown = sorted(set(mapping) - set(self._adapter_by_name))
        if missing or unknown:
            raise KeyError(f"adapter state mismatch: missing {missing[:5]}, unknown {unknown[:5]}")
        for p in self._adapters:
            if np.shape(mapping[p.name]) != p.shape:
                raise ValueError(f"{p.name}: shape {np.shape(mapping[p.name])} does not match {p.shape}")
        for p in self._adapters:
            p.value[...] = np.asarray(mapping[p.name], dtype=np.float32)

    @property
    def gradient_pending(self) -> bool:
        self._check_open()
        return any(p.pending for p in self._base) or any(p.pending for p in self._adapters)

    def clear_pending(self):
        for p in self._base:
            p.pending = False
        for p in self._adapters:
            p.pending = False

    def state_dict(self) -> dict:
        """{name: copy of the values} for every base parameter, in order.

        Quantized weights appear dequantized (an inspection copy; training never makes one).
        """
        self._check_open()
        return {p.name: p.value.copy() if p.value is not None else dequantize_nf4(p.quantized)
                for p in self._base}

    def fp32_state_dict(self) -> dict:
        """{name: copy} of the base parameters held in FP32 (all but packed NF4 weights)."""
        self._check_open()
        return {p.name: p.value.copy() for p in self._base if p.value is not None}

    def load_state_dict(self, mapping: dict):
        """Set FP32 base values by name; every name and shape is checked first.

        On a quantized model the mapping covers the FP32 parameters only (embeddings,
        norms, output projection); packed bases are replaced with load_packed_state.
        """
        self._check_open()
        dense = [p for p in self._base if p.value is not None]
        packed = {p.name for p in self._base if p.value is None}
        if packed & set(mapping):
            raise ValueError(f"{sorted(packed & set(mapping))[0]} is quantized; replace packed "
                             "bases with load_packed_state")
        missing = [p.name for p in dense if p.name not in mapping]
        unknown = sorted(set(mapping) - {p.name for p in dense})
        if missing or unknown:
            raise KeyError(f"state dict mismatch: missing {missing[:5]}, unknown {unknown[:5]}")
        for p in dense:
            value = np.asarray(mapping[p.name])
            if value.shape != p.shape:
                raise ValueError(f"{p.name}: shape {value.shape} does not match {p.shape}")
        for p in dense:
            p.value[...] = np.asarray(mapping[p.name], dtype=np.float32)

    @property
    def output_weight(self) -> np.ndarray:
        self._check_open()
        return (self._lm_head or self._embed).value

    # -- forward ----------------------------------------------------------------------

    def _check_tokens(self, tokens, name="tokens"):
        tokens = np.asarray(tokens)
        if tokens.ndim != 2:
            raise ValueError(f"{name} must be [batch, time], got shape {tokens.shape}")
        if not np.issubdtype(tokens.dtype, np.integer):
            raise TypeError(f"{name} must be integers, got {tokens.dtype}")
        B, T = tokens.shape
        if B < 1:
            raise ValueError(f"{name} needs at least one sequence, got batch size {B}")
        if T < 1 or T > self.config.maximum_context:
            raise ValueError(f"{name} time {T} outside 1..maximum_context {self.config.maximum_context}")
        if tokens.min() < 0 or tokens.max() >= self.config.vocabulary_size:
            raise ValueError(f"{name} ids must lie in [0, {self.config.vocabulary_size})")
        return np.ascontiguousarray(tokens, dtype=np.int64)

    def _block_forward(self, block, x, B, T, kv=None):
        """One block on x [N,C]; with kv (keys [G,P,D], values [G,P,D], past) the new keys
        and values are written at positions past.. and attention reads the whole prefix."""
        cfg = self.config
        past = 0 if kv is None else kv[2]
        H, KV, D = cfg.head_count, cfg.kv_heads, cfg.head_dimension
        g, N = H // KV, B * T
        h1 = np.empty_like(x)  # [N,C]
        rstd1 = np.empty(N, np.float32)
        kernels.rmsnorm_forward(x, block.ln1.value, cfg.norm_epsilon, h1, rstd1)
        qkv = block.base_forward("qkv", h1)  # [N,(H+2KV)D]
        lora_qkv = block.lora_forward("qkv", h1, qkv)
        qkv4 = qkv.reshape(B, T, H + 2 * KV, D)
        q = np.empty((B, KV, T, g, D), np.float32)
        k = np.empty((B, KV, T, 1, D), np.float32)
        kernels.rope_forward(qkv4[:, :, :H], self._rope_cos, self._rope_sin, past, q)
        kernels.rope_forward(qkv4[:, :, H:H + KV], self._rope_cos, self._rope_sin, past, k)
        v = np.ascontiguousarray(qkv4[:, :, H + KV:].transpose(0, 2, 1, 3))  # [B,KV,T,D]
        q3, k3, v3 = q.reshape(B * KV, T * g, D), k.reshape(B * KV, T, D), v.reshape(B * KV, T, D)
        if kv is not None:
            keys, values, _ = kv  # [G,P,D] caches
            keys[:, past:past + T] = k3
            values[:, past:past + T] = v3
            k3, v3 = keys[:, :past + T], values[:, :past + T]
        scale = 1.0 / np.sqrt(D)
        if cfg.attention_algorithm == "dense":
            att, saved = attention.dense_forward(q3, k3, v3, scale, g, past)
        else:
            att, saved = attention.tiled_forward(q3, k3, v3, scale, g, cfg.attention_block_size, past)
        attn = att.reshape(B, KV, T, g, D).transpose(0, 2, 1, 3, 4).reshape(N, H * D)  # [N,HD]
        x_mid = block.base_forward("o", attn)  # [N,C]
        lora_o = block.lora_forward("o", attn, x_mid)
        x_mid += x
        h2 = np.empty_like(x)
        rstd2 = np.empty(N, np.float32)
        kernels.rmsnorm_forward(x_mid, block.ln2.value, cfg.norm_epsilon, h2, rstd2)
        gate_up = block.base_forward("gate_up", h2)  # [N,2F]
        lora_gate_up = block.lora_forward("gate_up", h2, gate_up)
        act = np.empty((N, cfg.feed_forward_width), np.float32)
        kernels.swiglu_forward(gate_up, act)
        x_out = block.base_forward("down", act)  # [N,C]
        lora_down = block.lora_forward("down", act, x_out)
        x_out += x_mid
        cache = dict(x=x, h1=h1, rstd1=rstd1, q=q3, k=k3, v=v3, att=att, saved=saved,
                     attn=attn, x_mid=x_mid, h2=h2, rstd2=rstd2, gate_up=gate_up, act=act,
                     lora_qkv=lora_qkv, lora_o=lora_o, lora_gate_up=lora_gate_up,
                     lora_down=lora_down)
        return x_out, cache

    def _hidden(self, tokens, keep_caches):
        """Token ids [B,T] -> final normed hidden [N,C] and what backward needs."""
        B, T = tokens.shape
        x = self._embed.value[tokens.reshape(-1)]  # [N,C]
        caches, inputs = [], []
        for block in self._blocks:
            inputs.append(x)
            x, cache = self._block_forward(block, x, B, T)
            if keep_caches and self.config.activation_checkpointing == "none":
                caches.append(cache)
        hidden = np.empty_like(x)
        rstd = np.empty(x.shape[0], np.float32)
        kernels.rmsnorm_forward(x, self._norm.value, self.config.norm_epsilon, hidden, rstd)
        return hidden, dict(tokens=tokens, B=B, T=T, block_inputs=inputs, caches=caches,
                            last=x, final_rstd=rstd)

    def forward_cached(self, tokens, cache, last_only=False) -> np.ndarray:
        """Logits [B,T,V] of new tokens [B,T] after the cache's prefix; extends the cache.

        `cache` is a trainer.generation.KVCache made for this model. No gradients. With
        last_only, only the last position's logits are computed ([B,1,V]).
        """
        self._check_open()
        tokens = self._check_tokens(tokens)
        B, T = tokens.shape
        past = cache.length
        if cache.batch_size != B:
            raise ValueError(f"the cache holds {cache.batch_size} sequences, got {B}")
        if past + T > self.config.maximum_context:
            raise ValueError(f"{past} cached + {T} new tokens exceed maximum_context "
                             f"{self.config.maximum_context}")
        x = self._embed.value[tokens.reshape(-1)]  # [N,C]
        for index, block in enumerate(self._blocks):
            x, _ = self._block_forward(block, x, B, T,
                                       (cache.keys[index], cache.values[index], past))
        hidden = np.empty_like(x)
        rstd = np.empty(x.shape[0], np.float32)
        kernels.rmsnorm_forward(x, self._norm.value, self.config.norm_epsilon, hidden, rstd)
        cache.length = past + T
        if last_only:
            hidden = hidden.reshape(B, T, -1)[:, -1]  # [B,C]
            return np.matmul(hidden, self.output_weight.T).reshape(B, 1, -1)  # [B,1,V]
        return np.matmul(hidden, self.output_weight.T).reshape(B, T, -1)  # [B,T,V]

    def logits(self, tokens) -> np.ndarray:
        """Float32 logits [B,T,V] for int token ids [B,T]."""
        self._check_open()
        tokens = self._check_tokens(tokens)
        hidden, _ = self._hidden(tokens, keep_caches=False)
        B, T = tokens.shape
        return np.matmul(hidden, self.output_weight.T).reshape(B, T, -1)  # [B,T,V]

    def token_losses(self, inputs, targets) -> np.ndarray:
        """Per-token cross-entropy [B,T] (0 where the target is IGNORE_INDEX); no gradients."""
        self._check_open()
        inputs = self._check_tokens(inputs, "inputs")
        targets = self._check_targets(targets, inputs.shape)
        hidden, _ = self._hidden(inputs, keep_caches=False)
        flat = targets.reshape(-1)
        out = np.zeros(flat.shape[0], np.float32)
        chunk = self.config.loss_chunk_tokens
        W = self.output_weight
        for start in range(0, flat.shape[0], chunk):
            rows = slice(start, start + chunk)
            logits = np.matmul(hidden[rows], W.T)  # [n,V]
            safe = np.where(flat[rows] == IGNORE_INDEX, 0, flat[rows])
            kernels.log_softmax_gather(logits, np.ascontiguousarray(safe), out[rows])
        out = np.where(flat == IGNORE_INDEX, np.float32(0), -out)
        return out.reshape(targets.shape)

    def _check_targets(self, targets, shape):
        targets = np.asarray(targets)
        if targets.shape != tuple(shape):
            raise ValueError(f"targets shape {targets.shape} must equal inputs shape {tuple(shape)}")
        if not np.issubdtype(targets.dtype, np.integer):
            raise TypeError(f"targets must be integers, got {targets.dtype}")
        valid = targets[targets != IGNORE_INDEX]
        if valid.size and (valid.min() < 0 or valid.max() >= self.config.vocabulary_size):
            raise ValueError(f"target ids must lie in [0, {self.config.vocabulary_size}) or be {IGNORE_INDEX}")
        return np.ascontiguousarray(targets, dtype=np.int64)

    # -- forward + backward -------------------------------------------------------------

    def forward_backward(self, inputs, targets) -> float:
        """Mean cross-entropy over non-ignored targets; accumulates pending gradients."""
        self._check_open()
        inputs = self._check_tokens(inputs, "inputs")
        targets = self._check_targets(targets, inputs.shape)
        flat = targets.reshape(-1)
        valid = int(np.count_nonzero(flat != IGNORE_INDEX))
        if valid == 0:
            raise ValueError("the batch has no target tokens (every target is ignored)")
        if self._base_trainable:
            self._ensure_base_grads()
        hidden, state = self._hidden(inputs, keep_caches=True)
        dhidden, loss_sum = self._loss_backward(hidden, flat, 1.0 / valid)
        self._backward_from_hidden(dhidden, inputs, state)
        return float(loss_sum / valid)

    def _backward_from_hidden(self, dhidden, inputs, state):
        """Backward from the gradient at the final hidden state down to the embedding."""
        dx = np.zeros_like(dhidden)
        self._rmsnorm_backward(dhidden, state["last"], self._norm, state["final_rstd"], dx)
        B, T = state["B"], state["T"]
        for index in range(len(self._blocks) - 1, -1, -1):
            block = self._blocks[index]
            if self.config.activation_checkpointing == "blocks":
                _, cache = self._block_forward(block, state["block_inputs"][index], B, T)
            else:
                cache = state["caches"][index]
            self._block_backward(block, cache, dx, B, T)
            state["caches"] = state["caches"][:index]
        if self._base_trainable:
            if not self._embed.pending:
                self._embed.grad.fill(0.0)
            kernels.embedding_backward(dx, inputs.reshape(-1), self._embed.grad)
            self._embed.pending = True

    def forward_backward_weighted(self, inputs, targets, coefficient_fn) -> np.ndarray:
        """Backpropagate sum_t c_t * log p(target_t) and return log p [B,T] (0 where ignored).

        coefficient_fn(logp [B,T] float32) -> c [B,T]: the derivative of the caller's loss
        with respect to each token's log-probability (policy-gradient objectives such as
        GRPO and OPD). Ignored targets get no gradient whatever c says there.
        """
        self._check_open()
        inputs = self._check_tokens(inputs, "inputs")
        targets = self._check_targets(targets, inputs.shape)
        flat = targets.reshape(-1)
        valid = flat != IGNORE_INDEX
        if not valid.any():
            raise ValueError("the batch has no target tokens (every target is ignored)")
        if self._base_trainable:
            self._ensure_base_grads()
        hidden, state = self._hidden(inputs, keep_caches=True)
        safe = np.where(valid, flat, 0)
        logp = np.zeros(flat.shape[0], np.float32)
        W = self.output_weight
        chunk = self.config.loss_chunk_tokens
        for start in range(0, flat.shape[0], chunk):
            rows = slice(start, start + chunk)
            kernels.log_softmax_gather(np.matmul(hidden[rows], W.T), safe[rows], logp[rows])
        logp[~valid] = 0.0
        coefficients = np.asarray(coefficient_fn(logp.reshape(targets.shape)), dtype=np.float64)
        if coefficients.shape != targets.shape or not np.all(np.isfinite(coefficients)):
            raise ValueError(f"coefficient_fn must return finite values of shape {targets.shape}")
        # d(c*logp)/dlogits = c * (onehot - softmax) = (softmax - onehot) * (-c)
        row_scales = np.where(valid, -coefficients.reshape(-1), 0.0).astype(np.float32)
        dhidden, _ = self._loss_backward(hidden, safe, 1.0, row_scales)
        self._backward_from_hidden(dhidden, inputs, state)
        return logp.reshape(targets.shape)

    def _loss_backward(self, hidden, flat_targets, grad_scale, row_scales=None):
        """Cross-entropy of hidden @ W.T; returns (dhidden [N,C], summed loss)."""
        W = self.output_weight  # [V,C]
        head = self._lm_head or self._embed
        N = hidden.shape[0]
        chunk = N if self.config.loss_route == "full_logits" else self.config.loss_chunk_tokens
        dhidden = np.empty_like(hidden)
        losses = np.empty(N, np.float32)
        for start in range(0, N, chunk):
            rows = slice(start, min(start + chunk, N))
            logits = np.matmul(hidden[rows], W.T)  # [n,V], becomes dlogits in place
            if row_scales is None:
                kernels.cross_entropy_forward_backward(logits, flat_targets[rows], losses[rows],
                                                       grad_scale, IGNORE_INDEX)
            else:
                kernels.weighted_cross_entropy(logits, flat_targets[rows], losses[rows],
                                               row_scales[rows])
            np.matmul(logits, W, out=dhidden[rows])
            if self._base_trainable:
                accumulate_weight_grad(head.grad, logits, hidden[rows], head.pending)
                head.pending = True
        return dhidden, float(np.sum(losses, dtype=np.float64))

    def _rmsnorm_backward(self, dout, x, weight, rstd, dx):
        if self._base_trainable:
            if not weight.pending:
                weight.grad.fill(0.0)
            kernels.rmsnorm_backward(dout, x, weight.value, rstd, dx, weight.grad)
            weight.pending = True
        else:
            scratch = np.zeros_like(weight.value)
            kernels.rmsnorm_backward(dout, x, weight.value, rstd, dx, scratch)

    def _weight_grad(self, params, grad, dy, x):
        if self._base_trainable:
            accumulate_weight_grad(grad, dy, x, params[0].pending)
            for p in params:
                p.pending = True

    def _block_backward(self, block, cache, d, B, T):
        """d [N,C]: gradient at the block output, turned in place into the input gradient."""
        cfg = self.config
        H, KV, D = cfg.head_count, cfg.kv_heads, cfg.head_dimension
        g, N = H // KV, B * T
        # MLP
        dact = block.base_input_grad("down", d)  # [N,F]
        self._weight_grad([block.down], block.down.grad, d, cache["act"])
        block.lora_backward("down", cache["act"], d, dact, cache["lora_down"])
        dgate_up = np.empty_like(cache["gate_up"])  # [N,2F]
        kernels.swiglu_backward(dact, cache["gate_up"], dgate_up)
        self._weight_grad([block.gate, block.up], block.gate_up_grad, dgate_up, cache["h2"])
        dh2 = block.base_input_grad("gate_up", dgate_up)  # [N,C]
        block.lora_backward("gate_up", cache["h2"], dgate_up, dh2, cache["lora_gate_up"])
        self._rmsnorm_backward(dh2, cache["x_mid"], block.ln2, cache["rstd2"], d)
        # attention
        dattn = block.base_input_grad("o", d)  # [N,HD]
        self._weight_grad([block.o], block.o.grad, d, cache["attn"])
        block.lora_backward("o", cache["attn"], d, dattn, cache["lora_o"])
        datt = np.ascontiguousarray(
            dattn.reshape(B, T, KV, g, D).transpose(0, 2, 1, 3, 4)).reshape(B * KV, T * g, D)
        scale = 1.0 / np.sqrt(D)
        if cfg.attention_algorithm == "dense":
            dq, dk, dv = attention.dense_backward(datt, cache["q"], cache["k"], cache["v"],
                                                  cache["saved"], scale)
        else:
            dq, dk, dv = attention.tiled_backward(datt, cache["q"], cache["k"], cache["v"],
                                                  cache["att"], cache["saved"], scale, g,
                                                  cfg.attention_block_size)
        dqkv = np.empty((N, (H + 2 * KV) * D), np.float32)
        dqkv4 = dqkv.reshape(B, T, H + 2 * KV, D)
        kernels.rope_backward(dq.reshape(B, KV, T, g, D), self._rope_cos, self._rope_sin, 0,
                              dqkv4[:, :, :H])
        kernels.rope_backward(dk.reshape(B, KV, T, 1, D), self._rope_cos, self._rope_sin, 0,
                              dqkv4[:, :, H:H + KV])
        dqkv4[:, :, H + KV:] = dv.reshape(B, KV, T, D).transpose(0, 2, 1, 3)
        self._weight_grad([block.q, block.k, block.v], block.qkv_grad, dqkv, cache["h1"])
        dh1 = block.base_input_grad("qkv", dqkv)  # [N,C]
        block.lora_backward("qkv", cache["h1"], dqkv, dh1, cache["lora_qkv"])
        self._rmsnorm_backward(dh1, cache["x"], block.ln1, cache["rstd1"], d)
