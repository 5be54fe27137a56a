"""The base registry's names, paths and identity: what a base is called, where it lives, the architecture and shard digests its identity is taken over, and the parameters it holds."""

import hashlib
import json
import os
import re
from dataclasses import dataclass, fields
from pathlib import Path

from trainer.checkpoint_format import parameter_signature
from trainer.config import FAMILY_DEFAULTS, TransformerConfig
from trainer.jsonio import canonical_bytes

IDENTITY_SCHEMA = "kiln.base-identity"
IDENTITY_VERSION = 1
CONFIG_FILE = "config.json"
IDENTITY_FILE = "identity.json"
SHARD_BYTES = 256 << 20  # FP32 bytes per shard: bounds the memory an import holds at once
ARCHITECTURE_FIELDS = ("vocabulary_size", "maximum_context", "model_width", "head_count",
                       "block_count", "feed_forward_width", "kv_head_count", "head_size",
                       "rope_theta", "norm_epsilon", "tie_embeddings")  # TransformerConfig.architecture()
FAMILY_FIELDS = tuple(FAMILY_DEFAULTS)  # architecture too, in architecture() only where not the Llama default
# TransformerConfig fields a caller may set when loading: how to run, never what to run
EXECUTION_OPTIONS = tuple(f.name for f in fields(TransformerConfig)
                          if f.name not in ARCHITECTURE_FIELDS and f.name not in FAMILY_FIELDS
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
    return hashlib.sha256(canonical_bytes(document, allow_nan=True)).hexdigest()  # its flags since version 1


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
    """{Hugging Face name: shape} of every base parameter, in the model's order."""
    return dict(parameter_signature(config))


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
