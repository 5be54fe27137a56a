"""Where one LoRA (or QLoRA) step's time goes: each part's exclusive time, its counted FLOPs and its share.

The same model and batch as bench/adapter_step.py's kiln-lora (SmolLM2-135M shape, rank 8 on all seven
projections, batch 1, the attention and loss an SFT run of the context picks). Each part is timed
exclusively (a part called inside another counts only in itself) over the steps after two warm-up steps:

    base forward, base input grad   the frozen base's products (trainer.blocks.Block.base_forward, base_input_grad;
                                    with --qlora they include dequantizing the NF4 tiles)
    adapters                        the rank-r products and their accumulation (lora_forward, lora_backward)
    attention products              trainer.attention's algorithms less the kernels they call (tiled: the
                                    whole fused C kernel, its softmax included)
    attention kernels               the softmax kernels of the dense algorithm
    loss                            the fused loss's two products (trainer.crossentropy) less its kernel
    loss kernel                     cross-entropy rows
    row kernels                     RMSNorm, rotary, SwiGLU and the Adam update (native_ext.kernels)
    optimizer                       Adam's Python part
    other                           the rest: Python, copies, residual additions

Then the ceiling: the base and loss products' shapes timed alone, hot, back to back (the best this BLAS
does on them), and the share of the peak the step would reach if those products ran at that rate and
every other part took the time it takes now, or no time at all:

    python bench/step_parts.py [--contexts 256,1024] [--steps 3] [--qlora]

Run with OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE unset, the machine otherwise idle (docs/engine.md).
"""

import argparse
import functools
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from adapter_step import ALPHA, RANK, SHAPE, TARGETS, _batch, lora_step_flops  # noqa: E402
from machine import describe, gemm_peak  # noqa: E402

ATTENTION_KERNELS = {"softmax_causal_forward", "softmax_backward"}
LOSS_KERNELS = {"cross_entropy_forward_backward"}
ORDER = ("base forward", "base input grad", "adapters", "attention products", "attention kernels", "loss",
         "loss kernel", "row kernels", "optimizer", "other")


class PartTimer:
    """Exclusive wall time per part: a wrapped call's time less that of the wrapped calls inside it."""

    def __init__(self):
        self.seconds = defaultdict(float)
        self._stack = []

    def wrap(self, function, part):
        @functools.wraps(function)
        def timed(*args, **kwargs):
            start = time.perf_counter()
            self._stack.append(0.0)
            try:
                return function(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - start
                inner = self._stack.pop()
                self.seconds[part] += elapsed - inner
                if self._stack:
                    self._stack[-1] += elapsed
        return timed


def instrument(timer):
    """Wrap the engine's parts where their callers look them up (module attributes imported by name too)."""
    from native_ext import kernels
    from trainer import attention, blocks, crossentropy, model, optim

    # project and project_backward hold a fused group's one product (its adapters' down products included): base
    # parts, less the lora_forward and lora_backward calls inside them
    for name, part in (("base_forward", "base forward"), ("base_input_grad", "base input grad"),
                       ("project", "base forward"), ("project_backward", "base input grad"),
                       ("lora_forward", "adapters"), ("lora_backward", "adapters")):
        setattr(blocks.Block, name, timer.wrap(getattr(blocks.Block, name), part))
    for name in ("dense_forward", "dense_backward", "tiled_forward", "tiled_backward"):
        setattr(attention, name, timer.wrap(getattr(attention, name), "attention products"))
    loss = timer.wrap(crossentropy.fused_linear_cross_entropy, "loss")
    crossentropy.fused_linear_cross_entropy = model.fused_linear_cross_entropy = loss
    optim.Adam.step = timer.wrap(optim.Adam.step, "optimizer")
    originals = {}
    for name in dir(kernels):
        function = getattr(kernels, name)
        if name.startswith("_") or not callable(function) or getattr(function, "__module__", "") != kernels.__name__:
            continue
        part = ("attention kernels" if name in ATTENTION_KERNELS else
                "loss kernel" if name in LOSS_KERNELS else "row kernels")
        originals[function] = timer.wrap(function, part)
        setattr(kernels, name, originals[function])
    for module in (attention, blocks, crossentropy, model, optim):
        for name, value in list(vars(module).items()):
            if callable(value) and value in originals:
                setattr(module, name, originals[value])


def step_profile(context, steps, quantized):
    from trainer import Adam, DecoderOnlyTransformer, LoraConfig, TransformerConfig
    from trainer.runs.admission import attention_options, loss_options

    timer = PartTimer()
    instrument(timer)
    tokens, targets = _batch(context)
    options = {**loss_options("kt_tape_flce", SHAPE["vocabulary_size"]), **attention_options(context)}
    model = DecoderOnlyTransformer(TransformerConfig(**{**SHAPE, "maximum_context": max(context, 256)}, **options))
    with model:
        if quantized:
            model.quantize(block_size=64)
        model.attach_lora(LoraConfig(rank=RANK, alpha=ALPHA, targets=tuple(TARGETS)))
        with model.adapter_parameters() as adapters, Adam(adapters, learning_rate=1e-4) as optimizer:
            for _ in range(2):
                model.forward_backward(tokens, targets)
                optimizer.step()
            timer.seconds.clear()
            start = time.perf_counter()
            for _ in range(steps):
                model.forward_backward(tokens, targets)
                optimizer.step()
            step = (time.perf_counter() - start) / steps
    parts = {part: seconds / steps for part, seconds in timer.seconds.items()}
    parts["other"] = step - sum(parts.values())
    return step, parts, options


def counted_flops(context):
    """The counted FLOPs of lora_step_flops split by part: base products, attention, loss."""
    C, H, KV, F, L, V = (SHAPE["model_width"], SHAPE["head_count"], SHAPE["kv_head_count"],
                         SHAPE["feed_forward_width"], SHAPE["block_count"], SHAPE["vocabulary_size"])
    D = C // H
    linear = L * (C * (H + 2 * KV) * D + H * D * C + 3 * C * F)
    base = 2 * linear * context  # forward, and the same again for the input gradient
    loss = 2 * 2 * V * C * context
    attention = lora_step_flops(context) - 2 * base - loss
    return {"base forward": base, "base input grad": base, "attention products": attention, "loss": loss}


def isolated_seconds(context, repeats=5):
    """The base and loss products of one step, each shape timed alone and hot (best of REPEATS): seconds per step."""
    C, H, KV, F, L, V = (SHAPE["model_width"], SHAPE["head_count"], SHAPE["kv_head_count"],
                         SHAPE["feed_forward_width"], SHAPE["block_count"], SHAPE["vocabulary_size"])
    D = C // H
    rng = np.random.default_rng(0)
    total = {"base forward": 0.0, "base input grad": 0.0, "loss": 0.0}
    from native_ext import blas
    from trainer.runs.admission import loss_options
    chunk = min(context, loss_options("kt_tape_flce", V)["loss_chunk_tokens"])
    base = ("base forward", "base input grad")
    shapes = [(base, L, context, C, out) for out in ((H + 2 * KV) * D, C, 2 * F)]
    shapes.append((base, L, context, F, C))
    shapes.append((("loss", "loss"), context // chunk, chunk, C, V))  # full chunks, then the rest
    if context % chunk:
        shapes.append((("loss", "loss"), 1, context % chunk, C, V))
    for (forward_part, backward_part), count, rows, n_in, n_out in shapes:
        x = rng.standard_normal((rows, n_in), dtype=np.float32)
        weight = rng.standard_normal((n_out, n_in), dtype=np.float32)
        y = np.empty((rows, n_out), np.float32)
        dx = np.empty((rows, n_in), np.float32)
        # through native_ext.blas: the library the engine computes its float32 products with (oneDNN or OpenBLAS)
        for part, product in ((forward_part, lambda: blas.gemm(y, x, weight, trans_b=True)),
                              (backward_part, lambda: blas.gemm(dx, y, weight))):
            product()
            best = min(_timed(product) for _ in range(repeats))
            total[part] += count * best
    return total


def _timed(function):
    start = time.perf_counter()
    function()
    return time.perf_counter() - start


def report(context, steps, quantized, peak):
    step, parts, options = step_profile(context, steps, quantized)
    flops = counted_flops(context)
    total_flops = lora_step_flops(context)
    kind = "QLoRA (NF4, block 64)" if quantized else "LoRA"
    algorithm = options.get("attention_algorithm", "dense")
    print(f"\n{kind} step, SmolLM2-135M shape, context {context}, batch 1, {algorithm} attention: "
          f"{step * 1e3:.0f} ms, {total_flops / step / 1e9:.1f} GFLOP/s, "
          f"{total_flops / step / peak:.1%} of the peak")
    print(f"{'part':20s} {'ms':>8s} {'share':>7s} {'GFLOP':>7s} {'GFLOP/s':>8s} {'of peak':>8s}")
    for part in ORDER:
        seconds = parts.get(part, 0.0)
        line = f"{part:20s} {seconds * 1e3:8.1f} {seconds / step:7.1%}"
        if part in flops and seconds > 0:
            rate = flops[part] / seconds
            line += f" {flops[part] / 1e9:7.1f} {rate / 1e9:8.1f} {rate / peak:8.1%}"
        print(line)
    if quantized:
        return
    alone = isolated_seconds(context)
    products = sum(parts[p] for p in alone)
    rest = step - products
    best_products = sum(alone.values())
    for part, seconds in alone.items():
        print(f"{part + ', alone':20s} {seconds * 1e3:8.1f} {'':7s} {flops[part] / 1e9:7.1f} "
              f"{flops[part] / seconds / 1e9:8.1f} {flops[part] / seconds / peak:8.1%}")
    print(f"ceiling: those products at their rate alone with the rest as now: "
          f"{total_flops / (best_products + rest) / peak:.1%} of the peak; with the rest free: "
          f"{total_flops / best_products / peak:.1%}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="256,1024")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--qlora", action="store_true", help="an NF4 base (no ceiling lines)")
    args = parser.parse_args()
    peak = gemm_peak()
    print(describe(peak))
    for context in (int(c) for c in args.contexts.split(",")):
        report(context, args.steps, args.qlora, peak)


if __name__ == "__main__":
    main()
