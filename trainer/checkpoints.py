"""TrainingCheckpoint: the exact, versioned .riftckpt archive of one Adam run.

A run is dense FP32 full-parameter training, LoRA (an adapter-only Adam over a frozen
FP32 base) or QLoRA (the same over packed NF4 Linear bases). A checkpoint holds
everything that decides the next step: the model configuration and execution policies,
every FP32 base parameter by name, the LoRA configuration and adapter values, the exact
packed NF4 nibbles and scales of each quantized weight, Adam's hyperparameters, step,
beta powers and both moments, the global step, the process-wide Python random state, the
batch source's checkpoint state and user metadata. On disk it is a ZIP with one
canonical `manifest.json` and one raw little-endian member per array; nothing is pickled.
Loading validates the whole archive before it returns, and `restore()` validates
compatibility before it changes anything, then commits transactionally (batch source,
FP32 base, packed bases, adapters, Adam, Python random state) and rolls back in reverse
order on failure. A packed base is never dequantized. The format is described in
docs/checkpoints.md.

This module holds `TrainingCheckpoint` (capture, save, load, restore) and is the format's
public face; checkpoint_format (constants, errors, layouts, field checks), checkpoint_manifest
(building and validating the manifest) and checkpoint_archive (the ZIP) do the rest, over
trainer.fsio and trainer.jsonio.
"""

import copy
import json
import os
import random
from dataclasses import dataclass, fields

from trainer import fsio
from trainer.checkpoint_archive import (
    _check_contents, _load_v1, _load_v2, _open_archive, _read_manifest, _write_zip)
from trainer.checkpoint_format import (  # the format's public names are read from here too
    BUILTIN_SOURCE_KINDS, EXACT_POWER_STEPS, FORMAT_VERSION, MANIFEST, MAX_DIMENSIONS, MAX_INFLATION, MAX_INT,
    MAX_MANIFEST_BYTES, MAX_MANIFEST_DEPTH, READABLE_VERSIONS, SCHEMA, ZIP64_THRESHOLD, ZIP_TIMESTAMP,
    CheckpointError, IndeterminateStateError, adapter_signature, checkpoint_id, member_name, parameter_signature,
    quantized_signature, v1_member_name)
from trainer.checkpoint_format import (
    _ARCHITECTURE, _FREE_CONFIG_FIELDS, _HYPERPARAMETERS, _LORA_IDENTITY, _MOMENTS, _POLICIES, _integer,
    _plain_json, _source_state)
from trainer.checkpoint_manifest import (
    _build_manifest, _nf4_tensors, _validate_manifest)
from trainer.config import TransformerConfig
from trainer.lora import LoraConfig
from trainer.training import random_state_from_json, random_state_to_json

__all__ = [
    "BUILTIN_SOURCE_KINDS", "EXACT_POWER_STEPS", "FORMAT_VERSION", "MANIFEST", "MAX_DIMENSIONS", "MAX_INFLATION",
    "MAX_INT", "MAX_MANIFEST_BYTES", "MAX_MANIFEST_DEPTH", "READABLE_VERSIONS", "SCHEMA", "ZIP64_THRESHOLD",
    "ZIP_TIMESTAMP", "CheckpointError", "IndeterminateStateError", "RestoreResult", "TrainingCheckpoint",
    "adapter_signature", "checkpoint_id", "member_name", "parameter_signature", "quantized_signature",
    "v1_member_name",
]


@dataclass(frozen=True)
class RestoreResult:
    checkpoint_id: str
    format_version: int  # the version of the archive the checkpoint was read from
    global_step: int
    optimizer_step: int
    metadata: dict



class TrainingCheckpoint:
    """The exact state of one Adam run (dense, LoRA or QLoRA); build with capture() or load()."""

    def __init__(self, manifest, arrays, config, lora, format_version):
        self._manifest = manifest  # validated v2 manifest, checkpoint_id included
        self._arrays = arrays  # {member: read-only little-endian array}
        self._config = config
        self._lora = lora  # the archived LoraConfig, or None for dense training
        self._format_version = format_version

    # -- read-only view ---------------------------------------------------------------

    @property
    def checkpoint_id(self) -> str:
        return self._manifest["checkpoint_id"]

    @property
    def format_version(self) -> int:
        return self._format_version

    @property
    def config(self) -> TransformerConfig:
        return self._config

    @property
    def lora_config(self) -> LoraConfig | None:
        """The archived LoRA configuration (its initializer seed included), or None."""
        return self._lora

    @property
    def quantized(self) -> bool:
        """Whether the archive holds packed NF4 Linear bases (QLoRA)."""
        return self._manifest["quantization"] is not None

    @property
    def global_step(self) -> int:
        return self._manifest["training"]["global_step"]

    @property
    def optimizer_step(self) -> int:
        return self._manifest["optimizer"]["step"]

    @property
    def metadata(self) -> dict:
        return copy.deepcopy(self._manifest["metadata"])

    @property
    def source_state(self) -> dict | None:
        source = self._manifest["source"]
        return None if source is None else copy.deepcopy(source["state"])

    @property
    def parameter_names(self) -> tuple:
        """The FP32 base parameters' names (packed NF4 weights are listed under quantization)."""
        return tuple(e["name"] for e in self._manifest["model"]["parameters"])

    def manifest(self) -> dict:
        """A copy of the v2 manifest (what save() writes as manifest.json)."""
        return copy.deepcopy(self._manifest)

    def _section(self, section):
        """{name: read-only array} of "model", "adapter", "first_moment" or "second_moment"."""
        if section == "model":
            entries = self._manifest["model"]["parameters"]
        elif section == "adapter":
            entries = self._manifest["adapter"]["parameters"]
        else:
            entries = self._manifest["optimizer"][section]
        return {e["name"]: self._arrays[e["member"]] for e in entries}

    # -- capture --------------------------------------------------------------------------

    @classmethod
    def capture(cls, model, optimizer, *, source, global_step, metadata=None):
        """Copy the state of `model`, its `optimizer` and `source` at a clean step boundary."""
        refused = "capture refused"
        if getattr(optimizer, "model", None) is not model:
            raise CheckpointError(f"{refused}: the optimizer belongs to a different model "
                                  f"instance (optimizer.model is not model)")
        lora = getattr(model, "lora_config", None)
        quantized = getattr(model, "quantization", None) is not None
        _check_optimizer_owns(model, optimizer, lora, refused,
                              "the model has no LoRA adapter" if lora is None
                              else "the model has a LoRA adapter attached")
        if quantized and lora is None:  # quantize() freezes the base; Adam could own nothing
            raise CheckpointError(f"{refused}: the model has a quantized (NF4) base but no LoRA "
                                  f"adapter; attach_lora before training")
        if model.gradient_pending or optimizer.gradient_pending:
            raise CheckpointError(f"{refused}: a gradient is pending; call optimizer.step() "
                                  f"or optimizer.zero_gradients() first (an exactly-zero gradient "
                                  f"is still pending)")
        _integer(global_step, f"{refused}: global_step")
        metadata = {} if metadata is None else metadata
        if not isinstance(metadata, dict):
            raise CheckpointError(f"{refused}: metadata must be a dict, got "
                                  f"{type(metadata).__name__}")
        metadata = _plain_json(metadata, f"{refused}: metadata")
        source_state = None
        if source is not None:
            _check_source_protocol(source, refused)
            try:
                state = source.checkpoint_state()
            except Exception as error:
                raise CheckpointError(f"{refused}: {type(source).__name__}."
                                      f"checkpoint_state() failed: {error}") from error
            source_state = _source_state(_plain_json(state, f"{refused}: source state"),
                                         f"{refused}: source state")
        try:
            values = _fp32_base_state(model)
            adapters = None if lora is None else model.adapter_state_dict()
            packed = None if not quantized else model.packed_state()
            adam = optimizer.state_dict()
        except RuntimeError as error:  # a closed model or optimizer
            raise CheckpointError(f"{refused}: {error}") from error
        names = list(values if lora is None else adapters)
        for key in _MOMENTS:
            if list(adam[key]) != names:
                raise CheckpointError(f"{refused}: Adam's {key} names do not match the model's "
                                      f"{'base' if lora is None else 'adapter'} parameters")
        manifest, arrays = _build_manifest(
            config=model.config, values=values, adam=adam, global_step=global_step,
            random_state=random_state_to_json(random.getstate()), source_state=source_state,
            metadata=metadata, lora=lora, adapters=adapters, packed=packed)
        try:
            config, lora = _validate_manifest(manifest)
            _check_contents(manifest, arrays, refused)
        except CheckpointError as error:
            raise CheckpointError(f"{refused}: {error}") from None
        checkpoint = cls(manifest, arrays, config, lora, FORMAT_VERSION)
        size = len(checkpoint.manifest_bytes())
        if size > MAX_MANIFEST_BYTES:
            raise CheckpointError(f"{refused}: the manifest would be {size} bytes, more than "
                                  f"the {MAX_MANIFEST_BYTES} a reader accepts (large metadata?)")
        return checkpoint

    # -- save and load --------------------------------------------------------------------

    def manifest_bytes(self) -> bytes:
        return json.dumps(self._manifest, sort_keys=True, indent=1, ensure_ascii=True,
                          allow_nan=False).encode("ascii") + b"\n"

    def save(self, path):
        """Write the archive beside `path`, fsync it, then atomically replace `path`."""
        path = os.fspath(path)
        directory = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(directory):
            raise CheckpointError(f"cannot save {path}: directory {directory} does not exist")
        try:
            fsio.publish_file(path, self._write_zip)
        except OSError as error:
            raise CheckpointError(f"cannot save {path}: {error}") from error

    def _write_zip(self, handle):
        _write_zip(handle, self.manifest_bytes(), self._manifest, self._arrays)

    @classmethod
    def load(cls, path):
        """Read and fully validate an archive (format 2 or dense format 1)."""
        path = os.fspath(path)
        return cls._from_archive(_open_archive(path), path)

    @classmethod
    def from_bytes(cls, data, name="<bytes>"):
        """load() of an archive already in memory; `name` stands for the path in refusals."""
        return cls._from_archive(_open_archive(name, data), name)

    @classmethod
    def _from_archive(cls, opened, path):
        with opened as archive:
            manifest = _read_manifest(archive, path)
            if not isinstance(manifest, dict):
                raise CheckpointError(f"checkpoint {path}: {MANIFEST} must be a JSON object")
            if manifest.get("schema") != SCHEMA:
                raise CheckpointError(f"checkpoint {path}: {MANIFEST}: schema is "
                                      f"{manifest.get('schema')!r}, expected {SCHEMA!r}")
            version = manifest.get("format_version")
            if version == 2:
                config, lora, arrays = _load_v2(archive, path, manifest)
            elif version == 1:
                config, lora, manifest, arrays = _load_v1(archive, path, manifest)
            else:
                raise CheckpointError(f"checkpoint {path}: {MANIFEST}: format_version "
                                      f"{version!r} is not readable; this version reads "
                                      f"{list(READABLE_VERSIONS)}")
        return cls(manifest, arrays, config, lora, version)

    # -- restore ----------------------------------------------------------------------------

    def restore(self, model, optimizer, source=None) -> RestoreResult:
        """Replace the state of fresh, compatible objects; all or nothing."""
        prior = self._check_restore(model, optimizer, source)
        adam = {"step": self.optimizer_step,
                "beta1_power": self._manifest["optimizer"]["beta1_power"],
                "beta2_power": self._manifest["optimizer"]["beta2_power"],
                "hyperparameters": dict(self._manifest["optimizer"]["hyperparameters"]),
                "first_moment": self._section("first_moment"),
                "second_moment": self._section("second_moment")}
        values = self._section("model")
        random_state = random_state_from_json(self._manifest["training"]["python_random_state"])
        steps = []  # (what, apply, undo): the source callback runs before the Adam commit
        if source is not None:
            steps.append(("batch source",
                          lambda: source.restore_checkpoint_state(self.source_state),
                          lambda: source.restore_checkpoint_state(copy.deepcopy(prior.source))))
        steps.append(("model parameters", lambda: model.load_state_dict(values),
                      lambda: model.load_state_dict(prior.values)))
        if self.quantized:
            packed = self._packed_tensors()  # fresh NF4 tensors over copies of the archived bytes
            steps.append(("packed NF4 bases", lambda: model.load_packed_state(packed),
                          lambda: model.load_packed_state(prior.packed)))
        if self._lora is not None:
            adapters = self._section("adapter")
            steps.append(("LoRA adapter values", lambda: model.load_adapter_state_dict(adapters),
                          lambda: model.load_adapter_state_dict(prior.adapters)))
        steps += [
            ("Adam state", lambda: optimizer.load_state_dict(adam),
             lambda: optimizer.load_state_dict(prior.adam)),
            ("Python random state", lambda: random.setstate(random_state),
             lambda: random.setstate(prior.random)),
        ]
        started = []
        for what, apply, undo in steps:
            started.append((what, undo))  # a failed step may have changed part of its state
            try:
                apply()
            except BaseException as error:
                self._roll_back(started, prior.random, what, error)
                if not isinstance(error, Exception):
                    raise
                raise CheckpointError(
                    f"restore failed while restoring the {what}: {type(error).__name__}: {error}; "
                    f"rolled back: model, optimizer, batch source and Python random state are as "
                    f"before") from error
        return RestoreResult(checkpoint_id=self.checkpoint_id, format_version=self.format_version,
                             global_step=self.global_step, optimizer_step=self.optimizer_step,
                             metadata=self.metadata)

    @staticmethod
    def _roll_back(started, prior_random, failed, error):
        failures = []
        for what, undo in reversed(started):
            try:
                undo()
            except BaseException as undo_error:  # keep undoing the rest
                failures.append(f"{what} ({type(undo_error).__name__}: {undo_error})")
        random.setstate(prior_random)  # a custom callback may have drawn from it
        if failures:
            raise IndeterminateStateError(
                f"restore failed while restoring the {failed} ({type(error).__name__}: {error}) "
                f"and rolling back failed for: {'; '.join(failures)}. Live state is indeterminate: "
                f"discard these objects and construct fresh ones") from error

    def _check_restore(self, model, optimizer, source):
        """Every compatibility check; returns the snapshots for rollback. Mutates nothing."""
        refused = "restore refused"
        if getattr(optimizer, "model", None) is not model:
            raise CheckpointError(f"{refused}: the optimizer belongs to a different model instance; "
                                  f"construct Adam from `with model.parameters()` (or "
                                  f"`model.adapter_parameters()`) of this model")
        config = getattr(model, "config", None)
        if not isinstance(config, TransformerConfig):
            raise CheckpointError(f"{refused}: the model has no TransformerConfig")
        self._check_structure(model, refused)
        _check_optimizer_owns(model, optimizer, self._lora, refused,
                              "the checkpoint holds base-parameter Adam state" if self._lora is None
                              else "the checkpoint holds LoRA adapter Adam state")
        self._check_config(config, refused)
        hyper, live_hyper = self._manifest["optimizer"]["hyperparameters"], optimizer.hyperparameters()
        drift = [f"{k}: checkpoint {hyper[k]!r}, optimizer {live_hyper.get(k)!r}"
                 for k in _HYPERPARAMETERS if hyper[k] != live_hyper.get(k)]
        if drift:
            raise CheckpointError(f"{refused}: Adam hyperparameters differ: " + "; ".join(drift))
        if model.gradient_pending or optimizer.gradient_pending:
            raise CheckpointError(f"{refused}: the target has a pending gradient; call "
                                  f"optimizer.step() or optimizer.zero_gradients() first")
        archived_source = self._manifest["source"]
        if archived_source is None and source is not None:
            raise CheckpointError(
                f"{refused}: the checkpoint was captured with source=None (format "
                f"v{self.format_version}) and holds no data position, but a "
                f"{type(source).__name__} was given; restore with source=None")
        if archived_source is not None and source is None:
            raise CheckpointError(
                f"{refused}: the checkpoint holds batch-source state (data position and RNG) but "
                f"source=None was given; pass a source built over the same data and settings")
        try:
            prior = _Prior(values=_fp32_base_state(model),
                           adapters=None if self._lora is None else model.adapter_state_dict(),
                           packed=None if not self.quantized else dict(model.packed_state()),
                           adam=optimizer.state_dict(), source=None, random=None)
        except RuntimeError as error:  # closed objects
            raise CheckpointError(f"{refused}: {error}") from error
        sections = [("parameters", prior.values, self._manifest["model"]["parameters"])]
        if self._lora is not None:
            sections.append(("adapters", prior.adapters, self._manifest["adapter"]["parameters"]))
        if self.quantized:
            sections.append(("packed NF4 weights", prior.packed,
                             self._manifest["quantization"]["weights"]))
        for what, live_state, entries in sections:
            archived = [(e["name"], tuple(e["shape"])) for e in entries]
            live = [(name, tuple(value.shape)) for name, value in live_state.items()]
            if live != archived:
                raise CheckpointError(f"{refused}: the model's {what} do not match the checkpoint "
                                      f"(names or shapes); checkpoint {len(archived)}, model "
                                      f"{len(live)}")
        if source is not None:
            _check_source_protocol(source, refused)
            try:
                prior.source = copy.deepcopy(source.checkpoint_state())
            except Exception as error:
                raise CheckpointError(f"{refused}: {type(source).__name__}.checkpoint_state() "
                                      f"failed: {error}") from error
            _check_source_match(archived_source["state"], prior.source, refused)
        prior.random = random.getstate()
        return prior

    def _check_structure(self, model, refused):
        """Adapter and quantization presence, then the LoRA shape identity."""
        live_lora = getattr(model, "lora_config", None)
        live_quantization = getattr(model, "quantization", None)
        if self._lora is None and live_lora is not None:
            raise CheckpointError(f"{refused}: the checkpoint is dense (adapter: null) but the "
                                  f"model has a LoRA adapter attached; restore into a model "
                                  f"without attach_lora")
        if self._lora is not None and live_lora is None:
            raise CheckpointError(
                f"{refused}: the checkpoint holds a LoRA adapter ({_describe_lora(self._lora)}) "
                f"but the model has none; attach_lora with the same rank, alpha, targets and "
                f"use_rslora before constructing Adam over model.adapter_parameters()")
        if not self.quantized and live_quantization is not None:
            raise CheckpointError(f"{refused}: the checkpoint has an FP32 base (quantization: "
                                  f"null) but the model has a quantized (NF4) base; restore into "
                                  f"a model without quantize()")
        if self.quantized and live_quantization is None:
            raise CheckpointError(f"{refused}: the checkpoint holds packed NF4 (QLoRA) bases but "
                                  f"the model is not quantized; call model.quantize() (any block "
                                  f"size or scale encoding) before attach_lora")
        if self._lora is not None:
            archived, live = self._lora.shape_identity(), live_lora.shape_identity()
            drift = [f"{k}: checkpoint {archived[k]!r}, model {live[k]!r}"
                     for k in _LORA_IDENTITY if archived[k] != live[k]]
            if drift:
                raise CheckpointError(f"{refused}: the LoRA configuration differs from the "
                                      f"checkpoint: " + "; ".join(drift)
                                      + " (only initializer_seed may differ)")

    def _check_config(self, config, refused):
        """The whole TransformerConfig must match; only the initializer seed may differ."""
        archived = self._config
        drift = [f"{k}: checkpoint {getattr(archived, k)!r}, model {getattr(config, k)!r}"
                 for k in _ARCHITECTURE if getattr(archived, k) != getattr(config, k)]
        if drift:
            raise CheckpointError(f"{refused}: the model architecture differs from the checkpoint: "
                                  + "; ".join(drift))
        for key in _POLICIES:
            if getattr(archived, key) != getattr(config, key):
                raise CheckpointError(f"{refused}: {key} differs: checkpoint "
                                      f"{getattr(archived, key)!r}, model "
                                      f"{getattr(config, key)!r}; construct the model with the "
                                      f"archived policy")
        checked = set(_ARCHITECTURE + _POLICIES + _FREE_CONFIG_FIELDS)
        drift = [f"{f.name}: checkpoint {getattr(archived, f.name)!r}, model "
                 f"{getattr(config, f.name)!r}" for f in fields(TransformerConfig)
                 if f.name not in checked and getattr(archived, f.name) != getattr(config, f.name)]
        if drift:
            raise CheckpointError(f"{refused}: the model configuration differs from the "
                                  f"checkpoint: " + "; ".join(drift)
                                  + " (only initializer_seed may differ)")

    def _packed_tensors(self):
        return _nf4_tensors(self._manifest["quantization"], self._arrays)


@dataclass
class _Prior:
    """What restore() snapshots before it changes anything, for rollback."""
    values: dict  # FP32 base values by name (never a dequantized copy of a packed base)
    adapters: dict | None
    packed: dict | None  # {name: NF4 tensor}: the model's own objects, replaced not mutated
    adam: dict
    source: dict | None
    random: tuple | None


def _fp32_base_state(model):
    """{name: copy} of the base parameters that hold FP32 values; packed bases are skipped.

    model.state_dict() would dequantize packed bases into full FP32 copies.
    """
    return {p.name: p.value.copy() for p in model.parameters() if p.value is not None}


def _describe_lora(lora):
    identity = lora.shape_identity()
    return ", ".join(f"{k} {identity[k]!r}" for k in _LORA_IDENTITY)


def _check_optimizer_owns(model, optimizer, lora, refused, reason):
    """Adam owns the base list of a dense model, or the complete adapter list of a LoRA model."""
    kind = getattr(optimizer, "parameter_kind", None)
    expected = "base" if lora is None else "adapter"
    if kind != expected:
        raise CheckpointError(
            f"{refused}: {reason}, so Adam must own model."
            f"{'parameters' if lora is None else 'adapter_parameters'}(); this optimizer owns "
            f"{kind!r} parameters")
    if lora is not None:
        try:
            complete = [id(p) for p in model.adapter_parameters()]
        except (RuntimeError, ValueError) as error:
            raise CheckpointError(f"{refused}: {error}") from error
        if [id(p) for p in getattr(optimizer, "parameters", ())] != complete:
            raise CheckpointError(f"{refused}: Adam must own the complete, ordered "
                                  f"model.adapter_parameters() list of this model")


def _check_source_protocol(source, refused):
    missing = [m for m in ("checkpoint_state", "restore_checkpoint_state")
               if not callable(getattr(source, m, None))]
    if missing:
        raise CheckpointError(f"{refused}: {type(source).__name__} does not implement the batch-"
                              f"source checkpoint protocol (missing {', '.join(missing)}); pass a "
                              f"checkpointable source, or source=None to omit the data position")


def _check_source_match(archived, live, refused):
    """The parts of a source state that must agree before the source is asked to restore."""
    if not isinstance(live, dict):
        raise CheckpointError(f"{refused}: the source's checkpoint_state() is not an object")
    if set(archived) != set(live):
        raise CheckpointError(f"{refused}: batch-source state fields differ: checkpoint "
                              f"{sorted(archived)}, source {sorted(live)}")
    if archived.get("kind") != live.get("kind"):
        raise CheckpointError(f"{refused}: batch-source kind differs: checkpoint "
                              f"{archived.get('kind')!r}, source {live.get('kind')!r}")
    if archived.get("fingerprint") != live.get("fingerprint"):
        raise CheckpointError(
            f"{refused}: data fingerprint mismatch: checkpoint {archived.get('fingerprint')}, "
            f"source {live.get('fingerprint')} (different tokens/examples or batch_size, "
            f"context_size, random_seed, shuffle, pad_token)")
