"""Full-parameter FP32 training step: Kiln against PyTorch CPU on the same work.

Prints tokens/s of one Adam training step (forward, backward, update) for Kiln and for
PyTorch running the same Llama architecture with torch.optim.Adam, their ratio, and
Kiln's share of this machine's measured float32 GEMM peak; for the smollm2 shape, issue 19's
full-parameter target (2x PyTorch) with the share of the peak that 2x would need.

    python bench/engine_step.py [--steps 5] [--shapes tiny,smollm2]

Run with OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE unset (see docs/engine.md): this
machine's image pins OpenBLAS to Haswell kernels for old builds' sake.
"""

import argparse
import os
import time

import numpy as np
import torch
import torch.nn.functional as F

from machine import describe, gemm_peak
from trainer import Adam, DecoderOnlyTransformer, TransformerConfig

SHAPES = {
    # the engine contract's example config
    "tiny": dict(config=dict(vocabulary_size=8, maximum_context=4, model_width=8, head_count=2,
                             block_count=1, feed_forward_width=16), batch=2, context=4),
    # SmolLM2-135M's shape: width 576, 30 blocks, 9 heads, 3 KV heads, MLP 1536, V 49152
    "smollm2": dict(config=dict(vocabulary_size=49152, maximum_context=256, model_width=576,
                                head_count=9, kv_head_count=3, block_count=30,
                                feed_forward_width=1536, tie_embeddings=True, rope_theta=100000.0),
                    batch=1, context=256),
}


class TorchLlama(torch.nn.Module):
    """The same decoder in idiomatic PyTorch (nn.Linear, SDPA with GQA, fused CE)."""

    def __init__(self, cfg):
        super().__init__()
        C, H, KV, D, Fw = (cfg.model_width, cfg.head_count, cfg.kv_heads, cfg.head_dimension,
                           cfg.feed_forward_width)
        self.cfg = cfg
        self.embed = torch.nn.Embedding(cfg.vocabulary_size, C)
        self.layers = torch.nn.ModuleList()
        for _ in range(cfg.block_count):
            layer = torch.nn.Module()
            layer.ln1 = torch.nn.RMSNorm(C, eps=cfg.norm_epsilon)
            layer.q = torch.nn.Linear(C, H * D, bias=False)
            layer.k = torch.nn.Linear(C, KV * D, bias=False)
            layer.v = torch.nn.Linear(C, KV * D, bias=False)
            layer.o = torch.nn.Linear(H * D, C, bias=False)
            layer.ln2 = torch.nn.RMSNorm(C, eps=cfg.norm_epsilon)
            layer.gate = torch.nn.Linear(C, Fw, bias=False)
            layer.up = torch.nn.Linear(C, Fw, bias=False)
            layer.down = torch.nn.Linear(Fw, C, bias=False)
            self.layers.append(layer)
        self.norm = torch.nn.RMSNorm(C, eps=cfg.norm_epsilon)
        self.head = None if cfg.tie_embeddings else torch.nn.Linear(C, cfg.vocabulary_size, bias=False)
        inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
        ang = torch.outer(torch.arange(cfg.maximum_context, dtype=torch.float64), inv)
        emb = torch.cat([ang, ang], -1)
        self.cos, self.sin = emb.cos().float(), emb.sin().float()

    def forward(self, tokens, targets):
        cfg = self.cfg
        B, T = tokens.shape
        H, KV, D = cfg.head_count, cfg.kv_heads, cfg.head_dimension
        cos, sin = self.cos[:T], self.sin[:T]

        def rope(x):
            half = x.shape[-1] // 2
            return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin

        x = self.embed(tokens)
        for layer in self.layers:
            h = layer.ln1(x)
            q = rope(layer.q(h).view(B, T, H, D).transpose(1, 2))
            k = rope(layer.k(h).view(B, T, KV, D).transpose(1, 2))
            v = layer.v(h).view(B, T, KV, D).transpose(1, 2)
            att = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            x = x + layer.o(att.transpose(1, 2).reshape(B, T, H * D))
            h = layer.ln2(x)
            x = x + layer.down(F.silu(layer.gate(h)) * layer.up(h))
        h = self.norm(x)
        logits = h @ (self.embed.weight if self.head is None else self.head.weight).T
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


def _timed(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def step_flops(cfg, B, T):
    """Matrix-product FLOPs of one training step (3x forward), dense causal attention."""
    C, H, KV, D, Fw, V = (cfg.model_width, cfg.head_count, cfg.kv_heads, cfg.head_dimension,
                          cfg.feed_forward_width, cfg.vocabulary_size)
    linear = cfg.block_count * (C * (H + 2 * KV) * D + H * D * C + 3 * C * Fw) + V * C
    attention = cfg.block_count * 2 * 2 * H * T * T * D
    return 3 * (2 * B * T * linear + B * attention)


def bench_kiln(cfg, B, T, steps, tokens, targets):
    with DecoderOnlyTransformer(cfg) as model:
        with model.parameters() as params:
            with Adam(params, learning_rate=1e-4) as optimizer:
                times = []
                for _ in range(steps + 1):
                    start = time.perf_counter()
                    model.forward_backward(tokens, targets)
                    optimizer.step()
                    times.append(time.perf_counter() - start)
    return float(np.median(times[1:]))


def bench_torch(cfg, B, T, steps, tokens, targets):
    torch.manual_seed(0)
    model = TorchLlama(cfg)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    tokens, targets = torch.from_numpy(tokens), torch.from_numpy(targets)
    times = []
    for _ in range(steps + 1):
        start = time.perf_counter()
        loss = model(tokens, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    return float(np.median(times[1:]))


def loss_route_memory(shape):
    """Peak traced memory of one forward+backward (after a warm-up step) for each loss route."""
    import tracemalloc
    B, T = shape["batch"], shape["context"]
    rng = np.random.default_rng(0)
    out = {}
    for route in ("full_logits", "kt_tape_flce"):
        cfg = TransformerConfig(**shape["config"], loss_route=route)
        tokens = rng.integers(0, cfg.vocabulary_size, (B, T))
        with DecoderOnlyTransformer(cfg) as model, model.parameters() as params, Adam(params) as optimizer:
            model.forward_backward(tokens, tokens)
            optimizer.step()
            tracemalloc.start()
            model.forward_backward(tokens, tokens)
            out[route] = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
            optimizer.zero_gradients()
    return out


TARGET_FULL_PARAMETER_RATIO = 2.0  # issue 19: full-parameter training at least twice PyTorch's speed


def full_parameter_verdict(kiln_seconds, torch_seconds, flops, peak) -> str:
    """Issue 19's full-parameter target for one shape, with the share of the peak 2x would need: where PyTorch
    already runs at more than half the peak, 2x needs Kiln above it, out of reach on that machine."""
    target = TARGET_FULL_PARAMETER_RATIO
    ratio = torch_seconds / kiln_seconds
    torch_share = flops / torch_seconds / peak
    return (f"full-parameter >= {target:.0f}x PyTorch: {ratio:.2f}x, {'met' if ratio >= target else 'not met'}; "
            f"PyTorch at {torch_share:.1%} of the peak, so {target:.0f}x needs Kiln at {target * torch_share:.1%}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--shapes", default="tiny,smollm2")
    parser.add_argument("--attention", default="dense", choices=["dense", "tiled"])
    parser.add_argument("--loss-route", default="kt_tape_flce", choices=["full_logits", "kt_tape_flce"])
    args = parser.parse_args()
    threads = os.cpu_count()
    torch.set_num_threads(threads)
    peak = gemm_peak()
    print(f"{describe(peak)}; torch {torch.__version__} x{threads}")
    print(f"{'shape':10s} {'kiln tok/s':>12s} {'torch tok/s':>12s} {'ratio':>7s} {'kiln GFLOP/s':>13s} {'of peak':>8s}")
    for name in args.shapes.split(","):
        shape = SHAPES[name]
        cfg = TransformerConfig(**shape["config"], attention_algorithm=args.attention,
                                loss_route=args.loss_route)
        B, T = shape["batch"], shape["context"]
        steps = args.steps if name != "tiny" else max(args.steps, 200)
        rng = np.random.default_rng(0)
        tokens = rng.integers(0, cfg.vocabulary_size, (B, T))
        targets = rng.integers(0, cfg.vocabulary_size, (B, T))
        kiln = bench_kiln(cfg, B, T, steps, tokens, targets)
        ref = bench_torch(cfg, B, T, steps, tokens, targets)
        flops = step_flops(cfg, B, T)
        print(f"{name:10s} {B * T / kiln:12.1f} {B * T / ref:12.1f} {ref / kiln:7.2f} "
              f"{flops / kiln / 1e9:13.1f} {flops / kiln / peak:8.1%}")
        if name == "smollm2":
            verdict = full_parameter_verdict(kiln, ref, flops, peak)
    if "smollm2" in args.shapes.split(","):
        print(verdict)
        memory = loss_route_memory(SHAPES["smollm2"])
        print("peak memory allocated during one forward+backward (smollm2 shape, tracemalloc; "
              "weights, gradients and moments excluded):")
        for route, peak_bytes in memory.items():
            print(f"  {route:13s} {peak_bytes / 2**20:8.1f} MiB")


if __name__ == "__main__":
    main()
