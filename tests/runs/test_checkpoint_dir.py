"""The .kiln-checkpoint directory: names, deterministic atomic publication, every loader refusal, kills."""

import hashlib
import importlib.util
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from trainer import fsio
from trainer.jsonio import canonical_bytes
from trainer.runs import checkpoint_dir as cd
from trainer.runs.checkpoint_dir import CheckpointError
from trainer.runs.state import tensors_bytes, tensors_from

WORKER_PATH = Path(__file__).with_name("publish_worker.py")
_spec = importlib.util.spec_from_file_location("publish_worker", WORKER_PATH)
worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(worker)

FIELDS = {"seed", "config", "progress", "loss_history"}  # what checkpoint_inputs() writes


def publish(registry, step=1, adapter="bot", **kwargs):
    files, manifest = worker.checkpoint_inputs(step)
    kwargs.setdefault("checkpoint_type", "sft")
    return cd.publish_checkpoint(registry, adapter, step, files=files, manifest=manifest, **kwargs)


def refused(code, call, *args, **kwargs) -> str:
    """Run call, require a CheckpointError with this code, return its message."""
    with pytest.raises(CheckpointError) as info:
        call(*args, **kwargs)
    assert info.value.code == code, f"{info.value.code}: {info.value}"
    assert isinstance(info.value, cd.ERRORS[code])
    return str(info.value)


def rewrite_manifest(path: Path, change, keep_id=False):
    """Apply change(manifest) and write it back canonically, with a recomputed checkpoint_id."""
    manifest = json.loads((path / cd.MANIFEST).read_bytes())
    change(manifest)
    if not keep_id:
        manifest["checkpoint_id"] = cd.content_id(manifest)
    (path / cd.MANIFEST).write_bytes(canonical_bytes(manifest) + b"\n")


def tree(root: Path) -> dict:
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))}


@pytest.fixture
def registry(tmp_path):
    path = tmp_path / "adapters"
    path.mkdir()
    return path


@pytest.fixture
def published(registry):
    return publish(registry, step=3)


# --- names ---------------------------------------------------------------------------------


def test_basename_round_trip_and_refusals():
    assert cd.checkpoint_basename("support-bot", 25) == "support-bot-checkpoint-step-00000025.kiln-checkpoint"
    assert cd.parse_basename("support-bot-checkpoint-step-00000025.kiln-checkpoint") == ("support-bot", 25)
    assert cd.parse_basename("a-checkpoint-step-123456789.kiln-checkpoint") == ("a", 123456789)
    for name in ("support-bot-checkpoint-step-25.kiln-checkpoint",  # too few digits
                 "support-bot-checkpoint-step-000000025.kiln-checkpoint",  # extra leading zero
                 "support-bot-checkpoint-step-00000025",  # no suffix
                 ".support-bot-checkpoint-step-00000025.kiln-checkpoint",
                 "../support-bot-checkpoint-step-00000025.kiln-checkpoint",
                 "a..b-checkpoint-step-00000025.kiln-checkpoint", "support-bot", "", None):
        assert "not a canonical checkpoint name" in refused("noncanonical_name", cd.parse_basename, name)
    for adapter in ("../x", "a..b", "-x", ".x", "a/b", "x" * 101, "", "a-checkpoint-step-1", 3):
        assert "adapter name" in refused("noncanonical_name", cd.checkpoint_basename, adapter, 1)
    for step in (-1, True, 1.0, "1", 2 ** 63):
        assert "step" in refused("noncanonical_name", cd.checkpoint_basename, "bot", step)


def test_every_code_has_its_own_class():
    assert len(cd.ERRORS) == len({cls.code for cls in cd.ERRORS.values()}) == 22
    assert all(issubclass(cls, CheckpointError) for cls in cd.ERRORS.values())


# --- publication -------------------------------------------------------------------------------


def test_publication_is_deterministic_and_complete(tmp_path):
    timings = []
    first = publish(tmp_path / "a", step=7, on_timing=timings.append)
    files, manifest = worker.checkpoint_inputs(7)
    reordered = cd.publish_checkpoint(tmp_path / "b", "bot", 7, checkpoint_type="sft",
                                      files=dict(reversed(list(files.items()))),
                                      manifest=dict(reversed(list(manifest.items()))))
    assert first.name == reordered.name == "bot-checkpoint-step-00000007.kiln-checkpoint"
    assert tree(first) == tree(reordered)  # byte-identical, manifest included
    assert set(tree(first)) == {"adapter.safetensors", "optimizer.safetensors", "rng", "rng/streams.json",
                                "state.json", cd.MANIFEST}
    loaded = cd.load_checkpoint(first, allowed_manifest_fields=FIELDS)
    assert loaded.checkpoint_id == cd.load_checkpoint(reordered).checkpoint_id
    assert loaded.files == files
    raw = (first / cd.MANIFEST).read_bytes()
    assert loaded.manifest_digest == hashlib.sha256(raw).hexdigest()
    m = loaded.manifest
    assert set(m) == set(cd.OUTER_FIELDS) | FIELDS and "created_at" not in raw.decode()
    assert (m["schema"], m["checkpoint_type"], m["adapter"], m["step"]) == (cd.SCHEMA, "sft", "bot", 7)
    assert m["files"]["state.json"] == {"size": len(files["state.json"]),
                                        "sha256": hashlib.sha256(files["state.json"]).hexdigest()}
    assert m["checkpoint_id"] == hashlib.sha256(canonical_bytes(
        {k: v for k, v in m.items() if k != "checkpoint_id"})).hexdigest()
    assert raw == json.dumps(m, sort_keys=True, separators=(",", ":")).encode() + b"\n"
    assert set(timings[0]) >= {"hash_seconds", "write_seconds", "fsync_seconds", "rename_seconds", "bytes"}
    assert timings[0]["bytes"] == sum(map(len, files.values()))
    assert os.listdir(tmp_path / "a") == [first.name]  # no staging left behind


def test_publication_accepts_buffers_and_nested_paths(registry):
    data = bytearray(b"abc" * 1000)
    path = cd.publish_checkpoint(registry, "bot", 1, checkpoint_type="grpo",
                                 files={"a/b/c.bin": memoryview(data), "x.bin": data, "empty": b""}, manifest={})
    loaded = cd.load_checkpoint(path, expected_type="grpo", allowed_manifest_fields=set())
    assert loaded.files == {"a/b/c.bin": bytes(data), "x.bin": bytes(data), "empty": b""}


def test_existing_name_is_never_overwritten(registry, published):
    before = tree(published)
    message = refused("name_exists", publish, registry, step=3)
    assert "immutable" in message and "archive later" in message
    assert tree(published) == before and os.listdir(registry) == [published.name]


def test_name_created_during_publication_is_not_replaced(registry):
    """The race: the canonical name appears after the early check; even an empty directory survives."""
    target = registry / cd.checkpoint_basename("bot", 4)

    def squat(stage):
        if stage == "sentinel_removed":
            target.mkdir()
            (target / "marker").write_bytes(b"first writer")

    refused("name_exists", publish, registry, step=4, on_stage=squat)
    assert (target / "marker").read_bytes() == b"first writer"
    assert os.listdir(registry) == [target.name]  # staging cleaned up

    probe = [registry.parent / "probe-a", registry.parent / "probe-b"]
    for path in probe:
        path.mkdir()
    try:
        fsio.rename_noreplace(*probe)
    except FileExistsError:  # RENAME_NOREPLACE works here, so not even an empty directory is replaced
        target2 = registry / cd.checkpoint_basename("bot", 5)
        refused("name_exists", publish, registry, step=5,
                on_stage=lambda stage: stage == "sentinel_removed" and target2.mkdir())
        assert target2.is_dir() and os.listdir(target2) == []


def test_publication_input_refusals_leave_nothing_behind(registry):
    ok = {"a.bin": b"x"}
    for bad in ("../a", "/abs", "a\\b", "a//b", "./a", "a/", ".hidden", "a\x00b", cd.MANIFEST, "a b", ""):
        refused("bad_path", cd.publish_checkpoint, registry, "bot", 1, checkpoint_type="sft",
                files={bad: b"x"}, manifest={})
    refused("bad_path", cd.publish_checkpoint, registry, "bot", 1, checkpoint_type="sft",
            files={"a": b"x", "a/b": b"y"}, manifest={})
    refused("bad_path", cd.publish_checkpoint, registry, "bot", 1, checkpoint_type="sft",
            files={"A.bin": b"x", "a.bin": b"y"}, manifest={})
    assert "bytes" in refused("bad_field", cd.publish_checkpoint, registry, "bot", 1, checkpoint_type="sft",
                              files={"a.bin": "text"}, manifest={})
    for manifest, words in (({"files": {}}, "written by publish_checkpoint"),
                            ({"checkpoint_id": "x"}, "written by publish_checkpoint"),
                            ({"loss": float("nan")}, "strict JSON"),
                            ({"big": 2 ** 64}, "64 bits"),
                            ({"seed": object()}, "strict JSON"),
                            ({1: "a", "1": "b"}, "strict JSON"),
                            ({"progress": {"committed_step": 2}}, "committed_step")):
        with pytest.raises(CheckpointError) as info:
            cd.publish_checkpoint(registry, "bot", 1, checkpoint_type="sft", files=ok, manifest=manifest)
        assert info.value.code in ("bad_field", "inconsistent_state") and words in str(info.value)
    assert "supported" not in refused("unsupported_type", cd.publish_checkpoint, registry, "bot", 1,
                                      checkpoint_type="ppo", files=ok, manifest={})
    refused("noncanonical_name", cd.publish_checkpoint, registry, "../bot", 1, checkpoint_type="sft",
            files=ok, manifest={})
    assert os.listdir(registry) == []


def test_staging_orphans_are_invisible_and_do_not_block(registry):
    publish(registry, step=1)

    def crash(stage):
        if stage == "file:optimizer.safetensors":
            raise KeyboardInterrupt  # cleaned up: in-process failures leave no staging
    with pytest.raises(KeyboardInterrupt):
        publish(registry, step=2, on_stage=crash)
    assert cd.list_staging_orphans(registry) == []
    basename = cd.checkpoint_basename("bot", 2)
    orphan = registry / f".{basename}.staging-0123456789abcdef"  # what a killed process leaves
    orphan.mkdir()
    (orphan / cd.SENTINEL).write_bytes(b"")
    (orphan / "adapter.safetensors").write_bytes(b"partial")
    assert cd.list_checkpoints(registry) == [registry / cd.checkpoint_basename("bot", 1)]
    assert cd.latest_checkpoint(registry, "bot") == registry / cd.checkpoint_basename("bot", 1)
    assert cd.list_staging_orphans(registry, "bot") == [orphan]
    refused("noncanonical_name", cd.load_checkpoint, orphan)
    refused("noncanonical_name", cd.resolve_checkpoint, registry, orphan.name)
    path = publish(registry, step=2)
    assert cd.load_checkpoint(path).step == 2 and orphan.is_dir()
    assert cd.latest_checkpoint(registry, "bot") == path


def test_old_staging_orphans_are_removed_and_nothing_else(tmp_path, registry):
    kept = publish(registry, step=1)
    old = registry / f".{cd.checkpoint_basename('bot', 2)}.staging-0123456789abcdef"
    old.mkdir()
    (old / cd.SENTINEL).write_bytes(b"")
    (old / "adapter.safetensors").write_bytes(b"partial")
    young = registry / f".{cd.checkpoint_basename('bot', 3)}.staging-fedcba9876543210"
    young.mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious").write_bytes(b"keep")
    squatter = registry / f".{cd.checkpoint_basename('bot', 4)}.staging-00000000000000aa"
    squatter.symlink_to(outside)  # a link on a staging name: unlinked, never followed
    other = registry / ".not-a-staging-name"
    other.mkdir()
    hour_ago = time.time() - 3600
    for path in (old, old / cd.SENTINEL, old / "adapter.safetensors"):
        os.utime(path, (hour_ago, hour_ago), follow_symlinks=False)
    os.utime(squatter, (hour_ago, hour_ago), follow_symlinks=False)
    assert sorted(cd.remove_staging_orphans(registry, older_than=1800)) == sorted([old, squatter])
    assert not old.exists() and not os.path.lexists(squatter) and young.is_dir() and other.is_dir()
    assert (outside / "precious").read_bytes() == b"keep"
    assert cd.load_checkpoint(kept).step == 1
    assert cd.remove_staging_orphans(registry, older_than=0) == [young]
    with pytest.raises(ValueError):
        cd.remove_staging_orphans(registry, older_than=float("nan"))


# --- loading: every refusal --------------------------------------------------------------------


def test_light_and_full_loads_agree_on_valid_checkpoint(published):
    full = cd.load_checkpoint(published, allowed_manifest_fields=FIELDS, expected_type="sft",
                              expected_adapter="bot")
    light = cd.load_checkpoint(published, full=False, allowed_manifest_fields=FIELDS)
    assert light.files == {} and light.manifest == full.manifest
    assert (light.checkpoint_id, light.manifest_digest) == (full.checkpoint_id, full.manifest_digest)
    assert light.read("state.json") == full.read("state.json") == full.files["state.json"]
    with pytest.raises(KeyError):
        light.read("other.bin")
    summary = cd.checkpoint_summary(light)
    assert summary == {"resume_checkpoint": published.name, "training_kind": "sft", "adapter": "bot",
                       "step": 3, "checkpoint_id": full.checkpoint_id, "committed_step": 3,
                       "total_steps": 10 ** 6, "complete": False, "next_cursor": {"epoch": 0, "example": 6},
                       "data_source_kind": "inline", "manifest_sha256": full.manifest_digest}


def test_name_manifest_and_sentinel_refusals(registry, published):
    other = registry / "renamed"
    shutil.copytree(published, other)
    assert "canonical" in refused("noncanonical_name", cd.load_checkpoint, other)
    renamed = registry / cd.checkpoint_basename("bot", 4)
    shutil.copytree(published, renamed)
    assert "renamed" in refused("inconsistent_state", cd.load_checkpoint, renamed)
    (published / cd.SENTINEL).write_bytes(b"")
    assert "never finished" in refused("incomplete", cd.load_checkpoint, published)
    (published / cd.SENTINEL).unlink()
    (published / cd.MANIFEST).unlink()
    assert cd.MANIFEST in refused("missing_manifest", cd.load_checkpoint, published)
    assert "no checkpoint" in refused("not_found", cd.load_checkpoint, registry / cd.checkpoint_basename("bot", 9))


@pytest.mark.parametrize("change,code,words", [
    (lambda m: m.update(schema="kiln.training-checkpoint.v2"), "unsupported_schema", "kiln.training-checkpoint.v1"),
    (lambda m: m.update(checkpoint_type="ppo"), "unsupported_type", "'ppo'"),
    (lambda m: m.update(created_at="2024-01-01"), "unknown_field", "'created_at'"),
    (lambda m: m.pop("step"), "bad_field", "step"),
    (lambda m: m.update(step="3"), "bad_field", "'step' must be"),
    (lambda m: m.update(adapter="../x"), "bad_field", "'adapter'"),
    (lambda m: m["files"]["state.json"].pop("sha256"), "bad_field", "files['state.json']"),
    (lambda m: m["files"]["state.json"].update(size=-1), "bad_field", "size"),
    (lambda m: m["files"]["state.json"].update(sha256="AB" * 32), "bad_field", "sha256"),
    (lambda m: m.update(files=[]), "bad_field", "'files'"),
    (lambda m: m.update(progress=[]), "bad_field", "progress"),
    (lambda m: m["progress"].update(step=2), "bad_field", "progress must not hold step"),
    (lambda m: m["progress"].update(complete="no"), "bad_field", "complete"),
    (lambda m: m["progress"].update(committed_step=2), "inconsistent_state", "committed_step is 2"),
    (lambda m: m["progress"].update(total_steps=2), "inconsistent_state", "total_steps"),
    (lambda m: m.update(adapter="other"), "inconsistent_state", "adapter 'other'"),
    (lambda m: m.update(step=4), "inconsistent_state", "step 4"),
])
def test_manifest_field_refusals(published, change, code, words):
    rewrite_manifest(published, change)
    assert words in refused(code, cd.load_checkpoint, published, full=False, allowed_manifest_fields=FIELDS)
    refused(code, cd.load_checkpoint, published, allowed_manifest_fields=FIELDS)


def test_unknown_fields_are_checked_only_against_a_declared_set(published):
    rewrite_manifest(published, lambda m: m.update(teacher={"alias": "x"}))
    assert cd.load_checkpoint(published).manifest["teacher"] == {"alias": "x"}  # None: caller fields not checked
    cd.load_checkpoint(published, allowed_manifest_fields=FIELDS | {"teacher"})
    message = refused("unknown_field", cd.load_checkpoint, published, allowed_manifest_fields=FIELDS)
    assert "'teacher'" in message and "known fields are" in message


@pytest.mark.parametrize("bad", ["../x", "/abs", "a\\b", "a//b", "./a", "a/./b", ".hidden", "a\x00b", cd.MANIFEST])
def test_declared_path_refusals(published, bad):
    rewrite_manifest(published, lambda m: m["files"].update({bad: {"size": 1, "sha256": "0" * 64}}))
    assert repr(bad) in refused("bad_path", cd.load_checkpoint, published)


def test_strict_json_refusals(published):
    raw = (published / cd.MANIFEST).read_bytes()
    m = json.loads(raw)
    cases = [
        (raw.replace(b'"seed":1234', b'"seed":1234,"seed":1234'), "duplicate key"),
        (raw.replace(b'"seed":1234', b'"seed":NaN'), "NaN"),
        (raw.replace(b'"seed":1234', b'"seed":Infinity'), "Infinity"),
        (raw.replace(b'"seed":1234', b'"seed":1e999'), "overflows"),
        (raw.replace(b'"seed":1234', b'"seed":' + str(2 ** 63).encode()), "64 bits"),
        (raw.replace(b'"seed":1234', b'"seed":' + b"9" * 5000), "64 bits"),
        (b"[" * 100000 + b"]" * 100000, "strict JSON"),
        (b"\xff\xfe", "strict JSON"),
        (b"[1, 2]\n", "JSON object"),
        (json.dumps(m, indent=1).encode(), "canonical form"),  # same content, reformatted
    ]
    for data, words in cases:
        (published / cd.MANIFEST).write_bytes(data)
        assert words in refused("bad_field", cd.load_checkpoint, published, full=False)
    (published / cd.MANIFEST).write_bytes(b" " * (cd.MAX_MANIFEST_BYTES + 1))
    assert "limit" in refused("bad_field", cd.load_checkpoint, published, full=False)


def test_edited_manifest_breaks_the_checkpoint_id(published):
    rewrite_manifest(published, lambda m: m.update(seed=99), keep_id=True)
    assert "edited after publication" in refused("checksum_mismatch", cd.load_checkpoint, published, full=False)


def test_file_set_refusals(registry, published):
    def fresh():
        shutil.rmtree(published)
        return publish(registry, step=3)

    (published / "notes.txt").write_bytes(b"hi")
    assert "'notes.txt'" in refused("extra_file", cd.load_checkpoint, published, full=False)
    path = fresh()
    (path / "rng" / "extra.json").write_bytes(b"{}")
    assert "'rng/extra.json'" in refused("extra_file", cd.load_checkpoint, path)
    path = fresh()
    (path / "empty-dir").mkdir()
    assert "undeclared directory 'empty-dir'" in refused("extra_file", cd.load_checkpoint, path)
    path = fresh()
    (path / "optimizer.safetensors").unlink()
    assert "'optimizer.safetensors'" in refused("missing_file", cd.load_checkpoint, path, full=False)
    path = fresh()
    os.mkfifo(path / "pipe")
    assert "FIFO" in refused("untracked_file", cd.load_checkpoint, path, full=False)
    path = fresh()
    (path / "state.json").unlink()
    (path / "state.json").mkdir()
    assert "is a directory" in refused("untracked_file", cd.load_checkpoint, path)


def test_size_and_checksum_refusals(registry, published):
    target = published / "optimizer.safetensors"
    data = target.read_bytes()
    target.write_bytes(data + b"x")
    assert f"holds {len(data) + 1} bytes" in refused("size_mismatch", cd.load_checkpoint, published, full=False)
    refused("size_mismatch", cd.load_checkpoint, published)
    target.write_bytes(bytes([data[0] ^ 1]) + data[1:])
    light = cd.load_checkpoint(published, full=False)  # status polls do not rehash ...
    assert "do not edit" in refused("checksum_mismatch", light.read, "optimizer.safetensors")  # ... reads do
    message = refused("checksum_mismatch", cd.load_checkpoint, published)  # admission does
    assert "'optimizer.safetensors'" in message and "SHA-256" in message


def test_large_file_read_paths_refuse_drift(registry, monkeypatch):
    """Files above PIPELINE_MIN are read by a second thread while this one hashes: same refusals."""
    big = random.Random(1).randbytes(3 * cd.READ_CHUNK + 5)
    assert len(big) > cd.PIPELINE_MIN
    path = cd.publish_checkpoint(registry, "bot", 1, checkpoint_type="sft", files={"big.bin": big}, manifest={})
    assert cd.load_checkpoint(path).files["big.bin"] == big
    monkeypatch.setattr(fsio, "PIPELINE_MIN", len(big) + 1)  # the plain read-then-hash path agrees
    assert cd.load_checkpoint(path).files["big.bin"] == big
    monkeypatch.undo()
    real_readv = os.readv
    calls = []

    def shrinking(fd, buffers):  # the file is truncated by someone else after the first chunk
        calls.append(fd)
        return real_readv(fd, buffers) if len(calls) == 1 else 0
    monkeypatch.setattr(os, "readv", shrinking)
    assert "changed size while being read" in refused("size_mismatch", cd.load_checkpoint, path)
    monkeypatch.setattr(os, "readv", lambda fd, buffers: (_ for _ in ()).throw(OSError(5, "I/O error")))
    with pytest.raises(OSError, match="I/O error"):
        cd.load_checkpoint(path)
    monkeypatch.undo()
    with open(path / "big.bin", "r+b") as f:
        f.seek(len(big) - 1)
        f.write(bytes([big[-1] ^ 0x80]))
    assert "'big.bin'" in refused("checksum_mismatch", cd.load_checkpoint, path)


def test_large_state_files_restore_through_the_run_readers(registry):
    """Files above PIPELINE_MIN come back as read-only views; tensors and JSON parse from them as
    from bytes (a real base's optimizer file is tens of MB)."""
    rng = np.random.default_rng(3)
    moments = {"first_moment/w": rng.standard_normal((1200, 1100), dtype=np.float32),
               "second_moment/w": rng.random((1200, 1100), dtype=np.float32),
               "step_count": np.arange(5, dtype=np.int64)}
    state = {"plans": [[i, i * 2] for i in range(400_000)]}
    files = {"optimizer.safetensors": tensors_bytes(moments), "state.json": json.dumps(state).encode()}
    assert min(len(data) for data in files.values()) > cd.PIPELINE_MIN
    path = cd.publish_checkpoint(registry, "bot", 1, checkpoint_type="sft", files=files, manifest={})
    for loaded in (cd.load_checkpoint(path), cd.load_checkpoint(path, full=False)):
        data = loaded.read("optimizer.safetensors")
        assert data == files["optimizer.safetensors"]
        if loaded.files:
            assert isinstance(data, memoryview) and data.readonly
        restored = tensors_from(data)
        assert sorted(restored) == sorted(moments)
        for name, array in moments.items():
            assert restored[name].dtype == array.dtype and restored[name].shape == array.shape
            assert restored[name].tobytes() == array.tobytes()
            assert restored[name].flags.writeable
        assert loaded.read_json("state.json") == state


def test_symlink_refusals(tmp_path, registry, published):
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"x")
    link = registry / cd.checkpoint_basename("bot", 8)
    link.symlink_to(published)
    assert "symlink" in refused("symlink", cd.load_checkpoint, link)
    assert cd.list_checkpoints(registry) == [published]  # a symlinked name is never offered
    (published / "rng" / "streams.json").unlink()
    (published / "rng" / "streams.json").symlink_to(outside)
    assert "'rng/streams.json'" in refused("symlink", cd.load_checkpoint, published, full=False)
    shutil.rmtree(published)
    published = publish(registry, step=3)
    shutil.move(published / "rng", tmp_path / "rng")
    (published / "rng").symlink_to(tmp_path / "rng")
    refused("symlink", cd.load_checkpoint, published)
    shutil.rmtree(published)
    published = publish(registry, step=3)
    shutil.move(published / cd.MANIFEST, tmp_path / cd.MANIFEST)
    (published / cd.MANIFEST).symlink_to(tmp_path / cd.MANIFEST)
    refused("symlink", cd.load_checkpoint, published, full=False)


def test_hard_link_refusals(tmp_path, registry, published):
    os.link(published / "adapter.safetensors", tmp_path / "copy.bin")
    assert "2 hard links" in refused("hard_link", cd.load_checkpoint, published, full=False)
    os.unlink(tmp_path / "copy.bin")
    cd.load_checkpoint(published)
    os.link(published / cd.MANIFEST, tmp_path / "manifest-copy")
    refused("hard_link", cd.load_checkpoint, published, full=False)


def test_kind_and_adapter_refusals(published):
    message = refused("wrong_kind", cd.load_checkpoint, published, expected_type="grpo")
    assert "is a sft checkpoint" in message and "grpo" in message
    message = refused("wrong_adapter", cd.load_checkpoint, published, expected_adapter="other-bot")
    assert "'bot'" in message and "'other-bot'" in message


def test_peft_directory_is_refused_as_weights_only(registry):
    for name in ("support-bot", cd.checkpoint_basename("support-bot", 2)):
        peft = registry / name
        peft.mkdir()
        (peft / "adapter_config.json").write_text("{}")
        (peft / "adapter_model.safetensors").write_bytes(b"")
        for call in (lambda: cd.resolve_checkpoint(registry, name), lambda: cd.load_checkpoint(peft)):
            message = refused("not_a_checkpoint", call)
            assert "PEFT" in message and "base_adapter" in message and "weights only" in message


def test_light_load_does_not_read_large_files(registry, monkeypatch):
    big = random.Random(0).randbytes(1 << 20) * 48  # 48 MiB
    path = cd.publish_checkpoint(registry, "bot", 1, checkpoint_type="sft",
                                 files={"optimizer.safetensors": big, "state.json": b"{}"}, manifest={})
    artifacts, read = [], []
    real_read_hashed, real_read, real_readv = fsio.read_hashed, os.read, os.readv
    monkeypatch.setattr(fsio, "read_hashed", lambda fd, size: artifacts.append(size) or real_read_hashed(fd, size))
    monkeypatch.setattr(os, "read", lambda fd, n: read.append(n) or real_read(fd, n))
    monkeypatch.setattr(os, "readv", lambda fd, buffers: read.append(len(buffers[0])) or real_readv(fd, buffers))
    light = cd.load_checkpoint(path, full=False)
    assert artifacts == [] and max(read) < 4096 and light.files == {}  # the manifest only
    full = cd.load_checkpoint(path)
    assert sorted(artifacts) == [2, len(big)] and full.files["optimizer.safetensors"] == big
    assert light.read("state.json") == b"{}" and artifacts[-1] == 2


# --- resolution ----------------------------------------------------------------------------------


def test_resolution(tmp_path, registry, published):
    assert cd.resolve_checkpoint(registry, published.name) == published.resolve()
    assert cd.resolve_checkpoint(registry, str(published)) == published.resolve()
    via_link = tmp_path / "registry-link"
    via_link.symlink_to(registry)  # the same registry reached through a link is still the registry
    assert cd.resolve_checkpoint(via_link, str(via_link / published.name)) == published.resolve()
    assert cd.resolve_checkpoint(registry, str(via_link / published.name)) == published.resolve()
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(published, elsewhere / published.name)
    (registry / "nested").mkdir()
    shutil.copytree(published, registry / "nested" / published.name)
    for reference in (f"../adapters/{published.name}", f"nested/{published.name}", "..", ".",
                      f"..\\{published.name}", str(elsewhere / published.name),
                      str(registry / "nested" / published.name), f"{registry}/../adapters/{published.name}",
                      f"{registry}/./{published.name}", f"{registry}//{published.name}",
                      f"/etc/{published.name}", str(registry)):
        message = refused("outside_registry", cd.resolve_checkpoint, registry, reference)
        assert str(registry.resolve()) in message
    assert "canonical" in refused("noncanonical_name", cd.resolve_checkpoint, registry, "support-bot")
    refused("noncanonical_name", cd.resolve_checkpoint, registry, "")
    refused("not_found", cd.resolve_checkpoint, registry, cd.checkpoint_basename("bot", 99))
    link = registry / cd.checkpoint_basename("bot", 8)
    link.symlink_to(published)
    refused("symlink", cd.resolve_checkpoint, registry, link.name)
    refused("symlink", cd.resolve_checkpoint, registry, str(link))


# --- registry listing and deletion ----------------------------------------------------------------


def test_listing_sorts_by_step_and_filters_by_exact_adapter(registry):
    for adapter, step in (("bot", 10), ("bot", 2), ("bot", 123456789), ("bot-2", 5), ("bo", 1)):
        cd.publish_checkpoint(registry, adapter, step, checkpoint_type="sft", files={}, manifest={})
    (registry / cd.checkpoint_basename("bot", 999)).write_bytes(b"a file, not a checkpoint")
    (registry / "bot").mkdir()  # a PEFT snapshot directory beside its checkpoints
    assert [cd.parse_basename(p.name) for p in cd.list_checkpoints(registry, "bot")] == [
        ("bot", 2), ("bot", 10), ("bot", 123456789)]
    assert [p.name for p in cd.list_checkpoints(registry)][:2] == [
        cd.checkpoint_basename("bo", 1), cd.checkpoint_basename("bot", 2)]
    assert cd.latest_checkpoint(registry, "bot-2").name == cd.checkpoint_basename("bot-2", 5)
    assert cd.latest_checkpoint(registry, "nobody") is None
    assert cd.list_checkpoints(registry / "missing") == []


def test_delete_removes_only_the_exact_adapter(registry):
    for adapter in ("bot", "bot-2", "bot.v2", "bot_x", "bo"):
        for step in (1, 2):
            cd.publish_checkpoint(registry, adapter, step, checkpoint_type="sft", files={"a": b"x"}, manifest={})
    orphans = [registry / f".{cd.checkpoint_basename(a, 3)}.staging-0123456789abcdef" for a in ("bot", "bot-2")]
    for orphan in orphans:
        orphan.mkdir()
    (registry / "bot").mkdir()  # the PEFT adapter itself is not this function's to delete
    removed = cd.delete_adapter_checkpoints(registry, "bot")
    assert sorted(p.name for p in removed) == sorted(
        [cd.checkpoint_basename("bot", 1), cd.checkpoint_basename("bot", 2), orphans[0].name])
    left = sorted(os.listdir(registry))
    assert all(not name.startswith("bot-checkpoint-step-") and not name.startswith(".bot-checkpoint")
               for name in left)
    assert len(left) == 4 * 2 + 2  # four other adapters, bot-2's orphan, the PEFT directory
    assert cd.delete_adapter_checkpoints(registry, "bot") == []
    refused("noncanonical_name", cd.delete_adapter_checkpoints, registry, "../bot")


# --- crashes ----------------------------------------------------------------------------------------


def _spawn(registry, first, last, env=None):
    proc = subprocess.Popen([sys.executable, str(WORKER_PATH), str(registry), str(first), str(last)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, **(env or {})})
    assert proc.stdout.readline() == b"ready\n", proc.stderr.read().decode()
    return proc


def _check_registry(registry, since=1):
    """Every canonical checkpoint (from step `since`) loads fully valid and holds exactly its step's inputs."""
    steps = []
    for path in cd.list_checkpoints(registry, worker.ADAPTER):
        step = cd.parse_basename(path.name)[1]
        steps.append(step)
        if step < since:
            continue
        files, manifest = worker.checkpoint_inputs(step)
        loaded = cd.load_checkpoint(path, expected_adapter=worker.ADAPTER, allowed_manifest_fields=FIELDS)
        assert loaded.files == files and {k: loaded.manifest[k] for k in manifest} == manifest
    assert steps == list(range(1, len(steps) + 1))  # published in order, none skipped
    return len(steps)


def _stage_names():
    names = []
    files, manifest = worker.checkpoint_inputs(1)
    cd.publish_checkpoint(Path(os.environ["KILN_HOME"]) / "stage-probe", "probe", 1, checkpoint_type="sft",
                          files=files, manifest=manifest, on_stage=names.append)
    return names


STAGES = ["staging", "sentinel", "file:adapter.safetensors", "file:optimizer.safetensors",
          "file:rng/streams.json", "file:state.json", "manifest", "synced", "sentinel_removed",
          "renamed", "published"]


def test_stage_names_are_the_protocol():
    assert _stage_names() == STAGES


@pytest.mark.slow
@pytest.mark.parametrize("stage", range(len(STAGES)))
def test_kill_at_every_publication_stage(tmp_path, stage):
    registry = tmp_path / "adapters"
    publish_first = cd.publish_checkpoint  # step 1 published in-process; the worker dies during step 2
    files, manifest = worker.checkpoint_inputs(1)
    publish_first(registry, worker.ADAPTER, 1, checkpoint_type="sft", files=files, manifest=manifest)
    proc = _spawn(registry, 2, 2, {"KILN_TEST_KILL_AT_STAGE": str(stage)})
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    renamed = stage >= STAGES.index("renamed")
    assert _check_registry(registry) == (2 if renamed else 1)
    assert len(cd.list_staging_orphans(registry)) == (0 if renamed else 1)
    for step in ((3,) if renamed else (2, 3)):  # the next publication succeeds beside any orphan
        files, manifest = worker.checkpoint_inputs(step)
        cd.publish_checkpoint(registry, worker.ADAPTER, step, checkpoint_type="sft", files=files, manifest=manifest)
    assert _check_registry(registry) == 3


@pytest.mark.slow
def test_kill_at_random_moments(tmp_path):
    registry = tmp_path / "adapters"
    rng = random.Random(20240601)
    interrupted = 0
    first = 1
    for _ in range(30):
        proc = _spawn(registry, first, first + 40)
        time.sleep(rng.uniform(0.0, 0.12))
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        count = _check_registry(registry, since=first)
        assert count < first + 40, "the worker finished before it was killed; lengthen its run"
        orphans = cd.list_staging_orphans(registry)
        interrupted += bool(orphans)
        files, manifest = worker.checkpoint_inputs(count + 1)  # the step that was in flight
        cd.publish_checkpoint(registry, worker.ADAPTER, count + 1, checkpoint_type="sft", files=files,
                              manifest=manifest)
        assert _check_registry(registry, since=count + 1) == count + 1
        for orphan in orphans:  # what an operator may do; keeps later counts meaningful
            shutil.rmtree(orphan)
        first = count + 2
    assert interrupted >= 5, interrupted  # here 13-20 of 30 kills land inside a publication


def test_thread_pools_are_started_afresh_in_a_forked_child():
    """A child forked while the parent's pools run (and their lock may be held) gets working pools of its own."""
    pools = fsio.ThreadPools("test")
    parent_pool = pools.get("hash", 2)
    assert parent_pool.submit(lambda: 1).result() == 1
    assert pools.get("hash", 2) is parent_pool  # kept, not restarted
    pools._lock.acquire()  # as if another thread held it at the fork
    try:
        pid = os.fork()
        if pid == 0:  # the child: its pools are new, its lock free, and the pool runs work
            try:
                child_pool = pools.get("hash", 2)
                ok = child_pool is not parent_pool and child_pool.submit(lambda: 41 + 1).result(timeout=10) == 42
            except BaseException:
                ok = False
            os._exit(0 if ok else 1)
    finally:
        pools._lock.release()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert pools.get("hash", 2) is parent_pool  # the parent keeps its own
