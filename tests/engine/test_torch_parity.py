"""The engine against PyTorch (float32 tests/engine/torch_reference.py, torch.optim.Adam).

Both sides run float32 with the same weights, so 1e-4 relative to the reference
tensor's max |value| leaves two orders of magnitude above the observed ~1e-6.
"""

import numpy as np
import pytest
import torch

from torch_reference import TorchLlama
from trainer import Adam, DecoderOnlyTransformer

TOLERANCE = 1e-4


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("kv_head_count", [2, None], ids=["gqa", "mha"])
@pytest.mark.parametrize("loss_route", ["full_logits", "kt_tape_flce"])
@pytest.mark.parametrize("attention_algorithm", ["dense", "tiled"])
def test_engine_matches_torch_float32(attention_algorithm, loss_route, kv_head_count, tie, tiny_config,
                                      batch, rel_diff):
    config = tiny_config(attention_algorithm=attention_algorithm, loss_route=loss_route,
                         kv_head_count=kv_head_count, tie_embeddings=tie)
    inputs, targets = batch(B=3, T=11, seed=5, ignored=4)
    assert np.any(targets == -100) and inputs.shape[0] > 1
    with DecoderOnlyTransformer(config) as model:
        logits = model.logits(inputs)
        loss = model.forward_backward(inputs, targets)
        grads = {p.name: p.grad.copy() for p in model.parameters()}
        reference = TorchLlama(config, model.state_dict(), dtype=torch.float32)
    x, y = torch.tensor(inputs), torch.tensor(targets)
    torch_loss = reference.loss(x, y)
    torch_loss.backward()
    with torch.no_grad():
        torch_logits = reference.logits(x).numpy()
    assert logits.shape == torch_logits.shape == (3, 11, config.vocabulary_size)
    assert rel_diff(logits, torch_logits) <= TOLERANCE
    assert abs(loss - torch_loss.item()) <= TOLERANCE * abs(torch_loss.item())
    torch_grads = reference.grads()
    assert list(grads) == list(torch_grads)
    for name, expected in torch_grads.items():
        assert rel_diff(grads[name], expected) <= TOLERANCE, name


ADAM_SETTINGS = [
    dict(learning_rate=1e-3, beta1=0.9, beta2=0.999, epsilon=1e-8, weight_decay=0.0),
    dict(learning_rate=2e-2, beta1=0.8, beta2=0.95, epsilon=1e-6, weight_decay=0.1),
    dict(learning_rate=5e-3, beta1=0.0, beta2=0.5, epsilon=1e-4, weight_decay=1.0),
]


@pytest.mark.parametrize("settings", ADAM_SETTINGS, ids=["defaults", "decay", "extreme"])
def test_adam_matches_torch_optim_adam(settings, tiny_config, batch, rel_diff):
    """Six steps on the engine's own gradients, fed to both optimizers."""
    config = tiny_config()
    with DecoderOnlyTransformer(config) as model, model.parameters() as parameters, \
            Adam(parameters, **settings) as optimizer:
        torch_parameters = [torch.nn.Parameter(torch.tensor(p.value.copy())) for p in parameters]
        torch_optimizer = torch.optim.Adam(
            torch_parameters, lr=settings["learning_rate"], betas=(settings["beta1"], settings["beta2"]),
            eps=settings["epsilon"], weight_decay=settings["weight_decay"], foreach=False)
        start = [p.value.copy() for p in parameters]
        for step in range(6):
            model.forward_backward(*batch(seed=step))
            for tp, p in zip(torch_parameters, parameters):
                tp.grad = torch.tensor(p.grad.copy())
            optimizer.step()
            torch_optimizer.step()
            for tp, p in zip(torch_parameters, parameters):
                assert rel_diff(p.value, tp.detach().numpy()) <= 1e-6, f"{p.name} after step {step + 1}"
        state = optimizer.state_dict()
        assert state["step"] == 6
        for tp, p in zip(torch_parameters, parameters):
            torch_state = torch_optimizer.state[tp]
            assert rel_diff(state["first_moment"][p.name], torch_state["exp_avg"].numpy()) <= 1e-6
            assert rel_diff(state["second_moment"][p.name], torch_state["exp_avg_sq"].numpy()) <= 1e-6
        moved = [np.abs(p.value - s).max() for p, s in zip(parameters, start)]
        assert min(moved) > 0, "some parameter never moved"
