"""CudaModel (trainer/cuda_model.py) against the CPU engine: loss, logits, every gradient and Adam steps, on a
GPU (skipped, with the probe's reason, without one) and on the host emulation of the CUDA library (the same
kernel source built by g++ with -DKILN_CUDA_EMULATE; conftest.py's emulated_library).

Tolerance: a maximum relative difference (max |device - cpu| / max |cpu|) of 1e-4 for losses, logits and
gradients, 1e-4 for parameters and moments after a few Adam steps. The device and the CPU engine sum in
different orders (cuBLAS or the emulation's double-accumulated GEMM against numpy's BLAS), so closeness is
what is promised across them; on one device the same steps give the same bits, compared with `==`.
"""

import numpy as np
import pytest

from trainer import Adam, DecoderOnlyTransformer, TransformerConfig
from trainer.blocks import NF4_SCRATCH_ELEMENTS
from trainer import attention as cpu_attention
from trainer import cuda_model
from trainer.cuda_model import BLAS_WORKSPACE_BYTES, CudaModel, planned_device_bytes
from trainer.lora import PROJECTIONS, LoraConfig
from tests.engine.conftest import cuda_probe
from tests.engine.test_cuda_kernels import rounded

PROBE = cuda_probe()
TOLERANCE = 1e-4
SHAPE = dict(vocabulary_size=64, maximum_context=16, model_width=32, head_count=4, kv_head_count=2, block_count=2,
             feed_forward_width=48, initializer_range=0.2, loss_chunk_tokens=5)
B, T = 2, 16


def make_model(lora=None, quantize=None, **overrides):
    """A tiny CPU model; adapters get random values so that every adapter gradient is non-trivial."""
    model = DecoderOnlyTransformer(TransformerConfig(**{**SHAPE, **overrides}))
    if quantize is not None:
        model.quantize(**quantize)
    if lora is not None:
        model.attach_lora(lora)
        rng = np.random.default_rng(5)
        model.load_adapter_state_dict({name: rng.standard_normal(value.shape).astype(np.float32) * 0.1
                                       for name, value in model.adapter_state_dict().items()})
    return model


def batch(seed):
    rng = np.random.default_rng(seed)
    inputs = rng.integers(0, SHAPE["vocabulary_size"], (B, T))
    targets = rng.integers(0, SHAPE["vocabulary_size"], (B, T))
    targets[0, :3] = -100  # a prompt-like prefix carries no loss
    targets[1, -1] = -100
    return inputs, targets


def cpu_gradients(model):
    """{name: gradient} of the CPU model's trainable parameters."""
    if model.lora_config is not None:
        with model.adapter_parameters() as parameters:
            return {p.name: p.grad.copy() for p in parameters}
    if model.quantization is not None:
        return {}
    with model.parameters() as parameters:
        return {p.name: p.grad.copy() for p in parameters}


def compare_step(lib, assert_close, model, batches=(0,), attention="tiled"):
    """Forward/backward over `batches` (gradients accumulating) on both engines; compare loss, logits, gradients."""
    with CudaModel(model, lib, attention=attention) as device:
        for seed in batches:
            inputs, targets = batch(seed)
            device_loss = device.forward_backward(inputs, targets)
            cpu_loss = model.forward_backward(inputs, targets)
            assert_close(device_loss, cpu_loss, TOLERANCE, f"loss of batch {seed}")
        assert_close(device.logits(inputs), model.logits(inputs), TOLERANCE, "logits")
        gradients, expected = device.gradients(), cpu_gradients(model)
        assert list(gradients) == list(expected)
        for name, gradient in expected.items():
            assert np.any(gradient), f"{name}: the CPU gradient is zero, the comparison would prove nothing"
            assert_close(gradients[name], gradient, TOLERANCE, name)
        return device.state_dict()


@pytest.mark.parametrize("overrides", [dict(), dict(tie_embeddings=True, loss_route="kt_tape_flce"),
                                       dict(kv_head_count=4, attention_algorithm="tiled",
                                            activation_checkpointing="blocks")],
                         ids=["untied-full-logits", "tied-chunked-flce", "no-grouping"])
def test_dense_step_matches_the_cpu_engine(lib, assert_close, overrides):
    model = make_model(**overrides)
    state = compare_step(lib, assert_close, model)
    assert len(state) == len(model.state_dict())  # every base parameter is trainable, and compared above


@pytest.mark.parametrize("lora", [LoraConfig(rank=4, alpha=8.0),
                                  LoraConfig(rank=3, alpha=6.0, targets=("q_proj", "v_proj", "up_proj", "down_proj"),
                                             use_rslora=True)], ids=["all-targets", "subset-rslora"])
def test_lora_step_matches_the_cpu_engine(lib, assert_close, lora):
    model = make_model(lora=lora)
    compare_step(lib, assert_close, model, batches=(0, 1))  # two batches: gradients accumulate on the device
    assert len(cpu_gradients(model)) == 2 * SHAPE["block_count"] * len(lora.targets)


@pytest.mark.parametrize("quantize", [dict(block_size=64), dict(block_size=32, double_quantization=True)],
                         ids=["absmax", "double-quantization"])
def test_qlora_step_matches_the_cpu_engine(lib, assert_close, quantize):
    model = make_model(lora=LoraConfig(rank=4, alpha=8.0, targets=PROJECTIONS), quantize=quantize)
    compare_step(lib, assert_close, model)
    recorder = DequantizeRecorder(lib)
    with CudaModel(model, recorder) as device:  # the base is uploaded packed and dequantized in row tiles only
        device.forward_backward(*batch(0))
        packed = model.packed_state()
        name = next(iter(packed))
        np.testing.assert_array_equal(device.state_dict()[name], model.state_dict()[name])
        sizes = {p.packed.ptr: p.rows * p.cols for block in device._blocks
                 for projections in block.projections.values() for p in projections}
    assert len(sizes) == len(packed) and recorder.calls
    for pointer, count in recorder.calls:
        assert count < sizes[pointer], "a whole NF4 weight was dequantized"
        assert count <= NF4_SCRATCH_ELEMENTS


class DequantizeRecorder:
    """The library, recording (packed weight, element count) of every kiln_cuda_nf4_dequantize call."""

    def __init__(self, lib):
        self.lib, self.calls = lib, []

    def __getattr__(self, name):
        function = getattr(self.lib, name)
        if name != "kiln_cuda_nf4_dequantize":
            return function

        def recorded(packed, absmax, out, start, count, block_size, stream):
            self.calls.append((packed, count))
            return function(packed, absmax, out, start, count, block_size, stream)
        return recorded


def test_frozen_quantized_base_without_adapters_has_nothing_to_train(lib, assert_close):
    model = make_model(quantize=dict(block_size=64))
    with CudaModel(model, lib) as device:
        inputs, targets = batch(0)
        assert_close(device.forward_backward(inputs, targets), model.forward_backward(inputs, targets), TOLERANCE,
                     "loss")
        assert device.gradients() == {}
        with pytest.raises(ValueError, match="nothing is trainable"):
            device.adam_step()


@pytest.mark.parametrize("overrides", [dict(sliding_window=5, attention_bias=True, qk_norm=True, family="qwen3"),
                                       dict(rope_scaling=("llama3", 8.0, 1.0, 4.0, 8), family="llama")],
                         ids=["window-bias-qk-norm", "llama3-rope"])
def test_family_options_match_the_cpu_engine(lib, assert_close, overrides):
    model = make_model(**overrides)
    if overrides.get("attention_bias"):  # nonzero biases, so that their forward matters
        rng = np.random.default_rng(3)
        state = model.fp32_state_dict()
        model.load_state_dict({name: value + (rng.standard_normal(value.shape).astype(np.float32) * 0.1
                                              if name.endswith(".bias") else 0)
                               for name, value in state.items()})
    compare_step(lib, assert_close, model)
    lora = make_model(lora=LoraConfig(rank=2, alpha=4.0), **overrides)  # the same options under adapters
    compare_step(lib, assert_close, lora)


def test_weighted_objective_and_token_losses_match_the_cpu_engine(lib, assert_close):
    model = make_model(lora=LoraConfig(rank=4, alpha=8.0))
    inputs, targets = batch(2)

    def coefficients(logp):
        return np.linspace(-1.0, 1.0, logp.size).reshape(logp.shape)

    with CudaModel(model, lib) as device:
        assert_close(device.token_losses(inputs, targets), model.token_losses(inputs, targets), TOLERANCE,
                     "token losses")
        assert_close(device.forward_backward_weighted(inputs, targets, coefficients),
                     model.forward_backward_weighted(inputs, targets, coefficients), TOLERANCE, "log p")
        expected = cpu_gradients(model)
        for name, gradient in device.gradients().items():
            assert_close(gradient, expected[name], TOLERANCE, name)


def adam_run(lib, model, steps, hyperparameters):
    """`steps` device Adam steps; returns (losses, parameters, optimizer state, gradients before the last step)."""
    with CudaModel(model, lib) as device:
        losses = []
        for step in range(steps):
            losses.append(device.forward_backward(*batch(10 + step)))
            gradients = device.gradients()
            device.adam_step(**hyperparameters)
        parameters = device.adapter_state_dict() if model.lora_config is not None else device.state_dict()
        return losses, parameters, device.optimizer_state_dict(), gradients


@pytest.mark.parametrize("kind", ["dense", "lora"])
def test_adam_steps_match_the_cpu_engine(lib, assert_close, kind):
    hyperparameters = dict(learning_rate=1e-2, beta1=0.9, beta2=0.99, epsilon=1e-8, weight_decay=0.01)
    lora = LoraConfig(rank=4, alpha=8.0) if kind == "lora" else None
    losses, parameters, state, _ = adam_run(lib, make_model(lora=lora), 3, hyperparameters)
    model = make_model(lora=lora)
    with (model.adapter_parameters() if lora else model.parameters()) as trainable:
        optimizer = Adam(trainable, **hyperparameters)
        for step in range(3):
            assert_close(losses[step], model.forward_backward(*batch(10 + step)), TOLERANCE, f"loss of step {step}")
            optimizer.step()
        expected = optimizer.state_dict()
        for p in trainable:
            assert_close(parameters[p.name], p.value, TOLERANCE, p.name)
    assert (state["step"], state["beta1_power"], state["beta2_power"]) == \
        (expected["step"], expected["beta1_power"], expected["beta2_power"])
    assert state["hyperparameters"] == expected["hyperparameters"]
    for key in ("first_moment", "second_moment"):
        assert list(state[key]) == list(expected[key])
        for name, moment in expected[key].items():
            assert_close(state[key][name], moment, TOLERANCE, f"{key} {name}")


def test_a_resumed_device_run_ends_with_the_same_bits(lib):
    """Interrupted after two steps (adapters and optimizer state downloaded) and resumed in a fresh device
    model, the third step ends `==` to an uninterrupted run's."""
    lora, hyperparameters = LoraConfig(rank=4, alpha=8.0), dict(learning_rate=1e-2, weight_decay=0.01)
    _, whole, whole_state, _ = adam_run(lib, make_model(lora=lora), 3, hyperparameters)
    with CudaModel(make_model(lora=lora), lib) as first:
        for step in range(2):
            first.forward_backward(*batch(10 + step))
            first.adam_step(**hyperparameters)
        adapters, state = first.adapter_state_dict(), first.optimizer_state_dict()
    with CudaModel(make_model(lora=lora), lib) as resumed:
        resumed.load_adapter_state_dict(adapters)
        resumed.load_optimizer_state_dict(state)
        resumed.forward_backward(*batch(12))
        resumed.adam_step(**hyperparameters)
        for name, value in resumed.adapter_state_dict().items():
            assert np.array_equal(value, whole[name]), name
        final = resumed.optimizer_state_dict()
    assert (final["step"], final["beta1_power"], final["beta2_power"]) == \
        (whole_state["step"], whole_state["beta1_power"], whole_state["beta2_power"])
    for key in ("first_moment", "second_moment"):
        for name, moment in final[key].items():
            assert np.array_equal(moment, whole_state[key][name]), f"{key} {name}"


def test_the_cpu_optimizer_state_continues_on_the_device(lib, assert_close):
    lora, hyperparameters = LoraConfig(rank=4, alpha=8.0), dict(learning_rate=1e-2, beta2=0.99)
    model = make_model(lora=lora)
    with model.adapter_parameters() as trainable:
        optimizer = Adam(trainable, **hyperparameters)
        model.forward_backward(*batch(10))
        optimizer.step()
        with CudaModel(model, lib) as device:
            device.load_optimizer_state_dict(optimizer.state_dict())
            with pytest.raises(KeyError, match="first_moment names"):
                device.load_optimizer_state_dict({**optimizer.state_dict(), "first_moment": {}})
            device.forward_backward(*batch(11))
            device.adam_step(**hyperparameters)
            model.forward_backward(*batch(11))
            optimizer.step()
            for p in trainable:
                assert_close(device.adapter_state_dict()[p.name], p.value, TOLERANCE, p.name)
            assert device.optimizer_state_dict()["step"] == optimizer.state_dict()["step"] == 2


@pytest.mark.parametrize("kind", ["dense", "lora", "qlora"])
def test_clipping_and_scaling_follow_the_cpu_step(lib, assert_close, kind):
    """trainer.runs.step.clip_and_step on the CPU engine (norm, clip decision, factor, Adam step) against
    clip_grad_norm + adam_step on the device; scale_gradients and the clip factor are one float32 product per
    element, so the device's own gradients after them are `==` to the downloaded ones times the factor."""
    from trainer.runs.step import clip_and_step

    hyperparameters = dict(learning_rate=1e-2, beta1=0.9, beta2=0.99, epsilon=1e-8, weight_decay=0.01)
    lora = LoraConfig(rank=4, alpha=8.0) if kind != "dense" else None
    quantize = dict(block_size=32, double_quantization=True) if kind == "qlora" else None
    with CudaModel(make_model(lora=lora, quantize=quantize), lib) as device:
        device.forward_backward(*batch(0))
        device.forward_backward(*batch(1))
        before = device.gradients()
        expected_norm = np.sqrt(sum(float(np.dot(g.reshape(-1).astype(np.float64), g.reshape(-1)))
                                    for g in before.values()))
        norm = device.gradient_norm()
        assert abs(norm - expected_norm) <= 1e-12 * expected_norm
        half = np.float32(0.5)
        device.scale_gradients(half)  # gradient accumulation's 1/micro
        for name, gradient in device.gradients().items():
            assert np.array_equal(gradient, before[name] * half), name
        assert device.clip_grad_norm(None) == (device.gradient_norm(), False)
        assert device.clip_grad_norm(10 * norm)[1] is False
        scaled = device.gradients()
        assert all(np.array_equal(scaled[name], before[name] * half) for name in before)  # nothing clipped
        max_norm = 0.25 * norm
        device_norm, clipped = device.clip_grad_norm(max_norm)
        assert clipped and abs(device_norm - 0.5 * norm) <= 1e-6 * norm
        factor = np.float32(max_norm / (device_norm + 1e-6))
        for name, gradient in device.gradients().items():
            assert np.array_equal(gradient, scaled[name] * factor), name
        device.adam_step(**hyperparameters)
        device_values = device.adapter_state_dict() if lora else device.state_dict()
        for bad in (0, -1.0, float("nan"), True, "1"):
            with pytest.raises(ValueError, match="max_norm"):
                device.clip_grad_norm(bad)
    model = make_model(lora=lora, quantize=quantize)
    config = {"max_grad_norm": max_norm, "learning_rate": hyperparameters["learning_rate"],
              "lr_schedule": {"type": "constant", "warmup_steps": 0}}
    with (model.adapter_parameters() if lora else model.parameters()) as trainable:
        optimizer = Adam(trainable, **hyperparameters)
        model.forward_backward(*batch(0))
        model.forward_backward(*batch(1))
        for p in trainable:
            assert_close(before[p.name], p.grad, TOLERANCE, f"{p.name} gradient")
            # the step from the device's own gradients: Adam's first step maps g to about g / (|g| + epsilon),
            # so where |g| is near epsilon a gradient difference within the tolerance above moves the
            # update by up to the learning rate; the clipping and the step are what is compared here
            p.grad[...] = before[p.name]
            p.grad *= half
        cpu_norm, cpu_clipped, learning_rate = clip_and_step(config, optimizer, trainable, 0, 1, 1.0)
        assert cpu_clipped and learning_rate == hyperparameters["learning_rate"]
        assert_close(device_norm, cpu_norm, TOLERANCE, "gradient norm")
        for p in trainable:
            assert_close(device_values[p.name], p.value, TOLERANCE, p.name)


@pytest.mark.parametrize("kind", ["dense", "qlora-window"])
def test_the_same_steps_give_the_same_bits_twice(lib, kind):
    """No atomics, fixed reduction orders: two fresh device models running the same steps agree with `==`."""
    if kind == "dense":
        make = lambda: make_model(tie_embeddings=True, loss_route="kt_tape_flce")  # noqa: E731
    else:
        make = lambda: make_model(lora=LoraConfig(rank=4, alpha=8.0), sliding_window=6,  # noqa: E731
                                  quantize=dict(block_size=32, double_quantization=True))
    hyperparameters = dict(learning_rate=1e-2, weight_decay=0.01)
    first, second = adam_run(lib, make(), 2, hyperparameters), adam_run(lib, make(), 2, hyperparameters)
    assert first[0] == second[0], "losses differ"
    for index, what in ((1, "parameters"), (3, "gradients")):
        assert list(first[index]) == list(second[index])
        for name in first[index]:
            assert np.array_equal(first[index][name], second[index][name]), f"{what}: {name} differs"
    for key in ("first_moment", "second_moment"):
        for name in first[2][key]:
            assert np.array_equal(first[2][key][name], second[2][key][name]), f"{key}: {name} differs"


def test_a_head_too_large_for_the_attention_kernels_is_refused():
    model = DecoderOnlyTransformer(TransformerConfig(**{**SHAPE, "head_size": 160}), initialize=False)
    with pytest.raises(NotImplementedError, match="head_size 160"):
        CudaModel(model, library=object())  # refused before the library is touched


def test_use_after_close_and_bad_inputs_are_refused(lib):
    model = make_model(lora=LoraConfig(rank=2, alpha=4.0))
    device = CudaModel(model, lib)
    inputs, targets = batch(0)
    with pytest.raises(RuntimeError, match="needs a pending gradient"):
        device.adam_step()
    with pytest.raises(ValueError, match="every target is ignored"):
        device.forward_backward(inputs, np.full_like(targets, -100))
    with pytest.raises(ValueError, match="ids must lie"):
        device.logits(inputs + SHAPE["vocabulary_size"])
    device.close()
    device.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        device.forward_backward(inputs, targets)
    with pytest.raises(TypeError, match="DecoderOnlyTransformer"):
        CudaModel(object(), lib)


@pytest.mark.parametrize("case", ["dense", "lora", "lora-two-targets", "qlora", "family-options",
                                  "lora-dense-attention"])
def test_the_planned_device_bytes_are_what_a_training_step_allocates(lib, case):
    """planned_device_bytes (what admission compares with a device's free memory) against the bytes CudaModel
    really holds after a forward/backward and an Adam step: never less, and at most 1% more."""
    lora = LoraConfig(rank=4, alpha=8.0)
    kwargs = {"dense": dict(), "lora": dict(lora=lora),
              "lora-two-targets": dict(lora=LoraConfig(rank=3, alpha=8.0, targets=("q_proj", "v_proj"))),
              "qlora": dict(lora=lora, quantize=dict(block_size=64)),
              "family-options": dict(lora=lora, qk_norm=True, attention_bias=True, tie_embeddings=True,
                                     loss_route="kt_tape_flce"),
              "lora-dense-attention": dict(lora=lora, attention="dense")}[case]
    attention = kwargs.pop("attention", "tiled")
    model = make_model(**kwargs)
    with CudaModel(model, lib, attention=attention) as device:
        device.forward_backward(*batch(0))
        device.adam_step(learning_rate=1e-3, beta1=0.9, beta2=0.99, epsilon=1e-8, weight_decay=0.0)
        held = sum(array.nbytes for array in device._arrays)
    planned = planned_device_bytes(model.config, B, T, kwargs.get("lora"), kwargs.get("quantize"),
                                   attention=attention) - BLAS_WORKSPACE_BYTES
    assert held <= planned <= 1.01 * held, (held, planned)


def test_the_dense_attention_plan_bounds_shorter_batches_that_fit_more_groups(monkeypatch):
    """The plan is for the longest batch, but dense_chunk rounds down: a shorter batch may fit two head groups where
    the longest fits one, and its score buffers are then larger. The plan counts the most any batch up to POSITIONS
    can hold; an unknown algorithm is refused."""
    config = make_model().config
    G, R, positions = B * SHAPE["kv_head_count"], 2 * T, T
    monkeypatch.setattr(cuda_model, "DENSE_SCORES_BYTES", 2 * 4 * R * positions - 4)  # not quite two longest groups
    shorter = positions - 1
    assert cuda_model.dense_chunk(G, R, positions) == 1 and cuda_model.dense_chunk(G, 2 * shorter, shorter) == 2
    extra = planned_device_bytes(config, B, positions, attention="dense") - planned_device_bytes(config, B, positions)
    at_shorter = 2 * 4 * cuda_model.dense_chunk(G, 2 * shorter, shorter) * 2 * shorter * shorter  # both buffers
    assert extra >= at_shorter > 2 * 4 * R * positions
    with pytest.raises(ValueError, match="attention must be one of"):
        planned_device_bytes(config, B, positions, attention="flash")


@pytest.mark.parametrize("family", ["llama", "qwen3-options"])
@pytest.mark.parametrize("case", ["teacher", "served", "opd-student"])
def test_the_planned_device_bytes_of_scoring_sampling_and_serving_are_what_the_model_allocates(lib, case, family):
    """planned_device_bytes beyond a training step: a native OPD teacher (no adapter: its dense base's gradient
    buffers, a forward and CudaModel.logits' whole logits, no step), a served or evaluated adapter (generate()'s
    KV cache and decoding scratch only) and OPD's student (it samples, scores its sample with logits, then trains
    on it): the bytes held (the model's and the sampling cache's) never above the plan, and at most 1% below."""
    from trainer.generation import SamplingConfig, generate

    options = {"llama": {}, "qwen3-options": dict(qk_norm=True, attention_bias=True, tie_embeddings=True)}[family]
    lora = None if case == "teacher" else LoraConfig(rank=4, alpha=8.0)
    model = make_model(lora=lora, loss_route="kt_tape_flce", **options)
    prompt, new = [3, 1, 4, 1, 5], 6
    cached = len(prompt) + new  # generate's cache: the prompt and max_new_tokens (within maximum_context)
    sequence = np.asarray(prompt + [2] * new, np.int64)[None, :-1]  # [1,T] the scored and trained rows
    targets = np.full(sequence.shape, -100)
    targets[0, len(prompt) - 1:] = [2] * new
    caches = []
    with CudaModel(model, lib) as device:
        make_cache = device.kv_cache
        device.kv_cache = lambda *args, **kwargs: caches.append(make_cache(*args, **kwargs)) or caches[-1]
        if case == "teacher":
            device.logits(sequence)
            planned = planned_device_bytes(model.config, 1, sequence.shape[1], training=False, logits=True)
        elif case == "served":
            generate(device, prompt, SamplingConfig(max_new_tokens=new, temperature=0))
            planned = planned_device_bytes(model.config, 0, 0, lora, training=False, sampling=(len(prompt), cached))
        else:
            generate(device, prompt, SamplingConfig(max_new_tokens=new, temperature=0))
            device.logits(sequence)
            device.forward_backward_weighted(sequence, targets, lambda logp: np.ones_like(logp))
            device.adam_step(learning_rate=1e-3, beta1=0.9, beta2=0.99, epsilon=1e-8, weight_decay=0.0)
            planned = planned_device_bytes(model.config, 1, sequence.shape[1], lora, logits=True,
                                           sampling=(len(prompt), cached))
        held = sum(array.nbytes for array in device._arrays)
        held += sum(array.nbytes for cache in caches for array in cache.keys + cache.values)
    assert (len(caches) == 1) == (case != "teacher") and all(cache.positions == cached for cache in caches)
    planned -= BLAS_WORKSPACE_BYTES
    assert held <= planned <= 1.01 * held, (held, planned)


def test_a_bfloat16_base_on_the_device_computes_what_the_cpu_bfloat16_route_computes(request, lib, assert_close):
    """precision bfloat16: the frozen base's products and the output projection from bfloat16-rounded operands,
    FP32 accumulation, on both backends (cuBLAS's BF16 tensor cores; oneDNN on the CPU): loss, logits and adapter
    gradients within 1e-4 of the CPU's bfloat16 route on the emulation (which rounds to nearest, ties to even, as
    oneDNN does), 3e-3 on a GPU (whose tensor cores may round otherwise); and further than 1e-3 from float32."""
    from native_ext import onednn

    if onednn.unavailable_reason() is not None:
        pytest.skip(f"the CPU's bfloat16 route is unavailable here: {onednn.unavailable_reason()}")
    lora = LoraConfig(rank=4, alpha=8.0)
    for route in ("full_logits", "kt_tape_flce"):
        cpu = make_model(lora=lora, loss_route=route, base_precision="bfloat16")
        float32 = make_model(lora=lora, loss_route=route)
        tolerance = TOLERANCE if request.node.callspec.params["lib"] == "emulated" else 3e-3
        with CudaModel(make_model(lora=lora, loss_route=route), lib, precision="bfloat16") as device:
            inputs, targets = batch(0)
            assert_close(device.forward_backward(inputs, targets), cpu.forward_backward(inputs, targets), tolerance,
                         f"{route} loss")
            gradients, expected = device.gradients(), cpu_gradients(cpu)
            for name, gradient in expected.items():
                assert_close(gradients[name], gradient, tolerance, name)
            assert_close(device.logits(inputs), cpu.logits(inputs), tolerance, "logits")
            float32.forward_backward(inputs, targets)
            apart = max(np.max(np.abs(gradients[n] - g)) / np.max(np.abs(g)) for n, g in cpu_gradients(float32).items())
            assert apart > 1e-3, f"bfloat16 gradients within {apart:.1e} of float32: nothing was rounded"


def test_a_tfloat32_base_rounds_only_the_base_products(lib, assert_close):
    """precision tfloat32: the base's products on TF32 tensor cores (10-bit operands): within 1e-2 of float32,
    further from it than 1e-5, the same bits twice; refused for a model whose base trains, and unknown names."""
    lora = LoraConfig(rank=4, alpha=8.0)
    float32 = make_model(lora=lora)
    inputs, targets = batch(0)
    loss = float32.forward_backward(inputs, targets)
    runs = []
    for _ in range(2):
        with CudaModel(make_model(lora=lora), lib, precision="tfloat32") as device:
            runs.append((device.forward_backward(inputs, targets), device.gradients()))
    assert runs[0][0] == runs[1][0]
    for name, gradient in cpu_gradients(float32).items():
        assert np.array_equal(runs[0][1][name], runs[1][1][name]), name
        assert_close(runs[0][1][name], gradient, 1e-2, name)
    assert_close(runs[0][0], loss, 1e-3, "loss")
    apart = max(np.max(np.abs(runs[0][1][n] - g)) / np.max(np.abs(g)) for n, g in cpu_gradients(float32).items())
    assert apart > 1e-5, "tfloat32 gradients equal float32's: nothing was rounded"
    with pytest.raises(ValueError, match="computes a frozen LoRA base"):
        CudaModel(make_model(), lib, precision="tfloat32")
    with pytest.raises(ValueError, match="precision must be one of"):
        CudaModel(make_model(lora=lora), lib, precision="float16")


@pytest.mark.parametrize("case", ["dense-base", "lora-window-qk-norm", "lora-one-group-at-a-time"])
def test_dense_attention_matches_the_cpu_engine(lib, assert_close, monkeypatch, case):
    """attention="dense": the scores through batched cuBLAS GEMMs (FP32 here), the masked softmax and its gradient
    as row kernels. Loss, logits and every gradient within 1e-4 of the CPU engine over two accumulated batches, as
    the tiled kernels are; with the sliding window and Qwen3's q/k norm; and with a score buffer that holds one
    head group at a time (four passes a block). Unknown algorithms are refused."""
    lora = LoraConfig(rank=4, alpha=8.0)
    if case == "lora-one-group-at-a-time":
        monkeypatch.setattr(cuda_model, "DENSE_SCORES_BYTES", 1)
        assert cuda_model.dense_chunk(B * SHAPE["kv_head_count"], 2 * T, T) == 1
    model = {"dense-base": lambda: make_model(),
             "lora-window-qk-norm": lambda: make_model(lora=lora, sliding_window=5, qk_norm=True, family="qwen3"),
             "lora-one-group-at-a-time": lambda: make_model(lora=lora)}[case]()
    compare_step(lib, assert_close, model, batches=(0, 1), attention="dense")
    with pytest.raises(ValueError, match="attention must be one of"):
        CudaModel(make_model(), lib, attention="flash")


def _rounded_dense_attention(bits):
    """trainer.attention's dense_forward and dense_backward with each product's operands rounded to BITS mantissa
    bits (10: TF32, 7: bfloat16, as tensor cores take them; 23: FP32, unrounded)."""
    def r(x):
        return x if bits == 23 else rounded(x, bits)

    def forward(q, k, v, scale, group_size, past=0, window=None):
        probs = np.matmul(r(q), r(k).transpose(0, 2, 1))
        cpu_attention.hide_outside_window(probs, group_size, past, 0, window)
        cpu_attention.kernels.softmax_causal_forward(probs, scale, group_size, past)
        return np.matmul(r(probs), r(v)), probs

    def backward(dout, q, k, v, probs, scale):
        # the device's dS: p * (dP - rowsum(dout * out)) * scale, out as the forward computed it (flash attention's
        # delta; with rounded operands it is not rowsum(p * dP), which softmax_backward would take)
        delta = np.sum(dout * np.matmul(r(probs), r(v)), axis=-1, keepdims=True, dtype=np.float32)
        dv = np.matmul(r(probs).transpose(0, 2, 1), r(dout))
        dscores = probs * (np.matmul(r(dout), r(v).transpose(0, 2, 1)) - delta) * np.float32(scale)
        return np.matmul(r(dscores), r(k)), np.matmul(r(dscores).transpose(0, 2, 1), r(q)), dv

    return forward, backward


@pytest.mark.parametrize("precision,bits", [("float32", 23), ("tfloat32", 10), ("bfloat16", 7)])
@pytest.mark.parametrize("window", [0, 5])
def test_dense_attention_products_round_their_operands_at_the_precision(request, lib, assert_close, monkeypatch,
                                                                      precision, bits, window):
    """CudaModel's dense attention alone, forward and backward over GQA head groups in two passes of the score
    buffer (three groups, then one), against trainer.attention's dense algorithm with each product's operands
    rounded as the precision's tensor cores take them. On the emulation (which rounds to nearest, ties to even)
    within 1e-5 at FP32 and a quarter of the rounded format's unit at TF32 and BF16 (where the twin's probabilities
    differ in their last bits an operand may round the other way); on a GPU 1e-4 and 3e-3. The same bits twice; at
    tfloat32 and bfloat16 further than 1e-4 from the FP32 tiled kernels."""
    G, T, g, D = 4, 21, 3, 16
    R, scale = T * g, 1.0 / np.sqrt(D)
    rng = np.random.default_rng(9)
    q, k, v, dout = (rng.standard_normal(shape).astype(np.float32) for shape in
                     ((G, R, D), (G, T, D), (G, T, D), (G, R, D)))
    forward, backward = _rounded_dense_attention(bits)
    out, probs = forward(q, k, v, scale, g, 0, window or None)
    expected = [out, *backward(dout, q, k, v, probs, scale)]
    emulated = request.node.callspec.params["lib"] == "emulated"
    # rounded operands: the twin's probabilities differ from the device's in their last bits, so an operand may round
    # the other way, by up to one unit of the rounded format; FP32 has no such step
    tolerance = (1e-5 if precision == "float32" else 2.0 ** -bits / 4) if emulated else \
        (1e-4 if precision == "float32" else 3e-3)
    lora = LoraConfig(rank=2, alpha=4.0)
    monkeypatch.setattr(cuda_model, "DENSE_SCORES_BYTES", 3 * 4 * R * T)  # three groups, then the last one
    assert cuda_model.dense_chunk(G, R, T) == 3
    results = {}
    for attention in ("dense", "dense", "tiled"):
        with CudaModel(make_model(lora=lora), lib, precision=precision, attention=attention) as device:
            dq_, dk_, dv_, dout_ = (device._put(a) for a in (q, k, v, dout))
            att, lse, delta = device._zeros((G, R, D)), device._zeros((G, R)), device._zeros((G, R))
            grads = [device._zeros(shape) for shape in ((G, R, D), (G, T, D), (G, T, D))]
            device._attention_forward(dq_, dk_, dv_, att, lse, G, T, g, D, window, scale)
            device._attention_backward(dout_, dq_, dk_, dv_, att, lse, *grads, delta, G, T, g, D, window, scale)
            got = [device._download(a, 0, a.shape) for a in (att, *grads)]
        if attention in results:
            assert all(np.array_equal(a, b) for a, b in zip(got, results[attention])), "not the same bits twice"
        results[attention] = got
    for name, actual, twin in zip(("out", "dq", "dk", "dv"), results["dense"], expected):
        assert_close(actual, twin, tolerance, f"{precision} dense attention {name}")
    apart = max(np.max(np.abs(a - b)) / np.max(np.abs(b)) for a, b in zip(results["dense"], results["tiled"]))
    assert (apart > 1e-4) == (precision != "float32"), f"{precision}: dense within {apart:.1e} of tiled FP32"
