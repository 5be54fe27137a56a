"""Where a base's tensors come from: GGUF files (dequantized, Q/K permutation undone), Hugging Face directories, published registry directories and the built-in kiln-tiny."""

import json
import re
from collections import Counter
from pathlib import Path

import numpy as np

from trainer.bases_identity import (CONFIG_FILE, TINY_ARCHITECTURE, TINY_SEED, TINY_SPECIALS, TINY_STD,
                                    TINY_TOKENIZER_CONFIG, file_digest, parameter_shapes, shard_files)
from trainer.config import FAMILIES, LLAMA3_ROPE_KEYS, TransformerConfig
from trainer.tensorfiles import SafetensorsFile
from trainer.tokenizer import Tokenizer, byte_tokenizer, tokenizer_from_gguf, tokenizer_from_hf_directory


def phi3_fused_names(config, prefix="model.layers"):
    """{Kiln name: (Phi-3's fused name, row slice)}: qkv_proj holds q, k, v and gate_up_proj gate, up."""
    H, KV, D, F = config.head_count, config.kv_heads, config.head_dimension, config.feed_forward_width
    parts = {}
    for i in range(config.block_count):
        attention, mlp = f"{prefix}.{i}.self_attn.", f"{prefix}.{i}.mlp."
        qkv, gate_up = attention + "qkv_proj.weight", mlp + "gate_up_proj.weight"
        parts[attention + "q_proj.weight"] = (qkv, slice(0, H * D))
        parts[attention + "k_proj.weight"] = (qkv, slice(H * D, (H + KV) * D))
        parts[attention + "v_proj.weight"] = (qkv, slice((H + KV) * D, (H + 2 * KV) * D))
        parts[mlp + "gate_proj.weight"] = (gate_up, slice(0, F))
        parts[mlp + "up_proj.weight"] = (gate_up, slice(F, 2 * F))
    return parts


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
        self._fused = (None, None)
        self._where = self._weight_map()

    def _config(self):
        hf, where = self.hf_config, self.path.name
        family = hf.get("model_type")
        if family not in FAMILIES:
            raise ValueError(f"{where}: model_type {family!r} is not supported; Kiln imports "
                             f"{', '.join(repr(f) for f in FAMILIES)} directories")
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{where}: hidden_act {hf['hidden_act']!r} is not supported (silu only)")
        if hf.get("mlp_bias"):
            raise ValueError(f"{where}: mlp_bias is set; Kiln's MLP projections have no biases")
        if family != "qwen2" and hf.get("attention_bias"):
            raise ValueError(f"{where}: attention_bias is set on a {family} model (a bias on o_proj too); "
                             "Kiln supports q/k/v biases as Qwen2 has them, and no o_proj bias")
        layer_types = set(hf.get("layer_types") or ())
        if hf.get("use_sliding_window") or layer_types - {"full_attention"}:
            raise ValueError(f"{where}: per-layer sliding attention (use_sliding_window / layer_types "
                             f"{sorted(layer_types)}) is not supported")
        rope = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
        rope_type = rope.get("rope_type", rope.get("type")) or "default"
        if rope_type not in ("default", "llama3"):
            raise ValueError(f"{where}: rope type {rope_type!r} is not supported; Kiln supports unscaled "
                             "rotary positions and Llama 3's 'llama3' scaling")
        if float(rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) or 1.0) != 1.0:
            raise ValueError(f"{where}: partial rotary (partial_rotary_factor "
                             f"{rope.get('partial_rotary_factor', hf.get('partial_rotary_factor'))}) is not supported")
        scaling = None
        if rope_type == "llama3":
            try:
                scaling = ("llama3", *(float(rope[key]) for key in LLAMA3_ROPE_KEYS))
            except KeyError as exc:
                raise ValueError(f"{where}: rope type 'llama3' lacks {exc.args[0]}") from None
        theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
        heads = hf["num_attention_heads"] if "num_attention_heads" in hf else None
        try:
            context = hf["max_position_embeddings"]
            window = hf.get("sliding_window")
            return TransformerConfig(
                vocabulary_size=hf["vocab_size"], maximum_context=context,
                model_width=hf["hidden_size"], head_count=hf["num_attention_heads"],
                kv_head_count=hf.get("num_key_value_heads") or heads,
                block_count=hf["num_hidden_layers"], feed_forward_width=hf["intermediate_size"],
                head_size=hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
                rope_theta=float(theta), norm_epsilon=float(hf.get("rms_norm_eps", 1e-6)),
                tie_embeddings=bool(hf.get("tie_word_embeddings", False)), family=family,
                attention_bias=family == "qwen2", qk_norm=family == "qwen3", rope_scaling=scaling,
                # a window no shorter than the context hides nothing: the model is unwindowed
                sliding_window=window if family in ("mistral", "phi3") and window and window < context else None)
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
        expected = {name: (name, None) for name in parameter_shapes(self.config)}
        if self.config.family == "phi3":
            expected.update(phi3_fused_names(self.config))
        ignored = {n for n in weight_map if self.IGNORED.match(n)}
        if self.config.tie_embeddings:
            ignored.add("lm_head.weight")  # a tied output projection some savers still write
        stored = {source for source, _ in expected.values()}
        missing = sorted({source for source in stored if source not in weight_map})
        unknown = sorted(set(weight_map) - stored - ignored)
        if missing or unknown:
            raise ValueError(f"{self.path.name}: the weights do not form the {self.config.family} model config.json "
                             f"describes: missing {missing[:5]}, not understood {unknown[:5]}")
        self._rows = {name: (source, rows) for name, (source, rows) in expected.items()}
        return {name: weight_map[source] for name, (source, _) in expected.items()} | {
            source: weight_map[source] for source in stored}

    def _file(self, name):
        if name not in self._files:
            self._files[name] = SafetensorsFile(self.path / name)
        return self._files[name]

    def tensor(self, name):
        source, rows = self._rows[name]
        file = self._file(self._where[source])
        if source not in file.names:
            raise ValueError(f"{file.path.name} does not hold {source}, though the index says so")
        if rows is None:
            return file.float32(source)
        if self._fused[0] != source:  # Phi-3's fused matrices: read once for their two or three parts
            self._fused = (source, file.float32(source))
        return np.ascontiguousarray(self._fused[1][rows])

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
        self._fused = (None, None)


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
