"""Generation speed: Kiln's KV-cached sampling against transformers.generate on the CPU.

Batch 1, greedy, a fixed number of new tokens, the same weights on both sides (a
SmolLM2-135M-shaped model with random weights, or a registered base with --base):

    python bench/generate.py [--new-tokens 128] [--prompt-tokens 32] [--base NAME] [--serving] [--nf4] [--lora]

--serving runs Kiln's side on a thread of its own on the serving threads' route (native_ext.blas.serve_on_openblas,
as the OpenAI-compatible server's completion threads do); --nf4 quantizes Kiln's base to NF4 (block 64) first, so
its tokens need not match transformers' float32 ones (the line says so); --lora attaches rank-8 adapters to the
seven projections, as served adapters are.
"""

import argparse
import os
import threading
import time

import numpy as np
import torch
import transformers

from trainer import DecoderOnlyTransformer, TransformerConfig
from trainer.generation import SamplingConfig, generate

SMOLLM2 = dict(vocabulary_size=49152, maximum_context=2048, model_width=576, head_count=9,
               kv_head_count=3, block_count=30, feed_forward_width=1536, tie_embeddings=True,
               rope_theta=100000.0)


def hf_twin(model):
    cfg = model.config
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=cfg.vocabulary_size, hidden_size=cfg.model_width,
        intermediate_size=cfg.feed_forward_width, num_hidden_layers=cfg.block_count,
        num_attention_heads=cfg.head_count, num_key_value_heads=cfg.kv_heads,
        head_dim=cfg.head_dimension, max_position_embeddings=cfg.maximum_context,
        rms_norm_eps=cfg.norm_epsilon, rope_theta=cfg.rope_theta,
        tie_word_embeddings=cfg.tie_embeddings)).float().eval()
    state = {k: torch.from_numpy(v) for k, v in model.state_dict().items()}
    if cfg.tie_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    hf.load_state_dict(state)
    return hf


def kiln_generation(model, prompt, config, serving, times):
    """One timed generation (appended to times); with serving, on a new thread on the serving threads' route."""
    result = {}

    def run():
        if serving:
            from native_ext import blas
            blas.serve_on_openblas()
        start = time.perf_counter()
        result["generation"] = generate(model, prompt, config)
        times.append(time.perf_counter() - start)

    if serving:
        thread = threading.Thread(target=run)
        thread.start()
        thread.join()
    else:
        run()
    return result["generation"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--base", help="a registered base name, GGUF file or HF directory")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--serving", action="store_true", help="Kiln on a completion thread's route")
    parser.add_argument("--nf4", action="store_true", help="Kiln's base quantized to NF4 (block 64)")
    parser.add_argument("--lora", action="store_true", help="rank-8 adapters on Kiln's seven projections")
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count())
    if args.base:
        from trainer.bases import load_base
        model, _ = load_base(args.base)
    else:
        model = DecoderOnlyTransformer(TransformerConfig(**SMOLLM2))
    hf = hf_twin(model)
    prompt = np.random.default_rng(0).integers(0, model.config.vocabulary_size, args.prompt_tokens).tolist()
    config = SamplingConfig(max_new_tokens=args.new_tokens, temperature=0)
    if args.nf4:
        model.quantize(block_size=64)
    if args.lora:
        from trainer import LoraConfig
        model.attach_lora(LoraConfig(rank=8, alpha=16, targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                                "up_proj", "down_proj")))
    kiln_times, hf_times = [], []
    for _ in range(args.repeats):
        ours = kiln_generation(model, prompt, config, args.serving, kiln_times)
        start = time.perf_counter()
        with torch.no_grad():
            theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=args.new_tokens,
                                 min_new_tokens=args.new_tokens, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
        hf_times.append(time.perf_counter() - start)
    same = ours.tokens == theirs[0, len(prompt):].tolist()
    kiln, ref = args.new_tokens / min(kiln_times), args.new_tokens / min(hf_times)
    kind = ("NF4 base (transformers float32), " if args.nf4 else "") + ("LoRA rank 8, " if args.lora else "") \
        + ("serving route, " if args.serving else "")
    print(f"batch 1, prompt {args.prompt_tokens} tokens, {args.new_tokens} new tokens, greedy, {kind}"
          f"{os.cpu_count()} threads; identical tokens: {same}")
    print(f"{'kiln tok/s':>11s} {'transformers tok/s':>19s} {'ratio':>6s}")
    print(f"{kiln:11.1f} {ref:19.1f} {kiln / ref:6.2f}")


if __name__ == "__main__":
    main()
