"""What every run kind does on the cuda backend: the steps run on trainer.cuda_model.CudaModel.

The device model is built from the CPU model once it is quantized, LoRA-attached, warm-started and restored
(with the restored Adam state); clip_and_step's arithmetic runs on the device (device_clip_and_step); before each
checkpoint and the final snapshot the adapter values and Adam state come back into the CPU model and Adam
(download_device_state), whose writers are the CPU loop's.
"""

import math
from contextlib import contextmanager

from trainer.runs.admission import AdmissionError, RunFailed
from trainer.runs.step import clip_and_step, learning_rate_at


def device_model(model, optimizer=None, precision="float32"):
    """A CudaModel of the CPU model as it stands (its frozen base computing at PRECISION), with the restored Adam
    state when OPTIMIZER has taken a step: the steps run on the device from here on. AdmissionError
    backend_unavailable, with the loader's reason, when the library cannot be loaded after all."""
    from native_ext.cuda import CudaUnavailable
    from trainer.cuda_model import CudaModel

    try:
        device = CudaModel(model, precision=precision)
    except CudaUnavailable as error:
        raise AdmissionError("backend_unavailable", f"backend cuda is unavailable here: {error}") from None
    try:
        if optimizer is not None and optimizer.step_count > 0:
            device.load_optimizer_state_dict(optimizer.state_dict())
    except BaseException:
        device.close()
        raise
    return device


@contextmanager
def computing_model(model, optimizer, backend: str, precision: str = "float32"):
    """The model a run's loop computes on: MODEL itself on cpu; on cuda a device_model(MODEL, OPTIMIZER, PRECISION)
    (the cuda run's config.precision: admission.device_precision), closed on
    the way out, whose state is downloaded into MODEL and OPTIMIZER when the block ends without an error and the
    device holds an Adam step (so the final snapshot publishes it)."""
    if backend != "cuda":
        yield model
        return
    device = device_model(model, optimizer, precision)
    try:
        yield device
        if device.optimizer_steps > 0:
            download_device_state(device, model, optimizer)
    finally:
        device.close()


def on_device(model) -> bool:
    """Whether MODEL is a device model (computing_model's on cuda)."""
    from trainer.cuda_model import CudaModel

    return isinstance(model, CudaModel)


def download_device_state(device, model, optimizer) -> None:
    """The device's adapter values and Adam state into the CPU model and the CPU Adam (whose learning rate each
    step already set), so the checkpoint and PEFT writers publish them unchanged; after at least one step (or a
    restored Adam state)."""
    model.load_adapter_state_dict(device.adapter_state_dict())
    optimizer.load_state_dict(device.optimizer_state_dict())


def device_clip_and_step(config, device, optimizer, step: int, total_steps: int, loss: float):
    """trainer.runs.step.clip_and_step on the device: the gradient norm (summed in double on the device), the
    clip rule and float32 factor (CudaModel.clip_grad_norm), the scheduled learning rate and one Adam step with
    the CPU Adam's hyperparameters; returns (norm, clipped, lr). RunFailed("non_finite") before the adapters or
    the optimizer change (a non-finite norm clips nothing)."""
    grad_norm, clipped = device.clip_grad_norm(config["max_grad_norm"])
    if not math.isfinite(loss) or not math.isfinite(grad_norm):
        raise RunFailed("non_finite", f"step {step + 1}: loss {loss} / gradient norm {grad_norm} is not "
                                      "finite; lower the learning rate or check the data")
    optimizer.learning_rate = learning_rate_at(step, config, total_steps)
    device.adam_step(optimizer.learning_rate, optimizer.beta1, optimizer.beta2, optimizer.epsilon,
                     optimizer.weight_decay)
    return grad_norm, clipped, optimizer.learning_rate


def step_on(computing, config, optimizer, adapters, step: int, total_steps: int, loss: float):
    """One optimizer step on whichever model the loop computes on: clip_and_step over the CPU adapters, or
    device_clip_and_step on a device model; returns (norm, clipped, lr)."""
    if on_device(computing):
        return device_clip_and_step(config, computing, optimizer, step, total_steps, loss)
    return clip_and_step(config, optimizer, adapters, step, total_steps, loss)


def publishable(computing, model, optimizer) -> None:
    """Before a checkpoint: a device model's state downloaded into MODEL and OPTIMIZER (nothing to do on cpu)."""
    if on_device(computing):
        download_device_state(computing, model, optimizer)
