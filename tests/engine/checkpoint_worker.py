"""The fresh-process half of the exact-continuation test, and the data both halves share.

Run as `python checkpoint_worker.py SPEC.json`: load the checkpoint named in the spec,
restore it into freshly constructed objects (a different initializer seed, the spec's
Adam storage, and for LoRA/QLoRA the spec's adapter seed, NF4 block size and scale
encoding), run the remaining steps one at a time and write the final state to the spec's
output folder (state.npz for arrays, state.json for everything else). The test imports
this file for `build_model`, `build_source` and `final_state`, so both processes build
identical data.
"""

import json
import random
import sys

import numpy as np

from trainer import Adam, DecoderOnlyTransformer, LoraConfig, TransformerConfig
from trainer.checkpoints import TrainingCheckpoint
from trainer.training import (
    CausalLanguageModelTrainer,
    ExampleWindowBatchSource,
    RandomWindowBatchSource,
    SequenceWindowBatchSource,
    TrainingLoopConfig,
    random_state_to_json,
)

VOCABULARY = 16


def token_stream(offset=0):
    tokens = np.random.default_rng(1234).integers(0, VOCABULARY, 240)
    return [int((t + offset) % VOCABULARY) for t in tokens]


def examples():
    rng = np.random.default_rng(99)
    items = [rng.integers(0, VOCABULARY, int(n)).tolist() for n in rng.integers(3, 12, 9)]
    masks = [[i >= len(item) // 3 for i in range(len(item))] for item in items]  # prompt, answer
    return items, masks


def build_source(spec, context_size):
    """spec: {"kind": "random"|"sequence"|"example", "seed": int, "token_offset": int}."""
    kind, seed = spec["kind"], spec["seed"]
    if kind == "random":
        return RandomWindowBatchSource(token_stream(spec.get("token_offset", 0)), batch_size=2,
                                       context_size=context_size, random_seed=seed)
    if kind == "sequence":
        return SequenceWindowBatchSource(token_stream(spec.get("token_offset", 0)), batch_size=3,
                                         context_size=context_size, random_seed=seed)
    if kind == "example":
        items, masks = examples()
        return ExampleWindowBatchSource(items, batch_size=2, context_size=context_size,
                                        random_seed=seed, pad_token=1, loss_masks=masks)
    raise ValueError(f"unknown source kind {kind!r}")


def build_model(config, lora=None, quantize=None):
    """A model; quantize: {"block_size", "double_quantization"} first, then lora (a dict)."""
    model = DecoderOnlyTransformer(config)
    if quantize is not None:
        model.quantize(**quantize)
    if lora is not None:
        model.attach_lora(LoraConfig.from_dict(lora))
    return model


def build_adam(model, storage):
    """Adam over the base, or over the complete adapter list once LoRA is attached."""
    parameters = model.parameters() if model.lora_config is None else model.adapter_parameters()
    return Adam(parameters, learning_rate=3e-3, beta1=0.85, beta2=0.99, weight_decay=0.01,
                state_storage=storage, page_size=100)  # 100: parameters straddle pages


def fp32_base(model):
    """{name: copy} of the FP32 base values; packed NF4 weights are not dequantized."""
    return {p.name: p.value.copy() for p in model.parameters() if p.value is not None}


def packed_arrays(model):
    """{name/part: array} of every packed NF4 weight: nibbles, scales or codes and offset."""
    arrays = {}
    if model.quantization is None:
        return arrays
    for name, tensor in model.packed_state().items():
        arrays[f"{name}/packed"] = tensor.packed
        arrays[f"{name}/block_size"] = np.array(tensor.block_size)
        arrays[f"{name}/shape"] = np.array(tensor.shape)
        if tensor.double_quantized:
            arrays[f"{name}/absmax_codes"] = tensor.absmax_codes
            arrays[f"{name}/absmax_scales"] = tensor.absmax_scales
            arrays[f"{name}/offset"] = np.array([tensor.offset], np.float32)
        else:
            arrays[f"{name}/absmax"] = tensor.absmax
    return {k: np.array(v) for k, v in arrays.items()}


def final_state(model, optimizer, source):
    """(arrays, facts) that must match exactly between the two runs."""
    adam = optimizer.state_dict()
    arrays = {f"param/{k}": v for k, v in fp32_base(model).items()}
    if model.lora_config is not None:
        arrays.update({f"adapter/{k}": v for k, v in model.adapter_state_dict().items()})
    arrays.update({f"packed/{k}": v for k, v in packed_arrays(model).items()})
    arrays.update({f"m/{k}": v for k, v in adam["first_moment"].items()})
    arrays.update({f"v/{k}": v for k, v in adam["second_moment"].items()})
    facts = {"step": adam["step"], "beta1_power": adam["beta1_power"],
             "beta2_power": adam["beta2_power"], "source": source.checkpoint_state()}
    return arrays, facts


def trained_values(model):
    values = fp32_base(model)
    if model.lora_config is not None:
        values.update(model.adapter_state_dict())
    return values


def main(spec_path):
    with open(spec_path) as handle:
        spec = json.load(handle)
    random.seed(2024)  # some other process-wide random state: restore must replace it
    checkpoint = TrainingCheckpoint.load(spec["checkpoint"])
    config = TransformerConfig.from_dict(spec["config"])
    source = build_source(spec["source"], config.maximum_context)
    with build_model(config, spec.get("lora"), spec.get("quantize")) as model:
        with build_adam(model, spec["storage"]) as optimizer:
            before = trained_values(model)
            memory = {"before_restore": model.resident_memory()}
            restored = checkpoint.restore(model, optimizer, source)
            changed = {name: not np.array_equal(before[name], value)
                       for name, value in trained_values(model).items()}
            random_after_restore = random_state_to_json(random.getstate())
            restored_packed = packed_arrays(model)
            memory["after_steps"] = [model.resident_memory()]
            trainer = CausalLanguageModelTrainer(model, optimizer)
            for _ in range(spec["steps"]):
                trainer.run(source, TrainingLoopConfig(steps=1))
                memory["after_steps"].append(model.resident_memory())
            arrays, facts = final_state(model, optimizer, source)
    arrays.update({f"restored_packed/{k}": v for k, v in restored_packed.items()})
    facts.update(checkpoint_id=restored.checkpoint_id, global_step=restored.global_step,
                 optimizer_step=restored.optimizer_step, metadata=restored.metadata,
                 restore_changed_values=any(changed.values()), changed=changed,
                 random_state=random_after_restore, resident_memory=memory)
    np.savez(spec["output"] + "/state.npz", **arrays)
    with open(spec["output"] + "/state.json", "w") as handle:
        json.dump(facts, handle)


if __name__ == "__main__":
    main(sys.argv[1])
