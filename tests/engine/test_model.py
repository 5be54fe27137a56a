"""DecoderOnlyTransformer's public surface, and the training loop learning something."""

import math

import numpy as np
import pytest

from trainer import Adam, DecoderOnlyTransformer
from trainer.training import (CausalLanguageModelTrainer, RandomWindowBatchSource, SequenceWindowBatchSource,
                              TrainingLoopConfig)


def llama_names(block_count, tie):
    names = ["model.embed_tokens.weight"]
    for i in range(block_count):
        names += [f"model.layers.{i}.{suffix}" for suffix in (
            "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
            "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
            "input_layernorm.weight", "post_attention_layernorm.weight")]
    names.append("model.norm.weight")
    if not tie:
        names.append("lm_head.weight")
    return names


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_parameter_names_order_and_shapes_follow_hugging_face_llama(tie, tiny_config):
    # head_size 6 != model_width / head_count = 4, so q/k/v/o shapes show which is used
    config = tiny_config(tie_embeddings=tie, head_size=6, block_count=3)
    V, C, F, H, KV, D = 23, 16, 24, 4, 2, 6
    expected_shapes = {
        "embed_tokens": (V, C), "q_proj": (H * D, C), "k_proj": (KV * D, C), "v_proj": (KV * D, C),
        "o_proj": (C, H * D), "gate_proj": (F, C), "up_proj": (F, C), "down_proj": (C, F),
        "input_layernorm": (C,), "post_attention_layernorm": (C,), "model.norm": (C,), "lm_head": (V, C),
    }
    with DecoderOnlyTransformer(config) as model:
        parameters = model.parameters()
        assert parameters.names() == llama_names(3, tie)
        assert list(model.state_dict()) == llama_names(3, tie)
        assert parameters.kind == "base" and parameters.owner is model
        for p in parameters:
            kind = next(k for k in expected_shapes if k in p.name)
            assert p.shape == expected_shapes[kind], p.name
            assert p.value.dtype == np.float32 and p.grad.shape == p.shape and p.grad.dtype == np.float32
            assert not p.pending
        if tie:
            assert model.output_weight is parameters[0].value
        else:
            assert model.output_weight is parameters[-1].value
        projections = config.projection_shapes()  # what admission's rank check and the device plan use
        for p in parameters:
            name = p.name.split(".")[-2]
            if name in projections:
                assert p.shape == projections[name], p.name


def test_initialization_is_seeded_llama_style(tiny_config):
    with DecoderOnlyTransformer(tiny_config(initializer_seed=3, initializer_range=0.02)) as a, \
            DecoderOnlyTransformer(tiny_config(initializer_seed=3, initializer_range=0.02)) as b, \
            DecoderOnlyTransformer(tiny_config(initializer_seed=4, initializer_range=0.02)) as c:
        sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    for name, value in sa.items():
        assert np.array_equal(value, sb[name]), name
        if value.ndim == 1:
            assert np.all(value == 1.0), f"{name}: RMSNorm weights start at one"
        else:
            assert not np.array_equal(value, sc[name]), name
            assert abs(float(value.std()) - 0.02) < 0.006, name


def test_state_dict_returns_copies(tiny_config):
    with DecoderOnlyTransformer(tiny_config()) as model:
        state = model.state_dict()
        for value in state.values():
            value[...] = 0.0
        fresh = model.state_dict()
        assert all(np.any(v) for v in fresh.values())
        assert all(not np.shares_memory(fresh[p.name], p.value) for p in model.parameters())


def test_load_state_dict_round_trip_reaches_the_fused_buffers(tiny_config, batch):
    inputs, _ = batch()
    with DecoderOnlyTransformer(tiny_config(initializer_seed=1)) as source, \
            DecoderOnlyTransformer(tiny_config(initializer_seed=2)) as target:
        assert not np.array_equal(source.logits(inputs), target.logits(inputs))
        state = {name: value.astype(np.float64) for name, value in source.state_dict().items()}
        target.load_state_dict(state)  # float64 values are stored as float32
        for name, value in source.state_dict().items():
            assert np.array_equal(target.state_dict()[name], value), name
        # q/k/v and gate/up are views into fused matrices: the forward must see the new values
        np.testing.assert_array_equal(target.logits(inputs), source.logits(inputs))


@pytest.mark.parametrize("change", ["missing", "unknown", "shape", "shape of last"])
def test_load_state_dict_checks_everything_before_changing_anything(change, tiny_config):
    with DecoderOnlyTransformer(tiny_config(initializer_seed=1)) as model, \
            DecoderOnlyTransformer(tiny_config(initializer_seed=2)) as other:
        before = model.state_dict()
        state = other.state_dict()
        names = list(state)
        if change == "missing":
            del state["model.layers.1.mlp.up_proj.weight"]
            error, fragment = KeyError, "model.layers.1.mlp.up_proj.weight"
        elif change == "unknown":
            state["model.layers.9.self_attn.q_proj.weight"] = state[names[1]]
            error, fragment = KeyError, "model.layers.9.self_attn.q_proj.weight"
        elif change == "shape":
            state[names[2]] = state[names[2]].T
            error, fragment = ValueError, names[2]
        else:
            state[names[-1]] = state[names[-1]][:-1]
            error, fragment = ValueError, names[-1]
        with pytest.raises(error, match=fragment.replace(".", r"\.")):
            model.load_state_dict(state)
        for name, value in model.state_dict().items():
            assert np.array_equal(value, before[name]), f"{name} changed by a refused load"


@pytest.mark.parametrize("B,T", [(1, 1), (2, 7), (3, 16)])
def test_logits_shape_dtype_and_causality(B, T, tiny_config):
    rng = np.random.default_rng(B * 100 + T)
    tokens = rng.integers(0, 23, size=(B, T))
    with DecoderOnlyTransformer(tiny_config()) as model:
        logits = model.logits(tokens)
        assert logits.shape == (B, T, 23) and logits.dtype == np.float32
        assert np.all(np.isfinite(logits))
        # other integer dtypes and lists are accepted
        np.testing.assert_array_equal(model.logits(tokens.astype(np.int32)), logits)
        np.testing.assert_array_equal(model.logits(tokens.tolist()), logits)
        if T > 1:  # a later token never changes earlier positions
            changed = tokens.copy()
            changed[:, -1] = (changed[:, -1] + 1) % 23
            np.testing.assert_array_equal(model.logits(changed)[:, :-1], logits[:, :-1])
            assert not np.array_equal(model.logits(changed)[:, -1], logits[:, -1])
        # rows of a batch are independent
        np.testing.assert_allclose(model.logits(tokens[-1:])[0], logits[-1], rtol=1e-5, atol=1e-6)


TOKEN_ERRORS = [
    ("1-d", np.arange(5), ValueError, r"\[batch, time\]"),
    ("3-d", np.zeros((1, 2, 3), np.int64), ValueError, r"\[batch, time\]"),
    ("float", np.zeros((1, 4)), TypeError, "integers"),
    ("bool", np.zeros((1, 4), bool), TypeError, "integers"),
    ("empty time", np.zeros((1, 0), np.int64), ValueError, "maximum_context"),
    ("too long", np.zeros((1, 17), np.int64), ValueError, "maximum_context 16"),
    ("id too large", np.array([[0, 23]]), ValueError, r"\[0, 23\)"),
    ("negative id", np.array([[0, -1]]), ValueError, r"\[0, 23\)"),
]


@pytest.mark.parametrize("label,tokens,error,fragment", TOKEN_ERRORS, ids=[e[0] for e in TOKEN_ERRORS])
def test_token_validation(label, tokens, error, fragment, tiny_config):
    with DecoderOnlyTransformer(tiny_config()) as model:
        with pytest.raises(error, match=fragment):
            model.logits(tokens)
        with pytest.raises(error, match=fragment):
            model.forward_backward(tokens, tokens)
        assert not model.gradient_pending


TARGET_ERRORS = [
    ("shape", np.zeros((2, 10), np.int64), ValueError, "must equal inputs shape"),
    ("float", np.zeros((2, 11)), TypeError, "targets must be integers"),
    ("too large", np.full((2, 11), 23), ValueError, "target ids"),
    ("negative", np.full((2, 11), -1), ValueError, "target ids"),
]


@pytest.mark.parametrize("label,targets,error,fragment", TARGET_ERRORS, ids=[e[0] for e in TARGET_ERRORS])
def test_target_validation(label, targets, error, fragment, tiny_config, batch):
    inputs, _ = batch()
    with DecoderOnlyTransformer(tiny_config()) as model:
        with pytest.raises(error, match=fragment):
            model.forward_backward(inputs, targets)
        with pytest.raises(error, match=fragment):
            model.token_losses(inputs, targets)
        assert not model.gradient_pending


def test_constructor_requires_a_config():
    with pytest.raises(TypeError, match="TransformerConfig"):
        DecoderOnlyTransformer(dict(vocabulary_size=8))


def test_closed_model_refuses_further_use(tiny_config, batch):
    inputs, targets = batch()
    with DecoderOnlyTransformer(tiny_config()) as model:
        state = model.state_dict()
        model.logits(inputs)
    uses = {
        "logits": lambda: model.logits(inputs),
        "token_losses": lambda: model.token_losses(inputs, targets),
        "forward_backward": lambda: model.forward_backward(inputs, targets),
        "parameters": lambda: model.parameters(),
        "state_dict": lambda: model.state_dict(),
        "load_state_dict": lambda: model.load_state_dict(state),
    }
    for name, use in uses.items():
        with pytest.raises(RuntimeError, match="closed"):
            use()
    model.close()  # closing twice is harmless


def test_trainer_learns_a_repeating_sequence(tiny_config):
    # after 1 comes 4 or 5 and after 5 comes 9 or 3: attention must look further back
    tokens = np.tile([3, 1, 4, 1, 5, 9, 2, 6, 5, 3], 30)
    with DecoderOnlyTransformer(tiny_config(tie_embeddings=True)) as model, \
            Adam(model.parameters(), learning_rate=1e-2) as optimizer:
        source = RandomWindowBatchSource(tokens, batch_size=4, context_size=12, random_seed=0)
        losses = CausalLanguageModelTrainer(model, optimizer).run(source, TrainingLoopConfig(steps=30))
        assert len(losses) == 30 and all(isinstance(loss, float) and math.isfinite(loss) for loss in losses)
        assert source.emitted_batches == 30 and optimizer.step_count == 30
        assert not optimizer.gradient_pending
        assert abs(losses[0] - math.log(23)) < 0.3, "an untrained model is near-uniform"
        assert np.mean(losses[-5:]) < 0.35 * losses[0], losses
        # and run continues where it stopped
        more = CausalLanguageModelTrainer(model, optimizer).run(source, TrainingLoopConfig(steps=2))
        assert len(more) == 2 and optimizer.step_count == 32


def test_trainer_losses_equal_forward_backward_losses(tiny_config):
    """run() reports exactly what forward_backward returns for each batch."""
    tokens = np.arange(60) % 23
    config = tiny_config()
    with DecoderOnlyTransformer(config) as model, Adam(model.parameters()) as optimizer:
        losses = CausalLanguageModelTrainer(model, optimizer).run(
            SequenceWindowBatchSource(tokens, 2, 8, random_seed=1), TrainingLoopConfig(steps=3))
    with DecoderOnlyTransformer(config) as model, Adam(model.parameters()) as optimizer:
        source = SequenceWindowBatchSource(tokens, 2, 8, random_seed=1)
        expected = []
        for _ in range(3):
            expected.append(model.forward_backward(*source.next_batch()))
            optimizer.step()
    assert losses == expected


def test_trainer_refuses_a_foreign_optimizer_and_a_pending_gradient(tiny_config, batch):
    with DecoderOnlyTransformer(tiny_config()) as model, DecoderOnlyTransformer(tiny_config()) as other, \
            Adam(other.parameters()) as foreign, Adam(model.parameters()) as optimizer:
        with pytest.raises(ValueError, match="different model"):
            CausalLanguageModelTrainer(model, foreign)
        model.forward_backward(*batch())
        source = RandomWindowBatchSource(np.arange(40) % 23, 2, 8)
        with pytest.raises(RuntimeError, match="already pending"):
            CausalLanguageModelTrainer(model, optimizer).run(source, TrainingLoopConfig(steps=1))
        assert source.emitted_batches == 0


@pytest.mark.parametrize("steps", [0, -1, 1.0, True])
def test_training_loop_config_requires_positive_steps(steps):
    with pytest.raises(ValueError, match="steps"):
        TrainingLoopConfig(steps=steps)
