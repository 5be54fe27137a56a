"""base_precision "bfloat16": a LoRA model's frozen base computed from bfloat16 operands on oneDNN.

The conversion kernel against its numpy twin and PyTorch; oneDNN's products against float32 arithmetic on
the rounded operands; a LoRA model against PyTorch + peft computing the same recipe, and against PyTorch's
BF16 autocast; bit-identical steps across fresh processes; the refusals. Tests that multiply need a CPU with
BF16 dot-product instructions and the oneDNN library, and skip with the loader's reason elsewhere.
"""

import json
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch

from native_ext import bf16, blas, kernels, onednn, reference
from tests.engine.test_lora import batch_with_ignored_prefix, peft_twin, randomise_adapters, tiny
from trainer import DecoderOnlyTransformer, LoraConfig, TransformerConfig

UNAVAILABLE = onednn.unavailable_reason()
needs_bf16 = pytest.mark.skipif(UNAVAILABLE is not None, reason=f"no bfloat16 route here: {UNAVAILABLE}")


def _bits(values):
    return np.array(values, np.uint32).view(np.float32)


def test_to_bf16_equals_its_numpy_twin_and_pytorch():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((37, 301), dtype=np.float32) * np.float32(1e3)
    x[0, :12] = [np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-40, -1e-40, 3.4e38, -3.4e38, 1.0, -1.0]
    # ties: 1 + 2^-8 rounds down to even 1.0, 1 + 3 * 2^-8 up; the largest float rounds to infinity
    x[1, :4] = _bits([0x3F808000, 0x3F818000, 0x7F7FFFFF, 0x3F80FFFF])
    ours, twin = np.empty(x.shape, np.uint16), np.empty(x.shape, np.uint16)
    kernels.to_bf16(x, ours)
    reference.to_bf16(x, twin)
    assert np.array_equal(ours, twin)
    assert [hex(v) for v in ours[1, :4]] == ["0x3f80", "0x3f82", "0x7f80", "0x3f81"]
    assert np.isnan(reference.from_bf16(ours[0, :2])).all()
    theirs = torch.from_numpy(x).bfloat16().view(torch.int16).numpy().view(np.uint16)
    numbers = ~np.isnan(x)  # PyTorch keeps another NaN payload
    assert np.array_equal(ours[numbers], theirs[numbers])
    with pytest.raises(TypeError, match="uint16"):
        kernels.to_bf16(x, np.empty(x.shape, np.float32))


@needs_bf16
@pytest.mark.parametrize("trans_b", [False, True])
def test_bf16_gemm_is_float32_arithmetic_on_the_rounded_operands(trans_b):
    rng = np.random.default_rng(1)
    a = bf16.to_bf16(rng.standard_normal((70, 300), dtype=np.float32))
    b = bf16.to_bf16(rng.standard_normal((50, 300) if trans_b else (300, 50), dtype=np.float32))
    expected = reference.from_bf16(a).astype(np.float64) @ (reference.from_bf16(b).T if trans_b else
                                                            reference.from_bf16(b))
    c = np.full((70, 50), np.nan, np.float32)
    onednn.gemm(c, a, b, trans_b=trans_b)
    assert np.abs(c - expected).max() <= 1e-5 * np.abs(expected).max()
    again = np.ones((70, 50), np.float32)
    onednn.gemm(again, a, b, trans_b=trans_b, beta=1.0)
    assert np.abs(again - (expected + 1)).max() <= 1e-5 * np.abs(expected).max()
    with pytest.raises(ValueError, match="do not fit"):
        onednn.gemm(np.empty((70, 51), np.float32), a, b, trans_b=trans_b)
    with pytest.raises(TypeError, match="bfloat16 bits"):
        onednn.gemm(c, a.view(np.int16), b, trans_b=trans_b)


def test_blas_matmul_is_numpys_matmul_on_openblas_and_the_process_gemm_outside_a_route():
    rng = np.random.default_rng(2)
    q, k = rng.standard_normal((3, 20, 8), dtype=np.float32), rng.standard_normal((3, 12, 8), dtype=np.float32)
    with blas.routed(blas.OPENBLAS):
        assert blas.matmul(q, k.transpose(0, 2, 1)).tobytes() == np.matmul(q, k.transpose(0, 2, 1)).tobytes()
        assert blas.matmul(q[0], k[0].T).tobytes() == np.matmul(q[0], k[0].T).tobytes()
    expected = np.empty((3, 20, 12), np.float32)
    for g in range(3):
        if blas.FLOAT32_GEMM == "onednn":  # each matrix product on oneDNN, whose bytes may differ from OpenBLAS's
            onednn.sgemm(expected[g], q[g], k[g], trans_b=True)
        else:
            expected[g] = np.matmul(q[g], k[g].T)
    assert blas.matmul(q, k.transpose(0, 2, 1)).tobytes() == expected.tobytes()
    assert blas.matmul(q[0], k[0].T).tobytes() == expected[0].tobytes()


@needs_bf16
def test_routed_products_go_to_onednn_and_agree_with_numpy():
    rng = np.random.default_rng(3)
    q, k = rng.standard_normal((3, 20, 8), dtype=np.float32), rng.standard_normal((3, 12, 8), dtype=np.float32)
    calls = []

    def counting(*args):
        calls.append(args[0].shape)
        onednn.sgemm(*args)

    with blas.routed(counting):
        scores = blas.matmul(q, k.transpose(0, 2, 1))  # a transposed view per group
        out = np.empty((20, 12), np.float32)
        blas.matmul(q[1], k[1].T, out=out)
        c = np.zeros((20, 8), np.float32)
        blas.gemm(c, scores[0], k[0], alpha=0.5)
    assert calls == [(20, 12)] * 4 + [(20, 8)]
    expected = np.matmul(q, k.transpose(0, 2, 1))
    assert np.allclose(scores, expected, rtol=1e-5, atol=1e-5)
    assert np.allclose(out, expected[1], rtol=1e-5, atol=1e-5)
    assert np.allclose(c, 0.5 * expected[0] @ k[0], rtol=1e-4, atol=1e-4)


class _Bf16Linear(torch.autograd.Function):
    """The recipe in PyTorch: y = bf16(x) @ bf16(W).T and dx = bf16(dy) @ bf16(W), accumulated in float32, for
    every frozen Linear (the blocks' projections and the output projection)."""

    @staticmethod
    def forward(ctx, x, weight):
        rounded = weight.detach().bfloat16().float()
        ctx.save_for_backward(rounded)
        return x.bfloat16().float() @ rounded.T

    @staticmethod
    def backward(ctx, dy):
        (rounded,) = ctx.saved_tensors
        return dy.bfloat16().float() @ rounded, None


def _recipe_twin(model, lora):
    twin = peft_twin(model, lora)
    for module in twin.modules():
        if isinstance(module, torch.nn.Linear) and not module.weight.requires_grad:  # the base's and the head
            module.forward = lambda x, weight=module.weight: _Bf16Linear.apply(x, weight)
    return twin


def _compare(model, twin, inputs, targets, tolerance):
    V = model.config.vocabulary_size
    ours = model.logits(inputs)
    theirs = twin(input_ids=torch.from_numpy(inputs)).logits.detach().float().numpy()
    logits_error = np.abs(ours - theirs).max() / np.abs(theirs).max()
    loss = model.forward_backward(inputs, targets)
    reference_loss = torch.nn.functional.cross_entropy(
        twin(input_ids=torch.from_numpy(inputs)).logits.float().reshape(-1, V),
        torch.from_numpy(targets).reshape(-1), ignore_index=-100)
    reference_loss.backward()
    named = dict(twin.named_parameters())
    grad_error = 0.0
    with model.adapter_parameters() as adapters:
        for p in adapters:
            expected = named["base_model.model." + p.name.replace(".weight", ".default.weight")].grad.float().numpy()
            grad_error = max(grad_error, np.linalg.norm(p.grad - expected) / np.linalg.norm(expected))
    assert logits_error <= tolerance, logits_error
    assert abs(loss - reference_loss.item()) <= tolerance * abs(reference_loss.item())
    assert grad_error <= tolerance, grad_error


@needs_bf16
@pytest.mark.parametrize("algorithm", ["dense", "tiled"])
def test_lora_model_matches_pytorch_computing_the_same_recipe(algorithm):
    lora = LoraConfig(rank=4, alpha=8)
    with DecoderOnlyTransformer(tiny(base_precision="bfloat16", attention_algorithm=algorithm,
                                     attention_block_size=4, loss_route="kt_tape_flce",
                                     loss_chunk_tokens=8)) as model:
        model.attach_lora(lora)
        randomise_adapters(model)
        twin = _recipe_twin(model, lora)
        inputs, targets = batch_with_ignored_prefix(seed=4)
        # float32 summation orders differ, and an operand that lands on the other side of a bfloat16
        # rounding boundary moves by 2^-8 of itself: far below bfloat16's own error, far above float32's
        _compare(model, twin, inputs, targets, tolerance=1e-3)


@needs_bf16
def test_lora_model_is_within_bf16_error_of_pytorch_autocast():
    """PyTorch's CPU autocast also rounds attention, the output projection and the adapters (Kiln keeps them
    float32): the two agree to bfloat16's precision, and both differ from float32 by more than that tolerance
    allows for the recipe twin above."""
    lora = LoraConfig(rank=4, alpha=8)
    with DecoderOnlyTransformer(tiny(base_precision="bfloat16")) as model, \
            DecoderOnlyTransformer(tiny()) as exact:
        model.attach_lora(lora)
        exact.attach_lora(lora)
        exact.load_adapter_state_dict(randomise_adapters(model))
        twin = peft_twin(model, lora)
        rng = np.random.default_rng(5)
        inputs, targets = rng.integers(0, 64, (2, 12)), rng.integers(0, 64, (2, 12))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _compare(model, twin, inputs, targets, tolerance=3e-2)
        difference = np.abs(model.logits(inputs) - exact.logits(inputs)).max() / np.abs(exact.logits(inputs)).max()
        assert 1e-3 < difference < 3e-2  # the route really rounds, and only to bfloat16's precision


_STEPS = """
import hashlib, json, sys
import numpy as np
from trainer import Adam, DecoderOnlyTransformer, LoraConfig, TransformerConfig
config = TransformerConfig(vocabulary_size=300, maximum_context=64, model_width=96, head_count=6, kv_head_count=2,
                           block_count=2, feed_forward_width=256, loss_route="kt_tape_flce", loss_chunk_tokens=16,
                           attention_algorithm="tiled", attention_block_size=16, base_precision="bfloat16")
rng = np.random.default_rng(1)
with DecoderOnlyTransformer(config) as model:
    model.attach_lora(LoraConfig(rank=4, alpha=8.0))
    losses = []
    tokens = rng.integers(0, 300, (2, 49))
    with model.adapter_parameters() as adapters, Adam(adapters, learning_rate=1e-2) as optimizer:
        for _ in range(3):
            losses.append(model.forward_backward(tokens[:, :-1], tokens[:, 1:]))
            optimizer.step()
    digest = hashlib.sha256(b"".join(v.tobytes() for v in model.adapter_state_dict().values())).hexdigest()
json.dump({"losses": losses, "adapters": digest}, sys.stdout)
"""


@needs_bf16
def test_bf16_steps_are_bit_identical_across_fresh_processes():
    """oneDNN partitions its products by thread count alone: the same bytes run after run (the resume test
    in test_checkpoints_adapters.py continues a bfloat16 run in a fresh process with ==)."""
    runs = []
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", _STEPS], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        runs.append(json.loads(done.stdout))
    assert runs[0] == runs[1]
    assert runs[0]["losses"][2] < runs[0]["losses"][0]  # it learns the batch


# -- refusals and the configuration ------------------------------------------------------------


def test_base_precision_is_written_only_when_not_float32():
    assert "base_precision" not in tiny().to_dict()
    data = tiny(base_precision="bfloat16").to_dict()
    assert data["base_precision"] == "bfloat16"
    assert TransformerConfig.from_dict(data).base_precision == "bfloat16"
    with pytest.raises(ValueError, match="base_precision must be one of"):
        tiny(base_precision="float16")


def test_bf16_is_refused_for_a_trainable_quantized_or_cuda_base():
    with DecoderOnlyTransformer(tiny(base_precision="bfloat16")) as model:
        tokens = np.zeros((1, 4), np.int64)
        with pytest.raises(ValueError, match="attach_lora first"):
            model.logits(tokens)
        with pytest.raises(ValueError, match="attach_lora first"):
            model.forward_backward(tokens, tokens)
        with pytest.raises(ValueError, match="dense frozen base"):
            model.quantize()
    from trainer.cuda_model import CudaModel
    with pytest.raises(ValueError, match="CPU route"):
        CudaModel._check_supported(tiny(base_precision="bfloat16"))


def test_bf16_without_the_cpu_instructions_or_the_library_is_refused_with_the_reason(monkeypatch, tmp_path):
    monkeypatch.setattr(onednn, "cpu_bf16_flags", lambda: ())
    with DecoderOnlyTransformer(tiny(base_precision="bfloat16")) as model:
        with pytest.raises(RuntimeError, match="no BF16 dot-product instructions"):
            model.attach_lora(LoraConfig(rank=2, alpha=4))
    monkeypatch.setattr(onednn, "cpu_bf16_flags", lambda: ("avx512_bf16",))
    monkeypatch.setenv(onednn.LIBRARY_ENV, str(tmp_path / "libdnnl.so.3"))
    onednn._load.cache_clear()
    try:
        assert onednn.unavailable_reason().startswith(f"oneDNN library not found at {tmp_path}")
    finally:
        monkeypatch.delenv(onednn.LIBRARY_ENV)
        onednn._load.cache_clear()


@pytest.mark.django_db  # kiln doctor reports the database too
def test_kiln_doctor_reports_the_bf16_route(capsys, monkeypatch):
    from kiln_web.cli import main

    main(["doctor", "--json"])
    report = json.loads(capsys.readouterr().out)["onednn"]
    assert report["available"] == (UNAVAILABLE is None) and report["reason"] == UNAVAILABLE
    assert report["cpu_bf16_flags"] == list(onednn.cpu_bf16_flags())
    if UNAVAILABLE is None:
        assert report["version"] and len(report["library_sha256"]) == 64 and report["threads"] >= 1
    monkeypatch.setattr(onednn, "cpu_bf16_flags", lambda: ())
    main(["doctor"])
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("onednn")]
    assert len(lines) == 1 and "precision bfloat16 unavailable: this CPU has no BF16" in lines[0]


@needs_bf16
def test_computing_holds_numpys_blas_at_one_thread_and_routes_its_products():
    from threadpoolctl import threadpool_info

    def numpys_threads():
        return next(i["num_threads"] for i in threadpool_info() if i["filepath"] == str(blas.LIBRARY_PATH))

    before, default = numpys_threads(), blas.route()  # None, or oneDNN's sgemm where it computes float32 too
    counting = []
    with bf16.computing(), blas.routed(lambda *args: counting.append(args) or onednn.sgemm(*args)):
        assert numpys_threads() == 1  # its idle worker would spin beside oneDNN's threads
        assert blas.route() is not default
        other = []
        thread = threading.Thread(target=lambda: other.append(blas.route()))
        thread.start()
        thread.join()
        assert other == [default]  # another thread's products (a serving thread's) stay where they were
    with bf16.computing():
        assert blas.route() is onednn.sgemm
    assert numpys_threads() == before and blas.route() is default
