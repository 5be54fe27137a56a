"""Requests and files for the GRPO and OPD control-plane tests, sized for kiln-tiny: a dozen steps each."""

import json
import string
from pathlib import Path

import numpy as np


def make_group(i: int) -> dict:
    prompt = ({"messages": [{"role": "user", "content": f"What is {i} times 3?"}]} if i % 2
              else {"prompt": f"Q: {i} times 3 ="})
    return {**prompt, "completions": [
        {"text": f" {3 * i}.", "reward": 1.0},
        {"text": f" {3 * i + 1}, I think", "reward": 0.0},
        {"text": " I cannot say", "rewards": {"correct": 0.0, "polite": 1.0, "brief": None}},
    ], "reward_weights": {"polite": 0.3}}


GROUPS = [make_group(i) for i in range(4)]
GRPO_CONFIG = {"seed": 11, "learning_rate": 2e-2, "epochs": 3, "beta": 0.05, "checkpoint_interval": 4,
               "reference": {"type": "ema", "refresh_steps": 2, "mixup_alpha": 0.5},
               "lora": {"rank": 4, "alpha": 8}, "max_completion_length": 12}
PROMPTS = ["Hello", {"prompt": "Tell me a story about"},
           {"messages": [{"role": "user", "content": "What is 2 plus 2?"}]}]
STOPS = list(string.ascii_lowercase)  # about a tenth of the byte tokens end a completion
OPD_CONFIG = {"seed": 9, "steps": 12, "max_new_tokens": 8, "learning_rate": 2e-2, "checkpoint_interval": 4,
              "stop_strings": STOPS, "lora": {"rank": 4, "alpha": 8}}


def grpo_inline(adapter: str, **config) -> dict:
    """Twelve steps: four groups, one per step, three epochs; an EMA reference and a KL term."""
    return {"groups": GROUPS, "config": {"output_name": adapter, **GRPO_CONFIG, **config}}


def write_groups(path: Path) -> str:
    """GROUPS as JSONL with a blank line (consumed and hashed, no group); returns the absolute path."""
    lines = [json.dumps(group) for group in GROUPS]
    lines.insert(2, "")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def grpo_streamed(adapter: str, path: str, **config) -> dict:
    return {"dataset_path": path, "config": {"output_name": adapter, **GRPO_CONFIG, "streaming": True,
                                             "reference": {"type": "frozen"}, "loss_type": "grpo", **config}}


def opd_request(adapter: str, teacher: str, **config) -> dict:
    return {"prompts": PROMPTS, "config": {"output_name": adapter, "teacher": teacher, **OPD_CONFIG, **config}}


def write_teacher_adapter(home: Path, directory: Path, seed: int) -> Path:
    """A PEFT adapter over kiln-tiny with random weights: a teacher that differs from the fresh student."""
    from trainer import LoraConfig
    from trainer.bases import load_base
    from trainer.peft import export_adapter

    model, _ = load_base("kiln-tiny", home)
    try:
        model.attach_lora(LoraConfig(rank=4, alpha=8, initializer_seed=seed))
        rng = np.random.default_rng(seed)
        model.load_adapter_state_dict({name: rng.standard_normal(value.shape).astype(np.float32)
                                       for name, value in model.adapter_state_dict().items()})
        export_adapter(model, directory)
    finally:
        model.close()
    return directory
