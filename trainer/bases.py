"""The base-model registry: import GGUF files and Hugging Face directories, identify, load.

A registered base is one directory `ROOT/bases/NAME/` (ROOT is KILN_HOME, or ~/.kiln):

    config.json              the TransformerConfig architecture fields
    tokenizer.json           `tokenizers` format (built from GGUF metadata, or copied)
    tokenizer_config.json    bos/eos/pad/unk tokens, add_bos/add_eos, chat_template
    *.safetensors            FP32 shards with Hugging Face Llama parameter names
    identity.json            the identity, each shard's SHA-256 and size, tokenizer
                             identity, where the base came from

A base's identity is a SHA-256 over its configuration and the (SHA-256, size) of every
shard, taken in digest order: renaming or moving unchanged shards keeps it; changing any
byte, any size or the number of shards changes it. Imports are built in a hidden
staging directory, fsynced and published with one rename. `kiln-tiny` is built in:
a small deterministic random model with a byte-level tokenizer that needs no download;
it is written into the registry the first time it is used.
"""

import hashlib
import json
import os
import re
from collections import Counter
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np

from trainer.config import TransformerConfig
from trainer.tensorfiles import (SafetensorsFile, discard, publish_directory, safetensors_bytes,
                                 staging_directory, write_synced)
from trainer.tokenizer import (Tokenizer, byte_tokenizer, tokenizer_from_gguf,
                               tokenizer_from_hf_directory)

IDENTITY_SCHEMA = "kiln.base-identity"
IDENTITY_VERSION = 1
CONFIG_FILE = "config.json"
IDENTITY_FILE = "identity.json"
SHARD_BYTES = 256 << 20  # FP32 bytes per shard: bounds the memory an import holds at once
ARCHITECTURE_FIELDS = ("vocabulary_size", "maximum_context", "model_width", "head_count",
                       "block_count", "feed_forward_width", "kv_head_count", "head_size",
                       "rope_theta", "norm_epsilon", "tie_embeddings")  # TransformerConfig.architecture()
# TransformerConfig fields a caller may set when loading: how to run, never what to run
EXECUTION_OPTIONS = tuple(f.name for f in fields(TransformerConfig)
                          if f.name not in ARCHITECTURE_FIELDS
                          and f.name not in ("initializer_seed", "initializer_range"))
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,99}\Z")

BUILTIN_TINY = "kiln-tiny"
TINY_ARCHITECTURE = dict(
    vocabulary_size=260,  # 256 byte tokens + <|endoftext|> <|im_start|> <|im_end|> <pad>
    maximum_context=512, model_width=64, head_count=4, kv_head_count=2, block_count=2,
    feed_forward_width=128, head_size=16, rope_theta=10000.0, norm_epsilon=1e-5,
    tie_embeddings=True)
TINY_SEED = 1234  # fixed: every machine builds the same kiln-tiny bytes
TINY_STD = 0.02  # Hugging Face Llama's initializer_range
TINY_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<pad>"]
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
TINY_TOKENIZER_CONFIG = {"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>",
                         "pad_token": "<pad>", "unk_token": None, "add_bos_token": False,
                         "add_eos_token": False, "chat_template": CHATML_TEMPLATE}


# -- registry paths ----------------------------------------------------------------------


def default_root() -> Path:
    """KILN_HOME, or ~/.kiln (the same default as the web settings)."""
    raw = os.environ.get("KILN_HOME", "")
    path = Path(raw or "~/.kiln").expanduser()
    if not path.is_absolute():
        raise ValueError(f"KILN_HOME={raw!r} must be an absolute path (a leading ~ is expanded)")
    return path


def bases_directory(root=None) -> Path:
    return Path(root if root is not None else default_root()) / "bases"


def check_name(name) -> str:
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(f"base name {name!r} must be 1-100 letters, digits, '.', '_' or '-', "
                         "starting with a letter or digit")
    return name


# -- identity ----------------------------------------------------------------------------


def architecture_of(config) -> dict:
    """The architecture fields, canonical: explicit kv_head_count and head_size."""
    if isinstance(config, dict):
        config = TransformerConfig.from_dict(config)
    if not isinstance(config, TransformerConfig):
        raise TypeError("config must be a TransformerConfig or its dict")
    architecture = config.architecture()
    architecture["kv_head_count"] = config.kv_heads
    architecture["head_size"] = config.head_dimension
    architecture["rope_theta"] = float(architecture["rope_theta"])
    architecture["norm_epsilon"] = float(architecture["norm_epsilon"])
    return architecture


def base_identity(config, shards) -> str:
    """SHA-256 over the architecture and the (sha256, size) of every shard, in digest order.

    `shards` holds (sha256 hex, size) pairs or {"sha256", "size"} dicts; file names and
    locations do not enter, so renaming or moving unchanged shards keeps the identity.
    """
    pairs = []
    for shard in shards:
        digest, size = (shard["sha256"], shard["size"]) if isinstance(shard, dict) else shard
        if not re.fullmatch(r"[0-9a-f]{64}", str(digest)) or isinstance(size, bool) \
                or not isinstance(size, int) or size < 0:
            raise ValueError(f"a shard is a (sha256 hex, size) pair, got {shard!r}")
        pairs.append({"sha256": digest, "size": size})
    if not pairs:
        raise ValueError("a base has at least one shard")
    document = {"schema": IDENTITY_SCHEMA, "version": IDENTITY_VERSION,
                "config": architecture_of(config),
                "shards": sorted(pairs, key=lambda p: (p["sha256"], p["size"]))}
    canonical = json.dumps(document, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(canonical.encode("ascii")).hexdigest()


def file_digest(path) -> tuple:
    """(sha256 hex, size) of a file, read in 16 MiB pieces."""
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as handle:
        while piece := handle.read(16 << 20):
            digest.update(piece)
            size += len(piece)
    return digest.hexdigest(), size


def shard_files(directory) -> list:
    return sorted(p for p in Path(directory).iterdir()
                  if p.suffix == ".safetensors" and p.is_file() and not p.name.startswith("."))


def directory_identity(directory) -> str:
    """The identity of the base in `directory`, computed from its config.json and shard bytes."""
    directory = Path(directory)
    config = json.loads((directory / CONFIG_FILE).read_text(encoding="utf-8"))
    return base_identity(config, [file_digest(p) for p in shard_files(directory)])


# -- what a base holds -------------------------------------------------------------------


def parameter_shapes(config: TransformerConfig) -> dict:
    """{Hugging Face Llama name: shape} of every base parameter, in the model's order."""
    C, F, V = config.model_width, config.feed_forward_width, config.vocabulary_size
    H, KV, D = config.head_count, config.kv_heads, config.head_dimension
    shapes = {"model.embed_tokens.weight": (V, C)}
    for i in range(config.block_count):
        p = f"model.layers.{i}."
        shapes.update({
            p + "self_attn.q_proj.weight": (H * D, C), p + "self_attn.k_proj.weight": (KV * D, C),
            p + "self_attn.v_proj.weight": (KV * D, C), p + "self_attn.o_proj.weight": (C, H * D),
            p + "mlp.gate_proj.weight": (F, C), p + "mlp.up_proj.weight": (F, C),
            p + "mlp.down_proj.weight": (C, F), p + "input_layernorm.weight": (C,),
            p + "post_attention_layernorm.weight": (C,)})
    shapes["model.norm.weight"] = (C,)
    if not config.tie_embeddings:
        shapes["lm_head.weight"] = (V, C)
    return shapes


@dataclass(frozen=True)
class BaseInfo:
    """What `list_bases` and `show_base` report about one base."""

    name: str
    path: Path  # the base directory (for a not yet materialised built-in: where it will go)
    identity: str
    config: dict  # architecture fields
    shards: tuple  # ({"file", "sha256", "size"}, ...)
    parameter_count: int
    tokenizer: dict  # Tokenizer.identity()
    source: dict  # {"format": "gguf" | "huggingface" | "builtin", ...}
    builtin: bool
    materialised: bool

    @property
    def total_bytes(self) -> int:
        return sum(s["size"] for s in self.shards)

    def to_dict(self) -> dict:
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        data["path"] = str(self.path)
        data["shards"] = [dict(s) for s in self.shards]
        data["total_bytes"] = self.total_bytes
        return data


# -- sources: where tensors come from ------------------------------------------------------


class _Source:
    """config (TransformerConfig), tensor(name) -> FP32 array, tokenizer(), description()."""

    config: TransformerConfig

    def names(self):
        return list(parameter_shapes(self.config))

    def close(self):
        pass


def _f32_value(value) -> float:
    """A float stored as float32, as the shortest decimal that round-trips (1e-05, not 9.99e-06)."""
    return float(str(np.float32(value)))


def _gguf_field(field):
    from gguf import GGUFValueType

    kind = field.types[0]
    if kind == GGUFValueType.ARRAY:
        if field.types[1] == GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8") for i in field.data]
        if field.types[1] == GGUFValueType.ARRAY:
            return None  # nested arrays: nothing Kiln reads
        return [field.parts[i].tolist()[0] for i in field.data]
    if kind == GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8")
    return field.parts[field.data[0]].tolist()[0]


_GGUF_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm"}


def undo_gguf_qk_permutation(weight: np.ndarray, heads: int) -> np.ndarray:
    """Inverse of llama.cpp's convert_hf_to_gguf `permute` of q_proj / k_proj rows.

    llama.cpp stores each head's rows as (half, pair) -> (pair, half), i.e.
    w.reshape(heads, 2, D/2, in).swapaxes(1, 2); this swaps them back (as transformers'
    GGUF loader does), giving the rotate-half layout of Hugging Face Llama.
    """
    rows = weight.shape[0]
    half = rows // heads // 2
    assert heads * 2 * half == rows, f"{rows} rows do not split into {heads} heads of even size"
    return np.ascontiguousarray(
        weight.reshape(heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape))


class _GgufSource(_Source):
    def __init__(self, path):
        try:
            from gguf import GGUFReader
        except ImportError:
            raise ImportError("reading GGUF files needs the gguf package: pip install 'gguf>=0.10'") from None
        self.path = Path(path)
        try:
            self.reader = GGUFReader(self.path)
        except Exception as exc:  # the reader raises ValueError, struct.error, ...
            raise ValueError(f"{self.path} is not a readable GGUF file: {exc}") from None
        self.metadata = {k: _gguf_field(f) for k, f in self.reader.fields.items()
                         if not k.startswith("GGUF.")}
        self.tensors = {t.name: t for t in self.reader.tensors}
        self.config = self._config()
        self._names = self._name_map()

    def _config(self):
        md = self.metadata
        architecture = md.get("general.architecture")
        if architecture != "llama":
            raise ValueError(f"{self.path.name}: GGUF architecture {architecture!r} is not supported; "
                             "Kiln imports Llama-architecture GGUF files")

        def need(key):
            value = md.get(f"llama.{key}")
            if value is None:
                raise ValueError(f"{self.path.name}: the GGUF metadata lacks llama.{key}")
            return int(value)

        if md.get("llama.expert_count"):
            raise ValueError(f"{self.path.name}: mixture-of-experts Llama files are not supported")
        scaling = md.get("llama.rope.scaling.type")
        if scaling not in (None, "none") or "rope_freqs.weight" in self.tensors:
            raise ValueError(f"{self.path.name}: rotary scaling ({scaling or 'rope_freqs.weight'}) "
                             "is not supported; Kiln's rotary positions are unscaled")
        embedding = self.tensors.get("token_embd.weight")
        if embedding is None:
            raise ValueError(f"{self.path.name}: no token_embd.weight tensor")
        width, vocabulary = (int(x) for x in embedding.shape[:2])
        heads = need("attention.head_count")
        head_size = int(md.get("llama.attention.key_length") or width // heads)
        if int(md.get("llama.attention.value_length") or head_size) != head_size:
            raise ValueError(f"{self.path.name}: key and value head sizes differ")
        rotary = int(md.get("llama.rope.dimension_count") or head_size)
        if rotary != head_size:
            raise ValueError(f"{self.path.name}: partial rotary ({rotary} of {head_size} dimensions) "
                             "is not supported")
        if need("embedding_length") != width:
            raise ValueError(f"{self.path.name}: llama.embedding_length {need('embedding_length')} "
                             f"!= token_embd width {width}")
        return TransformerConfig(
            vocabulary_size=vocabulary, maximum_context=need("context_length"), model_width=width,
            head_count=heads, kv_head_count=int(md.get("llama.attention.head_count_kv") or heads),
            block_count=need("block_count"), feed_forward_width=need("feed_forward_length"),
            head_size=head_size, rope_theta=_f32_value(md.get("llama.rope.freq_base", 10000.0)),
            norm_epsilon=_f32_value(md.get("llama.attention.layer_norm_rms_epsilon", 1e-5)),
            tie_embeddings="output.weight" not in self.tensors)

    def _name_map(self):
        names = {"model.embed_tokens.weight": "token_embd.weight",
                 "model.norm.weight": "output_norm.weight"}
        if not self.config.tie_embeddings:
            names["lm_head.weight"] = "output.weight"
        for i in range(self.config.block_count):
            for short, long in _GGUF_BLOCK_NAMES.items():
                names[f"model.layers.{i}.{long}.weight"] = f"blk.{i}.{short}.weight"
        missing = [g for g in names.values() if g not in self.tensors]
        unknown = sorted(set(self.tensors) - set(names.values()))
        if missing or unknown:
            raise ValueError(f"{self.path.name}: the tensors do not form a Llama model: missing "
                             f"{missing[:5]}, not understood {unknown[:5]}")
        return names

    def tensor(self, name) -> np.ndarray:
        from gguf.quants import dequantize

        source = self.tensors[self._names[name]]
        try:
            values = dequantize(source.data, source.tensor_type)
        except NotImplementedError:
            raise ValueError(f"{self.path.name}: {source.name} is {source.tensor_type.name}, which "
                             "gguf.quants.dequantize cannot dequantize") from None
        shape = tuple(int(x) for x in reversed(source.shape.tolist()))  # GGUF lists ne0 first
        values = np.asarray(values, dtype=np.float32).reshape(shape)
        if name.endswith("self_attn.q_proj.weight"):
            values = undo_gguf_qk_permutation(values, self.config.head_count)
        elif name.endswith("self_attn.k_proj.weight"):
            values = undo_gguf_qk_permutation(values, self.config.kv_heads)
        return np.ascontiguousarray(values)

    def tokenizer(self):
        return tokenizer_from_gguf(self.metadata)

    def description(self):
        digest, size = file_digest(self.path)
        return {"format": "gguf", "file": self.path.name, "sha256": digest, "size": size,
                "name": self.metadata.get("general.name"),
                "tensor_types": dict(sorted(Counter(t.tensor_type.name
                                                    for t in self.tensors.values()).items()))}

    def close(self):
        self.reader = None
        self.tensors = {}


class _HuggingFaceSource(_Source):
    """A directory saved by transformers: config.json, *.safetensors (+ index), tokenizer files."""

    IGNORED = re.compile(r".*rotary_emb\.inv_freq\Z")

    def __init__(self, directory):
        self.path = Path(directory)
        config_path = self.path / CONFIG_FILE
        if not config_path.is_file():
            raise ValueError(f"{self.path} has no config.json; it is not a Hugging Face model directory")
        self.hf_config = json.loads(config_path.read_text(encoding="utf-8"))
        self.config = self._config()
        self._files = {}
        self._where = self._weight_map()

    def _config(self):
        hf, where = self.hf_config, self.path.name
        model_type = hf.get("model_type")
        if model_type != "llama":
            raise ValueError(f"{where}: model_type {model_type!r} is not supported; Kiln imports "
                             "Llama-architecture (model_type 'llama') directories")
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{where}: hidden_act {hf['hidden_act']!r} is not supported (silu only)")
        for flag in ("attention_bias", "mlp_bias"):
            if hf.get(flag):
                raise ValueError(f"{where}: {flag} is set; Kiln's Llama has no biases")
        rope = dict(hf.get("rope_parameters") or {})
        scaling = hf.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
        if rope_type not in (None, "default"):
            raise ValueError(f"{where}: rope type {rope_type!r} is not supported; Kiln's rotary "
                             "positions are unscaled")
        theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
        heads = hf["num_attention_heads"]
        try:
            return TransformerConfig(
                vocabulary_size=hf["vocab_size"], maximum_context=hf["max_position_embeddings"],
                model_width=hf["hidden_size"], head_count=heads,
                kv_head_count=hf.get("num_key_value_heads") or heads,
                block_count=hf["num_hidden_layers"], feed_forward_width=hf["intermediate_size"],
                head_size=hf.get("head_dim") or hf["hidden_size"] // heads,
                rope_theta=float(theta), norm_epsilon=float(hf.get("rms_norm_eps", 1e-6)),
                tie_embeddings=bool(hf.get("tie_word_embeddings", False)))
        except KeyError as exc:
            raise ValueError(f"{where}: config.json lacks {exc.args[0]}") from None

    def _weight_map(self):
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        else:
            files = sorted(self.path.glob("*.safetensors"))
            if not files:
                raise ValueError(f"{self.path} holds no *.safetensors weights (PyTorch .bin files "
                                 "are not read; save with safe_serialization=True)")
            weight_map = {}
            for file in files:
                for name in self._file(file.name).names:
                    weight_map[name] = file.name
        expected = parameter_shapes(self.config)
        ignored = {n for n in weight_map if self.IGNORED.match(n)}
        if self.config.tie_embeddings:
            ignored.add("lm_head.weight")  # a tied output projection some savers still write
        missing = [n for n in expected if n not in weight_map]
        unknown = sorted(set(weight_map) - set(expected) - ignored)
        if missing or unknown:
            raise ValueError(f"{self.path.name}: the weights do not form the Llama model config.json "
                             f"describes: missing {missing[:5]}, not understood {unknown[:5]}")
        return {n: weight_map[n] for n in expected}

    def _file(self, name):
        if name not in self._files:
            self._files[name] = SafetensorsFile(self.path / name)
        return self._files[name]

    def tensor(self, name):
        file = self._file(self._where[name])
        if name not in file.names:
            raise ValueError(f"{file.path.name} does not hold {name}, though the index says so")
        return file.float32(name)

    def tokenizer(self):
        return tokenizer_from_hf_directory(self.path)

    def description(self):
        return {"format": "huggingface", "directory": self.path.name,
                "architectures": self.hf_config.get("architectures"),
                "dtype": self.hf_config.get("dtype", self.hf_config.get("torch_dtype"))}

    def close(self):
        for file in self._files.values():
            file.close()
        self._files = {}


class _RegisteredSource(_Source):
    """A published base directory (FP32 shards; tensors are found by reading shard headers)."""

    def __init__(self, directory):
        self.path = Path(directory)
        self.config = TransformerConfig.from_dict(
            json.loads((self.path / CONFIG_FILE).read_text(encoding="utf-8")))
        self._files = [SafetensorsFile(p) for p in shard_files(self.path)]
        self._where = {}
        for file in self._files:
            for name in file.names:
                if name in self._where:
                    raise ValueError(f"{self.path}: {name} is in two shards")
                self._where[name] = file
        expected = parameter_shapes(self.config)
        if set(self._where) != set(expected):
            raise ValueError(f"{self.path}: the shards do not hold the base's parameters: missing "
                             f"{sorted(set(expected) - set(self._where))[:5]}, unknown "
                             f"{sorted(set(self._where) - set(expected))[:5]}")

    def tensor(self, name):
        return self._where[name].array(name)

    def tokenizer(self):
        return Tokenizer.from_directory(self.path)

    def close(self):
        for file in self._files:
            file.close()


class _TinySource(_Source):
    def __init__(self):
        self.config = TransformerConfig(**TINY_ARCHITECTURE)
        rng = np.random.default_rng(TINY_SEED)
        self._values = {}
        for name, shape in parameter_shapes(self.config).items():
            if len(shape) == 2:
                self._values[name] = rng.standard_normal(shape, dtype=np.float32) * np.float32(TINY_STD)
            else:
                self._values[name] = np.ones(shape, np.float32)

    def tensor(self, name):
        return self._values[name].copy()

    def tokenizer(self):
        return byte_tokenizer(TINY_SPECIALS, TINY_TOKENIZER_CONFIG)

    def description(self):
        return {"format": "builtin", "seed": TINY_SEED, "std": TINY_STD}


def _open_source(path) -> _Source:
    path = Path(path)
    if path.is_dir():
        return _HuggingFaceSource(path)
    if path.is_file():
        with open(path, "rb") as handle:
            magic = handle.read(4)
        if magic == b"GGUF":
            return _GgufSource(path)
        raise ValueError(f"{path} is neither a GGUF file nor a Hugging Face model directory")
    raise FileNotFoundError(f"{path} does not exist")


# -- writing a base ----------------------------------------------------------------------


def _shard_plan(shapes: dict, shard_bytes: int) -> list:
    """Consecutive groups of names, each at most shard_bytes of FP32 (or a single tensor)."""
    plan, current, size = [], [], 0
    for name, shape in shapes.items():
        nbytes = 4 * int(np.prod(shape, dtype=np.int64))
        if current and size + nbytes > shard_bytes:
            plan.append(current)
            current, size = [], 0
        current.append(name)
        size += nbytes
    plan.append(current)
    return plan


def _json_bytes(data) -> bytes:
    return (json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode("utf-8")


def _base_files(source: _Source, progress=None, shard_bytes=SHARD_BYTES):
    """Yield (file name, bytes) of a base directory: tokenizer, config, shards, identity.json last."""
    config = source.config
    architecture = architecture_of(config)
    tokenizer = source.tokenizer()
    if tokenizer.vocabulary_size > config.vocabulary_size:
        raise ValueError(f"the tokenizer has {tokenizer.vocabulary_size} tokens but the model's "
                         f"embedding only {config.vocabulary_size}")
    yield from tokenizer.files().items()
    yield CONFIG_FILE, _json_bytes(architecture)
    shapes = parameter_shapes(config)
    plan = _shard_plan(shapes, shard_bytes)
    done, shards = 0, []
    for index, names in enumerate(plan):
        tensors = {}
        for name in names:
            value = source.tensor(name)
            if value.shape != shapes[name]:
                raise ValueError(f"{name}: shape {value.shape} does not match {shapes[name]}")
            if not np.all(np.isfinite(value)):
                raise ValueError(f"{name} holds non-finite values")
            tensors[name] = value
            done += 1
            if progress is not None:
                progress(done, len(shapes), name)
        data = safetensors_bytes(tensors, metadata={"format": "pt"})
        del tensors
        file = f"model-{index + 1:05d}-of-{len(plan):05d}.safetensors"
        shards.append({"file": file, "sha256": hashlib.sha256(data).hexdigest(), "size": len(data)})
        yield file, data
    identity = {
        "schema": IDENTITY_SCHEMA, "version": IDENTITY_VERSION,
        "identity": base_identity(architecture, shards), "config": architecture,
        "shards": shards, "parameter_count": int(sum(np.prod(s) for s in shapes.values())),
        "tokenizer": tokenizer.identity(), "source": source.description()}
    yield IDENTITY_FILE, _json_bytes(identity)


def _publish(source: _Source, target: Path, progress=None, shard_bytes=SHARD_BYTES):
    staging = staging_directory(target)
    try:
        for file, data in _base_files(source, progress, shard_bytes):
            write_synced(staging / file, data)
        publish_directory(staging, target)
    except BaseException:
        discard(staging)
        raise


def import_base(path, name, root=None, progress=None, shard_bytes=SHARD_BYTES) -> BaseInfo:
    """Import a GGUF file or Hugging Face directory as ROOT/bases/NAME; returns its BaseInfo.

    `progress(done, total, parameter_name)` is called after each tensor is converted.
    Nothing appears under NAME unless the whole import succeeds.
    """
    check_name(name)
    if name == BUILTIN_TINY:
        raise ValueError(f"{BUILTIN_TINY!r} is the built-in base; import under another name")
    target = bases_directory(root) / name
    if target.exists():
        raise FileExistsError(f"a base named {name!r} already exists at {target}")
    source = _open_source(path)
    try:
        _publish(source, target, progress, shard_bytes)
    finally:
        source.close()
    return show_base(name, root)


def _materialise_tiny(root) -> Path:
    target = bases_directory(root) / BUILTIN_TINY
    if (target / IDENTITY_FILE).is_file():
        return target
    try:
        _publish(_TinySource(), target)
    except OSError:
        if not (target / IDENTITY_FILE).is_file():  # another process published it first: fine
            raise
    return target


# -- reading the registry ----------------------------------------------------------------


def _info(name, directory, document, builtin, materialised) -> BaseInfo:
    return BaseInfo(name=name, path=directory, identity=document["identity"],
                    config=document["config"], shards=tuple(document["shards"]),
                    parameter_count=document["parameter_count"], tokenizer=document["tokenizer"],
                    source=document["source"], builtin=builtin, materialised=materialised)


def _tiny_document() -> dict:
    """identity.json of kiln-tiny, computed in memory (the same bytes materialising writes)."""
    files = dict(_base_files(_TinySource()))
    return json.loads(files[IDENTITY_FILE])


def show_base(name, root=None) -> BaseInfo:
    check_name(name)
    directory = bases_directory(root) / name
    identity_path = directory / IDENTITY_FILE
    if identity_path.is_file():
        document = json.loads(identity_path.read_text(encoding="utf-8"))
        if document.get("schema") != IDENTITY_SCHEMA or document.get("version") != IDENTITY_VERSION:
            raise ValueError(f"{identity_path}: schema {document.get('schema')!r} version "
                             f"{document.get('version')!r} is not {IDENTITY_SCHEMA} {IDENTITY_VERSION}")
        return _info(name, directory, document, name == BUILTIN_TINY, True)
    if name == BUILTIN_TINY:
        return _info(name, directory, _tiny_document(), True, False)
    known = ", ".join(info.name for info in list_bases(root)) or "none"
    raise LookupError(f"no base named {name!r} in {bases_directory(root)} (known: {known})")


def list_bases(root=None) -> list:
    """BaseInfo of every registered base and the built-in one, by name."""
    directory = bases_directory(root)
    names = {BUILTIN_TINY}
    if directory.is_dir():
        names.update(p.name for p in directory.iterdir()
                     if not p.name.startswith(".") and (p / IDENTITY_FILE).is_file() and _NAME.match(p.name))
    return [show_base(name, root) for name in sorted(names)]


def verify_base(name, root=None) -> BaseInfo:
    """Recompute the identity from the files on disk; ValueError if it differs from identity.json."""
    info = show_base(name, root)
    if not info.materialised:
        return info
    actual = directory_identity(info.path)
    if actual != info.identity:
        raise ValueError(f"base {name!r} changed on disk: identity.json records {info.identity}, "
                         f"the files give {actual}")
    return info


# -- loading -------------------------------------------------------------------------------


def _is_path(name_or_path) -> bool:
    if isinstance(name_or_path, os.PathLike):
        return True
    text = str(name_or_path)
    return "/" in text or os.sep in text or text.endswith(".gguf")


def load_base(name_or_path, root=None, verify=True, **execution_options):
    """(DecoderOnlyTransformer, Tokenizer) of a registered base, a GGUF file or a HF directory.

    `execution_options` are TransformerConfig fields that decide how the model runs
    (attention_algorithm, attention_block_size, activation_checkpointing, loss_route,
    loss_chunk_tokens). A registered base's shards are checked against its identity
    first unless verify=False. Paths (anything with a '/' or ending .gguf) are read
    directly, without registering them.
    """
    from trainer.model import DecoderOnlyTransformer

    unknown = sorted(set(execution_options) - set(EXECUTION_OPTIONS))
    if unknown:
        raise ValueError(f"{', '.join(unknown)} cannot be set when loading a base; execution "
                         f"options are {', '.join(EXECUTION_OPTIONS)}")
    if _is_path(name_or_path):
        source = _open_source(name_or_path)
    else:
        name = check_name(str(name_or_path))
        if name == BUILTIN_TINY:
            _materialise_tiny(root)
        info = verify_base(name, root) if verify else show_base(name, root)
        source = _RegisteredSource(info.path)
    try:
        config = TransformerConfig(**{**architecture_of(source.config), **execution_options})
        tokenizer = source.tokenizer()
        model = DecoderOnlyTransformer(config, initialize=False)  # every weight is loaded next
        try:
            model.load_state_dict({name: source.tensor(name) for name in source.names()})
        except BaseException:
            model.close()
            raise
    finally:
        source.close()
    return model, tokenizer
