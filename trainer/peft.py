"""PEFT interchange: a Kiln LoRA adapter as a `peft` adapter directory, and back.

A directory holds adapter_config.json (peft's LoraConfig fields) and
adapter_model.safetensors with keys `base_model.model.<Kiln parameter name>`, e.g.
`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight` ([r, in]) and
`...lora_B.weight` ([out, r]); Kiln's parameter names are already Hugging Face's. An
exported adapter loads with `peft.PeftModel.from_pretrained` over the same base and
gives Kiln's logits. Import is a weights-only warm start: it attaches the adapter's
LoRA when the model has none, refuses anything that does not fit, and changes nothing
until every check has passed.

Phi-3 keeps q/k/v in one `qkv_proj` and gate/up in one `gate_up_proj`; Kiln splits them on
import and trains one adapter per projection. Its export re-fuses them as peft sees the
model: the fused module's lora_A stacks the members' A ([m*r, in]) and its lora_B places each
member's B in that member's rows and rank columns (block-diagonal, zeros elsewhere), with
`rank_pattern` m*r and `alpha_pattern` keeping each member's scaling, so peft computes exactly
Kiln's function. Which members a fused adapter holds is written in the weights file's
metadata ("kiln.fused"); import splits such an adapter back and refuses one whose lora_B is
not block-diagonal (trained fused by peft), which per-projection adapters cannot represent.
"""

import hashlib
import json
import math
import os
import uuid
from pathlib import Path

import numpy as np

from trainer.lora import ATTENTION, PROJECTIONS, LoraConfig
from trainer.tensorfiles import (SafetensorsFile, discard, fsync_directory, publish_directory, safetensors_bytes,
                                 staging_directory, write_synced)

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
ADAPTER_FILES = (CONFIG_FILE, WEIGHTS_FILE)  # what a PEFT adapter directory holds, all that Kiln reads of it
PREFIX = "base_model.model."
_MODULE = {p: ("self_attn." if p in ATTENTION else "mlp.") + p for p in PROJECTIONS}
# peft LoraConfig fields whose non-default values change the function Kiln would compute
_UNSUPPORTED = {"use_dora": False, "lora_bias": False, "fan_in_fan_out": False,
                "layers_to_transform": None, "layers_pattern": None, "modules_to_save": None,
                "rank_pattern": {}, "alpha_pattern": {}, "layer_replication": None,
                "exclude_modules": None, "trainable_token_indices": None, "target_parameters": None,
                "use_qalora": False}
# Phi-3's fused modules: (module path, members in row order)
FUSED = {"qkv_proj": ("self_attn.qkv_proj", ("q_proj", "k_proj", "v_proj")),
         "gate_up_proj": ("mlp.gate_up_proj", ("gate_proj", "up_proj"))}
FUSED_METADATA = "kiln.fused"


def _fused_groups(family, targets) -> dict:
    """{fused module: targeted members} for a family that fuses projections (Phi-3), else {}."""
    if family != "phi3":
        return {}
    groups = {module: tuple(m for m in members if m in targets) for module, (_, members) in FUSED.items()}
    return {module: members for module, members in groups.items() if members}


def _member_rows(config, module) -> dict:
    """{member: row slice} of a fused module's output."""
    H, KV, D, F = config.head_count, config.kv_heads, config.head_dimension, config.feed_forward_width
    if module == "qkv_proj":
        return {"q_proj": slice(0, H * D), "k_proj": slice(H * D, (H + KV) * D),
                "v_proj": slice((H + KV) * D, (H + 2 * KV) * D)}
    return {"gate_proj": slice(0, F), "up_proj": slice(F, 2 * F)}


def _fused_alpha(lora, members) -> float:
    """The alpha that keeps a member's scaling at rank len(members) * r."""
    m = len(members)
    return float(lora.alpha * (math.sqrt(m) if lora.use_rslora else m))


def adapter_config(lora: LoraConfig, base_model_name_or_path=None, family="llama") -> dict:
    """The adapter_config.json `peft` reads for a Kiln LoraConfig (over a base of `family`)."""
    fused = _fused_groups(family, lora.targets)
    if fused:
        config = adapter_config(lora, base_model_name_or_path)
        members = {m for group in fused.values() for m in group}
        config["target_modules"] = sorted([t for t in lora.targets if t not in members] + list(fused))
        config["rank_pattern"] = {module: len(group) * lora.rank for module, group in fused.items()}
        config["alpha_pattern"] = {module: _fused_alpha(lora, group) for module, group in fused.items()}
        return config
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
    family = model.config.family
    config = adapter_config(model.lora_config, base_model_name_or_path, family)
    tensors, metadata = _export_tensors(model, _fused_groups(family, model.lora_config.targets))
    staging = staging_directory(directory)
    try:
        write_synced(staging / CONFIG_FILE,
                     (json.dumps(config, indent=2, sort_keys=True) + "\n").encode("utf-8"))
        write_synced(staging / WEIGHTS_FILE, safetensors_bytes(tensors, metadata=metadata))
        if directory.exists():
            directory.rmdir()  # empty, checked above; rename needs the name free
        publish_directory(staging, directory)
    except BaseException:
        discard(staging)
        raise
    return directory


def _export_tensors(model, fused) -> tuple:
    """({file key: array}, safetensors metadata): per projection, or re-fused for Phi-3."""
    state = model.adapter_state_dict()
    if not fused:
        return {PREFIX + name: value for name, value in state.items()}, {"format": "pt"}
    r = model.lora_config.rank
    members = {m for group in fused.values() for m in group}
    tensors = {PREFIX + name: value for name, value in state.items()
               if name.split(".")[-3] not in members}
    for i in range(model.config.block_count):
        for module, group in fused.items():
            path, _ = FUSED[module]
            rows = _member_rows(model.config, module)
            parent = path.split(".")[0]
            names = [f"model.layers.{i}.{parent}.{m}" for m in group]
            A = np.concatenate([state[n + ".lora_A.weight"] for n in names])  # [m*r, in]
            B = np.zeros((max(s.stop for s in rows.values()), len(group) * r), np.float32)  # [out, m*r]
            for j, (member, name) in enumerate(zip(group, names)):
                B[rows[member], j * r:(j + 1) * r] = state[name + ".lora_B.weight"]
            tensors[f"{PREFIX}model.layers.{i}.{path}.lora_A.weight"] = A
            tensors[f"{PREFIX}model.layers.{i}.{path}.lora_B.weight"] = B
    metadata = {"format": "pt", FUSED_METADATA: json.dumps({k: list(v) for k, v in fused.items()}, sort_keys=True)}
    return dict(sorted(tensors.items())), metadata


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


def _recorded_fusion(directory) -> dict:
    """{fused module: members} a Kiln export wrote in the weights file's metadata ({} if none)."""
    weights = Path(directory) / WEIGHTS_FILE
    if not weights.is_file():
        return {}
    file = SafetensorsFile(weights)
    try:
        recorded = (file.metadata or {}).get(FUSED_METADATA)
    finally:
        file.close()
    return json.loads(recorded) if recorded else {}


def _unfused_config(config, path, recorded) -> dict:
    """A Phi-3 adapter_config with its fused modules replaced by their member projections.

    A fused module's rank must be (members) * r and its alpha keep each member's scaling, as
    Kiln's export writes them; anything else was trained fused and cannot be split.
    """
    targets = config.get("target_modules")
    if not isinstance(targets, list):
        return config
    rank, alpha = config.get("r"), config.get("lora_alpha")
    lora = LoraConfig(rank=rank, alpha=alpha, use_rslora=bool(config.get("use_rslora", False)))
    rank_pattern = dict(config.get("rank_pattern") or {})
    alpha_pattern = dict(config.get("alpha_pattern") or {})
    unfused = []
    for target in targets:
        module = str(target).split(".")[-1]
        if module not in FUSED:
            unfused.append(target)
            continue
        members = tuple(recorded.get(module) or FUSED[module][1])
        got_rank, got_alpha = rank_pattern.pop(module, rank), alpha_pattern.pop(module, alpha)
        if got_rank != len(members) * rank or not math.isclose(got_alpha, _fused_alpha(lora, members)):
            raise ValueError(f"{path}: the {module} adapter (rank {got_rank}, alpha {got_alpha}) was trained "
                             f"fused; Kiln trains one adapter per projection ({', '.join(members)}) and can "
                             f"load a fused one only as its export writes it (rank {len(members) * rank})")
        unfused.extend(members)
    return {**config, "target_modules": unfused, "rank_pattern": rank_pattern, "alpha_pattern": alpha_pattern}


def read_adapter_config(directory, family=None) -> LoraConfig:
    """The LoraConfig an adapter directory describes; ValueError for what Kiln cannot load.

    family: the base's (TransformerConfig.family); None reads fused Phi-3 module names when the
    adapter targets them (a caller that has not loaded the base yet).
    """
    path = Path(directory) / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist")
    config = json.loads(path.read_text(encoding="utf-8"))
    if family is None and isinstance(config.get("target_modules"), list):
        fused = any(str(t).split(".")[-1] in FUSED for t in config["target_modules"])
        family = "phi3" if fused else "llama"
    if family == "phi3" and config.get("peft_type") == "LORA":
        config = _unfused_config(config, path, _recorded_fusion(directory))
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


def check_rank_in_weights(directory, lora: LoraConfig) -> None:
    """ValueError unless the adapter's weights (their header alone) hold lora_A tensors of LORA's rank: r rows, or a
    multiple of r for a fused Phi-3 module. adapter_config.json's `r` sizes what a run allocates before it reads a
    weight, so a config whose r its tensors do not bear out (a hand-edited r of 2**40) is refused here, before
    the run, not by a MemoryError in it."""
    path = Path(directory) / WEIGHTS_FILE
    weights = SafetensorsFile(path)
    rows = [weights.info(name)[1][0] for name in weights.names if name.endswith(".lora_A.weight")]
    if not rows:
        raise ValueError(f"{path}: holds no lora_A tensor")
    most = max(len(members) for _, members in FUSED.values())  # a fused module stacks its members' A
    odd = sorted({count for count in rows if count % lora.rank or count // lora.rank > most})
    if odd:
        raise ValueError(f"{Path(directory) / CONFIG_FILE}: r={lora.rank}, but {path.name} has lora_A tensors of "
                         f"{odd[0]} rows: the weights do not bear out the configuration's rank")


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


def _split_fused(model, adapter, file, names, where) -> dict:
    """Phi-3: take each fused module's tensors out of `names` and return its members' {name: array}."""
    fused = _fused_groups(model.config.family, adapter.targets)
    r, split = adapter.rank, {}
    for i in range(model.config.block_count):
        for module, group in fused.items():
            path, _ = FUSED[module]
            base = f"model.layers.{i}.{path}"
            keys = [names.pop(f"{base}.lora_{part}.weight", None) for part in ("A", "B")]
            if None in keys:
                raise ValueError(f"{where}: the tensors do not match this model's LoRA layout: missing "
                                 f"{base}.lora_{'A' if keys[0] is None else 'B'}.weight")
            A, B = file.float32(keys[0]), file.float32(keys[1])
            rows = _member_rows(model.config, module)
            out = max(s.stop for s in rows.values())
            if A.shape[0] != len(group) * r or B.shape != (out, len(group) * r):
                raise ValueError(f"{where}: {base} has lora_A {list(A.shape)} and lora_B {list(B.shape)}; this "
                                 f"model needs [{len(group) * r}, in] and [{out}, {len(group) * r}]")
            inside = np.zeros(B.shape, bool)
            for j, member in enumerate(group):
                inside[rows[member], j * r:(j + 1) * r] = True
            if np.any(B[~inside] != 0):
                raise ValueError(f"{where}: {base}.lora_B is not block-diagonal over {', '.join(group)}: it was "
                                 "trained fused, and Kiln's per-projection adapters cannot represent it")
            parent = path.split(".")[0]
            for j, member in enumerate(group):
                name = f"model.layers.{i}.{parent}.{member}"
                split[name + ".lora_A.weight"] = np.ascontiguousarray(A[j * r:(j + 1) * r])
                split[name + ".lora_B.weight"] = np.ascontiguousarray(B[rows[member], j * r:(j + 1) * r])
    return split


def import_adapter(model, directory) -> LoraConfig:
    """Load a PEFT LoRA adapter's weights into `model` (attaching its LoRA if none is attached).

    Refuses with a ValueError naming the difference when the attached LoRA has another
    rank, alpha, rsLoRA flag or target set, or when a tensor is missing, unexpected or
    of another shape (an adapter trained over another base). Nothing changes before all
    checks pass. Returns the adapter's LoraConfig.
    """
    directory = Path(directory)
    adapter = read_adapter_config(directory, model.config.family)
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
        split = _split_fused(model, adapter, file, names, weights_path)
        expected = _expected_shapes(model, adapter)
        missing = [n for n in expected if n not in names and n not in split]
        unknown = sorted(set(names) - set(expected))
        if missing or unknown:
            raise ValueError(f"{weights_path}: the tensors do not match this model's LoRA layout: "
                             f"missing {missing[:3]}, unexpected {unknown[:3]}")
        for name, shape in expected.items():
            actual = split[name].shape if name in split else file.info(names[name])[1]
            if tuple(actual) != shape:
                raise ValueError(f"{weights_path}: {name} has shape {list(actual)}, this model needs "
                                 f"{list(shape)}; the adapter was trained over another base")
        values = {name: split[name] if name in split else file.float32(names[name]) for name in expected}
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
