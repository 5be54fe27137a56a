"""trainer.checkpoints for LoRA and packed-NF4 QLoRA: exact continuation in a fresh process,
restore across NF4 block sizes and scale encodings without an FP32 base, every refusal."""

import hashlib
import importlib.util
import json
import random
import subprocess
import sys
import tracemalloc
import zipfile
from pathlib import Path

import numpy as np
import pytest

import trainer.model
from native_ext import nf4, onednn
from trainer import TransformerConfig, quantization
from trainer.checkpoints import (
    CheckpointError,
    TrainingCheckpoint,
    adapter_signature,
    quantized_signature,
)
from trainer.lora import ATTENTION, PROJECTIONS, LoraConfig
from trainer.training import CausalLanguageModelTrainer, TrainingLoopConfig

WORKER_PATH = Path(__file__).with_name("checkpoint_worker.py")
_spec = importlib.util.spec_from_file_location("checkpoint_worker", WORKER_PATH)
worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(worker)

SMALL = dict(vocabulary_size=worker.VOCABULARY, maximum_context=6, model_width=16, head_count=4,
             kv_head_count=2, block_count=1, feed_forward_width=24)
RANDOM_SOURCE = {"kind": "random", "seed": 5}
LORA = {"rank": 2, "alpha": 4.0, "targets": list(PROJECTIONS), "use_rslora": False,
        "initializer_seed": 0}
ABSMAX_64 = {"block_size": 64, "double_quantization": False}
DOUBLE_32 = {"block_size": 32, "double_quantization": True}


# -- helpers ---------------------------------------------------------------------------------


def make_run(fields=None, lora=LORA, quantize=None, storage="contiguous", source_spec=RANDOM_SOURCE,
             steps=3, seed=0):
    """A (quantized,) LoRA model, its adapter Adam and a source after `steps` steps."""
    config = TransformerConfig(**{**SMALL, "initializer_seed": seed, **(fields or {})})
    model = worker.build_model(config, lora, quantize)
    optimizer = worker.build_adam(model, storage)
    source = worker.build_source(source_spec, config.maximum_context)
    if steps:
        CausalLanguageModelTrainer(model, optimizer).run(source, TrainingLoopConfig(steps=steps))
    return model, optimizer, source


def snapshot(model, optimizer, source=None):
    """Everything a refused or rolled-back restore must leave as it was (no dequantized copy)."""
    return {"base": worker.fp32_base(model),
            "adapters": None if model.lora_config is None else model.adapter_state_dict(),
            "packed": worker.packed_arrays(model),
            "packed_objects": [] if model.quantization is None
            else [id(t) for t in model.packed_state().values()],
            "quantization": model.quantization, "adam": optimizer.state_dict(),
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


def refused_restore(checkpoint, model, optimizer, source, match):
    before = snapshot(model, optimizer, source)
    with pytest.raises(CheckpointError, match=match):
        checkpoint.restore(model, optimizer, source)
    assert_same(before, snapshot(model, optimizer, source))


def refused_load(path, match, live):
    before = snapshot(*live)
    with pytest.raises(CheckpointError, match=match):
        TrainingCheckpoint.load(path)
    assert_same(before, snapshot(*live))


def rezip(source_path, out_path, replace=None):
    replace = replace or {}
    with zipfile.ZipFile(source_path) as src, zipfile.ZipFile(out_path, "w") as dst:
        for info in src.infolist():
            dst.writestr(info, replace.get(info.filename, src.read(info.filename)))


def edited(path, out_path, edit, replace=None):
    """Rewrite manifest.json through edit(manifest) with the documented id; replace members."""
    with zipfile.ZipFile(path) as archive:
        manifest = json.loads(archive.read("manifest.json"))
    edit(manifest)
    content = {k: v for k, v in manifest.items() if k != "checkpoint_id"}
    manifest["checkpoint_id"] = hashlib.sha256(json.dumps(
        content, sort_keys=True, separators=(",", ":"), ensure_ascii=True,
        allow_nan=False).encode()).hexdigest()
    rezip(path, out_path, replace={"manifest.json": json.dumps(manifest).encode(),
                                   **(replace or {})})


def weight(manifest, index=0):
    return manifest["quantization"]["weights"][index]


def saved_run(tmp_path, name="run", **run):
    model, optimizer, source = make_run(**run)
    checkpoint = TrainingCheckpoint.capture(model, optimizer, source=source, global_step=3,
                                            metadata={"run": name})
    path = tmp_path / f"{name}.riftckpt"
    checkpoint.save(path)
    return path, checkpoint, (model, optimizer, source)


@pytest.fixture
def lora_saved(tmp_path):
    return saved_run(tmp_path, "lora")


@pytest.fixture
def qlora_saved(tmp_path):
    return saved_run(tmp_path, "qlora-absmax", quantize=ABSMAX_64)


@pytest.fixture
def qlora_double_saved(tmp_path):
    return saved_run(tmp_path, "qlora-double", quantize=DOUBLE_32)


def fresh(quantize=None, lora=None, **run):
    """Compatible target objects that start elsewhere: other seeds, one step of their own."""
    lora = {**LORA, "initializer_seed": 9} if lora is None else lora
    return make_run(lora=lora, quantize=quantize, steps=1, seed=7, **run)


# -- the layout twins --------------------------------------------------------------------------


@pytest.mark.parametrize("fields,lora", [
    ({}, LORA),
    ({"block_count": 2, "tie_embeddings": True}, {**LORA, "targets": list(ATTENTION), "rank": 3}),
    ({"head_size": 6, "kv_head_count": None}, {**LORA, "targets": ["down_proj", "q_proj"]}),
])
def test_adapter_and_quantized_signatures_match_the_model(fields, lora):
    config = TransformerConfig(**{**SMALL, **fields})
    with worker.build_model(config, lora, ABSMAX_64) as model:
        assert adapter_signature(config, model.lora_config) == [
            (n, v.shape) for n, v in model.adapter_state_dict().items()]
        assert quantized_signature(config) == [
            (n, t.shape) for n, t in model.packed_state().items()]


# -- exact continuation in a fresh process ------------------------------------------------------

CONTINUATION_CASES = {
    # name: (lora, NF4 of the run, NF4 of the fresh target, fields, storage before, after)
    "lora": (LORA, None, None, {}, "contiguous", "paged"),
    "lora-attention-rslora": ({**LORA, "targets": list(ATTENTION), "use_rslora": True, "rank": 3},
                              None, None, {"attention_algorithm": "tiled",
                                           "attention_block_size": 2}, "paged", "contiguous"),
    "qlora-absmax": (LORA, ABSMAX_64, DOUBLE_32, {"block_count": 2}, "contiguous", "contiguous"),
    "qlora-double": (LORA, DOUBLE_32, {"block_size": 256, "double_quantization": False},
                     {"tie_embeddings": True, "activation_checkpointing": "blocks"}, "paged",
                     "contiguous"),
    # base families (tests/models/test_families.py checks their numbers against transformers)
    "qwen2-lora": (LORA, None, None, {"family": "qwen2", "attention_bias": True, "tie_embeddings": True},
                   "contiguous", "paged"),
    "qwen2-qlora": (LORA, ABSMAX_64, DOUBLE_32, {"family": "qwen2", "attention_bias": True}, "paged", "contiguous"),
    "qwen3-lora": (LORA, None, None, {"family": "qwen3", "qk_norm": True, "head_size": 6,
                                      "activation_checkpointing": "blocks"}, "paged", "paged"),
    "qwen3-qlora": (LORA, DOUBLE_32, ABSMAX_64, {"family": "qwen3", "qk_norm": True, "head_size": 6},
                    "contiguous", "contiguous"),
    # the frozen base computed from bfloat16 operands on oneDNN (tests/engine/test_bf16_base.py)
    "lora-bf16": (LORA, None, None, {"base_precision": "bfloat16", "block_count": 2}, "contiguous", "paged"),
    "llama3-lora": (LORA, None, None, {"rope_scaling": ("llama3", 8.0, 1.0, 4.0, 8.0)}, "contiguous", "paged"),
    "llama3-qlora": (LORA, ABSMAX_64, DOUBLE_32, {"rope_scaling": ("llama3", 8.0, 1.0, 4.0, 8.0)}, "paged",
                     "paged"),
    "mistral-window-lora": (LORA, None, None, {"family": "mistral", "sliding_window": 3,
                                               "attention_algorithm": "tiled", "attention_block_size": 2},
                            "contiguous", "contiguous"),
    "mistral-window-qlora": (LORA, ABSMAX_64, DOUBLE_32, {"family": "mistral", "sliding_window": 4},
                             "paged", "contiguous"),
    "phi3-window-lora": (LORA, None, None, {"family": "phi3", "sliding_window": 4}, "paged", "contiguous"),
    "phi3-window-qlora": (LORA, DOUBLE_32, ABSMAX_64, {"family": "phi3", "sliding_window": 2,
                                                       "attention_algorithm": "tiled", "attention_block_size": 2},
                          "contiguous", "paged"),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CONTINUATION_CASES))
def test_fresh_process_adapter_resume_equals_uninterrupted_run(tmp_path, case):
    lora, packed_as, target_packed_as, fields, before, after = CONTINUATION_CASES[case]
    if fields.get("base_precision") == "bfloat16" and onednn.unavailable_reason():
        pytest.skip(f"no bfloat16 route here: {onednn.unavailable_reason()}")
    N, K = 6, 2
    model, optimizer, source = make_run(fields, lora, packed_as, before, steps=N)
    expected_arrays, expected = worker.final_state(model, optimizer, source)
    expected_memory = model.resident_memory()

    model, optimizer, source = make_run(fields, lora, packed_as, before, steps=K)
    archived_packed = worker.packed_arrays(model)
    checkpoint = TrainingCheckpoint.capture(model, optimizer, source=source, global_step=K,
                                            metadata={"case": case})
    checkpoint.save(tmp_path / "k.riftckpt")
    assert checkpoint.lora_config == LoraConfig.from_dict(lora)
    assert checkpoint.quantized == (packed_as is not None)

    job = {"checkpoint": str(tmp_path / "k.riftckpt"),
           "config": {**model.config.to_dict(), "initializer_seed": 12345},
           "lora": {**lora, "initializer_seed": 777}, "quantize": target_packed_as,
           "source": RANDOM_SOURCE, "storage": after, "steps": N - K, "output": str(tmp_path)}
    (tmp_path / "spec.json").write_text(json.dumps(job))
    done = subprocess.run([sys.executable, str(WORKER_PATH), str(tmp_path / "spec.json")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr

    facts = json.loads((tmp_path / "state.json").read_text())
    with np.load(tmp_path / "state.npz") as resumed:
        restored_packed = {k[len("restored_packed/"):]: resumed[k] for k in resumed.files
                           if k.startswith("restored_packed/")}
        final = {k: resumed[k] for k in resumed.files if not k.startswith("restored_packed/")}
    assert sorted(final) == sorted(expected_arrays)
    for name, value in expected_arrays.items():
        assert final[name].dtype == value.dtype
        assert np.array_equal(final[name], value), name
    assert any(name.startswith("adapter/") for name in final)
    assert facts["step"] == expected["step"] == N
    assert facts["beta1_power"] == expected["beta1_power"]
    assert facts["beta2_power"] == expected["beta2_power"]
    assert facts["source"] == expected["source"]
    assert facts["random_state"] == checkpoint.manifest()["training"]["python_random_state"]
    assert (facts["checkpoint_id"], facts["global_step"], facts["optimizer_step"],
            facts["metadata"]) == (checkpoint.checkpoint_id, K, K, {"case": case})
    # the fresh target really started elsewhere: other base values and adapters
    assert facts["changed"]["model.embed_tokens.weight"]
    assert facts["changed"]["model.layers.0.self_attn.q_proj.lora_A.weight"]
    assert facts["changed"]["model.layers.0.self_attn.q_proj.lora_B.weight"]

    memory = facts["resident_memory"]
    assert len(memory["after_steps"]) == N - K + 1
    if packed_as is None:
        assert restored_packed == {} and archived_packed == {}
        assert all(m["packed_bytes"] == 0 for m in memory["after_steps"])
        return
    # byte-identical packed state: archived == restored == after continuation
    assert sorted(restored_packed) == sorted(archived_packed)
    for name, value in archived_packed.items():
        assert restored_packed[name].dtype == value.dtype, name
        assert np.array_equal(restored_packed[name], value), name
        assert np.array_equal(final[f"packed/{name}"], value), name
    # the target began with another block size or scale encoding, so another packed size
    assert memory["before_restore"]["packed_bytes"] != expected_memory["packed_bytes"]
    assert all(m == expected_memory for m in memory["after_steps"])


# -- restore: what may and may not differ ------------------------------------------------------


def test_lora_restore_replaces_base_adapters_and_moments_in_process(lora_saved):
    _, checkpoint, live = lora_saved
    expected = snapshot(*live)
    model, optimizer, source = fresh(storage="paged")
    random.seed(8)
    result = checkpoint.restore(model, optimizer, source)
    assert (result.global_step, result.optimizer_step) == (3, 3)
    restored = snapshot(model, optimizer, source)
    assert_same(expected, restored)
    assert model.lora_config.initializer_seed == 9  # the target's own seed is kept


@pytest.mark.parametrize("lora,match", [
    ({**LORA, "rank": 4}, "LoRA configuration differs from the checkpoint: rank: checkpoint 2, "
                          "model 4 \\(only initializer_seed may differ\\)"),
    ({**LORA, "alpha": 8.0}, "alpha: checkpoint 4.0, model 8.0"),
    ({**LORA, "targets": list(ATTENTION)},
     r"targets: checkpoint \['q_proj', 'k_proj', 'v_proj', 'o_proj', 'gate_proj', 'up_proj', "
     r"'down_proj'\], model \['q_proj', 'k_proj', 'v_proj', 'o_proj'\]"),
    ({**LORA, "use_rslora": True}, "use_rslora: checkpoint False, model True"),
    ({**LORA, "rank": 3, "alpha": 2.0}, "rank: checkpoint 2, model 3; alpha: checkpoint 4.0, "
                                        "model 2.0"),
])
def test_restore_refuses_lora_shape_drift(lora_saved, lora, match):
    _, checkpoint, _ = lora_saved
    refused_restore(checkpoint, *fresh(lora=lora), match)


def test_restore_refuses_structure_drift_between_dense_lora_and_qlora(
        tmp_path, lora_saved, qlora_saved):
    _, lora_checkpoint, _ = lora_saved
    _, qlora_checkpoint, _ = qlora_saved
    _, dense_checkpoint, _ = saved_run(tmp_path, "dense", lora=None)

    dense_target = make_run(lora=None, steps=1, seed=7)
    refused_restore(lora_checkpoint, *dense_target,
                    r"holds a LoRA adapter \(rank 2, alpha 4.0, targets .*, use_rslora False\) "
                    r"but the model has none; attach_lora")
    refused_restore(qlora_checkpoint, *dense_target, "holds a LoRA adapter")

    lora_target = fresh()
    refused_restore(dense_checkpoint, *lora_target,
                    r"dense \(adapter: null\) but the model has a LoRA adapter attached")
    refused_restore(qlora_checkpoint, *lora_target,
                    r"holds packed NF4 \(QLoRA\) bases but the model is not quantized; call "
                    r"model.quantize\(\)")

    qlora_target = fresh(quantize=DOUBLE_32)
    refused_restore(lora_checkpoint, *qlora_target,
                    r"has an FP32 base \(quantization: null\) but the model has a quantized "
                    r"\(NF4\) base")
    refused_restore(dense_checkpoint, *qlora_target, r"dense \(adapter: null\)")


def test_restore_refuses_adam_over_the_base_of_a_lora_model(lora_saved):
    _, checkpoint, _ = lora_saved
    config = TransformerConfig(**{**SMALL, "initializer_seed": 7})
    model = worker.build_model(config)
    optimizer = worker.build_adam(model, "contiguous")  # built over the base, before attach_lora
    model.attach_lora(LoraConfig.from_dict(LORA))
    source = worker.build_source(RANDOM_SOURCE, config.maximum_context)
    refused_restore(checkpoint, model, optimizer, source,
                    r"holds LoRA adapter Adam state, so Adam must own "
                    r"model.adapter_parameters\(\); this optimizer owns 'base' parameters")
    with pytest.raises(CheckpointError, match="the model has a LoRA adapter attached, so Adam"):
        TrainingCheckpoint.capture(model, optimizer, source=source, global_step=0)


def test_capture_refuses_a_quantized_model_without_adapters():
    config = TransformerConfig(**SMALL)
    model = worker.build_model(config)
    optimizer = worker.build_adam(model, "contiguous")
    model.quantize()
    with pytest.raises(CheckpointError, match=r"quantized \(NF4\) base but no LoRA adapter"):
        TrainingCheckpoint.capture(model, optimizer, source=None, global_step=0)


@pytest.mark.parametrize("fields,match", [
    ({"loss_route": "kt_tape_flce"}, "configuration differs from the checkpoint: loss_route: "
                                     "checkpoint 'full_logits', model 'kt_tape_flce'"),
    ({"loss_chunk_tokens": 5}, "loss_chunk_tokens: checkpoint 64, model 5"),
    ({"attention_block_size": 4}, "attention_block_size: checkpoint 64, model 4"),
    ({"activation_checkpointing": "blocks"}, "activation_checkpointing differs"),
    ({"model_width": 8, "head_count": 2}, "architecture differs .* model_width: checkpoint 16, "
                                          "model 8"),
])
def test_qlora_restore_refuses_config_drift(qlora_saved, fields, match):
    _, checkpoint, _ = qlora_saved
    refused_restore(checkpoint, *fresh(quantize=ABSMAX_64, fields=fields), match)


def test_restore_refuses_a_different_data_fingerprint(lora_saved, qlora_double_saved):
    for _, checkpoint, _ in (lora_saved, qlora_double_saved):
        model, optimizer, _ = fresh(quantize=ABSMAX_64 if checkpoint.quantized else None)
        other = worker.build_source({**RANDOM_SOURCE, "token_offset": 1}, SMALL["maximum_context"])
        refused_restore(checkpoint, model, optimizer, other, "data fingerprint mismatch")


class FailingAdamCommit:
    """Wraps optimizer.load_state_dict: the first commit completes and then raises."""

    def __init__(self, optimizer):
        self.real, self.calls = optimizer.load_state_dict, 0
        optimizer.load_state_dict = self

    def __call__(self, state):
        self.calls += 1
        self.real(state)
        if self.calls == 1:
            raise MemoryError("scripted failure after the Adam commit")


@pytest.mark.parametrize("quantize", [None, DOUBLE_32], ids=["lora", "qlora"])
def test_a_failing_adam_commit_rolls_back_base_packed_state_and_adapters(
        tmp_path, quantize):
    _, checkpoint, _ = saved_run(tmp_path, quantize=ABSMAX_64 if quantize else None)
    model, optimizer, source = fresh(quantize=quantize)
    commit = FailingAdamCommit(optimizer)
    before = snapshot(model, optimizer, source)
    with pytest.raises(CheckpointError, match="while restoring the Adam state: MemoryError"):
        checkpoint.restore(model, optimizer, source)
    assert commit.calls == 2  # the commit, then the rollback
    assert_same(before, snapshot(model, optimizer, source))  # packed: the same objects, bytes


# -- QLoRA restore never builds an FP32 Linear base ---------------------------------------------


def test_qlora_restore_never_dequantizes_or_allocates_an_fp32_linear_base(tmp_path, monkeypatch):
    fields = dict(vocabulary_size=16, maximum_context=4, model_width=512, head_count=4,
                  kv_head_count=4, feed_forward_width=512, tie_embeddings=True)
    lora = {**LORA, "rank": 1, "targets": ["q_proj", "down_proj"]}
    path, checkpoint, (model, _, _) = saved_run(tmp_path, fields=fields, lora=lora,
                                                quantize=ABSMAX_64, steps=1)
    archived_packed = worker.packed_arrays(model)
    largest = max(4 * t.numel for t in model.packed_state().values())
    assert largest == 4 * 512 * 512
    checkpoint = TrainingCheckpoint.load(path)
    target = fresh(quantize=DOUBLE_32, fields=fields, lora={**lora, "initializer_seed": 4})

    def forbidden(*args, **kwargs):
        raise AssertionError("restore dequantized a packed NF4 base")
    for module in (quantization, trainer.model):
        monkeypatch.setattr(module, "dequantize_nf4", forbidden)
        monkeypatch.setattr(module, "dequantize_rows", forbidden)
    monkeypatch.setattr(nf4, "dequantize", forbidden)
    monkeypatch.setattr(nf4, "dequantize_double", forbidden)
    tracemalloc.start()
    try:
        probe = np.empty((512, 512), np.float32)  # the probe sees numpy's allocations
        assert tracemalloc.get_traced_memory()[0] >= probe.nbytes
        del probe
        tracemalloc.reset_peak()
        start = tracemalloc.get_traced_memory()[0]
        checkpoint.restore(*target)
        peak = tracemalloc.get_traced_memory()[1] - start
    finally:
        tracemalloc.stop()
    monkeypatch.undo()
    assert peak < largest // 4, f"restore allocated {peak} bytes at its peak"
    assert_same(archived_packed, worker.packed_arrays(target[0]))


# -- load: every packed member is validated ----------------------------------------------------


def test_a_flipped_byte_in_each_qlora_member_is_refused(qlora_double_saved, tmp_path):
    path, _, _ = qlora_double_saved
    live = fresh(quantize=ABSMAX_64)
    data = path.read_bytes()
    with zipfile.ZipFile(path) as archive:
        infos = archive.infolist()
    names = [info.filename for info in infos]
    assert any(n.endswith("/absmax_codes.u8") for n in names)
    assert any(n.endswith("/absmax_scales.f32") for n in names)
    assert any(n.startswith("adapter/") for n in names)
    for info in infos:
        header = data[info.header_offset:info.header_offset + 30]
        start = info.header_offset + 30 + int.from_bytes(header[26:28], "little") \
            + int.from_bytes(header[28:30], "little")
        damaged = bytearray(data)
        damaged[start + info.compress_size // 2] ^= 0x10
        (tmp_path / "flipped.riftckpt").write_bytes(bytes(damaged))
        refused_load(tmp_path / "flipped.riftckpt", f"member '{info.filename}' is corrupt", live)


def test_altered_packed_content_fails_its_checksum(qlora_saved, tmp_path):
    path, _, _ = qlora_saved
    live = fresh(quantize=ABSMAX_64)
    with zipfile.ZipFile(path) as archive:
        members = [n for n in archive.namelist() if n.startswith("nf4/")]
        for member in members[:4]:
            content = bytearray(archive.read(member))
            content[0] ^= 0x01
            rezip(path, tmp_path / "altered.riftckpt", replace={member: bytes(content)})
            refused_load(tmp_path / "altered.riftckpt",
                         f"member '{member}' fails its checksum", live)


def _replace_member(manifest, entry, data):
    """Point an entry at new bytes: size and digest updated, as a forger would."""
    entry["bytes"] = len(data)
    entry["sha256"] = hashlib.sha256(data).hexdigest()
    return {entry["member"]: data}


PACKED_EDITS = [
    # (name, archive fixture, edit(manifest) -> replaced members, match)
    ("block size", "qlora", lambda m: weight(m).update(block_size=32),
     r"weights\[0\].absmax.shape: is \[4\], but the weight's shape and block sizes give \[8\]"),
    ("unsupported block size", "qlora", lambda m: weight(m).update(block_size=48),
     r"weights\[0\].block_size: must be one of \(32, 64"),
    ("weight shape", "qlora", lambda m: weight(m).update(shape=[16, 8]),
     r"weights\[0\].packed.shape: is \[128\], but the weight's shape and block sizes give \[64\]"),
    ("packed dtype", "qlora", lambda m: weight(m)["packed"].update(dtype="float32"),
     r"weights\[0\].packed.dtype: only uint8 is supported"),
    ("both encodings", "qlora", lambda m: weight(m).update(double_quantization={}),
     r"weights\[0\]: needs exactly one of absmax \(FP32 scales\) and double_quantization"),
    ("neither encoding", "qlora", lambda m: weight(m).update(absmax=None),
     r"weights\[0\]: needs exactly one of absmax"),
    ("missing weight", "qlora", lambda m: m["quantization"]["weights"].pop(2),
     r"quantization.weights: parameter names do not match model.config \(model.quantize\(\) packs "
     r"every block projection\): missing \['model.layers.0.self_attn.v_proj.weight'\]"),
    ("member path", "qlora", lambda m: weight(m)["absmax"].update(member="nf4/x/absmax.f32"),
     r"weights\[0\].absmax.member: is 'nf4/x/absmax.f32', the format requires"),
    ("type", "qlora", lambda m: m["quantization"].update(type="int8"),
     r"quantization.type: only 'nf4' is supported"),
    ("double block", "double", lambda m: weight(m)["double_quantization"].update(block_size=128),
     r"double_quantization.block_size: must be 256, got 128"),
    ("offset", "double", lambda m: weight(m)["double_quantization"].update(offset=0.1),
     r"double_quantization.offset: 0.1 is not a float32 value"),
    ("offset type", "double", lambda m: weight(m)["double_quantization"].update(offset="0.5"),
     r"double_quantization.offset: expected a finite float"),
    ("scales size", "double",
     lambda m: weight(m)["double_quantization"]["scales"].update(shape=[2], bytes=8),
     r"double_quantization.scales.shape: is \[2\], but .* block sizes give \[1\]"),
    ("codes size", "double",
     lambda m: weight(m)["double_quantization"]["codes"].update(shape=[4], bytes=4),
     r"double_quantization.codes.shape: is \[4\], but .* give \[8\]"),
    ("absmax NaN", "qlora",
     lambda m: _replace_member(m, weight(m, 1)["absmax"], np.array([1, np.nan], "<f4").tobytes()),
     r"nf4/model.layers.0.self_attn.k_proj.weight/absmax.f32'.*absmax of "
     r"model.layers.0.self_attn.k_proj.weight have non-finite entries"),
    ("absmax negative", "qlora",
     lambda m: _replace_member(m, weight(m, 1)["absmax"], np.array([1, -2], "<f4").tobytes()),
     r"absmax of model.layers.0.self_attn.k_proj.weight have negative entries"),
    ("scales infinite", "double",
     lambda m: _replace_member(m, weight(m)["double_quantization"]["scales"],
                               np.array([np.inf], "<f4").tobytes()),
     r"second-level absmax scales of model.layers.0.self_attn.q_proj.weight have non-finite"),
    ("adapter shape", "qlora",
     lambda m: m["adapter"]["parameters"][0].update(shape=[3, 16], bytes=192),
     r"adapter.parameters\[model.layers.0.self_attn.q_proj.lora_A.weight\]: shape \[3, 16\] does "
     r"not match model.config and adapter.config \[2, 16\]"),
    ("adapter targets order", "qlora",
     lambda m: m["adapter"]["config"].update(targets=list(reversed(PROJECTIONS))),
     r"adapter.config.targets: must be listed in canonical projection order"),
    ("adapter rank", "qlora", lambda m: m["adapter"]["config"].update(rank=0),
     r"adapter.config: not a valid LoraConfig: rank must be a positive integer"),
    ("optimizer kind", "qlora", lambda m: m["optimizer"].update(parameters="base"),
     r"optimizer.parameters: is 'base', but with adapter present Adam owns 'adapter' parameters"),
    ("moment names", "qlora", lambda m: m["optimizer"]["first_moment"].pop(),
     r"optimizer.first_moment: names and shapes must equal adapter.parameters"),
    ("no adapter", "qlora", lambda m: m.update(adapter=None),
     r"quantization: a quantized \(NF4\) base is frozen, so the archive needs a LoRA adapter"),
    ("packed in model", "qlora",
     lambda m: m["model"]["parameters"].insert(
         1, {**weight(m)["packed"], "name": weight(m)["name"]}),
     r"model.parameters\[1\].dtype: only float32 is supported here, got 'uint8'"),
]


@pytest.mark.parametrize("archive,edit,match", [(a, e, m) for _, a, e, m in PACKED_EDITS],
                         ids=[i for i, _, _, _ in PACKED_EDITS])
def test_packed_and_adapter_sections_are_validated(qlora_saved, qlora_double_saved, tmp_path,
                                                   archive, edit, match):
    path = {"qlora": qlora_saved, "double": qlora_double_saved}[archive][0]
    replaced = {}

    def apply(manifest):
        replaced.update(edit(manifest) or {})
    edited(path, tmp_path / "edited.riftckpt", apply)
    if replaced:
        rezip(tmp_path / "edited.riftckpt", tmp_path / "forged.riftckpt", replace=replaced)
        target = tmp_path / "forged.riftckpt"
    else:
        target = tmp_path / "edited.riftckpt"
    refused_load(target, match, fresh(quantize=ABSMAX_64))


def test_a_truncated_packed_member_is_refused_by_size(qlora_saved, tmp_path):
    path, _, _ = qlora_saved
    member = "nf4/model.layers.0.mlp.down_proj.weight/packed.u8"
    with zipfile.ZipFile(path) as archive:
        content = archive.read(member)
    rezip(path, tmp_path / "short.riftckpt", replace={member: content[:-1]})
    refused_load(tmp_path / "short.riftckpt",
                 f"member '{member}' has {len(content) - 1} bytes, the manifest says "
                 f"{len(content)}",
                 fresh(quantize=ABSMAX_64))


# -- the archive: layout, deterministic bytes ---------------------------------------------------


def test_qlora_archive_layout_and_deterministic_bytes(qlora_double_saved, tmp_path):
    path, checkpoint, (model, optimizer, source) = qlora_double_saved
    with zipfile.ZipFile(path) as archive:
        manifest = json.loads(archive.read("manifest.json"))
        names = archive.namelist()
        first = weight(manifest)
        packed = archive.read(first["packed"]["member"])
        codes = archive.read(first["double_quantization"]["codes"]["member"])
    tensor = model.packed_state()[first["name"]]
    assert packed == tensor.packed.tobytes() and codes == tensor.absmax_codes.tobytes()
    assert first["double_quantization"]["offset"] == float(tensor.offset)
    assert (first["block_size"], first["shape"]) == (32, [16, 16])
    assert manifest["adapter"]["config"] == {**LORA, "alpha": 4.0}
    assert manifest["optimizer"]["parameters"] == "adapter"
    assert [e["name"] for e in manifest["model"]["parameters"]] == [
        "model.embed_tokens.weight", "model.layers.0.input_layernorm.weight",
        "model.layers.0.post_attention_layernorm.weight", "model.norm.weight", "lm_head.weight"]
    assert names[0] == "manifest.json" and len(names) == len(set(names))
    again = TrainingCheckpoint.capture(model, optimizer, source=source, global_step=3,
                                       metadata={"run": "qlora-double"})
    assert again.checkpoint_id == checkpoint.checkpoint_id
    TrainingCheckpoint.load(path).save(tmp_path / "again.riftckpt")
    assert (tmp_path / "again.riftckpt").read_bytes() == path.read_bytes()
