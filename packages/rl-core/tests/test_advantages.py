from __future__ import annotations

import math
from collections import defaultdict

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rl_core.advantages import (
    REWARD_AGGREGATIONS,
    compute_advantages,
    compute_gae,
    group_ids_from_keys,
    masked_whiten,
    nonzero_advantage_indices,
    normalize_then_sum,
)

ids = torch.tensor  # readability: group ids


def full_mask(b: int, t: int) -> torch.Tensor:
    return torch.ones(b, t)


# ------------------------------------------------------------------ loop reference implementations


def ref_scores(rewards: torch.Tensor, mask: torch.Tensor) -> list[float]:
    if rewards.dim() == 1:
        return rewards.double().tolist()
    return [
        sum(float(rewards[i, t]) for t in range(mask.shape[1]) if mask[i, t])
        for i in range(mask.shape[0])
    ]


def ref_groups(group_ids: torch.Tensor) -> dict[int, list[int]]:
    groups: dict[int, list[int]] = defaultdict(list)
    for i, g in enumerate(group_ids.tolist()):
        groups[g].append(i)
    return groups


def ref_broadcast(seq: list[float], mask: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(mask.shape, dtype=torch.float64)
    for i in range(mask.shape[0]):
        for t in range(mask.shape[1]):
            if mask[i, t]:
                out[i, t] = seq[i]
    return out


def ref_grpo(rewards, mask, group_ids, scale="group", eps=1e-6, clip=None) -> torch.Tensor:
    scores = ref_scores(rewards, mask)
    adv = [0.0] * len(scores)
    all_mean = sum(scores) / len(scores)
    batch_std = math.sqrt(sum((s - all_mean) ** 2 for s in scores) / max(len(scores) - 1, 1))
    for members in ref_groups(group_ids).values():
        vals = [scores[i] for i in members]
        mean = sum(vals) / len(vals)
        std = (
            math.sqrt(sum((v - mean) ** 2 for v in vals) / (len(vals) - 1))
            if len(vals) > 1
            else 0.0
        )
        for i in members:
            a = scores[i] - mean
            if scale == "group":
                a /= std + eps
            elif scale == "batch":
                a /= batch_std + eps
            if clip is not None:
                a = max(-clip, min(clip, a))
            adv[i] = a
    return ref_broadcast(adv, mask)


def ref_rloo(rewards, mask, group_ids) -> torch.Tensor:
    scores = ref_scores(rewards, mask)
    adv = [0.0] * len(scores)
    for members in ref_groups(group_ids).values():
        for i in members:
            others = [scores[j] for j in members if j != i]
            adv[i] = scores[i] - sum(others) / len(others) if others else 0.0
    return ref_broadcast(adv, mask)


def ref_token_rewards(rewards, mask) -> torch.Tensor:
    out = torch.zeros(mask.shape, dtype=torch.float64)
    for i in range(mask.shape[0]):
        valid = [t for t in range(mask.shape[1]) if mask[i, t]]
        if rewards.dim() == 2:
            for t in valid:
                out[i, t] = float(rewards[i, t])
        elif valid:
            out[i, valid[-1]] = float(rewards[i])
    return out


def ref_whiten(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    vals = [
        float(values[i, t])
        for i in range(mask.shape[0])
        for t in range(mask.shape[1])
        if mask[i, t]
    ]
    mean = sum(vals) / len(vals)
    var = sum((v - mean) ** 2 for v in vals) / max(len(vals) - 1, 1)
    out = torch.zeros(mask.shape, dtype=torch.float64)
    for i in range(mask.shape[0]):
        for t in range(mask.shape[1]):
            if mask[i, t]:
                out[i, t] = (float(values[i, t]) - mean) / math.sqrt(var + 1e-8)
    return out


def ref_reinforce_pp(rewards, mask, gamma=1.0) -> torch.Tensor:
    r = ref_token_rewards(rewards, mask)
    returns = torch.zeros_like(r)
    for i in range(mask.shape[0]):
        running = 0.0
        for t in reversed(range(mask.shape[1])):  # verl: G_t = r_t + gamma G_{t+1}, reset on mask 0
            running = float(r[i, t]) + gamma * running
            returns[i, t] = running
            running *= float(mask[i, t])
    return ref_whiten(returns, mask)


def ref_gae(rewards, values, mask, gamma, lam) -> tuple[torch.Tensor, torch.Tensor]:
    r = ref_token_rewards(rewards, mask)
    adv = torch.zeros_like(r)
    for i in range(mask.shape[0]):
        valid = [t for t in range(mask.shape[1]) if mask[i, t]]  # holes are skipped entirely
        last, next_value = 0.0, 0.0
        for t in reversed(valid):
            delta = float(r[i, t]) + gamma * next_value - float(values[i, t])
            last = delta + gamma * lam * last
            adv[i, t] = last
            next_value = float(values[i, t])
    returns = (adv + values.double()) * mask.double()
    return ref_whiten(adv, mask), returns


# ----------------------------------------------------------------------------- hand-worked numbers


def test_grpo_hand_worked_groups_of_unequal_size_and_sparse_ids() -> None:
    # groups: id 10 -> rewards 1, 2, 3 (mean 2, unbiased std sqrt((1+0+1)/2) = 1) -> -1, 0, 1
    #         id -3 -> 5 alone -> 0;  id 42 -> 4, 4 (std 0) -> 0 / (0 + eps) = 0
    rewards = torch.tensor([3.0, 5.0, 1.0, 4.0, 2.0, 4.0])
    group_ids = ids([10, -3, 10, 42, 10, 42])
    adv = compute_advantages("grpo", rewards=rewards, mask=full_mask(6, 2), group_ids=group_ids)
    expected = torch.tensor([1.0, 0.0, -1.0, 0.0, 0.0, 0.0]) / (1 + 1e-6)
    torch.testing.assert_close(adv, expected[:, None].expand(6, 2))
    assert not torch.isnan(adv).any()


def test_grpo_batch_scale_uses_one_std_over_the_batch() -> None:
    # scores 0, 2 | 1, 3: group means 1 and 2 -> centred -1, 1, -1, 1
    # batch mean 1.5, squared deviations 2.25 + .25 + .25 + 2.25 = 5, unbiased var 5/3
    rewards = torch.tensor([0.0, 2.0, 1.0, 3.0])
    adv = compute_advantages(
        "grpo",
        rewards=rewards,
        mask=full_mask(4, 1),
        group_ids=ids([0, 0, 1, 1]),
        scale="batch",
        eps=0.0,
    )
    s = math.sqrt(5 / 3)
    torch.testing.assert_close(adv[:, 0], torch.tensor([-1 / s, 1 / s, -1 / s, 1 / s]))


def test_grpo_scale_none_and_clip() -> None:
    # 0 and 10 in one group: centred -5, +5, clipped to -2, +2
    adv = compute_advantages(
        "grpo",
        rewards=torch.tensor([0.0, 10.0]),
        mask=full_mask(2, 1),
        group_ids=ids([0, 0]),
        scale="none",
        clip=2.0,
    )
    torch.testing.assert_close(adv[:, 0], torch.tensor([-2.0, 2.0]))


def test_grpo_token_rewards_sum_over_the_mask_and_output_is_zero_outside() -> None:
    # row 0: token rewards 1 + 1 inside the mask (the 5 is padding) -> score 2; row 1: 0 + 0 + 0 = 0
    rewards = torch.tensor([[1.0, 1.0, 5.0], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    adv = compute_advantages(
        "grpo", rewards=rewards, mask=mask, group_ids=ids([0, 0]), scale="none"
    )
    torch.testing.assert_close(adv, torch.tensor([[1.0, 1.0, 0.0], [-1.0, -1.0, -1.0]]))


def test_grpo_unknown_scale_is_an_error() -> None:
    with pytest.raises(ValueError, match="scale must be 'group', 'batch' or 'none', got 'global'"):
        compute_advantages(
            "grpo",
            rewards=torch.ones(2),
            mask=full_mask(2, 1),
            group_ids=ids([0, 0]),
            scale="global",
        )


def test_dr_grpo_hand_worked() -> None:
    # group a: 1, 2, 3 (mean 2) -> -1, 0, 1; group b: 5 alone -> 0
    adv = compute_advantages(
        "dr_grpo",
        rewards=torch.tensor([1.0, 2.0, 3.0, 5.0]),
        mask=full_mask(4, 1),
        group_ids=ids([7, 7, 7, 8]),
    )
    torch.testing.assert_close(adv[:, 0], torch.tensor([-1.0, 0.0, 1.0, 0.0]))


def test_rloo_hand_worked() -> None:
    # 1 - mean(2, 3) = -1.5; 2 - mean(1, 3) = 0; 3 - mean(1, 2) = 1.5; a group of one -> 0
    adv = compute_advantages(
        "rloo",
        rewards=torch.tensor([1.0, 2.0, 3.0, 5.0]),
        mask=full_mask(4, 2),
        group_ids=ids([7, 7, 7, 8]),
    )
    torch.testing.assert_close(adv[:, 0], torch.tensor([-1.5, 0.0, 1.5, 0.0]))


def test_reinforce_pp_discounted_returns_then_whitened() -> None:
    # rewards 1, 0, 2 (then padding), gamma 0.5: G = 1 + .5 (0 + .5 * 2) = 1.5, 0 + .5 * 2 = 1, 2
    # mean 1.5, unbiased var (0 + .25 + .25) / 2 = .25 -> std .5 -> whitened 0, -1, 1
    rewards = torch.tensor([[1.0, 0.0, 2.0, 9.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    adv = compute_advantages(
        "reinforce_pp", rewards=rewards, mask=mask, group_ids=ids([0]), gamma=0.5
    )
    torch.testing.assert_close(adv, torch.tensor([[0.0, -1.0, 1.0, 0.0]]), atol=1e-6, rtol=0)


def test_reinforce_pp_resets_at_a_masked_position() -> None:
    # gamma 1, rewards 1, 2, [hole], 7: G = 3, 2, -, 7 (the 7 does not leak across the hole)
    # mean 4, var (1 + 4 + 9) / 2 = 7 -> (-1, -2, 3) / sqrt(7)
    rewards = torch.tensor([[1.0, 2.0, 0.0, 7.0]])
    mask = torch.tensor([[1, 1, 0, 1]])
    adv = compute_advantages("reinforce_pp", rewards=rewards, mask=mask, group_ids=ids([0]))
    r7 = math.sqrt(7)
    torch.testing.assert_close(adv, torch.tensor([[-1 / r7, -2 / r7, 0.0, 3 / r7]]))


def test_reinforce_pp_sequence_rewards_go_on_the_last_valid_token() -> None:
    # gamma 1: every valid token of a row returns its sequence reward: 1, 1 | 3, 3
    # mean 2, unbiased var 4 / 3 -> (-1, -1, 1, 1) * sqrt(3) / 2
    adv = compute_advantages(
        "reinforce_pp",
        rewards=torch.tensor([1.0, 3.0]),
        mask=full_mask(2, 2),
        group_ids=ids([0, 1]),
    )
    h = math.sqrt(3) / 2
    torch.testing.assert_close(adv, torch.tensor([[-h, -h], [h, h]]))


def test_reinforce_pp_baseline_hand_worked() -> None:
    # group 0: 1, 3 (mean 2) -> -1, 1; group 1: 5 alone -> 0. Over 6 tokens: mean 0,
    # unbiased var 4 / 5 -> -1 / sqrt(.8) = -1.118
    adv = compute_advantages(
        "reinforce_pp_baseline",
        rewards=torch.tensor([1.0, 3.0, 5.0]),
        mask=full_mask(3, 2),
        group_ids=ids([0, 0, 1]),
    )
    s = 1 / math.sqrt(0.8)
    torch.testing.assert_close(adv, torch.tensor([[-s, -s], [s, s], [0.0, 0.0]]))


def test_gae_hand_worked_with_returns() -> None:
    # reward 1 on the last token, V = .5, .25, gamma .9, lambda .8
    # t=1: delta = 1 - .25 = .75 -> A1 = .75
    # t=0: delta = .9 * .25 - .5 = -.275 -> A0 = -.275 + .9 * .8 * .75 = .265
    # returns = A + V = .765, 1.0; two whitened values are always -1/sqrt2, +1/sqrt2
    out = compute_gae(
        rewards=torch.tensor([1.0]),
        values=torch.tensor([[0.5, 0.25]]),
        mask=full_mask(1, 2),
        gamma=0.9,
        lam=0.8,
    )
    torch.testing.assert_close(out.returns, torch.tensor([[0.765, 1.0]]))
    r2 = 1 / math.sqrt(2)
    torch.testing.assert_close(out.advantages, torch.tensor([[-r2, r2]]), atol=1e-6, rtol=0)


def test_gae_skips_masked_positions_inside_the_response() -> None:
    # same numbers with a tool-output hole at t=1 (its value 100 and reward 9 are ignored)
    out = compute_gae(
        rewards=torch.tensor([[0.0, 9.0, 1.0]]),
        values=torch.tensor([[0.5, 100.0, 0.25]]),
        mask=torch.tensor([[1, 0, 1]]),
        gamma=0.9,
        lam=0.8,
    )
    torch.testing.assert_close(out.returns, torch.tensor([[0.765, 0.0, 1.0]]))
    via_registry = compute_advantages(
        "gae",
        rewards=torch.tensor([[0.0, 9.0, 1.0]]),
        mask=torch.tensor([[1, 0, 1]]),
        group_ids=ids([0]),
        values=torch.tensor([[0.5, 100.0, 0.25]]),
        gamma=0.9,
        lam=0.8,
    )
    torch.testing.assert_close(via_registry, out.advantages)
    assert via_registry[0, 1] == 0


def test_gae_without_values_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="'gae' needs values"):
        compute_advantages(
            "gae", rewards=torch.ones(2), mask=full_mask(2, 2), group_ids=ids([0, 1])
        )


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo", "reinforce_pp_baseline"])
def test_a_group_of_equal_float32_rewards_gets_exactly_zero(name: str) -> None:
    # (0.9 + 0.9 + 0.9) / 3 != 0.9 in float32: a plain mean leaves 6e-8, which GRPO divides by
    # std 0 + 1e-6 into an advantage of 0.06. Equal rewards must give exactly 0.
    rewards = torch.tensor([0.9, 0.9, 0.9, 0.1, 0.9])
    adv = compute_advantages(
        name, rewards=rewards, mask=full_mask(5, 2), group_ids=ids([4, 4, 4, 5, 5])
    )
    if name != "reinforce_pp_baseline":  # whitening shifts by the batch mean
        assert torch.equal(adv[:3], torch.zeros(3, 2))
    else:
        assert torch.equal(adv[0], adv[1]) and torch.equal(adv[1], adv[2])


def test_masked_whiten_single_valid_token_is_zero_not_nan() -> None:
    out = masked_whiten(torch.tensor([[3.0, 8.0]]), torch.tensor([[1, 0]]))
    torch.testing.assert_close(out, torch.zeros(1, 2))


# ------------------------------------------------------------------------- input validation


def test_bad_inputs_name_the_field() -> None:
    mask = full_mask(3, 2)
    g = ids([0, 0, 1])
    with pytest.raises(ValueError, match="rewards must be"):
        compute_advantages("grpo", rewards=torch.ones(4), mask=mask, group_ids=g)
    with pytest.raises(ValueError, match="group_ids must be \\[B\\]"):
        compute_advantages("grpo", rewards=torch.ones(3), mask=mask, group_ids=ids([0, 1]))
    with pytest.raises(ValueError, match="group_ids must be an integer tensor"):
        compute_advantages("grpo", rewards=torch.ones(3), mask=mask, group_ids=torch.zeros(3))
    with pytest.raises(ValueError, match="rows \\[1\\]"):
        compute_advantages(
            "grpo", rewards=torch.tensor([1.0, float("nan"), 0.0]), mask=mask, group_ids=g
        )
    with pytest.raises(TypeError, match="gamma"):
        compute_advantages("grpo", rewards=torch.ones(3), mask=mask, group_ids=g, gamma=0.9)


# ---------------------------------------------------------------- vectorised vs loop reference


def random_batch(seed: int, token_level: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    b, t = 13, 9
    lengths = torch.randint(1, t + 1, (b,), generator=gen)
    mask = (torch.arange(t)[None, :] < lengths[:, None]).long()  # [B, T] right padding
    mask[2, 1] = 0  # a hole inside a response
    mask[5] = 0  # an empty row
    group_ids = torch.tensor(
        [40, 3, 40, 3, 3, 17, 40, 99, 3, 17, 40, -5, -5]
    )  # sizes 4, 4, 2, 1, 2
    shape = (b, t) if token_level else (b,)
    rewards = torch.randn(shape, generator=gen)
    return rewards, mask, group_ids


@pytest.mark.parametrize("token_level", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_outcome_estimators_match_loop_reference(token_level: bool, seed: int) -> None:
    rewards, mask, g = random_batch(seed, token_level)
    kw = {"rewards": rewards, "mask": mask, "group_ids": g}
    for scale in ("group", "batch", "none"):
        torch.testing.assert_close(
            compute_advantages("grpo", scale=scale, clip=1.5, **kw),
            ref_grpo(rewards, mask, g, scale=scale, clip=1.5).float(),
        )
    torch.testing.assert_close(
        compute_advantages("dr_grpo", **kw), ref_grpo(rewards, mask, g, "none").float()
    )
    torch.testing.assert_close(compute_advantages("rloo", **kw), ref_rloo(rewards, mask, g).float())
    centred = ref_grpo(rewards, mask, g, "none")
    torch.testing.assert_close(
        compute_advantages("reinforce_pp_baseline", **kw),
        ref_whiten(centred, mask).float(),
        atol=1e-5,
        rtol=1e-5,
    )


@pytest.mark.parametrize("token_level", [False, True])
@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_token_estimators_match_loop_reference(token_level: bool, gamma: float) -> None:
    rewards, mask, g = random_batch(3, token_level)
    adv = compute_advantages("reinforce_pp", rewards=rewards, mask=mask, group_ids=g, gamma=gamma)
    torch.testing.assert_close(
        adv, ref_reinforce_pp(rewards, mask, gamma).float(), atol=1e-5, rtol=1e-5
    )
    values = torch.randn(mask.shape)
    out = compute_gae(rewards=rewards, values=values, mask=mask, gamma=gamma, lam=0.95)
    ref_adv, ref_ret = ref_gae(rewards, values, mask, gamma, 0.95)
    torch.testing.assert_close(out.advantages, ref_adv.float(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.returns, ref_ret.float(), atol=1e-5, rtol=1e-5)


def test_float64_rewards_give_float64_advantages() -> None:
    adv = compute_advantages(
        "grpo",
        rewards=torch.tensor([1.0, 2.0], dtype=torch.float64),
        mask=full_mask(2, 1),
        group_ids=ids([0, 0]),
    )
    assert adv.dtype == torch.float64


# ---------------------------------------------------------------------------------- properties

groups_strategy = st.lists(
    st.tuples(st.integers(-1000, 1000), st.floats(-100, 100, allow_nan=False)),
    min_size=1,
    max_size=24,
)


@given(groups_strategy, st.sampled_from(["group", "batch", "none"]))
def test_grpo_has_zero_mean_in_every_group_of_size_above_one(rows, scale) -> None:
    g = torch.tensor([gid % 5 for gid, _ in rows])
    rewards = torch.tensor([r for _, r in rows], dtype=torch.float64)
    adv = compute_advantages(
        "grpo", rewards=rewards, mask=full_mask(len(rows), 1), group_ids=g, scale=scale
    )[:, 0]
    assert torch.isfinite(adv).all()
    for gid in g.unique():
        members = g == gid
        if members.sum() > 1:
            assert abs(float(adv[members].mean())) < 1e-9
        else:
            assert float(adv[members]) == 0.0


@given(groups_strategy)
def test_rloo_sums_to_zero_in_every_group(rows) -> None:
    g = torch.tensor([gid % 4 for gid, _ in rows])
    rewards = torch.tensor([r for _, r in rows], dtype=torch.float64)
    adv = compute_advantages("rloo", rewards=rewards, mask=full_mask(len(rows), 1), group_ids=g)[
        :, 0
    ]
    for gid in g.unique():
        assert abs(float(adv[g == gid].sum())) < 1e-9


# ------------------------------------------------- std / eps conventions of Flow-GRPO and VRL


def test_grpo_population_std_with_flow_grpo_eps() -> None:
    # rewards 1, 2, 3: mean 2, population std sqrt(2/3) = 0.81650 (np.std), + 1e-4 (Flow-GRPO
    # stat_tracking.py: (r - mean) / (np.std(r) + 1e-4)) -> -1 / 0.81660 = -1.22459
    adv = compute_advantages(
        "grpo", rewards=torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64), mask=full_mask(3, 1),
        group_ids=ids([0, 0, 0]), std="population", eps=1e-4,
    )
    a = 1 / (math.sqrt(2 / 3) + 1e-4)
    torch.testing.assert_close(adv[:, 0], torch.tensor([-a, 0.0, a], dtype=torch.float64))
    assert abs(a - 1.22459) < 1e-5


def test_grpo_clamp_eps_mode_is_vrl_max_std_eps() -> None:
    # VRL (vrl/algorithms/advantages.py): (r - mean) / clamp(population std, min=eps).
    # group 0: 1, 3 -> population std 1 -> -1, 1 (exactly; "add" would give 1 / (1 + eps))
    # group 1: 0, 2e-9 -> std 1e-9 < eps = 1e-8 -> -1e-9 / 1e-8 = -0.1, 0.1
    rewards = torch.tensor([1.0, 3.0, 0.0, 2e-9], dtype=torch.float64)
    adv = compute_advantages(
        "grpo", rewards=rewards, mask=full_mask(4, 1), group_ids=ids([0, 0, 1, 1]),
        std="population", eps=1e-8, eps_mode="clamp",
    )
    torch.testing.assert_close(
        adv[:, 0], torch.tensor([-1.0, 1.0, -0.1, 0.1], dtype=torch.float64), rtol=1e-9, atol=0
    )


def test_grpo_batch_scale_with_population_std() -> None:
    # one std over the batch 0, 0, 2, 2: population std 1 (unbiased would be 1.1547)
    # groups {0, 2} and {0, 2}: mean 1 -> -1, +1 divided by (1 + 1e-4)
    adv = compute_advantages(
        "grpo", rewards=torch.tensor([0.0, 2.0, 0.0, 2.0]), mask=full_mask(4, 1),
        group_ids=ids([0, 0, 1, 1]), scale="batch", std="population", eps=1e-4,
    )
    torch.testing.assert_close(adv[:, 0], torch.tensor([-1.0, 1.0, -1.0, 1.0]) / (1 + 1e-4))


def test_grpo_bad_std_or_eps_mode_names_the_choices() -> None:
    kw = {"rewards": torch.ones(2), "mask": full_mask(2, 1), "group_ids": ids([0, 0])}
    with pytest.raises(ValueError, match="'unbiased' or 'population', got 'pop'"):
        compute_advantages("grpo", std="pop", **kw)
    with pytest.raises(ValueError, match="'add' or 'clamp', got 'max'"):
        compute_advantages("grpo", eps_mode="max", **kw)


def flow_grpo_stat_tracker(prompts: list[str], rewards: list[float]) -> list[float]:
    """Literal loop transcription of Flow-GRPO's PerPromptStatTracker.update (type='grpo',
    global_std=False): per prompt text, (r - mean) / (population std + 1e-4)."""
    out = [0.0] * len(rewards)
    for prompt in dict.fromkeys(prompts):
        members = [i for i, p in enumerate(prompts) if p == prompt]
        vals = [rewards[i] for i in members]
        mean = sum(vals) / len(vals)
        std = math.sqrt(sum((v - mean) ** 2 for v in vals) / len(vals)) + 1e-4
        for i in members:
            out[i] = (rewards[i] - mean) / std
    return out


def test_prompt_keyed_groups_reproduce_flow_grpo_stat_tracker() -> None:
    # two sampler groups (ids 0 and 1) drew the same prompt "a cat": Flow-GRPO pools them
    prompts = ["a cat", "a cat", "a dog", "a dog", "a cat", "a cat"]
    rewards = [0.1, 0.5, 0.3, 0.3, 0.9, 0.2]
    g = group_ids_from_keys(prompts)
    assert g.tolist() == [0, 0, 1, 1, 0, 0]
    adv = compute_advantages(
        "grpo", rewards=torch.tensor(rewards, dtype=torch.float64), mask=full_mask(6, 1),
        group_ids=g, std="population", eps=1e-4,
    )
    expected = torch.tensor(flow_grpo_stat_tracker(prompts, rewards), dtype=torch.float64)
    torch.testing.assert_close(adv[:, 0], expected)
    by_draw = compute_advantages(  # per sampler group: a different (and not Flow-GRPO's) answer
        "grpo", rewards=torch.tensor(rewards, dtype=torch.float64), mask=full_mask(6, 1),
        group_ids=ids([0, 0, 1, 1, 2, 2]), std="population", eps=1e-4,
    )
    assert not torch.allclose(by_draw, adv)


def test_group_ids_from_keys_numbers_by_first_appearance() -> None:
    ids_ = group_ids_from_keys([("p", 1), "b", ("p", 1), 3, "b"])
    assert ids_.dtype == torch.int64
    assert ids_.tolist() == [0, 1, 0, 2, 1]
    assert group_ids_from_keys([]).tolist() == []


# ------------------------------------------------------------- Flow-GRPO zero-advantage filter


def flow_grpo_mask(advantages: torch.Tensor, num_batches: int) -> torch.Tensor:
    """Literal transcription of Flow-GRPO train_sd3.py's filter (global torch RNG)."""
    mask = advantages.abs().sum(dim=1) != 0
    true_count = mask.sum()
    if true_count % num_batches != 0:
        false_indices = torch.where(~mask)[0]
        num_to_change = num_batches - (true_count % num_batches)
        if len(false_indices) >= num_to_change:
            random_indices = torch.randperm(len(false_indices))[:num_to_change]
            mask[false_indices[random_indices]] = True
    return mask


def test_nonzero_advantages_hand_worked() -> None:
    adv = torch.tensor([0.0, 1.0, 0.0, -2.0, 0.0, 0.5])
    # 3 non-zero, 3 batches: a multiple already, nothing put back
    assert nonzero_advantage_indices(adv, num_batches=3).tolist() == [1, 3, 5]
    # 3 non-zero, 2 batches: one of the zero samples 0, 2, 4 is put back
    kept = nonzero_advantage_indices(adv, num_batches=2, generator=torch.Generator().manual_seed(0))
    assert len(kept) == 4 and {1, 3, 5} < set(kept.tolist())
    assert kept.tolist() == sorted(kept.tolist())
    # 3 non-zero, 4 batches, only one zero sample needed and present
    assert nonzero_advantage_indices(torch.tensor([1.0, 1.0, 1.0, 0.0]), num_batches=4).tolist() == [0, 1, 2, 3]


def test_nonzero_advantages_edge_cases_as_flow_grpo() -> None:
    # 3 non-zero, 5 batches: 2 zero samples needed, 1 present -> none put back, K = 3
    assert nonzero_advantage_indices(torch.tensor([1.0, 1.0, 1.0, 0.0]), num_batches=5).tolist() == [0, 1, 2]
    # every advantage zero: nothing to train
    assert nonzero_advantage_indices(torch.zeros(4), num_batches=2).tolist() == []
    # [N, T] advantages (one per denoising step): a sample is zero when all its steps are
    adv = torch.tensor([[0.0, 0.0], [0.0, 1.0], [2.0, 2.0]])
    assert nonzero_advantage_indices(adv, num_batches=2).tolist() == [1, 2]
    with pytest.raises(ValueError, match="num_batches must be >= 1, got 0"):
        nonzero_advantage_indices(adv, num_batches=0)


@pytest.mark.parametrize("seed", range(5))
def test_nonzero_advantages_match_flow_grpo_with_the_same_rng_state(seed: int) -> None:
    rng = torch.Generator().manual_seed(100 + seed)
    adv = torch.randn(24, 3, generator=rng) * (torch.rand(24, 1, generator=rng) < 0.6)  # [24, 3]
    torch.manual_seed(seed)
    expected = torch.where(flow_grpo_mask(adv, num_batches=4))[0]
    kept = nonzero_advantage_indices(adv, num_batches=4, generator=torch.Generator().manual_seed(seed))
    assert kept.tolist() == expected.tolist()
    assert len(kept) % 4 == 0


# ------------------------------------------------------------------- reward aggregations (GDPO)


def test_normalize_then_sum_hand_worked() -> None:
    # Groups 5 (rows 0, 2) and 9 (rows 1, 3), interleaved; components (c1, c2), weights (1, 0.5).
    objectives = torch.tensor([[1.0, 0.0], [1.0, 2.0], [0.0, 4.0], [1.0, 0.0]])  # [4, 2]
    eps = 1e-4
    # A group of 2 values x, y: mean (x+y)/2, Bessel std |x-y|/sqrt(2), z = +-(|x-y|/2) / (std + eps).
    a1 = 0.5 / (math.sqrt(0.5) + eps)  # group 5, c1 = (1, 0): z = (+a1, -a1), ~0.70701
    a2 = 2.0 / (math.sqrt(8.0) + eps)  # group 5, c2 = (0, 4): z = (-a2, +a2), ~0.70708
    a3 = 1.0 / (math.sqrt(2.0) + eps)  # group 9, c2 = (2, 0): z = (+a3, -a3); c1 = (1, 1): std 0, z = 0
    s = [a1 - 0.5 * a2, 0.5 * a3, -a1 + 0.5 * a2, -0.5 * a3]  # weighted sums, ~(0.35347, 0.35353, -.., -..)
    mean = sum(s) / 4  # 0: each group's z sum to 0
    std = math.sqrt(sum((v - mean) ** 2 for v in s) / 3)  # ~0.40818
    expected = torch.tensor([(v - mean) / (std + eps) for v in s])  # ~(0.86574, 0.86589, -0.86574, -0.86589)
    out = normalize_then_sum(objectives, [1.0, 0.5], torch.tensor([5, 9, 5, 9]))
    torch.testing.assert_close(out, expected)
    # Summed first (1, 2, 4, 1), row 0 would lose to row 2 (c2's spread of 4 drowns c1's 1);
    # normalised first, c1 at weight 1 beats c2 at weight 0.5: row 0 wins its group.
    assert out[0] > 0 > out[2]


def test_normalize_then_sum_missing_components() -> None:
    nan = math.nan
    # Row 3 has no component: NaN out of every statistic, advantage 0. Group 1's c2 has one value
    # (row 3 lacks it): its std is NaN, so c2 adds nothing to group 1's rows.
    objectives = torch.tensor([[1.0, 0.0], [0.0, 2.0], [3.0, 1.0], [nan, nan], [0.0, nan]])  # [5, 2]
    group_ids = torch.tensor([0, 0, 1, 1, 1])
    out = normalize_then_sum(objectives, torch.tensor([2.0, 1.0]), group_ids)
    eps = 1e-4
    z = [2 * 0.5 / (math.sqrt(0.5) + eps) - 1 / (math.sqrt(2) + eps)]  # row 0: c1 +, c2 -
    z += [-z[0]]  # row 1
    z3 = 2 * 1.5 / (math.sqrt(4.5) + eps)  # group 1 c1 = (3, 0): mean 1.5, std sqrt(4.5)
    s = [z[0], z[1], z3, -z3]  # rows 0, 1, 2, 4
    std = math.sqrt(sum(v * v for v in s) / 3)  # mean 0
    expected = torch.tensor([s[0], s[1], s[2], 0.0, s[3]]) / (std + eps)
    torch.testing.assert_close(out, expected)


def _normalize_then_sum_loop(objectives, weights, group_ids, eps=1e-4) -> list[float]:
    """Loop reference of GDPO as TRL computes it (nanstd: Bessel, NaN below 2 values)."""

    def mean_std(values):
        v = [x for x in values if not math.isnan(x)]
        if not v:
            return math.nan, math.nan
        m = sum(v) / len(v)
        return m, math.sqrt(sum((x - m) ** 2 for x in v) / (len(v) - 1)) if len(v) > 1 else math.nan

    rows, k = objectives.shape
    z = [[math.nan] * k for _ in range(rows)]
    for members in ref_groups(group_ids).values():
        for j in range(k):
            m, sd = mean_std([float(objectives[i, j]) for i in members])
            for i in members:
                z[i][j] = (float(objectives[i, j]) - m) / (sd + eps)
    s = [math.nan if all(math.isnan(float(x)) for x in objectives[i]) else
         sum(w * v for w, v in zip(weights, z[i], strict=True) if not math.isnan(v)) for i in range(rows)]
    m, sd = mean_std(s)
    return [0.0 if math.isnan(v) or math.isnan(sd) else (v - m) / (sd + eps) for v in s]


@given(st.integers(0, 10_000))
def test_normalize_then_sum_matches_a_loop_reference(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    rows, k = 12, 3
    objectives = torch.randn(rows, k, generator=gen, dtype=torch.float64)  # [12, 3]
    objectives[torch.rand(rows, k, generator=gen) < 0.2] = math.nan  # some components missing
    group_ids = torch.randint(0, 4, (rows,), generator=gen) * 7 - 3  # any ids, any order, any sizes
    weights = [1.0, 0.5, 2.0]
    out = normalize_then_sum(objectives, weights, group_ids)
    torch.testing.assert_close(out, torch.tensor(_normalize_then_sum_loop(objectives, weights, group_ids),
                                                 dtype=torch.float64))


def test_reward_aggregations_registry() -> None:
    assert REWARD_AGGREGATIONS.names() == ["normalize_then_sum", "sum_then_normalize"]
    assert REWARD_AGGREGATIONS["sum_then_normalize"](None, None, torch.zeros(2)) is None  # the estimator runs
    assert REWARD_AGGREGATIONS.trait("normalize_then_sum", "replaces_estimator")
    with pytest.raises(ValueError, match=r"weights must be \[K\]=2"):
        normalize_then_sum(torch.zeros(4, 2), [1.0], torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="unknown reward aggregation 'gdpo'; valid names: normalize_then_sum"):
        REWARD_AGGREGATIONS["gdpo"]

