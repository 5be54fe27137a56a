"""Named parameters and the ordered lists that an optimizer may own."""

import numpy as np


class Parameter:
    """One named float32 tensor with its gradient buffer and a pending-gradient flag.

    `value` and `grad` may be views into a fused buffer owned by the model (q/k/v and
    gate/up projections share one matrix product). A quantized Linear weight has no
    FP32 `value`; its packed NF4 form is `quantized`. `pending` records that backward
    produced a gradient that no optimizer step has consumed yet; it is tracked apart
    from the gradient's values, so an exactly-zero gradient is still pending.
    """

    __slots__ = ("name", "value", "grad", "pending", "quantized")

    def __init__(self, name: str, value: np.ndarray | None, grad: np.ndarray | None):
        self.name = name
        self.value = value
        self.grad = grad
        self.pending = False
        self.quantized = None  # an NF4 tensor once the model is quantized; value is then None

    @property
    def shape(self) -> tuple:
        return tuple(self.value.shape if self.value is not None else self.quantized.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape))

    def __repr__(self) -> str:
        return f"Parameter({self.name!r}, shape={self.shape})"


class ParameterList(list):
    """The complete, ordered parameter list of one model: its base or its adapters.

    `owner` is the model instance and `kind` is "base" or "adapter"; an optimizer
    accepts only such a list, never a hand-made subset. Usable as a context manager.
    """

    def __init__(self, parameters, owner, kind: str):
        super().__init__(parameters)
        self.owner = owner
        self.kind = kind

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        return False

    def names(self) -> list[str]:
        return [p.name for p in self]
