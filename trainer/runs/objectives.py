"""GRPO and OPD objective arithmetic in plain numpy: rewards, advantages, per-token losses,
the loss reductions and each loss's derivative with respect to every token's log-probability.

The engine backpropagates sum_t c_t * log p_t (`DecoderOnlyTransformer.forward_backward_weighted`),
so an objective is implemented by its value and c_t = d loss / d log p_t, both computed here in
float64 from the engine's float32 log-probabilities. GRPO follows TRL's GRPOTrainer
(`_generate_and_score_completions` for advantages, `_compute_loss` for the loss); OPD is the
on-policy distillation policy gradient with the per-token advantage -(log p_student - log p_teacher).

Dimension letters: G completions of one group (a micro-batch), T completion positions (padded).
"""

import math

import numpy as np

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
SCALE_REWARDS = ("group", "batch", "none")
STD_EPSILON = 1e-4  # TRL: advantages / (std + 1e-4)


# -- rewards and advantages ----------------------------------------------------------------


def completion_reward(completion: dict, weights: dict) -> float:
    """The scalar reward of one completion: `reward`, or the weighted sum of `rewards` components.

    A component that is null is skipped (TRL sums reward functions with nansum); a component
    without a weight has weight 1. A completion whose components are all null is unscorable: NaN,
    which group_advantages leaves out of the baseline, as TRL does with a completion every reward
    function returned None for.
    """
    if "reward" in completion:
        return float(completion["reward"])
    total, scored = 0.0, False
    for name in sorted(completion["rewards"]):
        value = completion["rewards"][name]
        if value is not None:
            total += float(weights.get(name, 1.0)) * float(value)
            scored = True
    return total if scored else math.nan


def _nanstd(values: np.ndarray) -> float:
    """TRL's nanstd: the Bessel-corrected (torch.std) standard deviation of the scored (not NaN) values; NaN below two."""
    values = values[~np.isnan(values)]
    return float(np.std(values, ddof=1)) if values.size >= 2 else math.nan


def group_advantages(rewards_by_group, scale_rewards: str):
    """(advantages per group, std per group) for one step's groups, as TRL computes them.

    advantage = reward - group mean, then divided by (std + 1e-4) unless scale_rewards is
    "none"; std is the group's (scale "group"), or that of every reward in the step's batch
    (scale "batch"), Bessel-corrected as torch.std. Unscorable completions (NaN rewards) are left out
    of the means and stds, and an advantage that is then undefined (an unscorable completion, a group
    with fewer than two scored ones) is 0: TRL's nanmean, nanstd and nan_to_num. The std per group
    (reported) is 0 below two scored completions.
    """
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards must be one of {SCALE_REWARDS}, got {scale_rewards!r}")
    rewards_by_group = [np.asarray(r, dtype=np.float64) for r in rewards_by_group]
    group_std = [_nanstd(r) for r in rewards_by_group]
    batch_std = _nanstd(np.concatenate(rewards_by_group)) if rewards_by_group else math.nan
    out = []
    for rewards, std in zip(rewards_by_group, group_std):
        scored = rewards[~np.isnan(rewards)]
        mean = scored.mean() if scored.size else math.nan
        advantage = rewards - mean  # [G]
        if scale_rewards == "group":
            advantage = advantage / (std + STD_EPSILON)
        elif scale_rewards == "batch":
            advantage = advantage / (batch_std + STD_EPSILON)
        out.append(np.nan_to_num(advantage, nan=0.0))
    return out, [0.0 if math.isnan(std) else std for std in group_std]


# -- GRPO per-token terms -----------------------------------------------------------------


def grpo_token_terms(logp, old_logp, ref_logp, advantages, mask, epsilon_low, epsilon_high, beta):
    """Per-token loss l [G,T], its derivative dl/dlogp [G,T] and audit arrays.

    l = -min(r*A, clip(r, 1-epsilon_low, 1+epsilon_high)*A) + beta * k3,  r = exp(logp - old_logp),
    k3 = exp(ref - logp) - (ref - logp) - 1. The clipped branch carries no gradient when it is
    the minimum and the clip is active (r > 1+epsilon_high with A > 0, r < 1-epsilon_low with
    A < 0); otherwise d(-min)/dlogp = -r*A (at ties torch splits the gradient between two
    equal branches, which sums to the same). d k3/dlogp = 1 - exp(ref - logp). Masked
    positions are zero.
    """
    logp = np.asarray(logp, dtype=np.float64)  # [G,T]
    old = np.asarray(old_logp, dtype=np.float64)  # [G,T]
    m = np.asarray(mask, dtype=bool)  # [G,T]
    A = np.asarray(advantages, dtype=np.float64)[:, None]  # [G,1]
    ratio = np.exp(np.where(m, logp - old, 0.0))  # [G,T]
    clipped = np.clip(ratio, 1.0 - epsilon_low, 1.0 + epsilon_high)
    loss = -np.minimum(ratio * A, clipped * A)
    low = (ratio < 1.0 - epsilon_low) & (A < 0) & m
    high = (ratio > 1.0 + epsilon_high) & (A > 0) & m
    derivative = np.where(low | high, 0.0, -ratio * A)
    kl = None
    if beta != 0.0:
        delta = np.where(m, np.asarray(ref_logp, dtype=np.float64) - logp, 0.0)  # [G,T]
        kl = np.exp(delta) - delta - 1.0
        loss = loss + beta * kl
        derivative = derivative + beta * (1.0 - np.exp(delta))
    loss = np.where(m, loss, 0.0)
    derivative = np.where(m, derivative, 0.0)
    return loss, derivative, {"ratio": ratio, "low": low, "high": high, "kl": kl}


def reduction_weights(mask, loss_type: str, accumulation: int, max_completion_length: int,
                      step_tokens: int) -> np.ndarray:
    """w [G,T] with loss = sum(w * l) for one micro-batch (one group) of a step of `accumulation`.

    As TRL reduces (its loss is also divided by the gradient-accumulation count, except dapo):
    grpo: per-completion mean over its tokens, then mean over completions;
    bnpo: sum over the micro-batch's tokens / their count;
    dr_grpo: sum / (completions * max_completion_length);
    dapo: sum / the completion tokens of the whole step (num_items_in_batch).
    Counts are clamped to at least 1 as TRL clamps them.
    """
    m = np.asarray(mask, dtype=np.float64)  # [G,T]
    G = m.shape[0]
    if loss_type == "grpo":
        per_row = np.maximum(m.sum(axis=1), 1.0)[:, None]  # [G,1]
        return m / per_row / G / accumulation
    if loss_type == "bnpo":
        return m / max(float(m.sum()), 1.0) / accumulation
    if loss_type == "dr_grpo":
        return m / (G * max_completion_length) / accumulation
    if loss_type == "dapo":
        return m / max(float(step_tokens), 1.0)
    raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")


def grpo_micro_batch(logp, old_logp, ref_logp, advantages, mask, *, epsilon_low, epsilon_high, beta,
                     loss_type, accumulation, max_completion_length, step_tokens):
    """(loss, coefficients c [G,T] = dloss/dlogp, audit sums) of one group in a step."""
    loss_t, derivative, audit = grpo_token_terms(logp, old_logp, ref_logp, advantages, mask,
                                                 epsilon_low, epsilon_high, beta)
    weights = reduction_weights(mask, loss_type, accumulation, max_completion_length, step_tokens)
    m = np.asarray(mask, dtype=bool)
    tokens = int(m.sum())
    ratio = audit["ratio"][m]
    sums = {
        "tokens": tokens,
        "clipped_low": int(audit["low"].sum()),
        "clipped_high": int(audit["high"].sum()),
        "ratio_sum": float(ratio.sum()) if tokens else 0.0,
        "ratio_min": float(ratio.min()) if tokens else None,
        "ratio_max": float(ratio.max()) if tokens else None,
        "kl_sum": float(audit["kl"][m].sum()) if audit["kl"] is not None else None,
    }
    return float(np.sum(weights * loss_t)), weights * derivative, sums


# -- OPD ---------------------------------------------------------------------------------------


def opd_terms(student_logp, teacher_logp, mask, candidates: int):
    """(reverse-KL estimate, coefficients c [G,T], per-token advantage [G,T]) of sampled completions.

    The advantage -(log p_student - log p_teacher) is held constant (REINFORCE): the loss is
    -(1/candidates) * sum_rows (1/n_row) * sum_t A_t log p_t, so c_t = -A_t / n_row / candidates.
    The reported value is the mean over rows of each row's mean log-ratio (the sampled
    reverse KL, student || teacher).
    """
    s = np.asarray(student_logp, dtype=np.float64)  # [G,T]
    t = np.asarray(teacher_logp, dtype=np.float64)  # [G,T]
    m = np.asarray(mask, dtype=bool)
    advantage = np.where(m, -(s - t), 0.0)
    n = np.maximum(m.sum(axis=1), 1)[:, None].astype(np.float64)  # [G,1]
    coefficients = -advantage / n / candidates
    kl = float(np.mean((np.where(m, s - t, 0.0) / n).sum(axis=1)))
    return kl, coefficients, advantage


def mean_entropy(logits) -> float:
    """Mean entropy (nats) of the softmax rows of logits [T,V]."""
    z = np.asarray(logits, dtype=np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    log_norm = np.log(np.exp(z).sum(axis=-1, keepdims=True))
    logp = z - log_norm
    return float(np.mean(-(np.exp(logp) * logp).sum(axis=-1)))


def repetition_rate(tokens, n: int = 3) -> float:
    """Fraction of the completion's n-grams that repeat an earlier n-gram of the same completion."""
    tokens = list(tokens)
    if len(tokens) < n:
        return 0.0
    seen, repeats = set(), 0
    for i in range(len(tokens) - n + 1):
        gram = tuple(tokens[i:i + n])
        repeats += gram in seen
        seen.add(gram)
    return repeats / (len(tokens) - n + 1)


def finite(value) -> bool:
    return value is None or math.isfinite(value)
