"""trainer.checkpoints: exact continuation in a fresh process, every refusal, rollback, v1, ids."""

import hashlib
import importlib.util
import json
import math
import os
import random
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

from trainer import Adam, DecoderOnlyTransformer, LoraConfig, TransformerConfig
from trainer import checkpoint_archive, checkpoint_format
from trainer.checkpoints import (
    CheckpointError,
    IndeterminateStateError,
    TrainingCheckpoint,
    parameter_signature,
)
from trainer.training import (
    CausalLanguageModelTrainer,
    TrainingLoopConfig,
    random_state_to_json,
)

WORKER_PATH = Path(__file__).with_name("checkpoint_worker.py")
_spec = importlib.util.spec_from_file_location("checkpoint_worker", WORKER_PATH)
worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(worker)

SMALL = dict(vocabulary_size=worker.VOCABULARY, maximum_context=6, model_width=16, head_count=4,
             kv_head_count=2, block_count=1, feed_forward_width=24)
RANDOM_SOURCE = {"kind": "random", "seed": 5}


# -- helpers ---------------------------------------------------------------------------------


def make_run(config_fields=None, storage="contiguous", source_spec=RANDOM_SOURCE, steps=3,
             seed=0):
    """A model, its Adam and a source after `steps` training steps."""
    config = TransformerConfig(**{**SMALL, "initializer_seed": seed, **(config_fields or {})})
    model = DecoderOnlyTransformer(config)
    optimizer = worker.build_adam(model, storage)
    source = worker.build_source(source_spec, config.maximum_context)
    if steps:
        CausalLanguageModelTrainer(model, optimizer).run(source, TrainingLoopConfig(steps=steps))
    return model, optimizer, source


def snapshot(model, optimizer, source=None):
    return {"model": model.state_dict(), "adam": optimizer.state_dict(),
            "random": random.getstate(),
            "source": None if source is None else source.checkpoint_state()}


def assert_same(a, b, where="state"):
    """Exact equality of nested dicts/lists/arrays/scalars (arrays by dtype, shape and ==)."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), where
        for key in a:
            assert_same(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and a.dtype == b.dtype, where
        assert np.array_equal(a, b), where
    else:
        assert type(a) is type(b) and a == b, where


@pytest.fixture
def saved(tmp_path):
    """A 3-step run captured with its source and saved; returns (path, checkpoint)."""
    model, optimizer, source = make_run()
    checkpoint = TrainingCheckpoint.capture(model, optimizer, source=source, global_step=3,
                                            metadata={"run": "refusals"})
    path = tmp_path / "run.riftckpt"
    checkpoint.save(path)
    return path, checkpoint


@pytest.fixture
def target():
    """Fresh, compatible objects with non-trivial state of their own (a different seed)."""
    return make_run(steps=1, seed=7)


def rezip(source_path, out_path, replace=None, drop=(), add=None):
    """Copy an archive member by member, replacing, dropping or adding members.

    Kept members keep their headers and added ones get the writer's, so the copy has the
    canonical structure and only the edit itself can be refused.
    """
    replace, add = replace or {}, add or {}
    with zipfile.ZipFile(source_path) as src, zipfile.ZipFile(out_path, "w") as dst:
        for info in src.infolist():
            if info.filename in drop:
                continue
            dst.writestr(info, replace.get(info.filename, src.read(info.filename)))
        for name, data in add.items():
            info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
            info.create_system, info.external_attr = 3, 0o100644 << 16
            dst.writestr(info, data)


def edited_manifest(path, out_path, edit, keep_id=False):
    """Rewrite manifest.json through `edit(manifest)`, recomputing the documented id."""
    with zipfile.ZipFile(path) as archive:
        manifest = json.loads(archive.read("manifest.json"))
    edit(manifest)
    if not keep_id:
        content = {k: v for k, v in manifest.items() if k != "checkpoint_id"}
        manifest["checkpoint_id"] = hashlib.sha256(json.dumps(
            content, sort_keys=True, separators=(",", ":"), ensure_ascii=True,
            allow_nan=False).encode()).hexdigest()
    rezip(path, out_path, replace={"manifest.json": json.dumps(manifest).encode()})


def refused_load(path, match, live):
    before = snapshot(*live)
    with pytest.raises(CheckpointError, match=match):
        TrainingCheckpoint.load(path)
    assert_same(before, snapshot(*live))


# -- 2. exact continuation in a fresh process --------------------------------------------------

CONTINUATION_CASES = [
    # (source kind, attention, checkpointing, storage before, storage after, kv heads, tied)
    ("random", "dense", "none", "contiguous", "contiguous", 2, False),
    ("random", "tiled", "blocks", "paged", "contiguous", None, True),
    ("sequence", "dense", "blocks", "contiguous", "paged", 2, True),
    ("sequence", "tiled", "none", "paged", "paged", 1, False),
    ("example", "tiled", "blocks", "contiguous", "paged", 2, False),
    ("example", "dense", "none", "paged", "contiguous", None, True),
]


@pytest.mark.slow
@pytest.mark.parametrize("kind,attention,policy,before,after,kv,tied", CONTINUATION_CASES)
def test_fresh_process_resume_equals_uninterrupted_run(tmp_path, kind, attention, policy, before,
                                                      after, kv, tied):
    N, K = 7, 3
    fields = dict(block_count=2, kv_head_count=kv, tie_embeddings=tied, attention_algorithm=attention,
                  attention_block_size=2, activation_checkpointing=policy)
    spec = {"kind": kind, "seed": 11}
    model, optimizer, source = make_run(fields, before, spec, steps=N)
    expected_arrays, expected = worker.final_state(model, optimizer, source)

    model, optimizer, source = make_run(fields, before, spec, steps=K)
    checkpoint = TrainingCheckpoint.capture(model, optimizer, source=source, global_step=K,
                                            metadata={"case": kind})
    checkpoint.save(tmp_path / "k.riftckpt")
    archived_random = checkpoint.manifest()["training"]["python_random_state"]

    config = {**model.config.to_dict(), "initializer_seed": 12345}  # different initial values
    job = {"checkpoint": str(tmp_path / "k.riftckpt"), "config": config, "source": spec,
           "storage": after, "steps": N - K, "output": str(tmp_path)}
    (tmp_path / "spec.json").write_text(json.dumps(job))
    done = subprocess.run([sys.executable, str(WORKER_PATH), str(tmp_path / "spec.json")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr

    facts = json.loads((tmp_path / "state.json").read_text())
    with np.load(tmp_path / "state.npz") as resumed:
        assert sorted(resumed.files) == sorted(expected_arrays)
        for name, value in expected_arrays.items():
            assert resumed[name].dtype == np.float32
            assert np.array_equal(resumed[name], value), name
    assert facts["step"] == expected["step"] == N
    assert facts["beta1_power"] == expected["beta1_power"]
    assert facts["beta2_power"] == expected["beta2_power"]
    assert facts["source"] == expected["source"]
    assert facts["restore_changed_values"]  # the fresh model really started elsewhere
    assert facts["random_state"] == archived_random
    assert (facts["checkpoint_id"], facts["global_step"], facts["optimizer_step"],
            facts["metadata"]) == (checkpoint.checkpoint_id, K, K, {"case": kind})


# -- 3. refusals at capture --------------------------------------------------------------------


def test_capture_refuses_a_pending_gradient_even_an_exactly_zero_one():
    model, optimizer, source = make_run()
    inputs, targets = source.next_batch()
    model.forward_backward(inputs, targets)
    for p in model.parameters():
        p.grad[...] = 0.0
    with pytest.raises(CheckpointError, match="a gradient is pending"):
        TrainingCheckpoint.capture(model, optimizer, source=source, global_step=3)
    optimizer.zero_gradients()
    TrainingCheckpoint.capture(model, optimizer, source=source, global_step=3)


def test_capture_refuses_a_source_without_the_protocol():
    class Plain:
        def next_batch(self):
            raise AssertionError

    model, optimizer, _ = make_run(steps=0)
    with pytest.raises(CheckpointError, match="Plain does not implement the batch-source "
                                              "checkpoint protocol.*checkpoint_state"):
        TrainingCheckpoint.capture(model, optimizer, source=Plain(), global_step=0)


def test_capture_refuses_foreign_optimizer_bad_step_and_non_json_metadata():
    model, optimizer, source = make_run(steps=0)
    other, _, _ = make_run(steps=0)
    with pytest.raises(CheckpointError, match="different model instance"):
        TrainingCheckpoint.capture(other, optimizer, source=source, global_step=0)
    with pytest.raises(CheckpointError, match="global_step: expected an integer >= 0, got -1"):
        TrainingCheckpoint.capture(model, optimizer, source=source, global_step=-1)
    with pytest.raises(CheckpointError, match="metadata: must be plain JSON"):
        TrainingCheckpoint.capture(model, optimizer, source=source, global_step=0,
                                   metadata={"when": (1, 2)})
    with pytest.raises(CheckpointError, match="metadata: must be plain JSON"):
        TrainingCheckpoint.capture(model, optimizer, source=source, global_step=0,
                                   metadata={"loss": float("nan")})


def test_dense_checkpoints_and_lora_models_refuse_each_other(saved):
    """A LoRA model must train its adapters; a dense archive does not restore into it."""
    _, checkpoint = saved
    model, optimizer, source = make_run(steps=0)
    model.attach_lora(LoraConfig(rank=2, alpha=4.0))
    with pytest.raises(CheckpointError, match=r"the model has a LoRA adapter attached, so Adam "
                                              r"must own model.adapter_parameters\(\); this "
                                              r"optimizer owns 'base' parameters"):
        TrainingCheckpoint.capture(model, optimizer, source=source, global_step=0)
    adapter_adam = Adam(model.adapter_parameters())
    refused_restore(checkpoint, model, adapter_adam, source,
                    r"dense \(adapter: null\) but the model has a LoRA adapter attached")
    refused_restore(checkpoint, model, optimizer, source,
                    r"dense \(adapter: null\) but the model has a LoRA adapter attached")


# -- 3. refusals at load -------------------------------------------------------------------------


def test_a_flipped_byte_in_each_member_is_refused_naming_the_member(saved, tmp_path, target):
    path, _ = saved
    data = path.read_bytes()
    with zipfile.ZipFile(path) as archive:
        infos = archive.infolist()
    assert infos[0].filename == "manifest.json" and len(infos) == 1 + 3 * 12
    for info in infos:
        header = data[info.header_offset:info.header_offset + 30]
        start = info.header_offset + 30 + int.from_bytes(header[26:28], "little") \
            + int.from_bytes(header[28:30], "little")
        damaged = bytearray(data)
        damaged[start + info.compress_size // 2] ^= 0x10
        bad = tmp_path / "flipped.riftckpt"
        bad.write_bytes(bytes(damaged))
        refused_load(bad, f"member '{info.filename}' is corrupt: Bad CRC-32", target)


def test_altered_array_content_fails_its_checksum(saved, tmp_path, target):
    """Rewritten with a correct ZIP CRC, so only the manifest's SHA-256 can notice."""
    path, checkpoint = saved
    with zipfile.ZipFile(path) as archive:
        members = [n for n in archive.namelist() if n != "manifest.json"]
        for member in members:
            content = bytearray(archive.read(member))
            content[1] ^= 0x01
            rezip(path, tmp_path / "altered.riftckpt", replace={member: bytes(content)})
            refused_load(tmp_path / "altered.riftckpt",
                         f"member '{member}' fails its checksum: sha256", target)


def test_truncated_archive_is_refused(saved, tmp_path, target):
    path, _ = saved
    data = path.read_bytes()
    for length in (len(data) // 2, len(data) - 10, 0):
        (tmp_path / "cut.riftckpt").write_bytes(data[:length])
        refused_load(tmp_path / "cut.riftckpt", "not a complete ZIP archive", target)


def test_a_fifo_or_a_device_is_refused_without_waiting_or_reading_forever(tmp_path):
    """load() read the whole path with one read(): a named pipe blocked it until a writer came (forever), and a
    character device such as /dev/zero read until memory ran out. Only a regular file is an archive."""
    import threading

    fifo = tmp_path / "pipe.riftckpt"
    os.mkfifo(fifo)
    for path in (fifo, Path("/dev/zero")):
        outcome = []
        loader = threading.Thread(target=lambda: outcome.append(_load_outcome(path)), daemon=True)
        loader.start()
        loader.join(60)  # a bound on a hang, not a wait: a refusal returns at once
        assert outcome, f"TrainingCheckpoint.load({path}) did not return"
        error = outcome[0]
        assert isinstance(error, CheckpointError) and error.code == "invalid_checkpoint", error
        assert "not a regular file" in str(error) and str(path) in str(error)


def _load_outcome(path):
    try:
        TrainingCheckpoint.load(path)
    except Exception as error:  # noqa: BLE001 (the test inspects it)
        return error
    return None


def test_wrong_member_size_is_refused_before_reading(saved, tmp_path, target, monkeypatch):
    path, _ = saved
    member = "adam/first_moment/model.norm.weight.f32"
    with zipfile.ZipFile(path) as archive:
        content = archive.read(member)
    rezip(path, tmp_path / "short.riftckpt", replace={member: content[:-4]})
    reads = []
    real_read = checkpoint_archive._read_array
    monkeypatch.setattr(checkpoint_archive, "_read_array", lambda *a: reads.append(a) or real_read(*a))
    refused_load(tmp_path / "short.riftckpt",
                 f"member '{member}' has {len(content) - 4} bytes, the manifest says {len(content)}",
                 target)
    assert reads == []  # refused from the directory, before any array was read


def test_extra_missing_and_unsafe_members_are_refused(saved, tmp_path, target):
    path, _ = saved
    bad = tmp_path / "bad.riftckpt"
    rezip(path, bad, add={"notes.txt": b"hello"})
    refused_load(bad, r"unexpected member\(s\) \['notes.txt'\]", target)
    rezip(path, bad, drop=["adam/second_moment/model.norm.weight.f32"])
    refused_load(bad, r"missing member\(s\) \['adam/second_moment/model.norm.weight.f32'\]", target)
    rezip(path, bad, drop=["manifest.json"])
    refused_load(bad, "missing member 'manifest.json'", target)
    for name in ("../model/escape.f32", "/etc/passwd", "model//x.f32", "a\\b"):
        rezip(path, bad, add={name: b"\0" * 4})
        refused_load(bad, "unsafe member name", target)
    with zipfile.ZipFile(path) as archive:
        duplicate = archive.read("model/model.norm.weight.f32")
    with pytest.warns(UserWarning, match="Duplicate name"):
        rezip(path, bad, add={"model/model.norm.weight.f32": duplicate})
    refused_load(bad, "duplicate members", target)


def test_manifest_size_is_bounded_before_reading(saved, monkeypatch, target):
    path, _ = saved
    monkeypatch.setattr(checkpoint_archive, "MAX_MANIFEST_BYTES", 100)
    refused_load(path, r"manifest.json is \d+ bytes, more than the 100 allowed", target)


def _set(*keys, value):
    def edit(manifest):
        node = manifest
        for key in keys[:-1]:
            node = node[key]
        node[keys[-1]] = value(node[keys[-1]]) if callable(value) else value
    return edit


MANIFEST_EDITS = [
    ("schema", _set("schema", value="other"), "schema is 'other', expected 'kiln.riftckpt'"),
    ("version", _set("format_version", value=3), "format_version 3 is not readable"),
    ("beta1 power", _set("optimizer", "beta1_power", value=lambda p: p * (1 + 2 ** -40)),
     r"optimizer.beta1_power: is .*, but 3 Adam steps with beta 0.85 give 0.61412"),
    ("beta2 power", _set("optimizer", "beta2_power", value=0.5),
     r"optimizer.beta2_power: is 0.5, but 3 Adam steps"),
    ("beta range", _set("optimizer", "hyperparameters", "beta1", value=1.0),
     r"hyperparameters.beta1: must lie in \[0, 1\), got 1.0"),
    ("step", _set("optimizer", "step", value=-1), "optimizer.step: expected an integer >= 0, got -1"),
    ("epsilon type", _set("optimizer", "hyperparameters", "epsilon", value="1e-8"),
     "hyperparameters.epsilon: expected a finite float"),
    ("random state", _set("training", "python_random_state", "internal", value=lambda w: w[:-1]),
     "training.python_random_state: invalid Python random state"),
    ("fingerprint", _set("source", "state", "fingerprint", value="not-a-digest"),
     "source.state.fingerprint: expected 64 lowercase hex digits"),
    ("source rng", _set("source", "state", "random_state", value={"version": 3}),
     "source.state.random_state: invalid Python random state"),
    ("adapter", _set("adapter", value={"rank": 8}),
     r"adapter: fields do not match the format: missing \['config', 'parameters', 'type'\]"),
    ("quantization", _set("quantization", value={"type": "nf4"}),
     "quantization: a quantized .* base is frozen, so the archive needs a LoRA adapter section"),
    ("unknown field", _set("extra", value=1), r"fields do not match the format: missing \[\], "
                                              r"unexpected \['extra'\]"),
    ("member path", _set("model", "parameters", 0, "member", value="../model/x.f32"),
     r"model.parameters\[0\].member: is '../model/x.f32', the format requires"),
    ("shape", _set("model", "parameters", 1, "shape", value=[8, 16]),
     r"model.parameters\[1\].bytes: is 1024, but \[8, 16\] float32 elements take 512"),
    ("dtype", _set("optimizer", "first_moment", 0, "dtype", value="float16"),
     r"first_moment\[0\].dtype: only float32 is supported"),
    ("policy", _set("policies", "attention_algorithm", value="tiled"),
     "policies.attention_algorithm: is 'tiled' but model.config has 'dense'"),
    ("config", _set("model", "config", "head_count", value=3),
     "model.config: not a valid TransformerConfig"),
    ("architecture", _set("model", "config", "block_count", value=2),
     r"model.parameters: parameter names do not match model.config: missing \['model.layers.1"),
    ("names", _set("model", "parameters", 0, "name", value="model..x"),
     r"model.parameters\[0\].name: not a valid parameter name"),
]


@pytest.mark.parametrize("edit,match", [(e, m) for _, e, m in MANIFEST_EDITS],
                         ids=[i for i, _, _ in MANIFEST_EDITS])
def test_manifest_semantics_are_validated(saved, tmp_path, target, edit, match):
    path, _ = saved
    edited_manifest(path, tmp_path / "edited.riftckpt", edit)
    refused_load(tmp_path / "edited.riftckpt", match, target)


def test_epoch_order_must_hold_integers(tmp_path, target):
    model, optimizer, source = make_run(source_spec={"kind": "sequence", "seed": 2})
    TrainingCheckpoint.capture(model, optimizer, source=source, global_step=3).save(
        tmp_path / "sequence.riftckpt")
    edited_manifest(tmp_path / "sequence.riftckpt", tmp_path / "edited.riftckpt",
                    _set("source", "state", "order", value=lambda o: [float(i) for i in o]))
    refused_load(tmp_path / "edited.riftckpt", "source.state.order: expected a list of integer",
                 target)


def test_manifest_changed_without_a_new_id_is_refused(saved, tmp_path, target):
    path, _ = saved
    edited_manifest(path, tmp_path / "edited.riftckpt", _set("metadata", value={"run": "other"}),
                    keep_id=True)
    refused_load(tmp_path / "edited.riftckpt", "manifest.json does not match its checkpoint_id",
                 target)


def test_negative_second_moment_is_refused(saved, tmp_path, target):
    path, _ = saved
    member = "adam/second_moment/model.norm.weight.f32"
    negative = np.full(SMALL["model_width"], -1.0, "<f4").tobytes()

    def edit(manifest):
        for entry in manifest["optimizer"]["second_moment"]:
            if entry["member"] == member:
                entry["sha256"] = hashlib.sha256(negative).hexdigest()
    edited_manifest(path, tmp_path / "edited.riftckpt", edit)
    rezip(tmp_path / "edited.riftckpt", tmp_path / "negative.riftckpt", replace={member: negative})
    refused_load(tmp_path / "negative.riftckpt", "second moment has negative entries", target)


def test_beta_powers_are_checked_within_rounding_beyond_the_exact_limit(monkeypatch):
    monkeypatch.setattr(checkpoint_format, "EXACT_POWER_STEPS", 10)
    power = 1.0
    for _ in range(1000):
        power *= 0.999
    checkpoint_format._check_beta_power(power, 0.999, 1000, "p")
    with pytest.raises(CheckpointError, match="give about"):
        checkpoint_format._check_beta_power(power * (1 + 1e-9), 0.999, 1000, "p")


# -- 3. refusals at restore: validation finishes before anything changes -------------------------


def refused_restore(checkpoint, model, optimizer, source, match, watched_source=None):
    watched = source if watched_source is None else watched_source
    before = snapshot(model, optimizer, watched)
    with pytest.raises(CheckpointError, match=match):
        checkpoint.restore(model, optimizer, source)
    assert_same(before, snapshot(model, optimizer, watched))


def test_restore_refuses_a_different_data_fingerprint(saved):
    _, checkpoint = saved
    model, optimizer, _ = make_run(steps=1, seed=7)
    other_tokens = worker.build_source({**RANDOM_SOURCE, "token_offset": 1}, 6)
    other_tokens.next_batch()
    refused_restore(checkpoint, model, optimizer, other_tokens,
                    "data fingerprint mismatch: checkpoint [0-9a-f]{64}, source [0-9a-f]{64}")


def test_restore_refuses_an_optimizer_of_another_model(saved, target):
    _, checkpoint = saved
    model, optimizer, source = target
    other, _, _ = make_run(steps=0, seed=3)
    refused_restore(checkpoint, other, optimizer, source, "optimizer belongs to a different model",
                    watched_source=source)
    assert_same(model.state_dict(), target[0].state_dict())


def test_restore_refuses_hyperparameter_drift(saved):
    _, checkpoint = saved
    model, _, source = make_run(steps=0, seed=7)
    optimizer = Adam(model.parameters(), learning_rate=2e-3, beta1=0.85, beta2=0.99,
                     weight_decay=0.01)
    refused_restore(checkpoint, model, optimizer, source,
                    "Adam hyperparameters differ: learning_rate: checkpoint 0.003, optimizer 0.002")


@pytest.mark.parametrize("fields,match", [
    ({"attention_algorithm": "tiled"},
     "attention_algorithm differs: checkpoint 'dense', model 'tiled'"),
    ({"activation_checkpointing": "blocks"},
     "activation_checkpointing differs: checkpoint 'none', model 'blocks'"),
    ({"block_count": 2}, "architecture differs from the checkpoint: block_count: checkpoint 1, model 2"),
    ({"kv_head_count": 4, "tie_embeddings": True},
     "kv_head_count: checkpoint 2, model 4; tie_embeddings: checkpoint False, model True"),
    ({"loss_route": "kt_tape_flce", "loss_chunk_tokens": 5},
     "the model configuration differs from the checkpoint: loss_route: checkpoint 'full_logits', "
     "model 'kt_tape_flce'; loss_chunk_tokens: checkpoint 64, model 5 "
     r"\(only initializer_seed may differ\)"),
    ({"attention_block_size": 2}, "attention_block_size: checkpoint 64, model 2"),
    ({"initializer_range": 0.5}, "initializer_range: checkpoint 0.02, model 0.5"),
])
def test_restore_refuses_policy_and_architecture_drift(saved, fields, match):
    _, checkpoint = saved
    model, optimizer, source = make_run(fields, steps=1, seed=7)
    refused_restore(checkpoint, model, optimizer, source, match)


def test_restore_refuses_source_presence_drift_and_pending_gradients(saved, tmp_path, target):
    path, checkpoint = saved
    model, optimizer, source = target
    refused_restore(checkpoint, model, optimizer, None,
                    "holds batch-source state .* but source=None was given", watched_source=source)

    class Plain:
        pass
    refused_restore(checkpoint, model, optimizer, Plain(), "Plain does not implement",
                    watched_source=source)

    no_source = make_run()
    without = TrainingCheckpoint.capture(no_source[0], no_source[1], source=None, global_step=3)
    refused_restore(without, model, optimizer, source, "captured with source=None")

    inputs, targets = source.next_batch()
    model.forward_backward(inputs, targets)
    refused_restore(checkpoint, model, optimizer, source, "the target has a pending gradient")


def test_restore_with_source_none_when_captured_without_one(tmp_path):
    model, optimizer, _ = make_run()
    random.seed(1)
    checkpoint = TrainingCheckpoint.capture(model, optimizer, source=None, global_step=9)
    checkpoint.save(tmp_path / "nosource.riftckpt")
    expected = snapshot(model, optimizer)
    fresh_model, fresh_optimizer, _ = make_run(steps=0, seed=4, storage="paged")
    random.seed(2)
    result = TrainingCheckpoint.load(tmp_path / "nosource.riftckpt").restore(
        fresh_model, fresh_optimizer, None)
    assert (result.global_step, result.optimizer_step, result.metadata) == (9, 3, {})
    assert_same(expected, snapshot(fresh_model, fresh_optimizer))


# -- 4. transactional restore and rollback -------------------------------------------------------


class ScriptedSource:
    """A custom checkpointable source; `failures` lists the restore calls (1-based) that raise."""

    def __init__(self, inner, failures=()):
        self.inner, self.failures, self.calls = inner, set(failures), 0

    def next_batch(self):
        return self.inner.next_batch()

    def checkpoint_state(self):
        return self.inner.checkpoint_state()

    def restore_checkpoint_state(self, state):
        self.calls += 1
        if self.calls in self.failures:
            random.random()  # a misbehaving callback may even touch the global generator
            raise OSError(f"scripted failure on call {self.calls}")
        self.inner.restore_checkpoint_state(state)


def fail_adam_commit_once(optimizer):
    """Adam's commit completes and then raises, once: rollback must undo it."""
    real = optimizer.load_state_dict
    calls = []

    def load_state_dict(state):
        calls.append(1)
        real(state)
        if len(calls) == 1:
            raise MemoryError("scripted failure after the Adam commit")
    optimizer.load_state_dict = load_state_dict


def test_a_failing_source_callback_changes_nothing(saved, target):
    _, checkpoint = saved
    model, optimizer, inner = target
    source = ScriptedSource(inner, failures={1})
    before = snapshot(model, optimizer, source)
    with pytest.raises(CheckpointError, match="while restoring the batch source: OSError: scripted"):
        checkpoint.restore(model, optimizer, source)
    assert_same(before, snapshot(model, optimizer, source))


def test_a_failing_adam_commit_rolls_back_source_model_and_adam(saved, target):
    _, checkpoint = saved
    model, optimizer, inner = target
    source = ScriptedSource(inner)
    fail_adam_commit_once(optimizer)
    before = snapshot(model, optimizer, source)
    with pytest.raises(CheckpointError, match="while restoring the Adam state: MemoryError"):
        checkpoint.restore(model, optimizer, source)
    assert source.calls == 2  # restore, then rollback
    assert_same(before, snapshot(model, optimizer, source))


def test_a_failing_rollback_raises_indeterminate_state(saved, target):
    _, checkpoint = saved
    model, optimizer, inner = target
    source = ScriptedSource(inner, failures={2})  # the rollback call
    fail_adam_commit_once(optimizer)
    with pytest.raises(IndeterminateStateError, match=r"rolling back failed for: batch source "
                                                      r"\(OSError: scripted failure on call 2\)"):
        checkpoint.restore(model, optimizer, source)
    source = ScriptedSource(inner, failures={1, 2})
    with pytest.raises(IndeterminateStateError, match="restoring the batch source .* rolling back"):
        checkpoint.restore(model, optimizer, source)
    assert issubclass(IndeterminateStateError, CheckpointError)


# -- 5. the dense v1 layout ------------------------------------------------------------------------


def write_v1(path, model, optimizer, global_step, metadata):
    """The documented v1 writer: params/, adam/m/, adam/v/ raw <f4 members, deflated."""
    adam = optimizer.state_dict()
    members = {}
    for name, value in model.state_dict().items():
        members[f"params/{name}.bin"] = value.astype("<f4").tobytes()
        members[f"adam/m/{name}.bin"] = adam["first_moment"][name].astype("<f4").tobytes()
        members[f"adam/v/{name}.bin"] = adam["second_moment"][name].astype("<f4").tobytes()
    manifest = {
        "schema": "kiln.riftckpt", "format_version": 1,
        "config": model.config.to_dict(),
        "parameters": [{"name": n, "shape": list(v.shape)} for n, v in model.state_dict().items()],
        "optimizer": {"hyperparameters": adam["hyperparameters"], "step": adam["step"],
                      "beta1_power": adam["beta1_power"], "beta2_power": adam["beta2_power"]},
        "global_step": global_step,
        "python_random_state": random_state_to_json(random.getstate()),
        "metadata": metadata,
        "sha256": {n: hashlib.sha256(d).hexdigest() for n, d in members.items()},
    }
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("manifest.json", json.dumps(manifest, indent=2))
        for name, data in members.items():
            archive.writestr(name, data)


def test_v1_archive_loads_restores_and_upgrades(tmp_path):
    model, optimizer, source = make_run({"tie_embeddings": True})
    write_v1(tmp_path / "old.riftckpt", model, optimizer, 3, {"from": "v1"})
    expected = snapshot(model, optimizer)
    checkpoint = TrainingCheckpoint.load(tmp_path / "old.riftckpt")
    assert checkpoint.format_version == 1 and checkpoint.source_state is None

    fresh_model, fresh_optimizer, fresh_source = make_run({"tie_embeddings": True}, steps=1,
                                                          seed=8, storage="paged")
    refused_restore(checkpoint, fresh_model, fresh_optimizer, fresh_source,
                    r"captured with source=None \(format v1\)")
    random.seed(5)
    result = checkpoint.restore(fresh_model, fresh_optimizer, None)
    assert (result.format_version, result.global_step, result.optimizer_step,
            result.metadata) == (1, 3, 3, {"from": "v1"})
    assert_same(expected, snapshot(fresh_model, fresh_optimizer))

    checkpoint.save(tmp_path / "new.riftckpt")  # the v1 id is that of its v2 form
    again = TrainingCheckpoint.load(tmp_path / "new.riftckpt")
    assert (again.format_version, again.checkpoint_id) == (2, checkpoint.checkpoint_id)


def test_v1_archive_is_validated_too(tmp_path, target):
    model, optimizer, _ = make_run()
    write_v1(tmp_path / "old.riftckpt", model, optimizer, 3, {})
    member = "adam/v/model.norm.weight.bin"
    with zipfile.ZipFile(tmp_path / "old.riftckpt") as archive:
        content = bytearray(archive.read(member))
    content[0] ^= 0x01
    rezip(tmp_path / "old.riftckpt", tmp_path / "bad.riftckpt", replace={member: bytes(content)})
    refused_load(tmp_path / "bad.riftckpt", f"member '{member}' fails its checksum", target)
    edited_manifest(tmp_path / "old.riftckpt", tmp_path / "bad.riftckpt",
                    _set("optimizer", "beta2_power", value=0.5), keep_id=True)
    refused_load(tmp_path / "bad.riftckpt", r"\(format v1\).*optimizer.beta2_power: is 0.5", target)


# -- 6. deterministic ids and bytes; atomic save ---------------------------------------------------


def test_same_state_gives_same_id_and_identical_bytes(tmp_path):
    model, optimizer, source = make_run()
    random.seed(3)
    first = TrainingCheckpoint.capture(model, optimizer, source=source, global_step=3,
                                       metadata={"a": [1, 2.5, None]})
    random.seed(3)
    second = TrainingCheckpoint.capture(model, optimizer, source=source, global_step=3,
                                        metadata={"a": [1, 2.5, None]})
    assert first.checkpoint_id == second.checkpoint_id
    first.save(tmp_path / "1.riftckpt")
    second.save(tmp_path / "2.riftckpt")
    assert (tmp_path / "1.riftckpt").read_bytes() == (tmp_path / "2.riftckpt").read_bytes()
    loaded = TrainingCheckpoint.load(tmp_path / "1.riftckpt")
    assert loaded.checkpoint_id == first.checkpoint_id
    loaded.save(tmp_path / "3.riftckpt")
    assert (tmp_path / "3.riftckpt").read_bytes() == (tmp_path / "1.riftckpt").read_bytes()
    assert json.loads(zipfile.ZipFile(tmp_path / "1.riftckpt").read("manifest.json")) \
        == first.manifest()

    random.seed(3)
    other = TrainingCheckpoint.capture(model, optimizer, source=source, global_step=4,
                                       metadata={"a": [1, 2.5, None]})
    assert other.checkpoint_id != first.checkpoint_id


def test_save_is_atomic_and_leaves_no_temporary_file(tmp_path, monkeypatch):
    model, optimizer, source = make_run()
    checkpoint = TrainingCheckpoint.capture(model, optimizer, source=source, global_step=3)
    path = tmp_path / "run.riftckpt"
    path.write_bytes(b"previous")

    def broken(self, handle):
        handle.write(b"partial")
        raise OSError("disk full")
    monkeypatch.setattr(TrainingCheckpoint, "_write_zip", broken)
    with pytest.raises(CheckpointError, match="cannot save .*disk full"):
        checkpoint.save(path)
    assert path.read_bytes() == b"previous"
    assert sorted(os.listdir(tmp_path)) == ["run.riftckpt"]
    monkeypatch.undo()
    checkpoint.save(path)
    assert sorted(os.listdir(tmp_path)) == ["run.riftckpt"]
    assert TrainingCheckpoint.load(path).checkpoint_id == checkpoint.checkpoint_id
    with pytest.raises(CheckpointError, match="directory .* does not exist"):
        checkpoint.save(tmp_path / "missing" / "run.riftckpt")


def test_archive_is_plain_zip_with_raw_little_endian_members(saved):
    path, checkpoint = saved
    with zipfile.ZipFile(path) as archive:
        manifest = json.loads(archive.read("manifest.json"))
        for info in archive.infolist():
            assert info.date_time == (1980, 1, 1, 0, 0, 0)
            assert info.compress_type == zipfile.ZIP_STORED
        entry = manifest["model"]["parameters"][0]
        raw = archive.read(entry["member"])
    assert manifest["schema"] == "kiln.riftckpt" and manifest["format_version"] == 2
    assert manifest["adapter"] is None and manifest["quantization"] is None
    assert len(raw) == entry["bytes"] == 4 * math.prod(entry["shape"])
    assert hashlib.sha256(raw).hexdigest() == entry["sha256"]
    assert list(checkpoint.parameter_names) == [e["name"] for e in manifest["model"]["parameters"]]


# -- the layout twin -------------------------------------------------------------------------------


@pytest.mark.parametrize("fields", [
    {}, {"tie_embeddings": True}, {"kv_head_count": 1, "block_count": 3},
    {"head_size": 6, "kv_head_count": None},
    {"family": "qwen2", "attention_bias": True}, {"family": "qwen3", "qk_norm": True, "head_size": 6},
    {"family": "qwen2", "attention_bias": True, "qk_norm": True, "tie_embeddings": True},
])
def test_parameter_signature_matches_the_model(fields):
    config = TransformerConfig(**{**SMALL, **fields})
    with DecoderOnlyTransformer(config) as model:
        live = [(n, v.shape) for n, v in model.state_dict().items()]
    assert parameter_signature(config) == live
