"""DecoderOnlyTransformer: one Llama-family decoder's parameters, adapters and quantized bases, and its whole-model forward/backward passes.

Dimension letters: B batch, T time, N = B*T rows, C model width, V vocabulary, P positions
(maximum_context), D head size.
Parameter names are Hugging Face Llama's. The math of one block lives in
trainer.blocks and the chunked loss in trainer.crossentropy; this module runs them in
order: embedding, the blocks, the final RMSNorm, the output projection and the loss.
"""

import contextlib
import functools
from dataclasses import dataclass

import numpy as np

from native_ext import bf16, kernels, onednn
from trainer.blocks import Block, block_backward, block_forward, rmsnorm_backward, rope_tables
from trainer.config import TransformerConfig
from trainer.crossentropy import IGNORE_INDEX, fused_linear_cross_entropy, output_product
from trainer.generation import KVCache, check_cache_room
from trainer.lifetime import Closeable
from trainer.lora import LoraAdapter, LoraConfig
from trainer.parameters import Parameter, ParameterList
# dequantize_rows is re-exported: tests patch it here (and in trainer.quantization, which
# trainer.blocks calls through) to prove no whole NF4 weight is ever dequantized
from trainer.quantization import NF4Tensor, dequantize_nf4, dequantize_rows  # noqa: F401
from trainer.runtime import release_memory, tune_allocator


def check_tokens(config, tokens, name="tokens") -> np.ndarray:
    """Token ids [B,T] as C-contiguous int64, checked against CONFIG (shape, dtype, ids in the vocabulary)."""
    tokens = np.asarray(tokens)
    if tokens.ndim != 2:
        raise ValueError(f"{name} must be [batch, time], got shape {tokens.shape}")
    if not np.issubdtype(tokens.dtype, np.integer):
        raise TypeError(f"{name} must be integers, got {tokens.dtype}")
    B, T = tokens.shape
    if B < 1:
        raise ValueError(f"{name} needs at least one sequence, got batch size {B}")
    if T < 1 or T > config.maximum_context:
        raise ValueError(f"{name} time {T} outside 1..maximum_context {config.maximum_context}")
    if tokens.min() < 0 or tokens.max() >= config.vocabulary_size:
        raise ValueError(f"{name} ids must lie in [0, {config.vocabulary_size})")
    return np.ascontiguousarray(tokens, dtype=np.int64)


def check_targets(config, targets, shape) -> np.ndarray:
    """Target ids of SHAPE as C-contiguous int64: in the vocabulary, or IGNORE_INDEX."""
    targets = np.asarray(targets)
    if targets.shape != tuple(shape):
        raise ValueError(f"targets shape {targets.shape} must equal inputs shape {tuple(shape)}")
    if not np.issubdtype(targets.dtype, np.integer):
        raise TypeError(f"targets must be integers, got {targets.dtype}")
    valid = targets[targets != IGNORE_INDEX]
    if valid.size and (valid.min() < 0 or valid.max() >= config.vocabulary_size):
        raise ValueError(f"target ids must lie in [0, {config.vocabulary_size}) or be {IGNORE_INDEX}")
    return np.ascontiguousarray(targets, dtype=np.int64)


def check_batch(config, inputs, targets, trained=True) -> tuple:
    """(inputs, targets, flat targets [N]) checked against CONFIG; a batch that trains (TRAINED) needs at
    least one target that is not IGNORE_INDEX."""
    inputs = check_tokens(config, inputs, "inputs")
    targets = check_targets(config, targets, inputs.shape)
    flat = targets.reshape(-1)
    if trained and not np.any(flat != IGNORE_INDEX):
        raise ValueError("the batch has no target tokens (every target is ignored)")
    return inputs, targets, flat


def check_normalizer(normalizer, valid: int) -> int:
    """forward_backward's gradient divisor: VALID (the batch's own mean) when None, else a whole number of target
    tokens that covers this batch's VALID ones (a step's total over the batches it accumulates)."""
    if normalizer is None:
        return valid
    if isinstance(normalizer, bool) or not isinstance(normalizer, (int, np.integer)) or normalizer < valid:
        raise ValueError(f"normalizer must be a whole number of target tokens of at least this batch's {valid}, "
                         f"got {normalizer!r}")
    return int(normalizer)


@dataclass
class ForwardState:
    """What the whole-model forward keeps for backward (one batch)."""

    batch: int  # B
    time: int  # T
    block_inputs: list  # [N,C] input of each block; "blocks" checkpointing recomputes from it
    activations: list  # BlockActivations per block ("none" checkpointing), dropped as backward passes
    last: np.ndarray  # [N,C] output of the last block, input of the final norm
    final_rstd: np.ndarray  # [N] reciprocal RMS of the final norm
    consumed: bool = False  # backward ran; the state may not be reused


def _computing_scope(method):
    """Runs a compute method inside its model's _computing() scope."""
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with self._computing():
            return method(self, *args, **kwargs)
    return wrapper


class DecoderOnlyTransformer(Closeable):
    """A Llama-family decoder that owns its buffers; use it as a context manager."""

    def __init__(self, config: TransformerConfig, initialize: bool = True):
        """initialize=False skips the seeded random init (for a caller that loads every weight)."""
        if not isinstance(config, TransformerConfig):
            raise TypeError("config must be a TransformerConfig")
        tune_allocator()
        self.config = config
        C, V = config.model_width, config.vocabulary_size
        self._embed = Parameter("model.embed_tokens.weight", np.zeros((V, C), np.float32), None)
        self._blocks = [Block(i, config) for i in range(config.block_count)]
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
        self._output_bf16 = None  # the output weight's bfloat16 bits under base_precision "bfloat16"
        self._closed = False
        if initialize:
            self._initialize(config.initializer_seed)
        self._rope = rope_tables(config)  # (cos, sin) [P, D/2]

    # -- lifetime -------------------------------------------------------------------

    closed_message = "the model has been closed; construct a new one"

    def close(self):
        """Release every buffer; the model cannot be used afterwards."""
        super().close()
        self._output_bf16 = None
        self._blocks = []
        self._base = []
        self._by_name = {}
        release_memory()  # the heap is never trimmed while training (trainer.runtime): return what is free now

    # -- parameters -----------------------------------------------------------------

    def _initialize(self, seed):
        rng = np.random.default_rng(seed)  # before quantization every value is FP32
        std = self.config.initializer_range
        for p in self._base:
            if p.value.ndim == 2:
                p.value[...] = rng.standard_normal(p.shape, dtype=np.float32) * np.float32(std)

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
        self._freeze_bf16()
        if self.config.base_precision == "float32":
            for block in self._blocks:
                block.fuse_adapters()  # a no-op for an NF4 (quantized) base

    # -- base_precision "bfloat16" ---------------------------------------------------------

    def _freeze_bf16(self):
        """Under base_precision "bfloat16", the blocks' frozen weights as bfloat16 (from their FP32 values)."""
        if self.config.base_precision == "bfloat16" and self.lora_config is not None:
            onednn.require()  # the CPU's BF16 instructions and the oneDNN library, or why not
            for block in self._blocks:
                block.freeze_bf16()
            self._output_bf16 = bf16.to_bf16(self.output_weight)  # the output projection is frozen too

    def _computing(self):
        """The scope every forward and backward runs in: oneDNN's (native_ext.bf16.computing) under
        base_precision "bfloat16", which is refused until the base is frozen by attach_lora."""
        if self.config.base_precision == "float32":
            return contextlib.nullcontext()
        if self.lora_config is None:
            raise ValueError("base_precision 'bfloat16' computes the frozen base of a LoRA model: attach_lora "
                             "first (a trainable base computes in float32)")
        return bf16.computing()

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
        if self.config.base_precision == "bfloat16":
            raise ValueError("base_precision 'bfloat16' is for a dense frozen base; a quantized (NF4) base "
                             "computes its tiles in float32")
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
            block.qkv_grad = block.gate_up_grad = block.qkv_bias_grad = None
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
        self._freeze_bf16()

    @property
    def output_weight(self) -> np.ndarray:
        self._check_open()
        return (self._lm_head or self._embed).value

    # -- forward ----------------------------------------------------------------------

    def _check_tokens(self, tokens, name="tokens"):
        return check_tokens(self.config, tokens, name)

    def _hidden(self, tokens, keep_activations):
        """Token ids [B,T] -> final normed hidden [N,C] and the ForwardState backward needs."""
        B, T = tokens.shape
        x = self._embed.value[tokens.reshape(-1)]  # [N,C]
        activations, inputs = [], []
        for block in self._blocks:
            inputs.append(x)
            x, saved = block_forward(block, x, self.config, self._rope, B, T)
            if keep_activations and self.config.activation_checkpointing == "none":
                activations.append(saved)
        hidden = np.empty_like(x)  # [N,C]
        rstd = np.empty(x.shape[0], np.float32)  # [N]
        kernels.rmsnorm_forward(x, self._norm.value, self.config.norm_epsilon, hidden, rstd)
        return hidden, ForwardState(batch=B, time=T, block_inputs=inputs, activations=activations,
                                    last=x, final_rstd=rstd)

    def kv_cache(self, batch_size=1, positions=None):
        """An empty KVCache for BATCH_SIZE sequences of up to POSITIONS tokens (maximum_context): what
        forward_cached extends."""
        return KVCache(self, batch_size, positions)

    @_computing_scope
    def forward_cached(self, tokens, cache, last_only=False) -> np.ndarray:
        """Logits [B,T,V] of new tokens [B,T] after the cache's prefix; extends the cache.

        `cache` is this model's kv_cache(). No gradients. With
        last_only, only the last position's logits are computed ([B,1,V]).
        """
        self._check_open()
        tokens = self._check_tokens(tokens)
        B, T = tokens.shape
        past = cache.length
        check_cache_room(self.config, cache, B, T)
        x = self._embed.value[tokens.reshape(-1)]  # [N,C]
        for index, block in enumerate(self._blocks):
            x, _ = block_forward(block, x, self.config, self._rope, B, T,
                                 (cache.keys[index], cache.values[index], past))
        hidden = np.empty_like(x)
        rstd = np.empty(x.shape[0], np.float32)
        kernels.rmsnorm_forward(x, self._norm.value, self.config.norm_epsilon, hidden, rstd)
        cache.length = past + T
        if last_only:
            hidden = hidden.reshape(B, T, -1)[:, -1]  # [B,C]
            return output_product(hidden, self.output_weight, self._output_bf16).reshape(B, 1, -1)  # [B,1,V]
        return output_product(hidden, self.output_weight, self._output_bf16).reshape(B, T, -1)  # [B,T,V]

    @_computing_scope
    def logits(self, tokens) -> np.ndarray:
        """Float32 logits [B,T,V] for int token ids [B,T]."""
        self._check_open()
        tokens = self._check_tokens(tokens)
        hidden, _ = self._hidden(tokens, keep_activations=False)
        B, T = tokens.shape
        return output_product(hidden, self.output_weight, self._output_bf16).reshape(B, T, -1)  # [B,T,V]

    @_computing_scope
    def token_losses(self, inputs, targets) -> np.ndarray:
        """Per-token cross-entropy [B,T] (0 where the target is IGNORE_INDEX); no gradients."""
        self._check_open()
        inputs, targets, _ = check_batch(self.config, inputs, targets, trained=False)
        hidden, _ = self._hidden(inputs, keep_activations=False)
        flat = targets.reshape(-1)  # [N]
        logp, _ = fused_linear_cross_entropy(hidden, self.output_weight, flat,
                                             self.config.loss_chunk_tokens, weight_bf16=self._output_bf16)  # [N]
        return np.where(flat == IGNORE_INDEX, np.float32(0), -logp).reshape(targets.shape)

    # -- forward + backward -------------------------------------------------------------

    @_computing_scope
    def forward_backward(self, inputs, targets, normalizer=None) -> float:
        """Mean cross-entropy over non-ignored targets; accumulates pending gradients.

        The gradient is that of the summed token losses divided by `normalizer` (default: this batch's non-ignored
        targets, i.e. of the returned mean); a caller accumulating several batches into one step passes the
        step's total, as transformers' Trainer passes num_items_in_batch."""
        self._check_open()
        inputs, targets, flat = check_batch(self.config, inputs, targets)
        valid = int(np.count_nonzero(flat != IGNORE_INDEX))
        normalizer = check_normalizer(normalizer, valid)
        if self._base_trainable:
            self._ensure_base_grads()
        hidden, state = self._hidden(inputs, keep_activations=True)
        losses, dhidden = fused_linear_cross_entropy(
            hidden, self.output_weight, flat, self._loss_chunk(flat.shape[0]),
            grad_scale=1.0 / normalizer, head=self._trainable_head(), weight_bf16=self._output_bf16)
        self._backward_from_hidden(dhidden, inputs, state)
        return float(np.sum(losses, dtype=np.float64)) / valid

    def _loss_chunk(self, N):
        """Rows per chunk of the loss with gradients: all N on the full-logits route."""
        return N if self.config.loss_route == "full_logits" else self.config.loss_chunk_tokens

    def _trainable_head(self):
        """The output projection's Parameter when its gradient is wanted, else None."""
        return (self._lm_head or self._embed) if self._base_trainable else None

    def _backward_from_hidden(self, dhidden, inputs, state):
        """Backward from the gradient at the final hidden state [N,C] down to the embedding."""
        assert not state.consumed, "forward before backward: this ForwardState was used already"
        state.consumed = True
        dx = np.zeros_like(dhidden)  # [N,C]
        rmsnorm_backward(dhidden, state.last, self._norm, state.final_rstd, dx, self._base_trainable)
        B, T = state.batch, state.time
        for index in range(len(self._blocks) - 1, -1, -1):
            block = self._blocks[index]
            if self.config.activation_checkpointing == "blocks":
                _, saved = block_forward(block, state.block_inputs[index], self.config, self._rope, B, T)
            else:
                saved = state.activations[index]
            block_backward(block, saved, dx, self.config, self._rope, self._base_trainable)
            state.activations = state.activations[:index]
        if self._base_trainable:
            if not self._embed.pending:
                self._embed.grad.fill(0.0)
            kernels.embedding_backward(dx, inputs.reshape(-1), self._embed.grad)
            self._embed.pending = True

    @_computing_scope
    def forward_backward_weighted(self, inputs, targets, coefficient_fn) -> np.ndarray:
        """Backpropagate sum_t c_t * log p(target_t) and return log p [B,T] (0 where ignored).

        coefficient_fn(logp [B,T] float32) -> c [B,T]: the derivative of the caller's loss
        with respect to each token's log-probability (policy-gradient objectives such as
        GRPO and OPD). Ignored targets get no gradient whatever c says there.
        """
        self._check_open()
        inputs, targets, flat = check_batch(self.config, inputs, targets)
        valid = flat != IGNORE_INDEX
        if self._base_trainable:
            self._ensure_base_grads()
        hidden, state = self._hidden(inputs, keep_activations=True)
        logp, _ = fused_linear_cross_entropy(hidden, self.output_weight, flat,
                                             self.config.loss_chunk_tokens, weight_bf16=self._output_bf16)  # [N], 0 where ignored
        coefficients = np.asarray(coefficient_fn(logp.reshape(targets.shape)), dtype=np.float64)
        if coefficients.shape != targets.shape or not np.all(np.isfinite(coefficients)):
            raise ValueError(f"coefficient_fn must return finite values of shape {targets.shape}")
        # d(c*logp)/dlogits = c * (onehot - softmax) = (softmax - onehot) * (-c)
        row_scales = np.where(valid, -coefficients.reshape(-1), 0.0).astype(np.float32)
        _, dhidden = fused_linear_cross_entropy(
            hidden, self.output_weight, flat, self._loss_chunk(flat.shape[0]),
            row_scales=row_scales, head=self._trainable_head(), weight_bf16=self._output_bf16)
        self._backward_from_hidden(dhidden, inputs, state)
        return logp.reshape(targets.shape)
