"""The adapters' down products inside the base's products, against separate products (or against the fused
matrix's rows unpadded), in one process.

A LoRA step on a dense float32 base computes x @ [W; A_1; ..].T and [dy | du] @ [W; A_1; ..] (and on an NF4 base
the group's last tile carries the A rows); Block.separate_adapter_products() restores the separate x @ A.T and
dx += du @ A products. This script builds two models of the SmolLM2-135M shape, one each way, and alternates
their steps (the order swapped every pair), so that a drifting VM's speed lands on both; it prints each side's
median step and the median, lowest and highest of the per-pair ratio other / fused. --against unpadded compares
instead with the fused matrices stored without trainer.blocks.WEIGHT_ROW_PAD (rows contiguous; the same bytes):

    python bench/lora_fusion.py [--contexts 256,1024] [--steps 12] [--qlora] [--against separate|unpadded]

Run with OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE unset, the machine otherwise idle (docs/engine.md).
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from adapter_step import ALPHA, RANK, SHAPE, TARGETS, _batch  # noqa: E402
from machine import describe  # noqa: E402


def paired_steps(context, steps, quantized, against="separate"):
    """{"fused": [seconds], AGAINST: [seconds]}: steps of the two models, alternating, after one warm-up pair."""
    from trainer import Adam, DecoderOnlyTransformer, LoraConfig, TransformerConfig
    from trainer.runs.admission import attention_options, loss_options

    tokens, targets = _batch(context)
    options = {**loss_options("kt_tape_flce", SHAPE["vocabulary_size"]), **attention_options(context)}
    sides = {}
    for side in ("fused", against):
        model = DecoderOnlyTransformer(TransformerConfig(**{**SHAPE, "maximum_context": max(context, 256)}, **options))
        if quantized:
            model.quantize(block_size=64)
        model.attach_lora(LoraConfig(rank=RANK, alpha=ALPHA, targets=tuple(TARGETS)))
        for block in model._blocks:
            if side == "separate":
                block.separate_adapter_products()
            elif side == "unpadded":
                block._unfuse_adapters()
                block.fuse_adapters(row_pad=0)
        sides[side] = (model, Adam(model.adapter_parameters(), learning_rate=1e-4))
    seconds = {side: [] for side in sides}
    for pair in range(steps + 1):
        for side in (("fused", against) if pair % 2 else (against, "fused")):
            model, optimizer = sides[side]
            start = time.perf_counter()
            model.forward_backward(tokens, targets)
            optimizer.step()
            if pair:
                seconds[side].append(time.perf_counter() - start)
    for model, optimizer in sides.values():
        optimizer.close()
        model.close()
    return seconds


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="256,1024")
    parser.add_argument("--steps", type=int, default=12, help="pairs of steps measured per context")
    parser.add_argument("--qlora", action="store_true", help="NF4 bases (block 64) instead of float32")
    parser.add_argument("--against", choices=("separate", "unpadded"), default="separate")
    args = parser.parse_args()
    if args.qlora and args.against == "unpadded":
        parser.error("--against unpadded compares float32 bases' fused matrices; an NF4 base has none")
    print(describe())
    for context in (int(c) for c in args.contexts.split(",")):
        seconds = paired_steps(context, args.steps, args.qlora, args.against)
        other = args.against
        ratios = [s / f for f, s in zip(seconds["fused"], seconds[other])]
        print(f"{'QLoRA' if args.qlora else 'LoRA'} step, SmolLM2-135M shape, context {context}, {args.steps} pairs: "
              f"fused {statistics.median(seconds['fused']) * 1e3:.0f} ms, {other} "
              f"{statistics.median(seconds[other]) * 1e3:.0f} ms (medians); {other} / fused per pair: median "
              f"{statistics.median(ratios):.3f}, lowest {min(ratios):.3f}, highest {max(ratios):.3f}")


if __name__ == "__main__":
    main()
