"""A LoRA SFT step on the GPU: Kiln's CudaModel against PyTorch CUDA + peft, at one shape, in one run.

At the SmolLM2-135M shape (random weights: the arithmetic does not depend on them), context 1024, batch 8,
rank 8 on all seven projections, it times one optimizer step (forward, backward, gradient norm, Adam over the
adapters) of:

- Kiln: trainer.cuda_model.CudaModel (FP32, no TF32), the step SFT runs on cuda take;
- PyTorch + peft in FP32 (TF32 off) and with torch.autocast(dtype=bfloat16), SDPA attention.

It prints tokens/s side by side with the ratios, says which side could not run and why, and prints one JSON
summary line last. `--shape tiny` runs the Kiln side at a tiny shape (for a smoke run on the host emulation:
KILN_CUDA_LIBRARY=<emulated .so>); figures only mean something on a GPU.

    python bench/cuda_step.py [--steps 5] [--context 1024] [--batch 8] [--shape smollm2|tiny]
"""

import argparse
import json
import time

import numpy as np

SHAPES = {
    "smollm2": dict(vocabulary_size=49152, maximum_context=2048, model_width=576, head_count=9, kv_head_count=3,
                    block_count=30, feed_forward_width=1536, rope_theta=100000.0, tie_embeddings=True),
    "tiny": dict(vocabulary_size=260, maximum_context=64, model_width=64, head_count=4, kv_head_count=2,
                 block_count=2, feed_forward_width=128, tie_embeddings=True),
}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RANK, ALPHA, LEARNING_RATE = 8, 16, 1e-4


def kiln_step(shape: dict, batch: int, context: int, steps: int) -> dict:
    from native_ext import cuda
    from trainer import DecoderOnlyTransformer, LoraConfig, TransformerConfig
    from trainer.cuda_model import CudaModel
    from trainer.runs.admission import loss_options

    try:
        cuda.load()
    except cuda.CudaUnavailable as error:
        return {"ran": False, "reason": str(error)}
    config = TransformerConfig(**shape, **loss_options("kt_tape_flce", shape["vocabulary_size"]))
    model = DecoderOnlyTransformer(config)
    model.attach_lora(LoraConfig(rank=RANK, alpha=ALPHA, targets=tuple(TARGETS)))
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, shape["vocabulary_size"], (batch, context + 1))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    with CudaModel(model) as device:
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


def torch_peft_step(shape: dict, batch: int, context: int, steps: int, bf16: bool) -> dict:
    try:
        import torch
        from peft import LoraConfig, get_peft_model
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError as error:
        return {"ran": False, "reason": f"PyTorch, transformers or peft is not installed ({error})"}
    if not torch.cuda.is_available():
        return {"ran": False, "reason": "torch.cuda.is_available() is False (a CPU-only torch build or no GPU)"}
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=shape["vocabulary_size"], hidden_size=shape["model_width"],
                         intermediate_size=shape["feed_forward_width"], num_hidden_layers=shape["block_count"],
                         num_attention_heads=shape["head_count"], num_key_value_heads=shape["kv_head_count"],
                         max_position_embeddings=shape["maximum_context"], rope_theta=shape.get("rope_theta", 1e4),
                         tie_word_embeddings=True, attn_implementation="sdpa")
    model = get_peft_model(LlamaForCausalLM(config).cuda(),
                           LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=TARGETS, lora_dropout=0.0))
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(trainable, lr=LEARNING_RATE)
    tokens = torch.randint(0, shape["vocabulary_size"], (batch, context), device="cuda")

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
    result = {"ran": True, "step_ms": seconds * 1e3, "tokens_per_s": batch * context / seconds, "loss": loss,
              "peak_memory_mib": torch.cuda.max_memory_allocated() / 2**20, "device": torch.cuda.get_device_name(0)}
    del model, optimizer
    torch.cuda.empty_cache()
    return result


def line(name: str, side: dict, kiln: dict) -> str:
    if not side["ran"]:
        return f"{name:<34} not run: {side['reason']}"
    ratio = f"  Kiln {kiln['tokens_per_s'] / side['tokens_per_s']:.2f}x" if kiln["ran"] and side is not kiln else ""
    return f"{name:<34} {side['tokens_per_s']:10.0f} tokens/s  {side['step_ms']:9.1f} ms/step{ratio}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm2")
    args = parser.parse_args()
    shape = SHAPES[args.shape]
    if args.context >= shape["maximum_context"]:
        parser.error(f"--context must be below the shape's maximum_context {shape['maximum_context']}")
    kiln = kiln_step(shape, args.batch, args.context, args.steps)
    fp32 = torch_peft_step(shape, args.batch, args.context, args.steps, bf16=False)
    bf16 = torch_peft_step(shape, args.batch, args.context, args.steps, bf16=True)
    print(f"LoRA step, {args.shape} shape, batch {args.batch} x context {args.context}, rank {RANK}, 7 targets, "
          f"{args.steps} timed steps on {kiln.get('device') or fp32.get('device') or 'no device'}")
    print(line("Kiln CudaModel (FP32, no TF32)", kiln, kiln))
    print(line("PyTorch + peft FP32 (no TF32)", fp32, kiln))
    print(line("PyTorch + peft BF16 autocast", bf16, kiln))
    print(json.dumps({"shape": args.shape, "batch": args.batch, "context": args.context, "rank": RANK,
                      "steps": args.steps, "kiln_cuda": kiln, "torch_peft_fp32": fp32, "torch_peft_bf16": bf16}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
