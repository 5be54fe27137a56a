"""What every training kind does at one optimizer step: the learning-rate schedule, the gradient norm,
clipping and the Adam step, reference adapter values, and the hooks a run calls back into."""

import math
from contextlib import contextmanager

import numpy as np

from trainer.runs.admission import RunFailed


def learning_rate_at(step: int, config: dict, total_steps: int) -> float:
    """Learning rate of optimizer step `step` (0-based), as transformers' get_constant/linear/cosine_schedule_with_warmup
    give it (Trainer steps the scheduler after each optimizer step): `base * factor`, with the warmup factor
    step / warmup_steps (so the first step's rate is 0), the linear decay (total - step) / (total - warmup) and the
    cosine 0.5 * (1 + cos(pi * progress)), each in transformers' own float arithmetic."""
    base = config["learning_rate"]
    schedule = config["lr_schedule"]
    warmup = schedule["warmup_steps"]
    if step < warmup:
        return base * (float(step) / float(max(1.0, warmup)))
    if schedule["type"] == "constant":
        return base * 1.0
    if schedule["type"] == "linear":
        return base * max(0.0, float(total_steps - step) / float(max(1, total_steps - warmup)))
    progress = float(step - warmup) / float(max(1, total_steps - warmup))
    return base * max(0.0, 0.5 * (1.0 + math.cos(math.pi * 0.5 * 2.0 * progress)))


def clip_and_step(config, optimizer, adapters, step: int, total_steps: int, loss: float):
    """Gradient norm, optional clipping, learning rate and one Adam step; returns (norm, clipped, lr).

    RunFailed("non_finite") before anything changes when the loss or the norm is not finite, so no
    checkpoint ever holds a non-finite value."""
    total = 0.0
    for p in adapters:
        flat = p.grad.reshape(-1)
        total += float(np.dot(flat.astype(np.float64), flat))
    grad_norm = math.sqrt(total)
    if not math.isfinite(loss) or not math.isfinite(grad_norm):
        raise RunFailed("non_finite", f"step {step + 1}: loss {loss} / gradient norm {grad_norm} is not "
                                      "finite; lower the learning rate or check the data")
    clipped = config["max_grad_norm"] is not None and grad_norm > config["max_grad_norm"]
    if clipped:
        factor = np.float32(config["max_grad_norm"] / (grad_norm + 1e-6))
        for p in adapters:
            p.grad *= factor
    optimizer.learning_rate = learning_rate_at(step, config, total_steps)
    optimizer.step()
    return grad_norm, clipped, optimizer.learning_rate


@contextmanager
def adapter_values(model, values: dict):
    """Run the model with other adapter values (a reference), then restore the live ones exactly."""
    live = model.adapter_state_dict()
    model.load_adapter_state_dict(values)
    try:
        yield
    finally:
        model.load_adapter_state_dict(live)


def should_publish(interval, step: int, done: bool, cancel: bool) -> bool:
    """A checkpoint boundary: every `interval` steps, and at the end or a cancellation."""
    return bool(interval) and (step % interval == 0 or done or cancel)


class NullHooks:
    """What a run calls back into (the control plane's JobHooks); `on_publish_stage(name)` is optional."""

    def on_step(self, metrics):
        pass

    def should_cancel(self):
        return False

    def on_checkpoint(self, summary, timing):
        pass

    def on_event(self, level, message):
        pass
