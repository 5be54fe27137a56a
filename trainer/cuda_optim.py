"""The optimizer half of trainer.cuda_model.CudaModel: gradients, their norm, scaling and clipping, and Adam,
resident on the CUDA library in the CPU engine's arithmetic (trainer.optim.Adam, trainer.runs.step.clip_and_step).

DeviceOptimizer is a mixin: CudaModel supplies the device arrays (_trainable, _call, _at, _zeros, _download,
_upload_into, _check_open) it works on.
"""

import math

import numpy as np

from native_ext import cuda
from trainer.optim import check_hyperparameters

F32 = np.float32


class DeviceOptimizer:
    """Gradients and Adam on the device; mixed into CudaModel, whose arrays it reads."""

    def _trainable_names(self):
        if self.lora_config is not None:
            return list(self._adapter_names)
        return list(self._base_names) if self._base_trainable else []

    def _trainable(self):
        values = self._adapter_params if self.lora_config is not None else self._params
        return [(name, values[name], self._grads[name]) for name in self._trainable_names()]

    @property
    def gradient_pending(self) -> bool:
        self._check_open()
        return self._pending

    def gradients(self) -> dict:
        """{name: downloaded gradient} of the trainable parameters (adapters, or a dense base)."""
        self._check_open()
        return {name: self._download(*grad) for name, _, grad in self._trainable()}

    def gradient_norm(self) -> float:
        """The global L2 norm of the accumulated gradients: each trainable parameter's sum of squares in double
        (kiln_cuda_sum_squares, a fixed tree), then their sum in the CPU engine's parameter order and its square
        root (kiln_cuda_global_norm). trainer.runs.step.clip_and_step's norm, summed in another order."""
        self._check_open()
        trainable = self._trainable()
        if not trainable:
            raise ValueError("nothing is trainable, so there is no gradient norm")
        workspace = self._buffer("norm_workspace", (cuda.NORM_BLOCKS,), np.float64)
        sums = self._buffer("norm_sums", (len(trainable),), np.float64)  # [parameters]
        norm = self._buffer("norm", (1,), np.float64)
        for index, (_, _, (grad, offset, shape)) in enumerate(trainable):
            self._call("kiln_cuda_sum_squares", self._at(grad, offset), int(np.prod(shape)), workspace.ptr,
                       self._at(sums, index), None)
        self._call("kiln_cuda_global_norm", sums.ptr, len(trainable), norm.ptr, None)
        return float(self._download(norm, 0, (1,))[0])

    def scale_gradients(self, factor):
        """Every accumulated gradient *= float32(FACTOR) on the device (kiln_cuda_scale: one float32 product per
        element, as numpy's `grad *= np.float32(factor)` on the CPU)."""
        self._check_open()
        factor = F32(factor)
        if not np.isfinite(factor):
            raise ValueError(f"the gradient scale must be finite, got {factor}")
        for _, _, (grad, offset, shape) in self._trainable():
            self._call("kiln_cuda_scale", self._at(grad, offset), int(np.prod(shape)), float(factor), None)

    def clip_grad_norm(self, max_norm):
        """(norm, clipped): the gradient norm and, when MAX_NORM (None: no clipping) is exceeded, the gradients
        scaled by float32(max_norm / (norm + 1e-6)): trainer.runs.step.clip_and_step's rule and factor. A
        non-finite norm clips nothing, so a caller that refuses it (as runs do) has changed nothing."""
        if max_norm is not None and (isinstance(max_norm, bool) or not isinstance(max_norm, (int, float))
                                     or not math.isfinite(max_norm) or max_norm <= 0):
            raise ValueError(f"max_norm must be a positive number or None, got {max_norm!r}")
        norm = self.gradient_norm()
        clipped = max_norm is not None and math.isfinite(norm) and norm > max_norm
        if clipped:
            self.scale_gradients(F32(max_norm / (norm + 1e-6)))
        return norm, clipped

    def zero_gradients(self):
        """Discard the accumulated gradients without a step."""
        self._check_open()
        for device in {id(grad[0]): grad[0] for _, _, grad in self._trainable()}.values():
            self._clear(device)
        self._pending = False

    def adam_step(self, learning_rate=1e-3, beta1=0.9, beta2=0.999, epsilon=1e-8, weight_decay=0.0):
        """One Adam update of the trainable parameters from the accumulated gradients, which are then zeroed.

        trainer.optim.Adam's arithmetic and state: the library's kernel (the CPU kernel's float32 formula
        order), bias corrections from tracked beta powers, first and second moments per parameter.
        """
        self._check_open()
        trainable = self._trainable()
        if not trainable:
            raise ValueError("nothing is trainable: a quantized base is frozen; attach LoRA to the CPU model "
                             "before constructing the CudaModel")
        if not self._pending:
            raise RuntimeError("adam_step() needs a pending gradient; run forward_backward first")
        check_hyperparameters(learning_rate, beta1, beta2, epsilon, weight_decay)
        if self._adam is None:
            self._adam = {"step": 0, "beta1_power": 1.0, "beta2_power": 1.0,
                          "moments": {name: (self._zeros(shape), self._zeros(shape))
                                      for name, (_, _, shape), _ in trainable}}
        state = self._adam
        beta1_power = state["beta1_power"] * beta1
        beta2_power = state["beta2_power"] * beta2
        for name, (value, offset, shape), (grad, grad_offset, _) in trainable:
            m, v = state["moments"][name]
            self._call("kiln_cuda_adam_update", self._at(value, offset), self._at(grad, grad_offset), m.ptr, v.ptr,
                       int(np.prod(shape)), float(learning_rate), float(beta1), float(beta2), float(epsilon),
                       float(weight_decay), 1.0 - beta1_power, 1.0 - beta2_power, None)
        state.update(step=state["step"] + 1, beta1_power=beta1_power, beta2_power=beta2_power,
                     hyperparameters=dict(learning_rate=learning_rate, beta1=beta1, beta2=beta2, epsilon=epsilon,
                                          weight_decay=weight_decay))
        self.zero_gradients()

    @property
    def optimizer_steps(self) -> int:
        """How many Adam steps the device state holds (restored ones included); 0 before the first."""
        return 0 if self._adam is None else self._adam["step"]

    def optimizer_state_dict(self) -> dict:
        """trainer.optim.Adam.state_dict()'s layout: step, beta powers, hyperparameters, moments by name."""
        self._check_open()
        if self._adam is None:
            raise ValueError("no adam_step has run yet")
        state = self._adam
        moments = state["moments"]
        return {"step": state["step"], "beta1_power": state["beta1_power"], "beta2_power": state["beta2_power"],
                "hyperparameters": dict(state["hyperparameters"]),
                "first_moment": {name: m.to_host() for name, (m, _) in moments.items()},
                "second_moment": {name: v.to_host() for name, (_, v) in moments.items()}}

    def load_optimizer_state_dict(self, state: dict):
        """Replace step, beta powers and moments from Adam.state_dict()'s layout (the CPU optimizer's, or this
        model's); everything is checked before anything on the device changes."""
        self._check_open()
        trainable = self._trainable()
        if not trainable:
            raise ValueError("nothing is trainable, so there is no optimizer state to load")
        names = [name for name, _, _ in trainable]
        for key in ("first_moment", "second_moment"):
            if sorted(state[key]) != sorted(names):
                raise KeyError(f"{key} names do not match the trainable parameters")
            for name, (_, _, shape), _ in trainable:
                if tuple(np.shape(state[key][name])) != shape:
                    raise ValueError(f"{key}[{name}] has shape {np.shape(state[key][name])}, expected {shape}")
        step = state["step"]
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative integer, got {step!r}")
        for key in ("beta1_power", "beta2_power"):
            value = state[key]
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
                raise ValueError(f"{key} must be a number in [0, 1], got {value!r}")
        if self._adam is None:
            self._adam = {"moments": {name: (self._zeros(shape), self._zeros(shape))
                                      for name, (_, _, shape), _ in trainable}}
        for name, (m, v) in self._adam["moments"].items():
            self._upload_into(m, 0, state["first_moment"][name])
            self._upload_into(v, 0, state["second_moment"][name])
        self._adam.update(step=step, beta1_power=float(state["beta1_power"]),
                          beta2_power=float(state["beta2_power"]),
                          hyperparameters=dict(state.get("hyperparameters", {})))

