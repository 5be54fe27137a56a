"""GRPO and OPD arithmetic against a direct PyTorch implementation of TRL's formulas."""

import numpy as np
import pytest

from trainer.runs import objectives

torch = pytest.importorskip("torch")

G, T, V = 3, 6, 11  # completions per group, completion positions, vocabulary
EPS_LOW, EPS_HIGH = 0.2, 0.28
MAX_COMPLETION = 8


def trl_advantages(rewards, num_generations, scale_rewards):
    """TRL GRPOTrainer._generate_and_score_completions, the advantage part."""
    mean_grouped_rewards = rewards.view(-1, num_generations).mean(dim=1)
    mean_grouped_rewards = mean_grouped_rewards.repeat_interleave(num_generations, dim=0)
    advantages = rewards - mean_grouped_rewards
    if scale_rewards in ["group", "none"]:
        std_rewards = rewards.view(-1, num_generations).std(dim=1)
        std_rewards = std_rewards.repeat_interleave(num_generations, dim=0)
    else:
        std_rewards = rewards.std().expand_as(rewards)
    if scale_rewards != "none":
        advantages = advantages / (std_rewards + 1e-4)
    return advantages


def trl_loss(per_token_logps, old_per_token_logps, ref_per_token_logps, advantages, completion_mask, *,
             beta, loss_type, gradient_accumulation_steps, num_items_in_batch):
    """TRL GRPOTrainer._compute_loss (token-level importance sampling, one process)."""
    per_token_kl = torch.exp(ref_per_token_logps - per_token_logps) - (ref_per_token_logps - per_token_logps) - 1
    coef_1 = torch.exp(per_token_logps - old_per_token_logps)
    coef_2 = torch.clamp(coef_1, 1 - EPS_LOW, 1 + EPS_HIGH)
    per_token_loss1 = coef_1 * advantages.unsqueeze(1)
    per_token_loss2 = coef_2 * advantages.unsqueeze(1)
    per_token_loss = -torch.min(per_token_loss1, per_token_loss2)
    if beta != 0.0:
        per_token_loss = per_token_loss + beta * per_token_kl
    if loss_type == "grpo":
        loss = ((per_token_loss * completion_mask).sum(-1) / completion_mask.sum(-1).clamp(min=1.0)).mean()
        loss = loss / gradient_accumulation_steps
    elif loss_type == "bnpo":
        loss = (per_token_loss * completion_mask).sum() / completion_mask.sum().clamp(min=1.0)
        loss = loss / gradient_accumulation_steps
    elif loss_type == "dr_grpo":
        loss = (per_token_loss * completion_mask).sum() / (per_token_loss.size(0) * MAX_COMPLETION)
        loss = loss / gradient_accumulation_steps
    else:  # dapo
        loss = (per_token_loss * completion_mask).sum() / num_items_in_batch
    is_low = (coef_1 < 1 - EPS_LOW) & (advantages.unsqueeze(1) < 0)
    is_high = (coef_1 > 1 + EPS_HIGH) & (advantages.unsqueeze(1) > 0)
    return loss, (is_low * completion_mask).sum(), (is_high * completion_mask).sum()


def fixed_step():
    """Two groups (micro-batches) of one step: logits, targets, masks, old/ref log p, rewards."""
    rng = np.random.default_rng(20240611)
    groups = []
    for lengths in ((6, 3, 5), (2, 6, 4)):
        logits = rng.standard_normal((G, T, V))
        targets = rng.integers(0, V, (G, T))
        mask = np.arange(T)[None, :] < np.array(lengths)[:, None]
        logp = np.take_along_axis(logits - np.log(np.exp(logits).sum(-1, keepdims=True)),
                                  targets[..., None], -1)[..., 0]
        old = logp + rng.uniform(-0.6, 0.6, (G, T))  # num_iterations > 1: ratios on both sides of the clip
        ref = logp + rng.uniform(-0.5, 0.5, (G, T))
        groups.append({"logits": logits, "targets": targets, "mask": mask, "old": old, "ref": ref})
    rewards = [np.array([1.0, 0.0, 0.5]), np.array([0.25, 2.0, -1.0])]
    return groups, rewards


@pytest.mark.parametrize("scale_rewards", objectives.SCALE_REWARDS)
def test_advantages_match_trl(scale_rewards):
    _, rewards = fixed_step()
    ours, stds = objectives.group_advantages(rewards, scale_rewards)
    theirs = trl_advantages(torch.tensor(np.concatenate(rewards)), G, scale_rewards).numpy()
    np.testing.assert_allclose(np.concatenate(ours), theirs, rtol=1e-13, atol=1e-14)
    np.testing.assert_allclose(stds, [np.std(r, ddof=1) for r in rewards], rtol=1e-14)


def trl_nanstd(tensor, dim=None):
    """trl.trainer.utils.nanstd: Bessel-corrected, NaN entries ignored, NaN below two values."""
    mean = torch.nanmean(tensor, dim=dim, keepdim=True)
    variance = torch.nanmean((tensor - mean) ** 2, dim=dim, keepdim=True)
    count = torch.sum(~torch.isnan(tensor), dim=dim, keepdim=True).to(tensor.dtype)  # TRL's count / (count - 1)
    # is float32 (int / int); in the tensor's float64 here, so that only the formula is compared
    correction = torch.where(count > 1, count / (count - 1), torch.full_like(variance, float("nan")))
    std = torch.sqrt(variance * correction)
    return std.squeeze(dim) if dim is not None else std.reshape(())


def trl_scored_advantages(rewards_per_func, weights, num_generations, scale_rewards):
    """TRL GRPOTrainer._generate_and_score_completions (multi_objective_aggregation "sum_then_normalize", TRL >= 1.6):
    a completion every reward function returned None for (NaN) is unscorable: left out of its group's mean and
    std, advantage 0."""
    unscorable_mask = torch.isnan(rewards_per_func).all(dim=1)
    rewards = (rewards_per_func * weights.unsqueeze(0)).nansum(dim=1)
    rewards[unscorable_mask] = torch.nan
    mean_grouped_rewards = torch.nanmean(rewards.view(-1, num_generations), dim=1)
    mean_grouped_rewards = mean_grouped_rewards.repeat_interleave(num_generations, dim=0)
    if scale_rewards in ["group", "none"]:
        std_rewards = trl_nanstd(rewards.view(-1, num_generations), dim=1).repeat_interleave(num_generations, dim=0)
    else:
        std_rewards = trl_nanstd(rewards).expand_as(rewards)
    advantages = rewards - mean_grouped_rewards
    if scale_rewards != "none":
        advantages = advantages / (std_rewards + 1e-4)
    return torch.nan_to_num(advantages, nan=0.0)


SCORED = [  # two groups of four; None is a reward function that did not score the completion
    [{"correct": 1.0, "format": None}, {"correct": None, "format": None}, {"correct": 0.0, "format": 1.0},
     {"correct": None, "format": 0.5}],
    [{"correct": 0.5, "format": 0.5}, {"correct": 0.5, "format": 0.5}, {"correct": None, "format": None},
     {"correct": 0.5, "format": 0.5}],  # equal rewards: advantages 0
]


@pytest.mark.parametrize("scale_rewards", objectives.SCALE_REWARDS)
def test_unscorable_completions_are_left_out_of_the_baseline_as_trl_does(scale_rewards):
    weights = {"format": 0.3}
    rewards = [np.array([objectives.completion_reward({"rewards": c}, weights) for c in group]) for group in SCORED]
    ours, stds = objectives.group_advantages(rewards, scale_rewards)
    per_func = torch.tensor([[np.nan if c[k] is None else c[k] for k in ("correct", "format")]
                             for group in SCORED for c in group], dtype=torch.float64)
    theirs = trl_scored_advantages(per_func, torch.tensor([1.0, 0.3], dtype=torch.float64), 4, scale_rewards)
    np.testing.assert_allclose(np.concatenate(ours), theirs.numpy(), rtol=1e-13, atol=1e-14)
    assert ours[0][1] == 0.0 and ours[1][2] == 0.0 and not np.any(ours[1])
    assert all(np.isfinite(stds))


@pytest.mark.parametrize("loss_type", objectives.LOSS_TYPES)
@pytest.mark.parametrize("beta", [0.0, 0.07])
def test_grpo_loss_and_gradients_match_trl(loss_type, beta):
    groups, rewards = fixed_step()
    advantages, _ = objectives.group_advantages(rewards, "group")
    step_tokens = int(sum(g["mask"].sum() for g in groups))
    total_ours = total_theirs = 0.0
    clipped = [0, 0]
    for group, advantage in zip(groups, advantages):
        # TRL, through torch autograd from the logits
        logits = torch.tensor(group["logits"], requires_grad=True)
        logps = torch.log_softmax(logits, -1).gather(-1, torch.tensor(group["targets"])[..., None])[..., 0]
        mask = torch.tensor(group["mask"], dtype=torch.float64)
        loss, low, high = trl_loss(logps, torch.tensor(group["old"]), torch.tensor(group["ref"]),
                                   torch.tensor(advantage), mask, beta=beta, loss_type=loss_type,
                                   gradient_accumulation_steps=len(groups), num_items_in_batch=step_tokens)
        loss.backward()
        # Kiln: the loss value and c = dloss/dlogp, then the chain rule the engine applies
        ours, c, audit = objectives.grpo_micro_batch(
            logps.detach().numpy(), group["old"], group["ref"], advantage, group["mask"],
            epsilon_low=EPS_LOW, epsilon_high=EPS_HIGH, beta=beta, loss_type=loss_type,
            accumulation=len(groups), max_completion_length=MAX_COMPLETION, step_tokens=step_tokens)
        probabilities = torch.softmax(logits.detach(), -1).numpy()
        onehot = np.eye(V)[group["targets"]]
        gradient = c[..., None] * (onehot - probabilities)  # d(c * log p)/dlogits
        np.testing.assert_allclose(ours, loss.item(), rtol=1e-12, atol=1e-15)
        np.testing.assert_allclose(gradient, logits.grad.numpy(), rtol=1e-10, atol=1e-15)
        assert (audit["clipped_low"], audit["clipped_high"]) == (int(low), int(high))
        clipped[0] += audit["clipped_low"]
        clipped[1] += audit["clipped_high"]
        total_ours += ours
        total_theirs += loss.item()
    assert clipped[0] > 0 and clipped[1] > 0, "the fixed case must exercise both clip branches"
    np.testing.assert_allclose(total_ours, total_theirs, rtol=1e-12)


def test_derivative_matches_autograd_on_logp_at_ratio_one():
    """num_iterations == 1: old = logp, every ratio is exactly 1 and the gradient is -A (+ KL term)."""
    groups, rewards = fixed_step()
    group = groups[0]
    advantage = objectives.group_advantages(rewards, "none")[0][0]
    logp = np.where(group["mask"], group["old"], 0.0)
    leaf = torch.tensor(logp, requires_grad=True)
    mask = torch.tensor(group["mask"], dtype=torch.float64)
    loss, _, _ = trl_loss(leaf, leaf.detach(), torch.tensor(group["ref"]), torch.tensor(advantage), mask,
                          beta=0.04, loss_type="bnpo", gradient_accumulation_steps=1, num_items_in_batch=0)
    loss.backward()
    _, c, audit = objectives.grpo_micro_batch(logp, logp, group["ref"], advantage, group["mask"],
                                              epsilon_low=0.2, epsilon_high=0.2, beta=0.04, loss_type="bnpo",
                                              accumulation=1, max_completion_length=8, step_tokens=0)
    np.testing.assert_allclose(c, leaf.grad.numpy(), rtol=1e-12, atol=1e-15)
    assert audit["ratio_min"] == audit["ratio_max"] == 1.0


def test_opd_coefficients_are_the_reinforce_gradient():
    rng = np.random.default_rng(3)
    student = rng.normal(-3, 1, (2, 5))
    teacher = rng.normal(-3, 1, (2, 5))
    mask = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], bool)
    kl, c, advantage = objectives.opd_terms(student, teacher, mask, candidates=2)
    leaf = torch.tensor(student, requires_grad=True)
    m = torch.tensor(mask, dtype=torch.float64)
    A = (-(leaf - torch.tensor(teacher)) * m).detach()  # the advantage is a constant
    loss = -((A * leaf * m).sum(-1) / m.sum(-1)).sum() / 2
    loss.backward()
    np.testing.assert_allclose(c, leaf.grad.numpy(), rtol=1e-12)
    np.testing.assert_allclose(advantage, A.numpy())
    expected = np.mean([(student[i] - teacher[i])[mask[i]].mean() for i in range(2)])
    assert kl == pytest.approx(expected, rel=1e-12)


def test_reductions_need_known_names():
    with pytest.raises(ValueError):
        objectives.reduction_weights(np.ones((2, 2)), "sum", 1, 4, 4)
    with pytest.raises(ValueError):
        objectives.group_advantages([np.ones(2)], "rank")


def test_rewards_weighted_components_skip_null():
    completion = {"text": "x", "rewards": {"format": 1.0, "accuracy": 0.5, "style": None}}
    assert objectives.completion_reward(completion, {"accuracy": 2.0}) == 2.0
    assert objectives.completion_reward({"text": "x", "reward": -1}, {}) == -1.0


def test_entropy_and_repetition():
    assert objectives.mean_entropy(np.zeros((3, 8))) == pytest.approx(np.log(8))
    assert objectives.repetition_rate([1, 2, 3, 4, 5]) == 0.0
    assert objectives.repetition_rate([7] * 10) == pytest.approx(7 / 8)
    assert objectives.repetition_rate([1, 2]) == 0.0


def trl_reverse_kl(student_logits, teacher_logits, temperature):
    """TRL's GKD / DistillationTrainer generalized_jsd_loss with beta=1 (reverse KL) at one position."""
    student = torch.log_softmax(student_logits / temperature, -1)
    teacher = torch.log_softmax(teacher_logits / temperature, -1)
    return torch.nn.functional.kl_div(teacher, student, reduction="sum", log_target=True)


def expected_opd_gradient(student_logits, teacher_logits, sampling_temperature):
    """E over a token sampled at SAMPLING_TEMPERATURE of Kiln's OPD gradient d(sum c log p_s)/dlogits (one token,
    one candidate): log-probabilities of student and teacher are the untempered ones, as the run computes them."""
    def log_softmax(z):
        return z - np.log(np.exp(z - z.max()).sum()) - z.max()
    student, teacher = log_softmax(student_logits), log_softmax(teacher_logits)
    sampling = np.exp(log_softmax(student_logits / sampling_temperature))
    gradient = np.zeros(V)
    for token in range(V):
        _, c, _ = objectives.opd_terms([[student[token]]], [[teacher[token]]], [[True]], candidates=1)
        gradient += sampling[token] * c[0, 0] * (np.eye(V)[token] - np.exp(student))
    return gradient


def test_opd_expected_gradient_is_trls_reverse_kl_gradient_at_temperature_one():
    """Averaged over the student's own samples at temperature 1, the OPD update is the gradient of TRL's per-token
    reverse KL (GKD / DistillationTrainer, beta=1) at that position; a single sample is a noisy estimate of it.
    At another temperature it is neither that nor TRL's tempered divergence (docs/grpo-opd.md, "Where OPD differs
    from TRL's distillation trainers"): the temperature only shapes sampling."""
    rng = np.random.default_rng(17)
    student_logits, teacher_logits = rng.normal(size=V), rng.normal(size=V) * 2
    for temperature, same in ((1.0, True), (0.7, False)):
        leaf = torch.tensor(student_logits, requires_grad=True)
        trl_reverse_kl(leaf, torch.tensor(teacher_logits), temperature).backward()
        ours = expected_opd_gradient(student_logits, teacher_logits, temperature)
        if same:
            np.testing.assert_allclose(ours, leaf.grad.numpy(), rtol=1e-10, atol=1e-14)
        else:
            assert np.abs(ours - leaf.grad.numpy()).max() > 1e-3
