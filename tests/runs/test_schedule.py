"""The learning-rate schedules against transformers' get_*_schedule_with_warmup (the reference a user of
transformers' Trainer or TRL compares with): the rate each optimizer step uses, exactly."""

import pytest

from trainer.runs.step import learning_rate_at

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

REFERENCE = {
    "constant": lambda optimizer, warmup, total: transformers.get_constant_schedule_with_warmup(optimizer, warmup),
    "linear": transformers.get_linear_schedule_with_warmup,
    "cosine": transformers.get_cosine_schedule_with_warmup,
}


def reference_rates(kind, base, warmup, total):
    """The rate of each of `total` optimizer steps under transformers' scheduler, stepped after each
    optimizer step as Trainer steps it."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=base)
    scheduler = REFERENCE[kind](optimizer, warmup, total)
    rates = []
    for _ in range(total):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return rates


@pytest.mark.parametrize("kind", ["constant", "linear", "cosine"])
@pytest.mark.parametrize("warmup,total", [(0, 1), (0, 7), (1, 7), (3, 10), (10, 10), (4, 3), (5, 37)])
@pytest.mark.parametrize("base", [2e-4, 5e-3, 1e-5])
def test_each_step_uses_the_rate_transformers_gives_it(kind, warmup, total, base):
    config = {"learning_rate": base, "lr_schedule": {"type": kind, "warmup_steps": warmup}}
    kiln = [learning_rate_at(step, config, total) for step in range(total)]
    assert kiln == reference_rates(kind, base, warmup, total)


def test_warmup_starts_from_zero_as_transformers_does():
    """transformers' warmup is step / warmup_steps: the first optimizer step has rate 0 and the full rate
    is reached at step warmup_steps (0-based)."""
    config = {"learning_rate": 1e-3, "lr_schedule": {"type": "constant", "warmup_steps": 4}}
    assert [learning_rate_at(step, config, 8) for step in range(6)] == [0.0, 2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3]
