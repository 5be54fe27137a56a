"""Batch sources with an exact checkpoint protocol, and the causal-LM training loop.

A batch source yields (inputs [B,T], targets [B,T]) int64 arrays; IGNORE_INDEX targets
carry no loss. The built-in sources implement the checkpoint protocol:
`checkpoint_state()` returns plain JSON data (a SHA-256 fingerprint of the data and the
configuration, the emitted-batch count, the private random.Random state, and the
position) without side effects, and `restore_checkpoint_state(state)` validates all of
it before it changes anything.
"""

import hashlib
import json
import random
from dataclasses import dataclass

import numpy as np

from trainer.crossentropy import IGNORE_INDEX


class SourceStateError(ValueError):
    """A batch-source state that does not belong to this source or is malformed."""


def random_state_to_json(state) -> dict:
    version, internal, gauss_next = state
    return {"version": version, "internal": list(internal), "gauss_next": gauss_next}


def random_state_from_json(data) -> tuple:
    """Validate a JSON random.Random state and return the tuple for setstate()."""
    if not isinstance(data, dict) or set(data) != {"version", "internal", "gauss_next"}:
        raise SourceStateError("random state must have exactly version, internal, gauss_next")
    internal = data["internal"]
    if data["version"] != 3 or not isinstance(internal, list) or len(internal) != 625:
        raise SourceStateError("random state must be version 3 with 625 internal words")
    for word in internal[:624]:
        if isinstance(word, bool) or not isinstance(word, int) or not 0 <= word < 2**32:
            raise SourceStateError("random state words must be 32-bit unsigned integers")
    index = internal[624]
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index <= 624:
        raise SourceStateError("random state index must lie in 0..624")
    gauss = data["gauss_next"]
    if gauss is not None and (isinstance(gauss, bool) or not isinstance(gauss, float)):
        raise SourceStateError("random state gauss_next must be null or a float")
    probe = random.Random()
    state = (3, tuple(internal), gauss)
    probe.setstate(state)  # raises on anything CPython itself rejects
    return state


def _fingerprint(kind, settings, arrays) -> str:
    digest = hashlib.sha256()
    digest.update(json.dumps({"kind": kind, **settings}, sort_keys=True).encode())
    for array in arrays:
        digest.update(str(array.shape).encode())
        digest.update(np.ascontiguousarray(array, dtype="<i8").tobytes())
    return digest.hexdigest()


def _positive(name, value):
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _token_array(tokens, name="tokens"):
    array = np.asarray(tokens)
    if array.ndim != 1 or not (np.issubdtype(array.dtype, np.integer) or array.size == 0):
        raise ValueError(f"{name} must be a one-dimensional sequence of integer token ids")
    if array.size and array.min() < 0:
        raise ValueError(f"{name} must be non-negative token ids")
    return np.ascontiguousarray(array, dtype=np.int64)


class _BatchSource:
    """Shared checkpoint protocol: fingerprint, emitted-batch count, private RNG."""

    kind = "abstract"

    def __init__(self, random_seed):
        if isinstance(random_seed, bool) or not isinstance(random_seed, int):
            raise ValueError(f"random_seed must be an integer, got {random_seed!r}")
        self.random_seed = random_seed
        self._random = random.Random(random_seed)
        self.emitted_batches = 0

    def _extra_state(self) -> dict:
        return {}

    def _validate_extra(self, state) -> dict:
        return {}

    def _apply_extra(self, extra):
        pass

    def checkpoint_state(self) -> dict:
        return {
            "kind": self.kind,
            "fingerprint": self.fingerprint,
            "emitted_batches": self.emitted_batches,
            "random_state": random_state_to_json(self._random.getstate()),
            **self._extra_state(),
        }

    def restore_checkpoint_state(self, state):
        """Replace position and RNG state; everything is validated before anything changes."""
        if not isinstance(state, dict):
            raise SourceStateError("batch-source state must be an object")
        expected = set(self.checkpoint_state())
        if set(state) != expected:
            raise SourceStateError(
                f"batch-source state keys {sorted(state)} do not match {sorted(expected)}")
        if state["kind"] != self.kind:
            raise SourceStateError(f"state is for {state['kind']!r}, this source is {self.kind!r}")
        if state["fingerprint"] != self.fingerprint:
            raise SourceStateError(
                f"data fingerprint mismatch: checkpoint {str(state['fingerprint'])[:16]}..., "
                f"this source {self.fingerprint[:16]}... (different data or configuration)")
        emitted = state["emitted_batches"]
        if isinstance(emitted, bool) or not isinstance(emitted, int) or emitted < 0:
            raise SourceStateError("emitted_batches must be a non-negative integer")
        random_state = random_state_from_json(state["random_state"])
        extra = self._validate_extra(state)
        self._random.setstate(random_state)
        self.emitted_batches = emitted
        self._apply_extra(extra)


class RandomWindowBatchSource(_BatchSource):
    """Windows of context_size+1 tokens at uniformly random starts."""

    kind = "RandomWindowBatchSource"

    def __init__(self, tokens, batch_size, context_size, random_seed=0):
        super().__init__(random_seed)
        _positive("batch_size", batch_size)
        _positive("context_size", context_size)
        self.tokens = _token_array(tokens)
        if self.tokens.size < context_size + 1:
            raise ValueError(f"need at least context_size + 1 = {context_size + 1} tokens, "
                             f"got {self.tokens.size}")
        self.batch_size = batch_size
        self.context_size = context_size
        self.fingerprint = _fingerprint(self.kind, dict(batch_size=batch_size, context_size=context_size,
                                                        random_seed=random_seed), [self.tokens])

    def next_batch(self):
        T = self.context_size
        starts = [self._random.randrange(0, self.tokens.size - T) for _ in range(self.batch_size)]
        windows = np.stack([self.tokens[s:s + T + 1] for s in starts])  # [B,T+1]
        self.emitted_batches += 1
        return np.ascontiguousarray(windows[:, :-1]), np.ascontiguousarray(windows[:, 1:])


class _EpochOrderedSource(_BatchSource):
    """Items visited in a per-epoch order (shuffled by the private RNG when asked)."""

    def __init__(self, item_count, random_seed, shuffle):
        super().__init__(random_seed)
        if item_count <= 0:
            raise ValueError("the source has no windows or examples")
        self.shuffle = bool(shuffle)
        self.item_count = item_count
        self.epoch = 0
        self.position = 0
        self.order = self._new_order()

    def _new_order(self):
        order = list(range(self.item_count))
        if self.shuffle:
            self._random.shuffle(order)
        return order

    def _take(self, count):
        items = []
        for _ in range(count):
            if self.position == len(self.order):
                self.epoch += 1
                self.position = 0
                self.order = self._new_order()
            items.append(self.order[self.position])
            self.position += 1
        return items

    def _extra_state(self):
        return {"epoch": self.epoch, "position": self.position, "order": list(self.order)}

    def _validate_extra(self, state):
        epoch, position, order = state["epoch"], state["position"], state["order"]
        for name, value in (("epoch", epoch), ("position", position)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise SourceStateError(f"{name} must be a non-negative integer")
        if not isinstance(order, list) \
                or any(isinstance(i, bool) or not isinstance(i, int) for i in order) \
                or sorted(order) != list(range(self.item_count)):
            raise SourceStateError(f"order must be a permutation of 0..{self.item_count - 1}")
        if not self.shuffle and order != list(range(self.item_count)):
            raise SourceStateError("an unshuffled source must have the identity order")
        if position > self.item_count:
            raise SourceStateError(f"position {position} exceeds {self.item_count} items")
        return {"epoch": epoch, "position": position, "order": list(order)}

    def _apply_extra(self, extra):
        self.epoch, self.position, self.order = extra["epoch"], extra["position"], extra["order"]


class SequenceWindowBatchSource(_EpochOrderedSource):
    """Non-overlapping windows of context_size+1 tokens, each visited once per epoch."""

    kind = "SequenceWindowBatchSource"

    def __init__(self, tokens, batch_size, context_size, random_seed=0, shuffle=True):
        _positive("batch_size", batch_size)
        _positive("context_size", context_size)
        self.tokens = _token_array(tokens)
        self.batch_size = batch_size
        self.context_size = context_size
        windows = (self.tokens.size - 1) // context_size
        if windows <= 0:
            raise ValueError(f"need at least context_size + 1 = {context_size + 1} tokens")
        super().__init__(windows, random_seed, shuffle)
        self.fingerprint = _fingerprint(
            self.kind, dict(batch_size=batch_size, context_size=context_size,
                            random_seed=random_seed, shuffle=self.shuffle), [self.tokens])

    def next_batch(self):
        T = self.context_size
        starts = [i * T for i in self._take(self.batch_size)]
        windows = np.stack([self.tokens[s:s + T + 1] for s in starts])  # [B,T+1]
        self.emitted_batches += 1
        return np.ascontiguousarray(windows[:, :-1]), np.ascontiguousarray(windows[:, 1:])


class ExampleWindowBatchSource(_EpochOrderedSource):
    """One window per example: its first context_size+1 tokens, right-padded.

    `loss_masks` (optional, one bool sequence per example) marks the tokens that are
    predicted; the others (a prompt, say) get IGNORE_INDEX targets, as do padding slots.
    """

    kind = "ExampleWindowBatchSource"

    def __init__(self, examples, batch_size, context_size, random_seed=0, shuffle=True,
                 pad_token=0, loss_masks=None):
        _positive("batch_size", batch_size)
        _positive("context_size", context_size)
        if isinstance(pad_token, bool) or not isinstance(pad_token, int) or pad_token < 0:
            raise ValueError(f"pad_token must be a non-negative integer, got {pad_token!r}")
        self.examples = [_token_array(e, f"examples[{i}]") for i, e in enumerate(examples)]
        for i, example in enumerate(self.examples):
            if example.size < 2:
                raise ValueError(f"examples[{i}] needs at least 2 tokens, got {example.size}")
        if loss_masks is None:
            self.loss_masks = [np.ones(e.size, dtype=np.int64) for e in self.examples]
        else:
            if len(loss_masks) != len(self.examples):
                raise ValueError("loss_masks must have one entry per example")
            self.loss_masks = []
            for i, (mask, example) in enumerate(zip(loss_masks, self.examples)):
                mask = np.asarray(mask).astype(bool).astype(np.int64)
                if mask.shape != example.shape:
                    raise ValueError(f"loss_masks[{i}] must match examples[{i}] in length")
                self.loss_masks.append(mask)
        self.batch_size = batch_size
        self.context_size = context_size
        self.pad_token = pad_token
        super().__init__(len(self.examples), random_seed, shuffle)
        self.fingerprint = _fingerprint(
            self.kind, dict(batch_size=batch_size, context_size=context_size, random_seed=random_seed,
                            shuffle=self.shuffle, pad_token=pad_token),
            [a for pair in zip(self.examples, self.loss_masks) for a in pair])

    def next_batch(self):
        T = self.context_size
        inputs = np.full((self.batch_size, T), self.pad_token, dtype=np.int64)  # [B,T]
        targets = np.full((self.batch_size, T), IGNORE_INDEX, dtype=np.int64)  # [B,T]
        for row, index in enumerate(self._take(self.batch_size)):
            example, mask = self.examples[index][:T + 1], self.loss_masks[index][:T + 1]
            n = example.size - 1
            inputs[row, :n] = example[:-1]
            targets[row, :n] = np.where(mask[1:] == 1, example[1:], IGNORE_INDEX)
        self.emitted_batches += 1
        return inputs, targets


@dataclass(frozen=True)
class TrainingLoopConfig:
    steps: int  # optimizer steps to run in this call

    def __post_init__(self):
        _positive("steps", self.steps)


class CausalLanguageModelTrainer:
    """Runs forward/backward and an optimizer step per batch."""

    def __init__(self, model, optimizer):
        if optimizer.model is not model:
            raise ValueError("the optimizer belongs to a different model instance")
        self.model = model
        self.optimizer = optimizer

    def run(self, source, config: TrainingLoopConfig) -> list[float]:
        """Run config.steps steps; returns the loss of each step."""
        if self.optimizer.gradient_pending:
            raise RuntimeError("a gradient is already pending; call step() or zero_gradients() first")
        losses = []
        for _ in range(config.steps):
            inputs, targets = source.next_batch()
            losses.append(self.model.forward_backward(inputs, targets))
            self.optimizer.step()
        return losses
