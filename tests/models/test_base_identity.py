"""Base identity: content-addressed shards, independent of file names and locations; kiln-tiny."""

import json
import shutil

import numpy as np
import pytest

from trainer import TransformerConfig
from trainer.bases import (ARCHITECTURE_FIELDS, BUILTIN_TINY, EXECUTION_OPTIONS, TINY_ARCHITECTURE,
                           base_identity, directory_identity, file_digest, import_base, list_bases,
                           load_base, show_base, verify_base)

SHARD_BYTES = 64 << 10  # kiln-tiny's 363 KiB of FP32 in several shards


@pytest.fixture
def tiny_base(save_tiny_llama, tmp_path):
    """A registered base with several shards, and its root."""
    directory, _ = save_tiny_llama(seed=7)
    root = tmp_path / "home"
    info = import_base(directory, "tiny", root=root, shard_bytes=SHARD_BYTES)
    assert len(info.shards) >= 3
    return info, root


def _shards(path):
    return sorted(path.glob("*.safetensors"))


def test_identity_is_recorded_and_recomputable(tiny_base):
    info, root = tiny_base
    document = json.loads((info.path / "identity.json").read_text())
    assert document["identity"] == info.identity == directory_identity(info.path)
    assert [s["sha256"] for s in info.shards] == [file_digest(p)[0] for p in _shards(info.path)]
    assert verify_base("tiny", root).identity == info.identity


def test_renaming_and_relocating_shards_keeps_identity(tiny_base, tmp_path):
    info, root = tiny_base
    moved_root = tmp_path / "elsewhere"
    shutil.move(root, moved_root)
    moved = moved_root / "bases" / "tiny"
    for index, shard in enumerate(reversed(_shards(moved))):  # names now sort the other way
        shard.rename(moved / f"part-{index}.safetensors")
    assert directory_identity(moved) == info.identity
    model, _ = load_base("tiny", root=moved_root)  # verify=True: the recorded identity holds
    model.close()


def test_flipping_one_byte_changes_identity(tiny_base):
    info, root = tiny_base
    shard = _shards(info.path)[1]
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0x01  # inside a tensor's data: the file still parses
    shard.write_bytes(bytes(data))
    assert directory_identity(info.path) != info.identity
    with pytest.raises(ValueError, match="changed on disk"):
        load_base("tiny", root=root)


def test_changing_a_size_changes_identity(tiny_base):
    info, _ = tiny_base
    with open(_shards(info.path)[0], "ab") as handle:
        handle.write(b" ")
    assert directory_identity(info.path) != info.identity


def test_changing_the_shard_count_changes_identity(tiny_base, tmp_path):
    info, _ = tiny_base
    first = _shards(info.path)[0]
    extra = info.path / "copy.safetensors"
    shutil.copy(first, extra)
    assert directory_identity(info.path) != info.identity
    extra.unlink()
    assert directory_identity(info.path) == info.identity
    shards = [(s["sha256"], s["size"]) for s in info.shards]
    assert base_identity(info.config, shards[:-1]) != info.identity
    assert base_identity(info.config, list(reversed(shards))) == info.identity  # order-free
    assert base_identity({**info.config, "rope_theta": 1.0}, shards) != info.identity


def test_identity_is_deterministic_across_imports(save_tiny_llama, tiny_base, tmp_path):
    info, _ = tiny_base
    directory, _ = save_tiny_llama(seed=7)
    again = import_base(directory, "tiny-again", root=tmp_path / "other", shard_bytes=SHARD_BYTES)
    assert again.identity == info.identity
    single = import_base(directory, "tiny-single", root=tmp_path / "other")
    assert len(single.shards) == 1 and single.identity != info.identity  # other shard bytes


def test_kiln_tiny_is_deterministic_and_needs_no_import(tmp_path):
    first_root, second_root = tmp_path / "a", tmp_path / "b"
    listed = show_base(BUILTIN_TINY, first_root)
    assert listed.builtin and not listed.materialised
    first, first_tokenizer = load_base(BUILTIN_TINY, root=first_root)
    second, _ = load_base(BUILTIN_TINY, root=second_root)
    with first, second:
        a, b = first.state_dict(), second.state_dict()
        assert list(a) == list(b)
        assert all(np.array_equal(a[k], b[k]) for k in a)
        assert np.any(a["model.embed_tokens.weight"] != 0)
        assert first.config.architecture() == TINY_ARCHITECTURE
        logits = first.logits(np.array([first_tokenizer.encode("kiln")]))
        assert logits.shape == (1, 4, 260) and np.all(np.isfinite(logits))
    written = show_base(BUILTIN_TINY, first_root)
    assert written.materialised and written.identity == listed.identity
    assert show_base(BUILTIN_TINY, second_root).identity == listed.identity
    assert directory_identity(written.path) == listed.identity
    again, _ = load_base(BUILTIN_TINY, root=first_root)  # the published copy, verified
    again.close()


def test_names_are_checked_and_never_overwritten(tiny_base, save_tiny_llama):
    info, root = tiny_base
    directory, _ = save_tiny_llama(seed=7)
    with pytest.raises(FileExistsError, match="already exists"):
        import_base(directory, "tiny", root=root)
    with pytest.raises(ValueError, match="built-in"):
        import_base(directory, BUILTIN_TINY, root=root)
    for bad in ("", ".hidden", "a/b", "x" * 101, "white space"):
        with pytest.raises(ValueError, match="base name"):
            import_base(directory, bad, root=root)
    with pytest.raises(LookupError, match="known: kiln-tiny, tiny"):
        show_base("missing", root)
    with pytest.raises(FileNotFoundError):
        import_base(root / "no-such-file.gguf", "other", root=root)
    assert [b.name for b in list_bases(root)] == ["kiln-tiny", "tiny"]


def test_a_failed_import_publishes_nothing(save_tiny_llama, tmp_path):
    directory, _ = save_tiny_llama(seed=8)

    def interrupt(done, total, name):
        if done == 5:
            raise KeyboardInterrupt  # halfway through writing the shards

    with pytest.raises(KeyboardInterrupt):
        import_base(directory, "halfway", root=tmp_path, progress=interrupt, shard_bytes=SHARD_BYTES)
    assert list((tmp_path / "bases").iterdir()) == []  # neither the base nor its staging folder
    shard = directory / "model.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])  # truncated: the header no longer fits the file
    with pytest.raises(ValueError, match="data offsets"):
        import_base(directory, "broken", root=tmp_path)
    assert list((tmp_path / "bases").iterdir()) == []


def test_default_root_is_kiln_home(monkeypatch, tmp_path):
    monkeypatch.setenv("KILN_HOME", str(tmp_path))
    assert show_base(BUILTIN_TINY).path == tmp_path / "bases" / BUILTIN_TINY
    monkeypatch.setenv("KILN_HOME", "relative/home")
    with pytest.raises(ValueError, match="absolute"):
        list_bases()


def test_architecture_and_execution_fields_partition_the_config():
    config = TransformerConfig(**TINY_ARCHITECTURE)
    assert ARCHITECTURE_FIELDS == tuple(config.architecture())
    assert {"attention_algorithm", "activation_checkpointing", "loss_route"} <= set(EXECUTION_OPTIONS)
    assert not set(EXECUTION_OPTIONS) & set(ARCHITECTURE_FIELDS)
