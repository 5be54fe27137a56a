"""The SmolLM2-135M GGUF imported into the registry: configuration, weights, logits vs transformers."""

import json

import numpy as np
import pytest

from trainer.bases import directory_identity, list_bases, load_base, show_base

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "<|im_start|>user\nWrite a haiku about kilns 🔥<|im_end|>\n<|im_start|>assistant\n",
    "1, 2, 3, 4, 5,",
]


def test_import_records_the_smollm2_architecture(smollm2_import):
    info, _ = smollm2_import
    assert info.config == {
        "vocabulary_size": 49152, "maximum_context": 8192, "model_width": 576, "head_count": 9,
        "kv_head_count": 3, "block_count": 30, "feed_forward_width": 1536, "head_size": 64,
        "rope_theta": 100000.0, "norm_epsilon": 1e-5, "tie_embeddings": True}
    assert info.parameter_count == 134_515_008
    assert info.source["format"] == "gguf" and info.source["tensor_types"] == {
        "F32": 61, "Q4_1": 210, "Q8_0": 1}
    files = sorted(p.name for p in info.path.iterdir())
    assert files == ["config.json", "identity.json", "model-00001-of-00003.safetensors",
                     "model-00002-of-00003.safetensors", "model-00003-of-00003.safetensors",
                     "tokenizer.json", "tokenizer_config.json"]
    assert json.loads((info.path / "config.json").read_text()) == info.config
    root = info.path.parents[1]
    assert directory_identity(info.path) == info.identity == show_base("smollm2", root).identity
    assert not [p for p in info.path.parent.iterdir() if p.name.startswith(".")]  # no staging left
    assert [b.name for b in list_bases(root)] == ["kiln-tiny", "smollm2"]


def test_progress_is_reported_per_tensor(smollm2_import):
    _, calls = smollm2_import
    assert [done for done, _, _ in calls] == list(range(1, 273))
    assert {total for _, total, _ in calls} == {272}
    assert calls[0][2] == "model.embed_tokens.weight" and calls[-1][2] == "model.norm.weight"


def test_weights_equal_transformers_gguf_loader(smollm2, hf_gguf_model):
    """Same dequantization and the same inverse Q/K permutation: bit-identical FP32 weights."""
    model, _ = smollm2
    ours = model.state_dict()
    theirs = {k: v.detach().numpy() for k, v in hf_gguf_model.state_dict().items()}
    assert set(ours) <= set(theirs)
    for name, value in ours.items():
        assert np.array_equal(value, theirs[name]), name


def test_logits_match_transformers(smollm2, hf_gguf_model, max_abs_diff):
    torch = pytest.importorskip("torch")
    model, tokenizer = smollm2
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt)
        logits = model.logits(np.array([ids]))
        with torch.no_grad():
            expected = hf_gguf_model(torch.tensor([ids])).logits.numpy()
        assert max_abs_diff(logits, expected) <= 1e-3, prompt
    ids = tokenizer.encode("The capital of France is")
    assert tokenizer.decode([int(model.logits(np.array([ids]))[0, -1].argmax())]) == " Paris"


def test_load_gguf_path_directly_with_execution_options(smollm2_gguf, smollm2):
    model, tokenizer = smollm2
    direct, direct_tokenizer = load_base(smollm2_gguf, attention_algorithm="tiled",
                                         loss_route="kt_tape_flce")
    with direct:
        assert direct.config.attention_algorithm == "tiled"
        assert direct.config.loss_route == "kt_tape_flce"
        assert direct_tokenizer.identity() == tokenizer.identity()
        ids = np.array([tokenizer.encode(PROMPTS[1])])
        np.testing.assert_allclose(direct.logits(ids), model.logits(ids), rtol=0, atol=1e-4)
    with pytest.raises(ValueError, match="model_width cannot be set"):
        load_base(smollm2_gguf, model_width=8)
