"""Hugging Face directories (sharded, single-file, tied, BF16) imported and compared with transformers."""

import json

import numpy as np
import pytest

from trainer.bases import import_base, load_base

torch = pytest.importorskip("torch")


def _reference_logits(hf_model, tokens):
    with torch.no_grad():
        return hf_model(torch.tensor(tokens)).logits.numpy()


@pytest.mark.parametrize("shard,tie,dtype", [("40KB", False, "float32"), (None, False, "float32"),
                                             (None, True, "float32"), ("60KB", True, "bfloat16")],
                         ids=["sharded", "single", "tied", "bf16-sharded"])
def test_hf_directory_import_matches_transformers(save_tiny_llama, tmp_path, max_abs_diff, shard, tie, dtype):
    directory, hf_model = save_tiny_llama(tie=tie, shard=shard, dtype=dtype, seed=3)
    written = sorted(p.name for p in directory.glob("*.safetensors"))
    assert (len(written) > 1) == (shard is not None)
    assert (directory / "model.safetensors.index.json").is_file() == (shard is not None)
    info = import_base(directory, "tiny", root=tmp_path)
    assert info.config["tie_embeddings"] is tie and info.config["vocabulary_size"] == 300
    assert info.config["rope_theta"] == 5000.0 and info.config["norm_epsilon"] == 1e-6
    assert info.source["format"] == "huggingface"
    model, tokenizer = load_base("tiny", root=tmp_path)
    with model:
        reference = {k: v.numpy() for k, v in hf_model.state_dict().items()}
        for name, value in model.state_dict().items():
            assert np.array_equal(value, reference[name]), name
        tokens = np.array([tokenizer.encode("hello kiln, 123!")[:12],
                           tokenizer.encode("another line.\n\tok")[:12]])
        assert max_abs_diff(model.logits(tokens), _reference_logits(hf_model, tokens)) <= 1e-4


def test_hf_directory_loads_by_path_without_registering(save_tiny_llama, tmp_path):
    directory, hf_model = save_tiny_llama(seed=4)
    model, _ = load_base(directory, root=tmp_path)
    with model:
        tokens = np.arange(10).reshape(1, 10)
        assert np.abs(model.logits(tokens) - _reference_logits(hf_model, tokens)).max() <= 1e-4
    assert not (tmp_path / "bases").exists()


def test_unsupported_directories_are_refused_naming_the_reason(save_tiny_llama, tmp_path):
    directory, _ = save_tiny_llama(seed=5)
    config = json.loads((directory / "config.json").read_text())

    def variant(name, **changes):
        folder = tmp_path / name
        folder.mkdir()
        for file in directory.iterdir():
            (folder / file.name).write_bytes(file.read_bytes())
        (folder / "config.json").write_text(json.dumps({**config, **changes}))
        return folder

    with pytest.raises(ValueError, match="rope type 'llama3'"):
        import_base(variant("scaled", rope_scaling={"rope_type": "llama3", "factor": 8.0},
                            rope_parameters={"rope_type": "llama3", "rope_theta": 5000.0}),
                    "x", root=tmp_path)
    with pytest.raises(ValueError, match="rope type 'yarn' is not supported"):
        import_base(variant("yarn", rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 5000.0}),
                    "x", root=tmp_path)
    with pytest.raises(ValueError, match="model_type 'gpt_neox' is not supported"):
        import_base(variant("neox", model_type="gpt_neox"), "x", root=tmp_path)
    with pytest.raises(ValueError, match="do not form the qwen2 model .* missing .*q_proj.bias"):
        import_base(variant("qwen", model_type="qwen2"), "x", root=tmp_path)  # Llama weights lack the biases
    with pytest.raises(ValueError, match="per-layer sliding attention"):
        import_base(variant("qwen-window", model_type="qwen2", use_sliding_window=True), "x", root=tmp_path)
    with pytest.raises(ValueError, match="missing"):  # more layers than the weights hold
        import_base(variant("deeper", num_hidden_layers=3), "x", root=tmp_path)
    no_tokenizer = variant("no-tokenizer")
    (no_tokenizer / "tokenizer.json").unlink()
    with pytest.raises(ValueError, match="has no tokenizer.json"):
        import_base(no_tokenizer, "x", root=tmp_path)
    assert not [p for p in (tmp_path / "bases").iterdir()]  # nothing published, no staging left
