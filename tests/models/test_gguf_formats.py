"""GGUF files written here from a tiny transformers Llama (untied, grouped-query attention):
F32, F16, BF16 and Q8_0 tensors, Q/K rows permuted as llama.cpp's convert_hf_to_gguf does."""

import numpy as np
import pytest

from tests.models.conftest import add_gguf_architecture
from trainer.bases import import_base, load_base, undo_gguf_qk_permutation
from trainer.tokenizer import bytes_to_unicode

gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch")

BLOCK = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
         "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
         "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
         "post_attention_layernorm": "ffn_norm"}


def llama_cpp_permute(weight, heads):  # convert_hf_to_gguf.py LlamaModel.permute
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]) \
        .swapaxes(1, 2).reshape(weight.shape)


def gguf_name(name):
    if name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if name == "model.norm.weight":
        return "output_norm.weight"
    if name == "lm_head.weight":
        return "output.weight"
    _, _, index, rest = name.split(".", 3)
    return f"blk.{index}.{BLOCK[rest[:-len('.weight')]]}.weight"


def write_gguf(path, hf_model, qtype):
    config = hf_model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    add_gguf_architecture(writer, config)
    spelling = bytes_to_unicode()
    tokens = [spelling[b] for b in range(256)] + ["Ġt", "he", "<|im_start|>", "<|im_end|>"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * 258 + [3, 3])
    writer.add_token_merges(["Ġ t", "h e"])
    writer.add_bos_token_id(258)
    writer.add_eos_token_id(259)
    writer.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    for name, tensor in hf_model.state_dict().items():
        weight = tensor.numpy()
        if name.endswith("q_proj.weight"):
            weight = llama_cpp_permute(weight, heads)
        elif name.endswith("k_proj.weight"):
            weight = llama_cpp_permute(weight, kv_heads)
        if weight.ndim == 1 or qtype == "F32":  # norms stay F32, as llama.cpp writes them
            writer.add_tensor(gguf_name(name), np.ascontiguousarray(weight, np.float32))
        elif qtype == "F16":
            writer.add_tensor(gguf_name(name), weight.astype(np.float16))
        else:
            kind = getattr(gguf.GGMLQuantizationType, qtype)
            data = gguf.quants.quantize(weight, kind)
            writer.add_tensor(gguf_name(name), data, raw_shape=data.shape, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_undo_permutation_inverts_llama_cpp():
    weight = np.arange(24 * 5, dtype=np.float32).reshape(24, 5)
    for heads in (1, 2, 3, 6):
        assert np.array_equal(undo_gguf_qk_permutation(llama_cpp_permute(weight, heads), heads), weight)
    assert not np.array_equal(llama_cpp_permute(weight, 2), weight)


@pytest.mark.parametrize("qtype,tolerance", [("F32", 0.0), ("F16", 1e-3), ("BF16", 1e-2), ("Q8_0", 2e-2)])
def test_gguf_tensor_types_import(save_tiny_llama, tmp_path, qtype, tolerance):
    _, hf_model = save_tiny_llama(seed=31)
    path = tmp_path / f"tiny-{qtype}.gguf"
    write_gguf(path, hf_model, qtype)
    info = import_base(path, "tiny", root=tmp_path)
    assert info.config["tie_embeddings"] is False and info.config["kv_head_count"] == 2
    assert info.source["tensor_types"] == ({"F32": 5, qtype: 16} if qtype != "F32" else {"F32": 21})
    model, tokenizer = load_base("tiny", root=tmp_path)
    with model:
        reference = {k: v.numpy() for k, v in hf_model.state_dict().items()}
        for name, value in model.state_dict().items():
            scale = float(np.abs(reference[name]).max())
            assert np.abs(value - reference[name]).max() <= tolerance * scale, name
        tokens = np.array([[1, 7, 42, 99, 256, 257, 3, 5]])
        with torch.no_grad():
            expected = hf_model(torch.tensor(tokens)).logits.numpy()
        limit = 1e-4 if qtype == "F32" else 0.1
        assert np.abs(model.logits(tokens) - expected).max() <= limit
    assert tokenizer.encode("the tea") == [116, 257, 256, 101, 97]  # t he | Ġt e a
    assert tokenizer.bos_token_id == 258 and tokenizer.encode("<|im_end|>") == [259]
