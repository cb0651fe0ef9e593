"""`replay_update`, the update SD3 and Janus drive through a replay callback, on a linear model:
two units per sample (log-sigmoid of two outputs), a hand-worked first step, micro-batch splits
that do not change it, the first-replay check, zero-weight fillers, the non-finite guard."""

from __future__ import annotations

import math

import pytest
import torch
from accelerate import Accelerator

from rl_core.losses import aggregate
from rl_core.train import NonFiniteError, NonFiniteGuard
from rl_core.train.replay_update import Replay, RolloutCorrection, replay_update

X = torch.arange(8 * 3, dtype=torch.float32).reshape(8, 3) / 10  # [8, 3]
ADV = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, 0.0, -2.0, 1.0])  # [8]


def _run(plan: list[list[tuple[list[int], float]]], *, adv: torch.Tensor = ADV, old_shift: float = 0.0,
         kl_beta: float = 0.0, tolerance: float | None = 1e-6, guard: NonFiniteGuard | None = None,
         rescore: bool = False, correction: RolloutCorrection = RolloutCorrection()):
    acc = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2, bias=False)
    start = model.weight.detach().clone()
    with torch.no_grad():
        old = torch.nn.functional.logsigmoid(model(X)) + old_shift  # [8, 2] the rollout's log-probs
    model, optimizer = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.5))
    steps: list[int] = []

    def replay(micro: tuple[list[int], float]) -> Replay:
        rows, weight = micro
        logp = torch.nn.functional.logsigmoid(model(X[rows]))  # [b, 2]
        return Replay(logp, old[rows], adv[rows], weight, kl=(logp - old[rows]) ** 2)

    def trainer_logp(micro: tuple[list[int], float]) -> torch.Tensor:
        return torch.nn.functional.logsigmoid(model(X[micro[0]]))  # [b, 2]

    metrics = replay_update(acc, model, optimizer, plan, replay, units=lambda m: 2.0 * len(m[0]) * m[1],
                            clip_range=0.2, kl_beta=kl_beta, grad_clip=None, guard=guard or NonFiniteGuard(),
                            filler=([0], 0.0), tolerance=tolerance, after_step=lambda: steps.append(1),
                            rescore=trainer_logp if rescore else None, correction=correction)
    return start, acc.unwrap_model(model).weight.detach().clone(), metrics, len(steps)


def test_one_step_by_hand_and_any_micro_batch_split_gives_it() -> None:
    start, weight, metrics, stepped = _run([[(list(range(8)), 1.0)]])
    # on-policy ratio 1: loss = -sum_i adv_i * sum_u logsigmoid(w_u . x_i) / 16, grad by hand
    sig = torch.sigmoid(X @ start.T)  # [8, 2]
    grad = -((ADV[:, None] * (1 - sig)).T @ X) / 16  # [2, 3]
    torch.testing.assert_close(weight, start - 0.5 * grad)
    assert stepped == 1 and metrics["optimizer_steps"] == 1.0 and metrics["replay/engine_diff_mean"] == 0.0
    _, split, _, _ = _run([[([0, 1, 2], 1.0), ([3, 4, 5], 1.0), ([6, 7], 1.0)]])
    torch.testing.assert_close(split, weight, atol=1e-7, rtol=0)


def test_a_zero_weight_filler_trains_nothing() -> None:
    _, plain, _, _ = _run([[([0, 1, 2, 3], 1.0)]])
    _, filled, _, _ = _run([[([0, 1, 2, 3], 1.0), ([4, 5, 6, 7], 0.0)]])
    torch.testing.assert_close(filled, plain, atol=1e-7, rtol=0)


def test_two_optimizer_steps_run_after_step_twice_and_the_kl_term_counts() -> None:
    _, without, _, stepped = _run([[([0, 1, 2, 3], 1.0)], [([4, 5, 6, 7], 1.0)]])
    assert stepped == 2
    _, with_kl, metrics, _ = _run([[([0, 1, 2, 3], 1.0)], [([4, 5, 6, 7], 1.0)]], kl_beta=10.0)
    assert metrics["loss/kl"] > 0  # the second step is off the sampling weights
    assert not torch.allclose(with_kl, without)


def test_a_replay_that_disagrees_with_the_rollout_stops_before_the_first_step() -> None:
    with pytest.raises(RuntimeError, match=r"epoch 0: first replay: mean \|engine logp - trainer logp\| = 0.001"):
        replay_update_with_what()
    _, _, metrics, _ = _run([[(list(range(8)), 1.0)]], old_shift=1e-3, tolerance=None)  # no check asked for
    assert "replay/engine_diff_mean" not in metrics


def replay_update_with_what() -> None:
    acc = Accelerator(cpu=True)
    model = torch.nn.Linear(3, 2, bias=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)

    def replay(micro: list[int]) -> Replay:
        logp = torch.nn.functional.logsigmoid(model(X[micro]))
        return Replay(logp, logp.detach() + 1e-3, ADV[micro])

    replay_update(acc, model, optimizer, [[[0, 1]]], replay, units=lambda m: 2.0 * len(m), clip_range=0.2,
                  kl_beta=0.0, grad_clip=1.0, guard=NonFiniteGuard(), filler=[0], tolerance=1e-4,
                  what="epoch 0: first replay")


def test_nonfinite_advantages_skip_the_step_and_the_guard_stops_the_run() -> None:
    guard = NonFiniteGuard(max_consecutive=2)
    nan = torch.full((8,), math.nan)
    start, weight, metrics, stepped = _run([[(list(range(8)), 1.0)]], adv=nan, guard=guard)
    assert torch.equal(start, weight) and stepped == 0 and metrics["nonfinite/skipped_steps"] == 1.0
    with pytest.raises(NonFiniteError, match="2 optimizer steps in a row"):
        _run([[(list(range(8)), 1.0)]], adv=nan, guard=guard)


def test_the_kl_term_sums_as_token_mean_aggregation_does() -> None:
    """The per-unit KL is reduced per sample first, then over samples: bit for bit what
    `aggregate(kl, mask, "token-mean")` gives (Janus's per-token KL), where one flat sum of the
    same values rounds differently."""
    acc = Accelerator(cpu=True)
    torch.manual_seed(3)  # weights whose flat sum rounds differently (checked below)
    model = torch.nn.Linear(3, 576, bias=False)  # 576 units per sample: Janus-Pro's image tokens
    kls: list[torch.Tensor] = []

    def replay(rows: list[int]) -> Replay:
        logp = torch.nn.functional.logsigmoid(model(X[rows]))  # [b, 576]
        kls.append(-logp.detach())
        return Replay(logp, logp.detach(), ADV[rows], kl=-logp)

    metrics = replay_update(acc, model, torch.optim.SGD(model.parameters(), lr=0.0), [[list(range(8))]], replay,
                            units=lambda m: 576.0 * len(m), clip_range=0.2, kl_beta=1.0, grad_clip=None,
                            guard=NonFiniteGuard(), filler=[0])
    num_valid = torch.tensor(576.0 * 8)
    expected = aggregate(kls[0], torch.ones_like(kls[0]), "token-mean", num_valid=num_valid)
    assert metrics["loss/kl"] == float(expected)
    assert float(kls[0].sum() / num_valid) != float(expected)  # a flat sum would not be bit-identical


def test_a_log_ratio_replaces_the_ratio_and_policy_scale_scales_the_policy_loss() -> None:
    """GRPO-Guard's route: at the sampling weights (ratio 1) exp(x / 2) has gradient 1/2 of x's,
    so `log_ratio = (logp - old) / 2` with `policy_scale = 2` takes the plain step exactly; the
    first-replay check still reads `logp` against `old_logp` (a shifted old log-prob stops it)."""
    def run(halve: bool, old_shift: float = 0.0, tolerance: float | None = 1e-6):
        acc = Accelerator(cpu=True)
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 2, bias=False)
        with torch.no_grad():
            old = torch.nn.functional.logsigmoid(model(X)) + old_shift  # [8, 2]
        model, optimizer = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.5))

        def replay(rows: list[int]) -> Replay:
            logp = torch.nn.functional.logsigmoid(model(X[rows]))  # [b, 2]
            if not halve:
                return Replay(logp, old[rows], ADV[rows])
            return Replay(logp, old[rows], ADV[rows], log_ratio=(logp - old[rows] + old_shift) / 2, policy_scale=2.0)

        metrics = replay_update(acc, model, optimizer, [[list(range(8))]], replay, units=lambda m: 2.0 * len(m),
                                clip_range=0.2, kl_beta=0.0, grad_clip=None, guard=NonFiniteGuard(), filler=[0],
                                tolerance=tolerance, what="guarded replay")
        return acc.unwrap_model(model).weight.detach().clone(), metrics

    plain, plain_metrics = run(halve=False)
    halved, halved_metrics = run(halve=True)
    torch.testing.assert_close(halved, plain, atol=1e-7, rtol=0)
    assert halved_metrics["loss/policy"] == pytest.approx(2 * plain_metrics["loss/policy"])  # 2 x -mean(adv x 1)
    with pytest.raises(RuntimeError, match=r"guarded replay: mean \|engine logp - trainer logp\| = 0.001"):
        run(halve=True, old_shift=1e-3)


def test_a_rescored_update_trains_on_the_trainers_log_probs_and_corrects_the_engines_gap() -> None:
    """The engine's log-probs sit d = 0.1 above the trainer's on every unit (an FP8 rollout, say).
    Rescored, the ratio's old log-probs are the trainer's: the first replay passes a 1e-6
    tolerance and, uncorrected, the step is the on-policy one. The gap is logged as the engine's
    (`replay/engine_diff_*`): |d|, and the k3 KL e^-d - 1 + d. TIS weighs every unit by e^-d, so the SGD step shrinks by that factor;
    IcePop's mask [0.5, 2] keeps them (e^-0.1 = 0.905) and at d = 1 (e^-1 = 0.37) drops them all."""
    d = 0.1
    start, on_policy, _, _ = _run([[(list(range(8)), 1.0)]])
    _, rescored, metrics, _ = _run([[(list(range(8)), 1.0)]], old_shift=d, rescore=True)
    torch.testing.assert_close(rescored, on_policy, atol=1e-7, rtol=0)
    assert metrics["replay/engine_diff_mean"] == pytest.approx(d) and metrics["replay/engine_diff_max"] == pytest.approx(d)
    assert metrics["replay/engine_kl"] == pytest.approx(math.exp(-d) - 1 + d, rel=1e-4)
    _, tis, metrics, _ = _run([[(list(range(8)), 1.0)]], old_shift=d, rescore=True,
                              correction=RolloutCorrection("token_truncate", None, 3.0))
    torch.testing.assert_close(tis, start + math.exp(-d) * (on_policy - start), atol=1e-6, rtol=0)
    assert metrics["policy/is_ratio_mean"] == pytest.approx(math.exp(-d), rel=1e-5)
    _, kept, metrics, _ = _run([[(list(range(8)), 1.0)]], old_shift=d, rescore=True,
                               correction=RolloutCorrection("token_mask", 0.5, 2.0))
    assert metrics["policy/is_masked"] == 0.0 and not torch.equal(kept, start)
    _, masked, metrics, _ = _run([[(list(range(8)), 1.0)]], old_shift=1.0, rescore=True,
                                 correction=RolloutCorrection("token_mask", 0.5, 2.0))
    assert metrics["policy/is_masked"] == 1.0 and torch.equal(masked, start)
    with pytest.raises(KeyError, match="rollout correction"):
        _run([[(list(range(8)), 1.0)]], rescore=True, correction=RolloutCorrection("tis"))
