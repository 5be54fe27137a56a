"""What each training kind's checkpoint state is made of, below both the run loops that write it (trainer.runs.sft,
grpo, opd) and the semantic checks that read it back (trainer.runs.state_check, state_check_grpo): planning
schemas, extra file names, and the named constants and streams the state is recomputed from."""

import hashlib

# SFT
PLANNING_SCHEMA_SFT = "kiln.training-checkpoint-planning.v5"  # v5: plain prompt/completion without the chat template
SPIKE_FACTOR = 2.0  # a loss above twice the running mean of the last SPIKE_WINDOW is a spike
SPIKE_WINDOW = 20

# GRPO
REFERENCE_FILE = "reference.safetensors"  # EMA reference adapter values
ROLLOUT_FILE = "rollout.safetensors"  # old / reference log-probabilities of a batch still being iterated

# OPD
MAX_IDLE_CANDIDATES = 64  # consecutive candidates without an update before the run gives up
GUARDRAILS = {  # name: (window statistic, direction, what it means)
    "entropy_floor": ("entropy", "below", "mean student entropy (nats/token)"),
    "max_repetition_rate": ("repetition", "above", "mean repeated-trigram rate"),
    "max_empty_rate": ("empty", "above", "fraction of empty completions"),
    "kl_ceiling": ("kl", "above", "mean sampled reverse KL to the teacher (nats/token)"),
}


def rollout_seed(seed: int) -> int:
    """OPD's named stream "rollout", derived from the effective seed."""
    return int.from_bytes(hashlib.sha256(f"kiln.opd.rollout:{seed}".encode()).digest()[:8], "little")
