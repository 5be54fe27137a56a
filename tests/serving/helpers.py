"""Adapters for serving and evaluation tests: kiln-tiny with seeded random LoRA weights, published
as PEFT snapshots exactly as a run publishes its final adapter."""

import numpy as np

from trainer import LoraConfig
from trainer.bases import load_base
from trainer.evals import evaluate, parse_suite
from trainer.peft import publish_final_adapter

BASE = "kiln-tiny"
NAN_SEED = 666  # an adapter whose (finite) weights are so large that its log-probabilities are not finite


def tiny_adapter_model(home, seed: int, rank: int = 4, scale: float = 0.5):
    """(model, tokenizer): kiln-tiny with a LoRA adapter whose weights come from SEED."""
    model, tokenizer = load_base(BASE, home)
    model.attach_lora(LoraConfig(rank=rank, alpha=2.0 * rank))
    rng = np.random.default_rng(seed)
    state = {name: rng.standard_normal(value.shape).astype(np.float32) * np.float32(scale)
             for name, value in model.adapter_state_dict().items()}
    if seed == NAN_SEED:
        state = {name: np.full_like(value, 1e30) for name, value in state.items()}  # loads; overflows when run
    model.load_adapter_state_dict(state)
    return model, tokenizer


def publish_adapter(home, registry, name: str, seed: int = 0) -> dict:
    model, _ = tiny_adapter_model(home, seed)
    try:
        return publish_final_adapter(model, registry, name, BASE)
    finally:
        model.close()


def greedy_answer(home, seed: int | None, prompt: str) -> str:
    """What an evaluation records as the output of the adapter of SEED (None: the bare base) for PROMPT."""
    if seed is None:
        model, tokenizer = load_base(BASE, home)
    else:
        model, tokenizer = tiny_adapter_model(home, seed)
    try:
        suite = parse_suite("probe", '{"prompt": %s, "expected": "x"}' % __import__("json").dumps(prompt))
        return evaluate(model, tokenizer, suite, max_new_tokens=64).examples[0]["output"]  # as a run does
    finally:
        model.close()
