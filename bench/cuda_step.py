"""A LoRA SFT step on the GPU: PyTorch CUDA + peft, and Kiln's CUDA kernels at the same shape.

Kiln has no CUDA training step yet (the trainer runs on the CPU engine; the CUDA library is its
kernels), so this script times, at the SmolLM2-135M shape (context 256, batch 1, rank 8 on all seven
projections, FP32, TF32 off on both sides):

- the PyTorch + peft step (forward, backward, Adam over the adapters), tokens/s;
- each Kiln CUDA kernel one decoder block (and the loss) calls, in milliseconds per call.

It says which side could not run and why, and prints one JSON summary line last:

    python bench/cuda_step.py [--steps 5]
"""

import argparse
import ctypes
import json
import time

import numpy as np

SHAPE = dict(vocabulary_size=49152, maximum_context=256, model_width=576, head_count=9, kv_head_count=3,
             block_count=30, feed_forward_width=1536, rope_theta=100000.0)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RANK, ALPHA, CONTEXT = 8, 16, 256


def torch_peft_step(steps: int) -> dict:
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
    config = LlamaConfig(vocab_size=SHAPE["vocabulary_size"], hidden_size=SHAPE["model_width"],
                         intermediate_size=SHAPE["feed_forward_width"], num_hidden_layers=SHAPE["block_count"],
                         num_attention_heads=SHAPE["head_count"], num_key_value_heads=SHAPE["kv_head_count"],
                         max_position_embeddings=SHAPE["maximum_context"], rope_theta=SHAPE["rope_theta"],
                         tie_word_embeddings=True, attn_implementation="sdpa")
    model = get_peft_model(LlamaForCausalLM(config).cuda(),
                           LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=TARGETS, lora_dropout=0.0))
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    tokens = torch.randint(0, SHAPE["vocabulary_size"], (1, CONTEXT), device="cuda")

    def step():
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # warm-up: kernels, allocator
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / steps
    return {"ran": True, "step_ms": seconds * 1e3, "tokens_per_s": CONTEXT / seconds,
            "peak_memory_mib": torch.cuda.max_memory_allocated() / 2**20, "device": torch.cuda.get_device_name(0)}


def kiln_kernels(steps: int) -> dict:
    from native_ext import cuda

    try:
        lib = cuda.load()
    except cuda.CudaUnavailable as error:
        return {"ran": False, "reason": str(error)}
    rng = np.random.default_rng(0)
    arrays = []

    def put(array):
        arrays.append(cuda.DeviceArray.from_host(lib, np.ascontiguousarray(array)))
        return arrays[-1].ptr

    def zeros(*shape, dtype=np.float32):
        arrays.append(cuda.DeviceArray.zeros(lib, shape, dtype))
        return arrays[-1].ptr

    def normal(*shape, scale=0.05):
        return put((rng.standard_normal(shape) * scale).astype(np.float32))

    handle = ctypes.c_void_p(0)
    cuda.check(lib, lib.kiln_cuda_blas_create(ctypes.byref(handle), None, 32 << 20), "kiln_cuda_blas_create")
    blas = handle.value
    N, C, F, V = CONTEXT, SHAPE["model_width"], SHAPE["feed_forward_width"], SHAPE["vocabulary_size"]
    H, KV = SHAPE["head_count"], SHAPE["kv_head_count"]
    D, g = C // H, H // KV
    x, w, out, rstd = normal(N, C), put(np.ones(C, np.float32)), zeros(N, C), zeros(N)
    workspace_bytes = ctypes.c_size_t(0)
    lib.kiln_cuda_rmsnorm_backward_workspace(N, C, ctypes.byref(workspace_bytes))
    rms_workspace = zeros(workspace_bytes.value, dtype=np.uint8)
    dx, dw = zeros(N, C), zeros(C)
    qkv = normal(N, (H + 2 * KV) * D, scale=1.0)
    angles = np.arange(CONTEXT)[:, None] * (1.0 / 1e5 ** (np.arange(0, D, 2) / D))[None, :]
    cos, sin = put(np.cos(angles).astype(np.float32)), put(np.sin(angles).astype(np.float32))
    q_rot = zeros(1, KV, N, g, D)
    q, k, v, att, lse = normal(KV, N * g, D, scale=1.0), normal(KV, N, D, scale=1.0), normal(KV, N, D, scale=1.0), \
        zeros(KV, N * g, D), zeros(KV, N * g)
    dq, dk, dv, delta = zeros(KV, N * g, D), zeros(KV, N, D), zeros(KV, N, D), zeros(KV, N * g)
    gate_up, act, dgate_up = normal(N, 2 * F, scale=1.0), zeros(N, F), zeros(N, 2 * F)
    A, B, xa, dA, dB, dxa = normal(RANK, C), normal((H + 2 * KV) * D, RANK), zeros(N, RANK), zeros(RANK, C), \
        zeros((H + 2 * KV) * D, RANK), zeros(N, RANK)
    packed = put(rng.integers(0, 256, 2 * F * C // 2, dtype=np.uint8))
    absmax = put(np.full(2 * F * C // 64, 0.05, np.float32))
    tile_rows = 512
    tile, linear_out = zeros(tile_rows, C), zeros(N, 2 * F)
    head, targets = normal(V, C), put(rng.integers(0, V, N).astype(np.int64))
    losses, dhidden, logits = zeros(N), zeros(N, C), zeros(N, V)
    strides = ((H + 2 * KV) * D * N, (H + 2 * KV) * D, D)
    scale = float(1.0 / np.sqrt(D))
    calls = {
        "rmsnorm_forward": lambda: lib.kiln_cuda_rmsnorm_forward(x, w, 1e-5, out, rstd, N, C, None),
        "rmsnorm_backward": lambda: lib.kiln_cuda_rmsnorm_backward(x, x, w, rstd, dx, dw, rms_workspace, N, C, None),
        "rope_forward (q)": lambda: lib.kiln_cuda_rope_forward(qkv, *strides, cos, sin, CONTEXT, 0, q_rot, 1, N, KV,
                                                                g, D, None),
        "attention_forward": lambda: lib.kiln_cuda_attention_forward(q, k, v, att, lse, KV, N, g, N, D, 0, 0, scale,
                                                                     None),
        "attention_backward": lambda: lib.kiln_cuda_attention_backward(att, q, k, v, att, lse, dq, dk, dv, delta, KV,
                                                                       N, g, N, D, 0, 0, scale, None),
        "swiglu_forward": lambda: lib.kiln_cuda_swiglu_forward(gate_up, act, N, F, None),
        "swiglu_backward": lambda: lib.kiln_cuda_swiglu_backward(act, gate_up, dgate_up, N, F, None),
        "lora_forward (qkv)": lambda: lib.kiln_cuda_lora_forward(blas, x, A, B, 2.0, xa, qkv, N, C,
                                                                  (H + 2 * KV) * D, RANK, 0),
        "lora_backward (qkv)": lambda: lib.kiln_cuda_lora_backward(blas, x, A, B, xa, qkv, 2.0, dA, dB, None, dxa, N,
                                                                    C, (H + 2 * KV) * D, RANK, 0),
        "nf4_linear (gate_up)": lambda: lib.kiln_cuda_nf4_linear(blas, x, packed, absmax, 64, linear_out, 0.0, tile,
                                                                  tile_rows, N, C, 2 * F, 0),
        "fused_linear_cross_entropy": lambda: lib.kiln_cuda_fused_linear_cross_entropy(
            blas, x, head, targets, N, C, V, N, 1, 1.0 / N, None, -100, losses, dhidden, None, logits, 0),
    }
    start, end = ctypes.c_void_p(0), ctypes.c_void_p(0)
    lib.kiln_cuda_event_create(ctypes.byref(start))
    lib.kiln_cuda_event_create(ctypes.byref(end))
    timings = {}
    try:
        for name, call in calls.items():
            cuda.check(lib, call(), name)  # warm-up
            cuda.check(lib, lib.kiln_cuda_device_synchronize(), name)
            lib.kiln_cuda_event_record(start.value, None)
            for _ in range(steps):
                call()
            lib.kiln_cuda_event_record(end.value, None)
            cuda.check(lib, lib.kiln_cuda_event_synchronize(end.value), name)
            elapsed = ctypes.c_float(0)
            lib.kiln_cuda_event_elapsed_ms(ctypes.byref(elapsed), start.value, end.value)
            timings[name] = elapsed.value / steps
    finally:
        lib.kiln_cuda_blas_destroy(blas)
        for array in arrays:
            array.free()
    return {"ran": True, "kernel_ms": timings}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    torch_side = torch_peft_step(args.steps)
    kiln_side = kiln_kernels(args.steps)
    print("Kiln CUDA training step: not implemented yet (the trainer runs on the CPU engine); kernels only")
    if torch_side["ran"]:
        print(f"PyTorch + peft LoRA step ({torch_side['device']}, FP32, TF32 off): {torch_side['step_ms']:.1f} ms, "
              f"{torch_side['tokens_per_s']:.0f} tokens/s, peak {torch_side['peak_memory_mib']:.0f} MiB")
    else:
        print(f"PyTorch + peft LoRA step: not run: {torch_side['reason']}")
    if kiln_side["ran"]:
        for name, ms in kiln_side["kernel_ms"].items():
            print(f"  kiln_cuda {name:<28} {ms:8.3f} ms")
    else:
        print(f"Kiln CUDA kernels: not run: {kiln_side['reason']}")
    print(json.dumps({"shape": SHAPE, "context": CONTEXT, "rank": RANK, "steps": args.steps, "torch_peft": torch_side,
                      "kiln_cuda_kernels": kiln_side, "kiln_cuda_step": None}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
