"""Adam: what it owns, its hyperparameter checks, pending gradients, beta powers, storage."""

import math

import numpy as np
import pytest

from trainer import Adam, DecoderOnlyTransformer
from trainer.parameters import ParameterList


@pytest.fixture
def model(tiny_config):
    with DecoderOnlyTransformer(tiny_config()) as model:
        yield model


def test_refuses_a_hand_made_list(model):
    with pytest.raises(TypeError, match="not a hand-made list"):
        Adam(list(model.parameters()))


@pytest.mark.parametrize("selection", ["all but last", "all but first", "reversed", "duplicated"])
def test_refuses_an_incomplete_or_reordered_parameter_list(model, selection):
    parameters = model.parameters()
    subset = {"all but last": parameters[:-1], "all but first": parameters[1:],
              "reversed": parameters[::-1], "duplicated": parameters + parameters[:1]}[selection]
    with pytest.raises(ValueError, match="must own the complete base parameter list"):
        Adam(ParameterList(subset, owner=model, kind="base"))


def test_refuses_another_models_parameters(model, tiny_config):
    with DecoderOnlyTransformer(tiny_config()) as other:
        with pytest.raises(ValueError, match="complete base parameter list"):
            Adam(ParameterList(list(other.parameters()), owner=model, kind="base"))


@pytest.mark.parametrize("kind", ["adapter", "bogus"])
def test_refuses_a_kind_the_model_does_not_have(model, kind):
    # no LoRA adapter is attached, and "bogus" is no kind at all
    with pytest.raises(ValueError, match="adapter|unknown parameter kind"):
        Adam(ParameterList(list(model.parameters()), owner=model, kind=kind))


BAD_HYPERPARAMETERS = [
    ("learning_rate", -1e-3), ("learning_rate", math.nan), ("learning_rate", math.inf),
    ("beta1", 1.0), ("beta1", -0.1), ("beta1", math.nan),
    ("beta2", 1.0), ("beta2", 1.5), ("beta2", math.nan),
    ("epsilon", 0.0), ("epsilon", -1e-8), ("epsilon", math.nan),
    ("weight_decay", -0.1), ("weight_decay", math.nan),
    ("state_storage", "sharded"), ("state_storage", None),
    ("page_size", 0), ("page_size", -7), ("page_size", 7.0), ("page_size", True),
]


@pytest.mark.parametrize("name,value", BAD_HYPERPARAMETERS)
def test_refuses_bad_hyperparameters_by_name(model, name, value):
    with pytest.raises(ValueError, match=name):
        Adam(model.parameters(), **{name: value})


def test_accepts_boundary_hyperparameters(model):
    with Adam(model.parameters(), learning_rate=0.0, beta1=0.0, beta2=0.0, weight_decay=0.0,
              state_storage="paged", page_size=1) as optimizer:
        assert optimizer.hyperparameters() == dict(learning_rate=0.0, beta1=0.0, beta2=0.0,
                                                   epsilon=1e-8, weight_decay=0.0)


def test_step_without_pending_gradient_raises(model):
    before = model.state_dict()
    with Adam(model.parameters()) as optimizer:
        with pytest.raises(RuntimeError, match="run backward first"):
            optimizer.step()
        assert optimizer.step_count == 0 and optimizer.beta1_power == 1.0
    for name, value in model.state_dict().items():
        assert np.array_equal(value, before[name]), name


def test_step_consumes_the_pending_gradient(model, batch):
    with Adam(model.parameters()) as optimizer:
        model.forward_backward(*batch())
        assert optimizer.gradient_pending and model.gradient_pending
        optimizer.step()
        assert not optimizer.gradient_pending and not model.gradient_pending
        with pytest.raises(RuntimeError, match="pending gradient"):
            optimizer.step()
        assert optimizer.step_count == 1


def test_zero_gradients_clears_pending(model, batch):
    with Adam(model.parameters()) as optimizer:
        model.forward_backward(*batch())
        before = model.state_dict()
        optimizer.zero_gradients()
        assert not optimizer.gradient_pending
        assert not model.gradient_pending
        assert not any(p.pending for p in model.parameters())
        with pytest.raises(RuntimeError):
            optimizer.step()
        for name, value in model.state_dict().items():
            assert np.array_equal(value, before[name]), name


def test_exactly_zero_gradient_is_still_pending(model, batch):
    """With zero output projections, attention and MLP inputs get exactly-zero gradients."""
    state = model.state_dict()
    for name in state:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            state[name][...] = 0.0
    model.load_state_dict(state)
    zero_kinds = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "input_layernorm",
                  "post_attention_layernorm")
    with Adam(model.parameters()) as optimizer:
        model.forward_backward(*batch())
        zero = [p for p in optimizer.parameters if any(kind in p.name for kind in zero_kinds)]
        assert len(zero) == len(zero_kinds) * model.config.block_count
        for p in zero:
            assert not np.any(p.grad), f"{p.name} gradient expected exactly zero"
            assert p.pending, f"{p.name}: a zero gradient is still a gradient"
        optimizer.step()  # must not refuse: every parameter has a (possibly zero) gradient
        assert optimizer.step_count == 1
        after = model.state_dict()
        for p in zero:  # m = v = 0 and a zero gradient: Adam leaves the value unchanged
            assert np.array_equal(after[p.name], state[p.name]), p.name
        assert not np.array_equal(after["model.embed_tokens.weight"], state["model.embed_tokens.weight"])


def test_beta_powers_are_tracked(model, batch):
    with Adam(model.parameters(), beta1=0.8, beta2=0.95) as optimizer:
        for step in range(1, 6):
            model.forward_backward(*batch(seed=step))
            optimizer.step()
            assert optimizer.step_count == step
            assert abs(optimizer.beta1_power - 0.8**step) <= 1e-12
            assert abs(optimizer.beta2_power - 0.95**step) <= 1e-12
        state = optimizer.state_dict()
        assert state["step"] == 5
        assert abs(state["beta1_power"] - 0.8**5) <= 1e-12
        assert abs(state["beta2_power"] - 0.95**5) <= 1e-12


def run_steps(config, storage, page_size, batches, **settings):
    with DecoderOnlyTransformer(config) as model, \
            Adam(model.parameters(), state_storage=storage, page_size=page_size, **settings) as optimizer:
        for inputs, targets in batches:
            model.forward_backward(inputs, targets)
            optimizer.step()
        return model.state_dict(), optimizer.state_dict(), [p.size for p in optimizer.parameters]


@pytest.mark.parametrize("page_size", [1, 7, 1000, 1 << 20])
def test_paged_state_is_byte_identical_to_contiguous(page_size, tiny_config, batch):
    config = tiny_config(tie_embeddings=True)
    batches = [batch(seed=s) for s in range(4)]
    settings = dict(learning_rate=1e-2, weight_decay=0.05)
    params_c, state_c, sizes = run_steps(config, "contiguous", 1 << 20, batches, **settings)
    params_p, state_p, _ = run_steps(config, "paged", page_size, batches, **settings)
    if page_size == 7:  # parameters really straddle page boundaries
        offsets = np.cumsum([0] + sizes[:-1])
        assert any(offset % 7 + size > 7 for offset, size in zip(offsets, sizes))
    assert list(params_c) == list(params_p)
    for name in params_c:
        assert params_c[name].tobytes() == params_p[name].tobytes(), name
    for key in ("step", "beta1_power", "beta2_power", "hyperparameters"):
        assert state_c[key] == state_p[key], key
    for key in ("first_moment", "second_moment"):
        assert list(state_c[key]) == list(state_p[key])
        for name in state_c[key]:
            assert state_c[key][name].shape == params_c[name].shape
            assert state_c[key][name].tobytes() == state_p[key][name].tobytes(), (key, name)
    assert np.any(state_c["second_moment"]["model.norm.weight"])


def test_state_dict_is_a_copy(model, batch):
    with Adam(model.parameters()) as optimizer:
        model.forward_backward(*batch())
        optimizer.step()
        state = optimizer.state_dict()
        name = "model.norm.weight"
        state["first_moment"][name][...] = 123.0
        assert not np.any(optimizer.state_dict()["first_moment"][name] == 123.0)


def test_closed_optimizer_refuses_use(model, batch):
    optimizer = Adam(model.parameters())
    with optimizer:
        pass
    model.forward_backward(*batch())
    with pytest.raises(RuntimeError, match="closed"):
        optimizer.step()
    with pytest.raises(RuntimeError, match="closed"):
        optimizer.state_dict()


@pytest.mark.parametrize("power", ["not a number", None, math.nan, 1.5, -0.1])
def test_load_state_dict_refuses_bad_beta_power_before_changing_anything(model, batch, power):
    """Regression: the moments and the step were written before the powers were converted."""
    with Adam(model.parameters()) as optimizer:
        model.forward_backward(*batch())
        optimizer.step()
        before = optimizer.state_dict()
        bad = optimizer.state_dict()
        bad["step"] = 7
        bad["first_moment"] = {name: np.full_like(m, 5.0) for name, m in bad["first_moment"].items()}
        bad["beta1_power"] = power
        with pytest.raises(ValueError, match="beta1_power"):
            optimizer.load_state_dict(bad)
        after = optimizer.state_dict()
        assert after["step"] == before["step"]
        for name, moment in before["first_moment"].items():
            assert np.array_equal(after["first_moment"][name], moment), name
