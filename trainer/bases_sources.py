"""Where a base's tensors come from: GGUF files (dequantized, Q/K permutation undone), Hugging Face directories, published registry directories and the built-in kiln-tiny."""

import json
import re
from collections import Counter
from pathlib import Path

import numpy as np

from trainer.bases_identity import (CONFIG_FILE, TINY_ARCHITECTURE, TINY_SEED, TINY_SPECIALS, TINY_STD,
                                    TINY_TOKENIZER_CONFIG, file_digest, parameter_shapes, shard_files)
from trainer.blocks import llama3_frequencies
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


# the Kiln (Hugging Face) name in a block -> llama.cpp's (gguf's TensorNameMap)
_GGUF_BLOCK_NAMES = {
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias", "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight"}
GGUF_FAMILIES = ("llama", "qwen2", "qwen3", "phi3")  # llama.cpp architectures (Mistral converts as llama)


def llama3_scaling_from_factors(factors, theta, head_size):
    """("llama3", factor, low_freq_factor, high_freq_factor, original context) whose divisors are
    `factors` (llama.cpp's rope_freqs.weight), or None when they follow no such scaling.

    The divisors depend on (factor, a, b) only, with s = a * inv_freq - b between the two
    wavelength bounds, so low_freq_factor is taken as 1 (as in every Llama 3.x) and the rest
    solved from two smoothed frequencies; the result is checked against every divisor.
    """
    inv_freq = 1.0 / (theta ** (np.arange(0, head_size, 2, dtype=np.float64) / head_size))
    if factors.shape != inv_freq.shape or not np.all(np.isfinite(factors)) or factors.min() < 1 - 1e-6:
        return None
    factor = float(factors.max())
    if factor <= 1:
        return None
    medium = np.flatnonzero((factors > 1 + 1e-6) & (factors < factor * (1 - 1e-6)))
    wavelength = 2 * np.pi / inv_freq
    if len(medium) >= 2:
        smooth = (1.0 / factors[medium] - 1.0 / factor) / (1.0 - 1.0 / factor)  # s, linear in inv_freq
        a, b = np.polyfit(inv_freq[medium], smooth, 1)
        b = -b
        if not (a > 0 and b > 0):
            return None
        high = float(round(1.0 + 1.0 / b, 4))
        original = float(round(2 * np.pi * a / b))
    else:  # one smoothed frequency or none: the divisors fix less, and any bounds that give them fit
        kept, divided = wavelength[factors <= 1 + 1e-6], wavelength[factors >= factor * (1 - 1e-6)]
        shortest_divided = divided.min() if len(divided) else np.inf
        longest_kept = kept.max() if len(kept) else 0.0
        if not np.isfinite(shortest_divided):
            return None
        original = float(np.floor(shortest_divided))
        if len(medium) == 1:  # s at that wavelength fixes high once original is chosen
            m = medium[0]
            smooth = (1.0 / factors[m] - 1.0 / factor) / (1.0 - 1.0 / factor)
            if not 0 < smooth < 1 or original <= wavelength[m]:
                return None
            high = float(1.0 + (original / wavelength[m] - 1.0) / smooth)
        else:
            high = float(round(original / max(longest_kept, 1e-12) * 0.99, 4)) if len(kept) else 2.0
        if high <= 1 or original / high <= longest_kept:
            return None
    candidate = ("llama3", float(round(factor, 4)), 1.0, high, original)
    expected = inv_freq / llama3_frequencies(inv_freq, *candidate[1:])
    return candidate if np.allclose(expected, factors, rtol=1e-5, atol=0) else None


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
        md, where = self.metadata, self.path.name
        arch = md.get("general.architecture")
        if arch not in GGUF_FAMILIES:
            raise ValueError(f"{where}: GGUF architecture {arch!r} is not supported; Kiln imports "
                             f"{', '.join(repr(a) for a in GGUF_FAMILIES)} GGUF files")

        def need(key):
            value = md.get(f"{arch}.{key}")
            if value is None:
                raise ValueError(f"{where}: the GGUF metadata lacks {arch}.{key}")
            return int(value)

        if md.get(f"{arch}.expert_count"):
            raise ValueError(f"{where}: mixture-of-experts files are not supported")
        scaling_type = md.get(f"{arch}.rope.scaling.type")
        if scaling_type not in (None, "none"):
            raise ValueError(f"{where}: rotary scaling type {scaling_type!r} is not supported")
        if any(name.startswith("rope_factors_") for name in self.tensors):
            raise ValueError(f"{where}: long-context rotary factors (rope_factors_long/short) are not supported")
        embedding = self.tensors.get("token_embd.weight")
        if embedding is None:
            raise ValueError(f"{where}: no token_embd.weight tensor")
        width, vocabulary = (int(x) for x in embedding.shape[:2])
        heads = need("attention.head_count")
        head_size = int(md.get(f"{arch}.attention.key_length") or width // heads)
        if int(md.get(f"{arch}.attention.value_length") or head_size) != head_size:
            raise ValueError(f"{where}: key and value head sizes differ")
        rotary = int(md.get(f"{arch}.rope.dimension_count") or head_size)
        if rotary != head_size:
            raise ValueError(f"{where}: partial rotary ({rotary} of {head_size} dimensions) is not supported")
        if need("embedding_length") != width:
            raise ValueError(f"{where}: {arch}.embedding_length {need('embedding_length')} "
                             f"!= token_embd width {width}")
        theta = _f32_value(md.get(f"{arch}.rope.freq_base", 10000.0))
        context = need("context_length")
        window = md.get(f"{arch}.attention.sliding_window")
        return TransformerConfig(
            vocabulary_size=vocabulary, maximum_context=context, model_width=width,
            head_count=heads, kv_head_count=int(md.get(f"{arch}.attention.head_count_kv") or heads),
            block_count=need("block_count"), feed_forward_width=need("feed_forward_length"),
            head_size=head_size, rope_theta=theta,
            norm_epsilon=_f32_value(md.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
            tie_embeddings="output.weight" not in self.tensors, family=arch,
            attention_bias=arch == "qwen2", qk_norm=arch == "qwen3",
            rope_scaling=self._rope_scaling(theta, head_size),
            sliding_window=int(window) if arch == "phi3" and window and int(window) < context else None)

    def _rope_scaling(self, theta, head_size):
        """Llama 3's scaling from llama.cpp's rope_freqs.weight (one divisor per frequency), or None."""
        tensor = self.tensors.get("rope_freqs.weight")
        if tensor is None:
            return None
        factors = np.asarray(tensor.data, dtype=np.float64).reshape(-1)
        scaling = llama3_scaling_from_factors(factors, theta, head_size)
        if scaling is None:
            raise ValueError(f"{self.path.name}: rope_freqs.weight does not follow Llama 3's rotary scaling; "
                             "other frequency factors are not supported")
        return scaling

    def _name_map(self):
        arch, config = self.metadata["general.architecture"], self.config
        names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
        if not config.tie_embeddings:
            names["lm_head.weight"] = "output.weight"
        for i in range(config.block_count):
            for long, short in _GGUF_BLOCK_NAMES.items():
                names[f"model.layers.{i}.{long}"] = f"blk.{i}.{short}"
        self._rows = {}
        if arch == "phi3":  # fused attn_qkv and ffn_up (gate, then up), as Phi-3's qkv_proj and gate_up_proj
            for name, (fused, rows) in phi3_fused_names(config).items():
                block = name.split(".")[2]
                names[name] = f"blk.{block}.attn_qkv.weight" if fused.endswith("qkv_proj.weight") \
                    else f"blk.{block}.ffn_up.weight"
                self._rows[name] = rows
        names = {n: names[n] for n in parameter_shapes(config)}
        used = set(names.values()) | ({"rope_freqs.weight"} if config.rope_scaling else set())
        missing = sorted(g for g in set(names.values()) if g not in self.tensors)
        unknown = sorted(set(self.tensors) - used)
        if missing or unknown:
            raise ValueError(f"{self.path.name}: the tensors do not form a {arch} model: missing "
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
        if name in self._rows:
            values = values[self._rows[name]]
        elif self.metadata["general.architecture"] == "llama":  # only llama.cpp's llama permutes Q and K
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
