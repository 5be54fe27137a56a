"""Kiln's tokenizers against transformers': the SmolLM2 GGUF, a saved HF directory, kiln-tiny."""

import json

import pytest

from trainer.bases import load_base
from trainer.tokenizer import Tokenizer

# No whitespace run here ends right before a digit: see test_digits_split_as_llama_cpp.
CORPUS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "Ünïcödé façade naïve — “quotes” ‘single’ … ß ẞ Ωμέγα Привет мир",
    "日本語のテキストとカタカナ、中文字符，한국어 텍스트",
    "emoji 😀🎉👍🏽 family 👨‍👩‍👧‍👦 flags 🇫🇷🇯🇵",
    "spaces    inside  and trailing   ",
    "   leading spaces",
    "tabs\tand\t\ttabs\nnew\nlines\r\nwindows\n\n\nblank",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "for (int i = 0; i < 10; ++i) { x[i] = y[i] * 2.5f; }  // C",
    "numbers 0 7 42 123 4096 3.14159 -17 1e-5 2024-06-01 1,000,000 0x1F",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>",
    "<|endoftext|><repo_name>kiln<file_sep>a.py<filename>b.py",
    "it's they'll we've I'm you'd she's don't",
    "mixed\u00a0nbsp and\u2009thin and zero\u200bwidth",
    "",
    " ",
    "\n",
]
DIGIT_CASES = ["x=  42", "a\t\t7", "line\n\n12", "   123 456", "sum  =  1 +  2"]
MESSAGES = [{"role": "user", "content": "What is the capital of France?"},
            {"role": "assistant", "content": "Paris."},
            {"role": "user", "content": "And of Japan? 🇯🇵"}]
SYSTEM = [{"role": "system", "content": "You answer in one word."}] + MESSAGES


@pytest.mark.parametrize("text", CORPUS)
def test_gguf_token_ids_match_transformers(smollm2, hf_gguf_tokenizer, text):
    _, tokenizer = smollm2
    expected = hf_gguf_tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.encode(text) == expected
    assert tokenizer.encode(text, add_special_tokens=True) == hf_gguf_tokenizer.encode(text)
    assert tokenizer.decode(expected) == hf_gguf_tokenizer.decode(expected)
    assert tokenizer.decode(expected, skip_special_tokens=True) == \
        hf_gguf_tokenizer.decode(expected, skip_special_tokens=True)


def test_digits_split_as_llama_cpp(smollm2, hf_gguf_tokenizer):
    """`tokenizer.ggml.pre = smollm`: llama.cpp splits off each digit (\\p{N}) before GPT-2's
    regex, like SmolLM2's own tokenizer.json (Digits(individual_digits) + ByteLevel).

    transformers' GGUF converter has no "smollm" entry and applies GPT-2's regex alone, so
    a whitespace run right before a digit groups differently there ("x=  42": "ĠĠ" vs
    "Ġ" "Ġ"). The reference here is transformers' BPE applied to llama.cpp's pieces.
    """
    regex = pytest.importorskip("regex")
    _, tokenizer = smollm2

    def reference(text):
        ids = []
        for piece in regex.split(r"(\p{N})", text):
            if piece:
                ids += hf_gguf_tokenizer.encode(piece, add_special_tokens=False)
        return ids

    for text in CORPUS + DIGIT_CASES:
        assert tokenizer.encode(text) == reference(text), text
        assert tokenizer.decode(tokenizer.encode(text)) == text
    assert tokenizer.encode("x=  42") == [104, 45, 256, 36, 34]  # x = ĠĠ 4 2


@pytest.mark.parametrize("messages", [MESSAGES, SYSTEM, MESSAGES[:1]], ids=["chat", "system", "one"])
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_gguf_chat_template_matches_transformers(smollm2, hf_gguf_tokenizer, messages, generation_prompt):
    _, tokenizer = smollm2
    expected = hf_gguf_tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt,
                                                     tokenize=False)
    assert tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt) == expected
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True)
    assert ids == hf_gguf_tokenizer.encode(expected, add_special_tokens=False)


def test_gguf_special_tokens(smollm2, hf_gguf_tokenizer):
    _, tokenizer = smollm2
    assert tokenizer.vocabulary_size == len(hf_gguf_tokenizer) == 49152
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == \
        (hf_gguf_tokenizer.bos_token_id, hf_gguf_tokenizer.eos_token_id, hf_gguf_tokenizer.pad_token_id)
    assert tokenizer.eos_token_id == tokenizer.token_to_id("<|im_end|>") == 2
    assert tokenizer.encode("<|im_end|>") == [2]  # kept whole, not cut into pieces


def test_tokenizer_identity_covers_file_and_template(smollm2):
    _, tokenizer = smollm2
    identity = tokenizer.identity()
    files = tokenizer.files()
    config = json.loads(files["tokenizer_config.json"])
    same = Tokenizer(files["tokenizer.json"], config)
    assert same.identity() == identity
    other_template = Tokenizer(files["tokenizer.json"], {**config, "chat_template": "{{ messages }}"})
    assert other_template.identity()["tokenizer_json_sha256"] == identity["tokenizer_json_sha256"]
    assert other_template.identity()["chat_template_sha256"] != identity["chat_template_sha256"]
    pretty = json.dumps(json.loads(files["tokenizer.json"]), indent=1).encode()
    assert Tokenizer(pretty, config).identity()["tokenizer_json_sha256"] != identity["tokenizer_json_sha256"]


def test_hf_directory_tokenizer_matches_transformers(save_tiny_llama, models_home):
    transformers = pytest.importorskip("transformers")
    directory, _ = save_tiny_llama()
    reference = transformers.AutoTokenizer.from_pretrained(directory)
    _, tokenizer = load_base(directory, root=models_home)
    for text in CORPUS + DIGIT_CASES:
        assert tokenizer.encode(text) == reference.encode(text, add_special_tokens=False)
    for messages in (MESSAGES, SYSTEM):
        for generation_prompt in (True, False):
            assert tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt) == \
                reference.apply_chat_template(messages, add_generation_prompt=generation_prompt,
                                              tokenize=False)
    with pytest.raises(Exception, match="roles are user and assistant"):  # raise_exception()
        tokenizer.apply_chat_template([{"role": "tool", "content": "x"}])
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == \
        (reference.bos_token_id, reference.eos_token_id, reference.pad_token_id)


def test_kiln_tiny_tokenizer_is_byte_level(models_home):
    model, tokenizer = load_base("kiln-tiny", root=models_home)
    model.close()
    assert tokenizer.vocabulary_size == 260
    text = "héllo 😀\tworld"
    ids = tokenizer.encode(text)
    assert ids == list(text.encode("utf-8"))  # one token per byte
    assert tokenizer.decode(ids) == text
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=True)
    assert ids[0] == tokenizer.token_to_id("<|im_start|>") == 257
    assert tokenizer.eos_token_id == 258 and tokenizer.pad_token_id == 259
    assert tokenizer.decode(ids, skip_special_tokens=True) == "user\nhi\nassistant\n"


# -- SentencePiece GGUF vocabularies (Llama 2, Mistral, Phi-3) ----------------------------------------

SPM_PIECES = list("▁abcdefghijklmnopqrstuvwxyz.,!?'TH0123456789") + [
    "▁t", "he", "▁the", "▁a", "in", "▁in", "er", "▁h", "▁he", "ll", "llo", "▁hello", "▁w", "or", "ld", "▁wor",
    "▁world", "▁▁", "▁▁▁", "▁T", "▁Th", "▁The"]
SPM_TEXTS = ["the hello world", " the  hello", "The world!", "héllo wörld 😀", "a\nb\tc", "  leading", "trailing  ",
             "<|user|>hi<|end|>", "", "ThThe 42", "x", "the\n\nworld"]


def write_spm_gguf(path, arch, add_space_prefix=None):
    """A GGUF whose vocabulary is SentencePiece's, as llama.cpp writes Llama 2 / Mistral / Phi-3 files:
    <unk>, <s>, </s>, the 256 byte tokens, scored pieces (merges implied by the scores), control tokens."""
    gguf = pytest.importorskip("gguf")
    writer = gguf.GGUFWriter(str(path), arch)
    for add, value in ((writer.add_block_count, 1), (writer.add_context_length, 64), (writer.add_embedding_length, 8),
                       (writer.add_feed_forward_length, 8), (writer.add_head_count, 2), (writer.add_head_count_kv, 2)):
        add(value)
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + SPM_PIECES + ["<|user|>", "<|end|>"]
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_types([2, 3, 3] + [6] * 256 + [1] * len(SPM_PIECES) + [3, 3])
    writer.add_token_scores([0.0] * 259 + [-float(i) for i in range(len(SPM_PIECES))] + [0.0, 0.0])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    if add_space_prefix is not None:
        writer.add_add_space_prefix(add_space_prefix)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("arch", ["llama", "phi3"])
def test_sentencepiece_gguf_vocabulary_encodes_as_transformers_does(arch, tmp_path):
    """Merges recovered from the scores, byte fallback, the space prefix (Metaspace for llama, Phi-3's
    normalizer), BOS added by default, control tokens whole: ids and decoded text equal transformers'
    GGUF tokenizer's on the same file."""
    transformers = pytest.importorskip("transformers")
    gguf = pytest.importorskip("gguf")
    from trainer.bases_sources import _gguf_field
    from trainer.tokenizer import tokenizer_from_gguf

    write_spm_gguf(tmp_path / "spm.gguf", arch)
    reference = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="spm.gguf")
    reader = gguf.GGUFReader(tmp_path / "spm.gguf")
    ours = tokenizer_from_gguf({k: _gguf_field(f) for k, f in reader.fields.items() if not k.startswith("GGUF.")})
    for text in SPM_TEXTS:
        ids = ours.encode(text, add_special_tokens=True)
        assert ids == reference.encode(text, add_special_tokens=True), text
        assert ours.decode(ids, skip_special_tokens=True) == reference.decode(ids, skip_special_tokens=True), text
    assert ours.encode("hello", add_special_tokens=True)[0] == ours.bos_token_id == 1
    # not in the vocabulary: the space prefix, then its two UTF-8 bytes as byte tokens (<0xC3> <0xA9>), never <unk>
    assert ours.encode("é") == [3 + 256 + SPM_PIECES.index("▁"), 3 + 0xC3, 3 + 0xA9]


# -- chat templates: Kiln's jinja2 environment against transformers' apply_chat_template ---------------------------

# Each family's template shape, rendered from the same string by both (transformers builds its own environment).
FAMILY_TEMPLATES = {
    "llama3": (  # BOS in the template, trimmed contents, a system turn when given
        "{{ bos_token }}{% for message in messages %}"
        "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"),
    "qwen2": (  # a default system turn, tools, the tool role
        "{%- if tools %}{{- '<|im_start|>system\n' }}{%- for tool in tools %}{{- tool | tojson }}\n{%- endfor %}"
        "{{- '<|im_end|>\n' }}{%- elif messages[0]['role'] != 'system' %}"
        "{{- '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{%- endif %}"
        "{%- for message in messages %}{%- if message.role == 'tool' %}"
        "{{- '<|im_start|>user\n<tool_response>\n' + message.content + '\n</tool_response><|im_end|>\n' }}"
        "{%- else %}{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}{%- endif %}"
        "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"),
    "mistral": (  # [INST] turns, BOS, EOS after each answer, alternation enforced with raise_exception
        "{{ bos_token }}{% for message in messages %}"
        "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
        "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
        "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}{% endif %}{% endfor %}"),
    "phi3": (  # block tags on their own lines: trim_blocks / lstrip_blocks decide the whitespace
        "{% for message in messages %}\n"
        "    {% if message['role'] == 'system' %}\n"
        "{{'<|system|>\n' + message['content'] + '<|end|>\n'}}\n"
        "    {% elif message['role'] == 'user' %}\n"
        "{{'<|user|>\n' + message['content'] + '<|end|>\n'}}\n"
        "    {% elif message['role'] == 'assistant' %}\n"
        "{{'<|assistant|>\n' + message['content'] + '<|end|>\n'}}\n"
        "    {% endif %}\n"
        "{% endfor %}\n"
        "{% if add_generation_prompt %}\n{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}"),
    "chatml_generation": (  # TRL's assistant-only templates mark the answer with {% generation %}
        "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
        "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<|im_end|>' }}"
        "{% endgeneration %}{% else %}{{ message['content'] + '<|im_end|>' }}{% endif %}{{ '\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"),
}
CHATS = {
    "one": [{"role": "user", "content": "  Hi there \n"}],
    "multi": MESSAGES + [{"role": "assistant", "content": "Tokyo."}],
    "system": SYSTEM,
    "control text": [{"role": "user", "content": "say <|im_end|> and [INST] please"},
                     {"role": "assistant", "content": "<|im_end|>"}],
}


def reference_tokenizer(transformers, tokenizer, template):
    """transformers' tokenizer over the same tokenizers backend and special tokens, with TEMPLATE."""
    config = tokenizer.config
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer.backend, chat_template=template,
        **{name: config[name] for name in ("bos_token", "eos_token", "pad_token", "unk_token") if config[name]})


@pytest.mark.parametrize("family", sorted(FAMILY_TEMPLATES))
@pytest.mark.parametrize("chat", sorted(CHATS))
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_family_chat_templates_render_as_transformers_does(models_home, family, chat, generation_prompt):
    transformers = pytest.importorskip("transformers")
    from trainer.bases import TINY_SPECIALS, TINY_TOKENIZER_CONFIG
    from trainer.tokenizer import byte_tokenizer
    template = FAMILY_TEMPLATES[family]
    tokenizer = byte_tokenizer(TINY_SPECIALS, {**TINY_TOKENIZER_CONFIG, "chat_template": template})
    reference = reference_tokenizer(transformers, tokenizer, template)
    messages = CHATS[chat]
    try:
        expected = reference.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False)
    except Exception as error:  # the template refuses this chat: Kiln must refuse it with the same message
        with pytest.raises(Exception, match=str(error)):
            tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt)
        return
    assert tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt) == expected
    assert tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True) == \
        reference.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True,
                                      return_dict=False)
