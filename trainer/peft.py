"""PEFT interchange: a Kiln LoRA adapter as a `peft` adapter directory, and back.

A directory holds adapter_config.json (peft's LoraConfig fields) and
adapter_model.safetensors with keys `base_model.model.<Kiln parameter name>`, e.g.
`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight` ([r, in]) and
`...lora_B.weight` ([out, r]); Kiln's parameter names are already Hugging Face's. An
exported adapter loads with `peft.PeftModel.from_pretrained` over the same base and
gives Kiln's logits. Import is a weights-only warm start: it attaches the adapter's
LoRA when the model has none, refuses anything that does not fit, and changes nothing
until every check has passed.
"""

import hashlib
import json
import os
import uuid
from pathlib import Path

import numpy as np

from trainer.lora import ATTENTION, PROJECTIONS, LoraConfig
from trainer.tensorfiles import (SafetensorsFile, discard, fsync_directory, publish_directory, safetensors_bytes,
                                 staging_directory, write_synced)

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PREFIX = "base_model.model."
_MODULE = {p: ("self_attn." if p in ATTENTION else "mlp.") + p for p in PROJECTIONS}
# peft LoraConfig fields whose non-default values change the function Kiln would compute
_UNSUPPORTED = {"use_dora": False, "lora_bias": False, "fan_in_fan_out": False,
                "layers_to_transform": None, "layers_pattern": None, "modules_to_save": None,
                "rank_pattern": {}, "alpha_pattern": {}, "layer_replication": None,
                "exclude_modules": None, "trainable_token_indices": None, "target_parameters": None,
                "use_qalora": False}


def adapter_config(lora: LoraConfig, base_model_name_or_path=None) -> dict:
    """The adapter_config.json `peft` reads for a Kiln LoraConfig."""
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model_name_or_path,
        "revision": None, "inference_mode": True, "r": lora.rank, "lora_alpha": lora.alpha,
        "target_modules": sorted(lora.targets), "lora_dropout": 0.0, "fan_in_fan_out": False,
        "bias": "none", "use_rslora": lora.use_rslora, "modules_to_save": None,
        "init_lora_weights": True, "layers_to_transform": None, "layers_pattern": None,
        "rank_pattern": {}, "alpha_pattern": {}, "use_dora": False, "lora_bias": False,
    }


def export_adapter(model, directory, base_model_name_or_path=None) -> Path:
    """Write the model's LoRA adapter as a PEFT directory (new, or empty), atomically."""
    if model.lora_config is None:
        raise ValueError("the model has no LoRA adapter attached; nothing to export")
    directory = Path(directory)
    if directory.exists() and (not directory.is_dir() or any(directory.iterdir())):
        raise FileExistsError(f"{directory} already exists and is not an empty directory")
    config = adapter_config(model.lora_config, base_model_name_or_path)
    tensors = {PREFIX + name: value for name, value in model.adapter_state_dict().items()}
    staging = staging_directory(directory)
    try:
        write_synced(staging / CONFIG_FILE,
                     (json.dumps(config, indent=2, sort_keys=True) + "\n").encode("utf-8"))
        write_synced(staging / WEIGHTS_FILE, safetensors_bytes(tensors, metadata={"format": "pt"}))
        if directory.exists():
            directory.rmdir()  # empty, checked above; rename needs the name free
        publish_directory(staging, directory)
    except BaseException:
        discard(staging)
        raise
    return directory


def _targets(value) -> tuple:
    """peft target_modules -> Kiln projection names; refuses what Kiln cannot reproduce."""
    if value == "all-linear":
        return PROJECTIONS
    if isinstance(value, str) or not isinstance(value, (list, tuple)) or not value:
        raise ValueError(f"target_modules {value!r}: Kiln reads a list of projection names "
                         f"(or 'all-linear'), not a regular expression")
    targets = []
    for target in value:
        match = [p for p, module in _MODULE.items() if target in (p, module)]
        if not match:
            raise ValueError(f"target module {target!r} is not one of Kiln's LoRA projections "
                             f"{list(PROJECTIONS)}")
        targets.extend(match)
    return tuple(p for p in PROJECTIONS if p in targets)


def read_adapter_config(directory) -> LoraConfig:
    """The LoraConfig an adapter directory describes; ValueError for what Kiln cannot load."""
    path = Path(directory) / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist")
    config = json.loads(path.read_text(encoding="utf-8"))
    if config.get("peft_type") != "LORA":
        raise ValueError(f"{path}: peft_type {config.get('peft_type')!r} is not 'LORA'")
    if config.get("task_type") not in (None, "CAUSAL_LM"):
        raise ValueError(f"{path}: task_type {config.get('task_type')!r} is not 'CAUSAL_LM'")
    if config.get("bias", "none") != "none":
        raise ValueError(f"{path}: bias {config['bias']!r} is not supported (Kiln trains no biases)")
    for key, default in _UNSUPPORTED.items():
        value = config.get(key)
        if value is not None and value != default and value not in ([], {}):
            raise ValueError(f"{path}: {key}={value!r} is not supported by Kiln's LoRA")
    try:
        return LoraConfig(rank=config["r"], alpha=config["lora_alpha"],
                          targets=_targets(config["target_modules"]),
                          use_rslora=bool(config.get("use_rslora", False)))
    except KeyError as exc:
        raise ValueError(f"{path}: lacks {exc.args[0]}") from None


def _expected_shapes(model, lora: LoraConfig) -> dict:
    c = model.config
    C, F, H, KV, D = (c.model_width, c.feed_forward_width, c.head_count, c.kv_heads,
                      c.head_dimension)
    io = {"q_proj": (C, H * D), "k_proj": (C, KV * D), "v_proj": (C, KV * D), "o_proj": (H * D, C),
          "gate_proj": (C, F), "up_proj": (C, F), "down_proj": (F, C)}  # (in, out)
    shapes = {}
    for i in range(c.block_count):
        for p in lora.targets:
            name = f"model.layers.{i}.{_MODULE[p]}"
            features_in, features_out = io[p]
            shapes[f"{name}.lora_A.weight"] = (lora.rank, features_in)
            shapes[f"{name}.lora_B.weight"] = (features_out, lora.rank)
    return shapes


def _describe_difference(attached: LoraConfig, adapter: LoraConfig) -> str:
    parts = []
    if attached.rank != adapter.rank:
        parts.append(f"rank {adapter.rank} (adapter) vs {attached.rank} (model)")
    if float(attached.alpha) != float(adapter.alpha):
        parts.append(f"alpha {adapter.alpha} (adapter) vs {attached.alpha} (model)")
    if attached.use_rslora != adapter.use_rslora:
        parts.append(f"use_rslora {adapter.use_rslora} (adapter) vs {attached.use_rslora} (model)")
    if attached.targets != adapter.targets:
        parts.append(f"targets {list(adapter.targets)} (adapter) vs {list(attached.targets)} (model)")
    return "; ".join(parts)


def import_adapter(model, directory) -> LoraConfig:
    """Load a PEFT LoRA adapter's weights into `model` (attaching its LoRA if none is attached).

    Refuses with a ValueError naming the difference when the attached LoRA has another
    rank, alpha, rsLoRA flag or target set, or when a tensor is missing, unexpected or
    of another shape (an adapter trained over another base). Nothing changes before all
    checks pass. Returns the adapter's LoraConfig.
    """
    directory = Path(directory)
    adapter = read_adapter_config(directory)
    attached = model.lora_config
    if attached is not None:
        difference = _describe_difference(attached, adapter)
        if difference:
            raise ValueError(f"{directory}: the adapter does not fit the attached LoRA: {difference}")
    weights_path = directory / WEIGHTS_FILE
    if not weights_path.is_file():
        raise FileNotFoundError(f"{weights_path} does not exist")
    file = SafetensorsFile(weights_path)
    try:
        names = {}
        for key in file.names:
            name = key[len(PREFIX):] if key.startswith(PREFIX) else key
            names[name.replace(".lora_A.default.weight", ".lora_A.weight")
                  .replace(".lora_B.default.weight", ".lora_B.weight")] = key
        expected = _expected_shapes(model, adapter)
        missing = [n for n in expected if n not in names]
        unknown = sorted(set(names) - set(expected))
        if missing or unknown:
            raise ValueError(f"{weights_path}: the tensors do not match this model's LoRA layout: "
                             f"missing {missing[:3]}, unexpected {unknown[:3]}")
        for name, shape in expected.items():
            actual = file.info(names[name])[1]
            if actual != shape:
                raise ValueError(f"{weights_path}: {name} has shape {list(actual)}, this model needs "
                                 f"{list(shape)}; the adapter was trained over another base")
        values = {name: file.float32(names[name]) for name in expected}
    finally:
        file.close()
    for name, value in values.items():
        if not np.all(np.isfinite(value)):
            raise ValueError(f"{weights_path}: {name} holds non-finite values")
    if attached is None:
        model.attach_lora(adapter)
    model.load_adapter_state_dict(values)
    return adapter


def publish_final_adapter(model, registry, adapter: str, base_model_name_or_path=None) -> dict:
    """Publish the trained adapter as the PEFT snapshot `registry/adapter`, atomically.

    The snapshot is built in a hidden sibling directory and renamed into place; an
    older snapshot of the same adapter is swapped out only after the new one is
    complete. Returns {"path", "adapter_sha256", "config_sha256"}. A PEFT snapshot holds
    weights only: it is never accepted as a resume checkpoint.
    """
    registry = Path(registry)
    target = registry / adapter
    staging = registry / f".staging-final-{adapter}-{uuid.uuid4().hex[:12]}"
    export_adapter(model, staging, base_model_name_or_path)
    retired = None
    try:
        if target.exists():
            retired = registry / f".retired-{adapter}-{uuid.uuid4().hex[:12]}"
            os.rename(target, retired)
        os.rename(staging, target)
        fsync_directory(registry)
    except BaseException:
        if retired is not None and not target.exists():
            os.rename(retired, target)
        discard(staging)
        raise
    if retired is not None:
        discard(retired)
    return {"path": str(target),
            "adapter_sha256": hashlib.sha256((target / WEIGHTS_FILE).read_bytes()).hexdigest(),
            "config_sha256": hashlib.sha256((target / CONFIG_FILE).read_bytes()).hexdigest()}
