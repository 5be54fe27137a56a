"""Adam over the complete parameter list of one model, with contiguous or paged moments.

Arithmetic is PyTorch's Adam (L2 weight decay folded into the gradient, bias corrections
from explicitly tracked beta powers) carried out per element in float32 by the Cython
kernel native_ext._kernels.adam_update. The storage layout of the moments is physical
only: contiguous and paged storage give identical bytes and identical checkpoints.
"""

import math

import numpy as np

from native_ext import kernels
from trainer.lifetime import Closeable
from trainer.parameters import ParameterList

STORAGES = ("contiguous", "paged")


def check_hyperparameters(learning_rate, beta1, beta2, epsilon, weight_decay) -> None:
    """ValueError naming the first of Adam's hyperparameters outside its range."""
    for name, value in (("beta1", beta1), ("beta2", beta2)):
        if not 0.0 <= value < 1.0:
            raise ValueError(f"{name} must lie in [0, 1), got {value}")
    if not learning_rate >= 0.0 or not math.isfinite(learning_rate):
        raise ValueError(f"learning_rate must be a finite non-negative number, got {learning_rate}")
    if not epsilon > 0.0 or not math.isfinite(epsilon):
        raise ValueError(f"epsilon must be a finite positive number, got {epsilon}")
    if not weight_decay >= 0.0 or not math.isfinite(weight_decay):
        raise ValueError(f"weight_decay must be a finite non-negative number, got {weight_decay}")


class Adam(Closeable):
    closed_message = "the optimizer has been closed"

    def __init__(self, parameters, learning_rate=1e-3, beta1=0.9, beta2=0.999, epsilon=1e-8,
                 weight_decay=0.0, state_storage="contiguous", page_size=1 << 20):
        if not isinstance(parameters, ParameterList):
            raise TypeError(
                "Adam takes the complete list from `with model.parameters()` or "
                "`with model.adapter_parameters()`, not a hand-made list")
        owner = parameters.owner
        expected = owner._optimizable(parameters.kind)
        if [id(p) for p in parameters] != [id(p) for p in expected]:
            raise ValueError(
                f"Adam must own the complete {parameters.kind} parameter list of its model "
                f"({len(expected)} parameters, in order); got {len(parameters)}")
        check_hyperparameters(learning_rate, beta1, beta2, epsilon, weight_decay)
        if state_storage not in STORAGES:
            raise ValueError(f"state_storage must be one of {STORAGES}, got {state_storage!r}")
        if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size <= 0:
            raise ValueError(f"page_size must be a positive integer, got {page_size!r}")
        self.model = owner
        self.parameter_kind = parameters.kind
        self.parameters = list(parameters)
        self.learning_rate = float(learning_rate)
        self.beta1 = float(beta1)
        self.beta2 = float(beta2)
        self.epsilon = float(epsilon)
        self.weight_decay = float(weight_decay)
        self.state_storage = state_storage
        self.page_size = page_size
        self.step_count = 0
        self.beta1_power = 1.0
        self.beta2_power = 1.0
        self._closed = False
        total = sum(p.size for p in self.parameters)
        self._offsets = np.cumsum([0] + [p.size for p in self.parameters]).tolist()
        if state_storage == "contiguous":
            self._pages = [(np.zeros(total, np.float32), np.zeros(total, np.float32))]
            self._page_len = max(total, 1)
        else:
            self._pages = []
            for start in range(0, total, page_size):
                n = min(page_size, total - start)
                self._pages.append((np.zeros(n, np.float32), np.zeros(n, np.float32)))
            self._page_len = page_size
        # (parameter index, parameter offset, page index, page offset, length)
        self._segments = self._plan_segments()

    def _plan_segments(self):
        segments = []
        for index, p in enumerate(self.parameters):
            start, end = self._offsets[index], self._offsets[index + 1]
            position = start
            while position < end:
                page, page_offset = divmod(position, self._page_len)
                length = min(end - position, self._page_len - page_offset)
                segments.append((index, position - start, page, page_offset, length))
                position += length
        return segments

    def close(self):
        super().close()
        self._pages = []

    def _check_open(self):
        super()._check_open()
        self.model._check_open()

    @property
    def gradient_pending(self) -> bool:
        return any(p.pending for p in self.parameters)

    def zero_gradients(self):
        """Discard pending gradients without a step (values are overwritten by the next backward)."""
        self._check_open()
        for p in self.parameters:
            p.pending = False
        self.model.clear_pending()

    def step(self):
        """One Adam update from the pending gradients, which are then cleared."""
        self._check_open()
        missing = [p.name for p in self.parameters if not p.pending]
        if missing:
            raise RuntimeError(
                f"step() needs a pending gradient for every parameter; run backward first "
                f"(no gradient for {missing[:3]}{'...' if len(missing) > 3 else ''})")
        beta1_power = self.beta1_power * self.beta1
        beta2_power = self.beta2_power * self.beta2
        bias_correction1 = 1.0 - beta1_power
        bias_correction2 = 1.0 - beta2_power
        for index, param_offset, page, page_offset, length in self._segments:
            p = self.parameters[index]
            value = p.value.reshape(-1)[param_offset:param_offset + length]
            grad = p.grad.reshape(-1)[param_offset:param_offset + length]
            m, v = self._pages[page]
            kernels.adam_update(value, grad, m[page_offset:page_offset + length],
                                v[page_offset:page_offset + length], self.learning_rate,
                                self.beta1, self.beta2, self.epsilon, self.weight_decay,
                                bias_correction1, bias_correction2)
        self.step_count += 1
        self.beta1_power = beta1_power
        self.beta2_power = beta2_power
        self.zero_gradients()

    # -- logical state ---------------------------------------------------------------

    def _moment(self, which, index):
        p = self.parameters[index]
        start, end = self._offsets[index], self._offsets[index + 1]
        out = np.empty(end - start, np.float32)
        for seg_index, param_offset, page, page_offset, length in self._segments:
            if seg_index == index:
                out[param_offset:param_offset + length] = \
                    self._pages[page][which][page_offset:page_offset + length]
        return out.reshape(p.shape)

    def hyperparameters(self) -> dict:
        return dict(learning_rate=self.learning_rate, beta1=self.beta1, beta2=self.beta2,
                    epsilon=self.epsilon, weight_decay=self.weight_decay)

    def state_dict(self) -> dict:
        """Step, beta powers and both moments by parameter name (logical, layout-free)."""
        self._check_open()
        return {
            "step": self.step_count,
            "beta1_power": self.beta1_power,
            "beta2_power": self.beta2_power,
            "hyperparameters": self.hyperparameters(),
            "first_moment": {p.name: self._moment(0, i) for i, p in enumerate(self.parameters)},
            "second_moment": {p.name: self._moment(1, i) for i, p in enumerate(self.parameters)},
        }

    def load_state_dict(self, state: dict):
        """Replace step, beta powers and moments; everything is checked before anything changes."""
        self._check_open()
        names = [p.name for p in self.parameters]
        for key in ("first_moment", "second_moment"):
            got = list(state[key])
            if sorted(got) != sorted(names):
                raise KeyError(f"{key} names do not match the optimizer's parameters")
            for i, p in enumerate(self.parameters):
                if tuple(np.shape(state[key][p.name])) != p.shape:
                    raise ValueError(f"{key}[{p.name}] has shape {np.shape(state[key][p.name])}, "
                                     f"expected {p.shape}")
        step = state["step"]
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative integer, got {step!r}")
        powers = {}
        for key in ("beta1_power", "beta2_power"):
            value = state[key]
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not math.isfinite(value) or not 0.0 <= value <= 1.0:
                raise ValueError(f"{key} must be a number in [0, 1], got {value!r}")
            powers[key] = float(value)
        for i, p in enumerate(self.parameters):
            for which, key in ((0, "first_moment"), (1, "second_moment")):
                flat = np.asarray(state[key][p.name], dtype=np.float32).reshape(-1)
                for seg_index, param_offset, page, page_offset, length in self._segments:
                    if seg_index == i:
                        self._pages[page][which][page_offset:page_offset + length] = \
                            flat[param_offset:param_offset + length]
        self.step_count = step
        self.beta1_power = powers["beta1_power"]
        self.beta2_power = powers["beta2_power"]
