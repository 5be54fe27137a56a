"""Tokenizer: a `tokenizers.Tokenizer` with the model's special tokens and its own chat template.

A base stores two files: `tokenizer.json` (the `tokenizers` library's own format,
copied from a Hugging Face directory or built here from GGUF metadata) and
`tokenizer_config.json` (bos/eos/pad/unk token strings, add_bos_token/add_eos_token,
chat_template). Chat templates render as transformers renders them: a sandboxed jinja2
environment with trim_blocks and lstrip_blocks, the loopcontrols extension, a tojson
that does not escape HTML, and the globals raise_exception and strftime_now, given the
messages, add_generation_prompt and the special token strings; `{% generation %}` blocks render their
body as transformers renders them. strftime_now reads the clock (`datetime.now()`), unless the Tokenizer's
`template_clock` pins the instant it renders at (a training run does: trainer.runs.tokenizers).
"""

import hashlib
import json
from datetime import datetime
from pathlib import Path

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
SPECIAL_NAMES = ("bos_token", "eos_token", "pad_token", "unk_token")
CONFIG_KEYS = SPECIAL_NAMES + ("add_bos_token", "add_eos_token", "chat_template")

# GGUF token types (llama.cpp's llama_token_type)
GGUF_CONTROL = 3
GGUF_USER_DEFINED = 4

# llama.cpp's pre-tokenizer regexes, by `tokenizer.ggml.pre` (src/llama-vocab.cpp).
# GPT-2's own regex is ByteLevel(use_regex=True) in `tokenizers`.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
GPT2_PRE = ("default", "gpt2", "mpt", "olmo", "jais")  # GPT-2's regex alone
DIGITS_THEN_GPT2_PRE = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone",
                        "minerva")  # "\p{N}" (each digit alone), then GPT-2's regex
SPLIT_PRE = {"llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
             "smaug-bpe": _LLAMA3_SPLIT, "dbrx": _LLAMA3_SPLIT, "falcon3": _LLAMA3_SPLIT,
             "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT}


def bytes_to_unicode() -> dict:
    """GPT-2's reversible byte -> printable character map (the ByteLevel alphabet)."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _token_string(value):
    """A special token as tokenizer_config.json spells it: a string, an AddedToken dict, or null."""
    if isinstance(value, dict):
        value = value.get("content")
    if value is not None and not isinstance(value, str):
        raise ValueError(f"a special token must be a string, got {value!r}")
    return value


def _chat_template(value):
    """tokenizer_config's chat_template: a string, or a list of {name, template} (take "default")."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {item.get("name"): item.get("template") for item in value if isinstance(item, dict)}
        if "default" in named:
            return named["default"]
        raise ValueError(f"the chat templates are named {sorted(named)}; none is named 'default'")
    raise ValueError(f"chat_template must be a string or a list, got {type(value).__name__}")


def normalise_config(raw: dict, fallback_specials: dict | None = None) -> dict:
    """The tokenizer_config.json Kiln stores: only the keys in CONFIG_KEYS, in plain form."""
    fallback_specials = fallback_specials or {}
    config = {}
    for name in SPECIAL_NAMES:
        value = raw.get(name, fallback_specials.get(name))
        config[name] = _token_string(value)
    for name in ("add_bos_token", "add_eos_token"):
        value = raw.get(name, False)
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be true or false, got {value!r}")
        config[name] = value
    config["chat_template"] = _chat_template(raw.get("chat_template"))
    return config


def compile_chat_template(source: str, now=None):
    """The jinja2 template object transformers would build for `source`; its strftime_now formats `now()`
    (None: datetime.now)."""
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """transformers' `{% generation %}...{% endgeneration %}` block (its AssistantTracker, which TRL's
        assistant-only templates use): it renders its body unchanged; only transformers' assistant masks read it."""
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(format):
        return (now or datetime.now)().strftime(format)

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=[Generation, loopcontrols])
    environment.filters["tojson"] = tojson
    environment.globals["raise_exception"] = raise_exception
    environment.globals["strftime_now"] = strftime_now
    return environment.from_string(source)


def _special_id(name: str) -> property:
    """A Tokenizer property: the id of the special token NAME (bos_token ...), or None when it has none."""
    return property(lambda self: self._id(name), doc=f"The id of the {name}, or None when there is none.")


class Tokenizer:
    """Text <-> token ids and chat prompts for one base model."""

    def __init__(self, tokenizer_json: bytes | str, config: dict):
        if isinstance(tokenizer_json, str):
            tokenizer_json = tokenizer_json.encode("utf-8")
        self._json = bytes(tokenizer_json)
        try:
            self.backend = BackendTokenizer.from_str(self._json.decode("utf-8"))
        except Exception as exc:  # tokenizers raises a bare Exception on bad input
            raise ValueError(f"{TOKENIZER_FILE} does not load in `tokenizers`: {exc}") from None
        self.config = normalise_config(config)
        self._template = None  # compiled on first use
        self.template_clock = None  # the datetime strftime_now renders; None: the clock at each rendering
        for name in SPECIAL_NAMES:
            token = self.config[name]
            if token is not None and self.backend.token_to_id(token) is None:
                raise ValueError(f"{name} {token!r} is not in the vocabulary")

    # -- files --------------------------------------------------------------------------

    @classmethod
    def from_directory(cls, directory) -> "Tokenizer":
        directory = Path(directory)
        with open(directory / CONFIG_FILE, encoding="utf-8") as handle:
            config = json.load(handle)
        return cls((directory / TOKENIZER_FILE).read_bytes(), config)

    def files(self) -> dict:
        """{file name: bytes} of the two files a base directory holds."""
        config = json.dumps(self.config, indent=2, ensure_ascii=False, sort_keys=True) + "\n"
        return {TOKENIZER_FILE: self._json, CONFIG_FILE: config.encode("utf-8")}

    def identity(self) -> dict:
        """SHA-256 of tokenizer.json's bytes and of the chat template, and the special tokens."""
        template = self.config["chat_template"]
        return {
            "tokenizer_json_sha256": _sha256(self._json),
            "chat_template_sha256": None if template is None else _sha256(template.encode("utf-8")),
            "special_tokens": {name: self.config[name] for name in SPECIAL_NAMES},
            "add_bos_token": self.config["add_bos_token"],
            "add_eos_token": self.config["add_eos_token"],
        }

    # -- tokens -------------------------------------------------------------------------

    @property
    def vocabulary_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def _id(self, name):
        token = self.config[name]
        return None if token is None else self.backend.token_to_id(token)

    bos_token_id = _special_id("bos_token")
    eos_token_id = _special_id("eos_token")
    pad_token_id = _special_id("pad_token")
    unk_token_id = _special_id("unk_token")

    def token_to_id(self, token):
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id):
        return self.backend.id_to_token(token_id)

    def encode(self, text: str, add_special_tokens: bool = False) -> list:
        """Token ids of `text`; add_special_tokens applies tokenizer.json's post-processor (BOS...)."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    # -- chat ---------------------------------------------------------------------------

    @property
    def chat_template(self):
        return self.config["chat_template"]

    @property
    def reads_clock(self) -> bool:
        """Whether the chat template may render the date or time (it calls strftime_now, as Llama 3's does)."""
        return self.chat_template is not None and "strftime_now" in self.chat_template

    def pin_clock(self, instant: datetime | None = None) -> None:
        """strftime_now renders INSTANT from here on (None: this moment, to the second)."""
        self.template_clock = instant if instant is not None else datetime.now().replace(microsecond=0)

    def _now(self):
        return self.template_clock if self.template_clock is not None else datetime.now()

    def apply_chat_template(self, messages, add_generation_prompt: bool = True,
                            tokenize: bool = False, **kwargs):
        """The prompt the model's template renders for `messages` (token ids if tokenize)."""
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template")
        if not isinstance(messages, (list, tuple)) or not all(
                isinstance(m, dict) and "role" in m for m in messages):
            raise ValueError("messages must be a list of {'role': ..., 'content': ...} dicts")
        variables = {name: self.config[name] for name in SPECIAL_NAMES if self.config[name] is not None}
        variables.update(kwargs)
        variables.setdefault("tools", None)
        variables.setdefault("documents", None)
        if self._template is None:
            self._template = compile_chat_template(self.chat_template, self._now)
        text = self._template.render(
            messages=[dict(m) for m in messages], add_generation_prompt=add_generation_prompt,
            **variables)
        return self.encode(text, add_special_tokens=False) if tokenize else text


# -- building tokenizer.json ------------------------------------------------------------


def _post_processor(config, token_id):
    """BOS/EOS around each sequence when the config asks for them (as llama.cpp adds them)."""
    before = [config["bos_token"]] if config["add_bos_token"] and config["bos_token"] else []
    after = [config["eos_token"]] if config["add_eos_token"] and config["eos_token"] else []
    if not before and not after:
        return None
    single = " ".join(before + ["$A"] + after)
    pair = " ".join(before + ["$A"] + after + [f"{t}:1" for t in before] + ["$B:1"]
                    + [f"{t}:1" for t in after])
    specials = [(t, token_id(t)) for t in dict.fromkeys(before + after)]
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)


def byte_level_bpe(vocab: dict, merges: list, pre: str = "gpt2") -> BackendTokenizer:
    """A byte-level BPE `tokenizers.Tokenizer` with the pre-tokenizer llama.cpp names `pre`."""
    backend = BackendTokenizer(models.BPE(vocab=vocab, merges=merges, dropout=None, unk_token=None,
                                          continuing_subword_prefix="", end_of_word_suffix="",
                                          fuse_unk=False, byte_fallback=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    if pre in GPT2_PRE:
        backend.pre_tokenizer = byte_level
    elif pre in DIGITS_THEN_GPT2_PRE:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level])
    elif pre in SPLIT_PRE:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(SPLIT_PRE[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False)])
    else:
        known = sorted(GPT2_PRE + DIGITS_THEN_GPT2_PRE + tuple(SPLIT_PRE))
        raise ValueError(f"GGUF pre-tokenizer {pre!r} is not supported; Kiln knows {', '.join(known)}")
    backend.decoder = decoders.ByteLevel()
    return backend


def sentencepiece_merges(tokens: list, scores: list) -> list:
    """The BPE merges a SentencePiece vocabulary implies (GGUF files carry scores, not merges): every split
    of a token into two vocabulary pieces, best score first (transformers' generate_merges, which its GGUF
    converter uses: pieces of one token ordered by their ids, then all by score, then by piece lengths)."""
    vocab = {}
    for index, token in enumerate(tokens):
        vocab.setdefault(token, index)
    merges = []
    for token, score in zip(tokens, scores):
        local = [(token[:i], token[i:], score) for i in range(1, len(token))
                 if token[:i] in vocab and token[i:] in vocab]
        merges.extend(sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]])))
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def sentencepiece_bpe(tokens: list, scores: list, prefix_by_normalizer: bool = False,
                      add_space_prefix: bool = True) -> BackendTokenizer:
    """A SentencePiece-style BPE (Llama 2, Mistral, Phi-3 GGUF vocabularies): "▁" for spaces, byte
    fallback to <0xNN> tokens, a space before the text. As transformers' LlamaTokenizer builds it (Metaspace,
    prepend "first"), or with prefix_by_normalizer as Phi-3's own tokenizer.json does (a normalizer that
    prepends "▁" and turns every space into one, no pre-tokenizer)."""
    vocab = {}
    for index, token in enumerate(tokens):
        vocab.setdefault(token, index)
    backend = BackendTokenizer(models.BPE(vocab=vocab, merges=sentencepiece_merges(tokens, scores), dropout=None,
                                          fuse_unk=True, byte_fallback=True))
    if prefix_by_normalizer:
        steps = [normalizers.Prepend("▁")] if add_space_prefix else []
        backend.normalizer = normalizers.Sequence(steps + [normalizers.Replace(" ", "▁")])
    else:
        backend.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement="▁", prepend_scheme="first" if add_space_prefix else "never", split=False)
    strip = [decoders.Strip(content=" ", left=1)] if add_space_prefix else []
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
                                        + strip)
    return backend


def _byte_level_from_gguf(metadata, tokens, types) -> tuple:
    """(backend, vocabulary, CONTROL tokens to add as special) of a "gpt2" GGUF vocabulary."""
    merges = metadata.get("tokenizer.ggml.merges")
    if merges is None:
        raise ValueError("the GGUF file has no tokenizer.ggml.merges; a byte-level BPE needs them")
    alphabet = set(bytes_to_unicode().values())
    spelling = bytes_to_unicode()

    def spelled(token):
        if set(token) <= alphabet:
            return token
        return "".join(spelling[b] for b in token.encode("utf-8"))

    vocab = {}
    for index, token in enumerate(tokens):
        vocab.setdefault(spelled(token), index)
    if len(vocab) != len(tokens):
        raise ValueError(f"the GGUF vocabulary repeats tokens ({len(tokens) - len(vocab)} duplicates)")
    pairs = []
    for merge in merges:
        left, _, right = merge.partition(" ")
        pairs.append((left, right))
    backend = byte_level_bpe(vocab, pairs, metadata.get("tokenizer.ggml.pre") or "default")
    control = [AddedToken(token, normalized=False, special=True)
               for token, kind in zip(tokens, types) if kind == GGUF_CONTROL and set(token) <= alphabet]
    return backend, vocab, control


def tokenizer_from_gguf(metadata: dict) -> Tokenizer:
    """Build the tokenizer a GGUF file's `tokenizer.*` metadata describes: a byte-level BPE ("gpt2": Llama 3,
    Qwen, SmolLM2) or a SentencePiece BPE ("llama": Llama 2, Mistral, Phi-3; merges from the scores).

    Tokens typed CONTROL become special added tokens and USER_DEFINED ones plain added
    tokens, so neither is cut into pieces; in a byte-level vocabulary a CONTROL token spelled
    outside the byte alphabet is a llama.cpp mislabel and stays an ordinary vocabulary entry
    (as in transformers' GGUF converter).
    """
    model = metadata.get("tokenizer.ggml.model")
    if model not in ("gpt2", "llama"):
        raise ValueError(f"GGUF tokenizer model {model!r} is not supported; Kiln builds byte-level BPE ('gpt2') "
                         "and SentencePiece BPE ('llama') tokenizers")
    tokens = metadata["tokenizer.ggml.tokens"]
    types = metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if model == "llama":
        scores = metadata.get("tokenizer.ggml.scores")
        if scores is None or len(scores) != len(tokens):
            raise ValueError("the GGUF file has no tokenizer.ggml.scores for its SentencePiece vocabulary")
        vocab = set(tokens)
        backend = sentencepiece_bpe(tokens, scores, metadata.get("general.architecture") == "phi3",
                                    bool(metadata.get("tokenizer.ggml.add_space_prefix", True)))
        control = [AddedToken(token, normalized=False, special=True)
                   for token, kind in zip(tokens, types) if kind == GGUF_CONTROL]
    else:
        backend, vocab, control = _byte_level_from_gguf(metadata, tokens, types)
    if control:
        backend.add_special_tokens(control)
    user = [AddedToken(token, normalized=False, special=False)
            for token, kind in zip(tokens, types) if kind == GGUF_USER_DEFINED and token in vocab]
    if user:
        backend.add_tokens(user)

    def token_of(key):
        index = metadata.get(f"tokenizer.ggml.{key}")
        if index is None:
            return None
        if not 0 <= int(index) < len(tokens):
            raise ValueError(f"tokenizer.ggml.{key} {index} is outside the vocabulary of {len(tokens)}")
        return tokens[int(index)]

    config = {"bos_token": token_of("bos_token_id"), "eos_token": token_of("eos_token_id"),
              "pad_token": token_of("padding_token_id"), "unk_token": token_of("unknown_token_id"),
              # llama.cpp adds BOS to a SentencePiece vocabulary that does not say otherwise (older files have no flag)
              "add_bos_token": bool(metadata.get("tokenizer.ggml.add_bos_token", model == "llama")),
              "add_eos_token": bool(metadata.get("tokenizer.ggml.add_eos_token", False)),
              "chat_template": metadata.get("tokenizer.chat_template")}
    post = _post_processor(config, backend.token_to_id)
    if post is not None:
        backend.post_processor = post
    return Tokenizer(backend.to_str(), config)


def tokenizer_from_hf_directory(directory) -> Tokenizer:
    """tokenizer.json copied byte for byte; tokenizer_config.json reduced to what Kiln uses.

    The chat template comes from chat_template.jinja, chat_template.json or
    tokenizer_config.json (the first present); special tokens missing from
    tokenizer_config.json are taken from special_tokens_map.json.
    """
    directory = Path(directory)
    tokenizer_json = directory / TOKENIZER_FILE
    if not tokenizer_json.is_file():
        raise ValueError(f"{directory} has no {TOKENIZER_FILE}; Kiln needs the fast-tokenizer file "
                         "(save the tokenizer with transformers' save_pretrained to write it)")
    raw = {}
    if (directory / CONFIG_FILE).is_file():
        raw = json.loads((directory / CONFIG_FILE).read_text(encoding="utf-8"))
    fallback = {}
    if (directory / "special_tokens_map.json").is_file():
        fallback = json.loads((directory / "special_tokens_map.json").read_text(encoding="utf-8"))
    if (directory / "chat_template.jinja").is_file():
        raw["chat_template"] = (directory / "chat_template.jinja").read_text(encoding="utf-8")
    elif (directory / "chat_template.json").is_file():
        raw["chat_template"] = json.loads(
            (directory / "chat_template.json").read_text(encoding="utf-8")).get("chat_template")
    return Tokenizer(tokenizer_json.read_bytes(), normalise_config(raw, fallback))


def byte_tokenizer(specials: list, config: dict) -> Tokenizer:
    """A byte-level tokenizer: ids 0..255 are the bytes, then `specials` (no merges)."""
    spelling = bytes_to_unicode()
    vocab = {spelling[b]: b for b in range(256)}
    for offset, token in enumerate(specials):
        vocab[token] = 256 + offset
    backend = byte_level_bpe(vocab, [], "gpt2")
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in specials])
    return Tokenizer(backend.to_str(), config)
