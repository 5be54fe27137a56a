"""The three batch sources: batches, epochs, and their exact save/restore protocol.

Test names and ids avoid the word "checkpoint": the quick run deselects it with -k.
"""

import copy
import json
import re

import numpy as np
import pytest

from trainer.model import IGNORE_INDEX
from trainer.training import (ExampleWindowBatchSource, RandomWindowBatchSource, SequenceWindowBatchSource,
                              SourceStateError)

TOKENS = np.arange(1000, 1000 + 61)  # distinct ids: a window's position is readable from its values
EXAMPLES = [list(range(100 * i, 100 * i + n)) for i, n in enumerate([2, 5, 9, 12, 3, 7, 4])]
MASKS = [[i >= n // 2 for i in range(n)] for n in (len(e) for e in EXAMPLES)]  # a "prompt" half

FACTORIES = {
    "random": lambda **kw: RandomWindowBatchSource(TOKENS, **{"batch_size": 3, "context_size": 8,
                                                              "random_seed": 5, **kw}),
    "sequence": lambda **kw: SequenceWindowBatchSource(TOKENS, **{"batch_size": 3, "context_size": 8,
                                                                  "random_seed": 5, **kw}),
    "example": lambda **kw: ExampleWindowBatchSource(EXAMPLES, **{"batch_size": 3, "context_size": 8,
                                                                  "random_seed": 5, "pad_token": 1,
                                                                  "loss_masks": MASKS, **kw}),
}
KINDS = list(FACTORIES)


def take(source, count):
    return [source.next_batch() for _ in range(count)]


def assert_same_batches(a, b):
    assert len(a) == len(b)
    for (x1, y1), (x2, y2) in zip(a, b):
        np.testing.assert_array_equal(x1, x2)
        np.testing.assert_array_equal(y1, y2)


@pytest.mark.parametrize("kind", KINDS)
def test_batch_shapes_and_dtypes(kind):
    source = FACTORIES[kind]()
    for inputs, targets in take(source, 4):
        assert inputs.shape == targets.shape == (3, 8)
        assert inputs.dtype == targets.dtype == np.int64
        assert inputs.flags.c_contiguous and targets.flags.c_contiguous
    assert source.emitted_batches == 4


@pytest.mark.parametrize("kind", ["random", "sequence"])
def test_window_targets_are_inputs_shifted(kind):
    for inputs, targets in take(FACTORIES[kind](), 10):
        np.testing.assert_array_equal(targets[:, :-1], inputs[:, 1:])
        np.testing.assert_array_equal(targets, inputs + 1)  # consecutive ids in TOKENS
        assert inputs.min() >= TOKENS[0] and targets.max() <= TOKENS[-1]


def test_random_windows_cover_the_first_and_last_window():
    source = RandomWindowBatchSource(np.arange(12), batch_size=4, context_size=8, random_seed=0)
    starts = {int(row[0]) for inputs, _ in take(source, 30) for row in inputs}
    assert starts == {0, 1, 2, 3}  # the last window ends on the last token


def test_sequence_epochs_visit_each_window_once_then_reshuffle():
    source = FACTORIES["sequence"]()  # (61 - 1) // 8 = 7 windows, 3 per batch
    windows = 7
    starts = [int(row[0]) - 1000 for inputs, _ in take(source, 7) for row in inputs]  # 21 = 3 epochs
    epochs = [starts[i * windows:(i + 1) * windows] for i in range(3)]
    for epoch in epochs:
        assert sorted(epoch) == [8 * i for i in range(windows)]
    assert epochs[0] != epochs[1] or epochs[1] != epochs[2], "the order is reshuffled each epoch"
    assert source.epoch == 2


def test_unshuffled_sequence_repeats_in_order():
    source = FACTORIES["sequence"](shuffle=False)
    starts = [int(row[0]) - 1000 for inputs, _ in take(source, 7) for row in inputs]
    assert starts == [8 * (i % 7) for i in range(21)]


def test_example_windows_pad_and_ignore():
    source = ExampleWindowBatchSource(EXAMPLES, batch_size=7, context_size=8, shuffle=False, pad_token=1)
    inputs, targets = source.next_batch()
    for row, example in enumerate(EXAMPLES):
        window = example[:9]  # context_size + 1 tokens, longer examples truncated
        n = len(window) - 1
        np.testing.assert_array_equal(inputs[row, :n], window[:-1])
        np.testing.assert_array_equal(targets[row, :n], window[1:])
        assert np.all(inputs[row, n:] == 1), "padding uses pad_token"
        assert np.all(targets[row, n:] == IGNORE_INDEX), "padding carries no loss"


def test_example_loss_masks_ignore_unmasked_targets():
    source = ExampleWindowBatchSource(EXAMPLES, batch_size=7, context_size=8, shuffle=False,
                                      loss_masks=MASKS)
    inputs, targets = source.next_batch()
    for row, (example, mask) in enumerate(zip(EXAMPLES, MASKS)):
        n = min(len(example), 9) - 1
        for j in range(n):  # target j predicts example[j + 1]
            expected = example[j + 1] if mask[j + 1] else IGNORE_INDEX
            assert targets[row, j] == expected, (row, j)
        np.testing.assert_array_equal(inputs[row, :n], example[:n])
    assert np.any(targets == IGNORE_INDEX) and np.any(targets != IGNORE_INDEX)


def test_example_epochs_wrap_and_reshuffle():
    source = FACTORIES["example"](batch_size=4)  # 7 examples: batches straddle epochs
    firsts = [int(row[0]) // 100 for inputs, _ in take(source, 7) for row in inputs]  # 28 = 4 epochs
    epochs = [firsts[i * 7:(i + 1) * 7] for i in range(4)]
    for epoch in epochs:
        assert sorted(epoch) == list(range(7))
    assert len({tuple(e) for e in epochs}) > 1


@pytest.mark.parametrize("kind", KINDS)
def test_saved_state_is_json_and_has_no_side_effect(kind):
    source, twin = FACTORIES[kind](), FACTORIES[kind]()
    take(source, 2)
    take(twin, 2)
    first = source.checkpoint_state()
    second = source.checkpoint_state()
    assert first == second
    assert json.loads(json.dumps(first)) == first
    assert first["kind"] == type(source).__name__ and first["emitted_batches"] == 2
    assert_same_batches(take(source, 5), take(twin, 5))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("before", [0, 1, 3, 5])  # 3 and 5 cross an epoch boundary (7 items)
def test_restore_continues_the_exact_stream(kind, before):
    source = FACTORIES[kind]()
    take(source, before)
    saved = json.loads(json.dumps(source.checkpoint_state()))
    expected = take(source, 6)
    resumed = FACTORIES[kind]()
    take(resumed, 2)  # a different position, overwritten by the restore
    resumed.restore_checkpoint_state(saved)
    assert resumed.checkpoint_state() == saved
    assert_same_batches(take(resumed, 6), expected)
    assert resumed.emitted_batches == before + 6


def _with(state, **changes):
    state = copy.deepcopy(state)
    for key, value in changes.items():
        if key.startswith("rng_"):
            state["random_state"][key[4:]] = value
        else:
            state[key] = value
    return state


def _bad_states(kind, state):
    """(label, malformed state) pairs for a source of `kind`; every one must be refused."""
    internal = state["random_state"]["internal"]
    bad = {
        "wrong fingerprint": _with(state, fingerprint="0" * 64),
        "rng version": _with(state, rng_version=2),
        "rng short": _with(state, rng_internal=internal[:-1]),
        "rng word range": _with(state, rng_internal=[2**32] + internal[1:]),
        "rng word type": _with(state, rng_internal=["1"] + internal[1:]),
        "rng index": _with(state, rng_internal=internal[:-1] + [625]),
        "rng gauss": _with(state, rng_gauss_next="0.5"),
        "rng keys": _with(state, random_state={"version": 3, "internal": internal}),
        "emitted negative": _with(state, emitted_batches=-1),
        "emitted bool": _with(state, emitted_batches=True),
        "emitted float": _with(state, emitted_batches=2.0),
        "missing key": {k: v for k, v in state.items() if k != "emitted_batches"},
        "extra key": _with(state, cursor=0),
        "not a dict": [state],
    }
    if kind != "random":
        n = len(state["order"])
        bad.update({
            "order short": _with(state, order=state["order"][:-1]),
            "order duplicate": _with(state, order=[state["order"][0]] * n),
            "order out of range": _with(state, order=[i + 1 for i in range(n)]),
            "order bools": _with(state, order=[False, True] + list(range(2, n))),
            "order not a list": _with(state, order=",".join(map(str, state["order"]))),
            "position beyond": _with(state, position=n + 1),
            "position negative": _with(state, position=-1),
            "epoch negative": _with(state, epoch=-1),
            "epoch float": _with(state, epoch=0.0),
        })
    return bad


def _labels(kind):
    source = FACTORIES[kind]()
    return list(_bad_states(kind, source.checkpoint_state()))


@pytest.mark.parametrize("kind,label", [(k, label) for k in KINDS for label in _labels(k)])
def test_restore_refuses_malformed_state_and_changes_nothing(kind, label):
    source, twin = FACTORIES[kind](), FACTORIES[kind]()
    take(source, 3)
    take(twin, 3)
    good = source.checkpoint_state()
    bad = _bad_states(kind, good)[label]
    with pytest.raises(SourceStateError):
        source.restore_checkpoint_state(bad)
    assert source.checkpoint_state() == good
    assert_same_batches(take(source, 4), take(twin, 4))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("difference", ["seed", "batch_size", "data"])
def test_restore_refuses_another_sources_fingerprint(kind, difference):
    changed = {"seed": dict(random_seed=6), "batch_size": dict(batch_size=2)}.get(difference, {})
    if difference == "data":
        other = (RandomWindowBatchSource(TOKENS[1:], 3, 8, 5) if kind == "random" else
                 SequenceWindowBatchSource(TOKENS[:-1], 3, 8, 5) if kind == "sequence" else
                 ExampleWindowBatchSource(EXAMPLES[:-1] + [[1, 2]], 3, 8, 5, pad_token=1,
                                          loss_masks=MASKS[:-1] + [[1, 1]]))
    else:
        other = FACTORIES[kind](**changed)
    source, twin = FACTORIES[kind](), FACTORIES[kind]()
    before = source.checkpoint_state()
    with pytest.raises(SourceStateError, match="fingerprint mismatch"):
        source.restore_checkpoint_state(other.checkpoint_state())
    assert source.checkpoint_state() == before
    assert_same_batches(take(source, 3), take(twin, 3))


def test_example_fingerprint_covers_the_loss_masks():
    other = FACTORIES["example"](loss_masks=None)
    with pytest.raises(SourceStateError, match="fingerprint"):
        FACTORIES["example"]().restore_checkpoint_state(other.checkpoint_state())


def test_restore_refuses_a_state_of_another_kind():
    sequence = SequenceWindowBatchSource(TOKENS, 3, 8, 5)
    example = FACTORIES["example"]()
    before = example.checkpoint_state()
    assert set(sequence.checkpoint_state()) == set(before)  # same keys: only the kind tells them apart
    with pytest.raises(SourceStateError, match="SequenceWindowBatchSource"):
        example.restore_checkpoint_state(sequence.checkpoint_state())
    assert example.checkpoint_state() == before
    with pytest.raises(SourceStateError):
        FACTORIES["random"]().restore_checkpoint_state(sequence.checkpoint_state())


def test_unshuffled_source_refuses_a_shuffled_order():
    source = FACTORIES["sequence"](shuffle=False)
    state = source.checkpoint_state()
    with pytest.raises(SourceStateError, match="identity order"):
        source.restore_checkpoint_state(_with(state, order=state["order"][::-1]))
    assert source.checkpoint_state() == state


def test_restore_refuses_float_order_entries():
    """Regression: sorted([1.0, 0.0]) == [0, 1] passed the permutation check, and the
    restored source then failed in next_batch with a TypeError."""
    source, twin = FACTORIES["sequence"](), FACTORIES["sequence"]()
    state = source.checkpoint_state()
    with pytest.raises(SourceStateError, match="order"):
        source.restore_checkpoint_state(_with(state, order=[float(i) for i in state["order"]]))
    assert source.checkpoint_state() == state
    assert_same_batches(take(source, 3), take(twin, 3))


CONSTRUCTION_ERRORS = [
    (lambda: RandomWindowBatchSource(TOKENS, 0, 8), "batch_size"),
    (lambda: RandomWindowBatchSource(TOKENS, 2, 61), "context_size + 1"),
    (lambda: RandomWindowBatchSource([1, -2, 3], 1, 1), "non-negative"),
    (lambda: RandomWindowBatchSource([0.5, 1.5, 2.5], 1, 1), "integer token ids"),
    (lambda: RandomWindowBatchSource(TOKENS, 2, 8, random_seed=1.0), "random_seed"),
    (lambda: SequenceWindowBatchSource(TOKENS, 2, True), "context_size"),
    (lambda: SequenceWindowBatchSource(np.arange(8), 2, 8), "context_size + 1"),
    (lambda: ExampleWindowBatchSource([[1]], 1, 4), "at least 2 tokens"),
    (lambda: ExampleWindowBatchSource([], 1, 4), "no windows or examples"),
    (lambda: ExampleWindowBatchSource([[1, 2]], 1, 4, pad_token=-1), "pad_token"),
    (lambda: ExampleWindowBatchSource([[1, 2]], 1, 4, loss_masks=[]), "one entry per example"),
    (lambda: ExampleWindowBatchSource([[1, 2]], 1, 4, loss_masks=[[1]]), "must match examples[0]"),
]


@pytest.mark.parametrize("index", range(len(CONSTRUCTION_ERRORS)))
def test_constructor_refuses_bad_arguments(index):
    make, fragment = CONSTRUCTION_ERRORS[index]
    with pytest.raises(ValueError, match=re.escape(fragment)):
        make()
