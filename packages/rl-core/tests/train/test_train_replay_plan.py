"""`rl_core.train.replay_plan`: the micro-batch plan of a replayed update, on one process
(diffusion-grpo's tests run it over 2 processes and pin its presets' plans)."""

from __future__ import annotations

import torch

from rl_core.train import by_trajectory, chunked_steps, flow_grpo_steps, plan_micro_batches


def _rows(plan):
    return [[(k, rows.tolist(), weight) for k, rows, weight in step] for step in plan]


def test_rows_split_by_sampled_batch_in_chunks() -> None:
    """Samples 0-3 are sampled batch 0, 4-7 batch 1: rows 0, 2, 3 and 5, 6, 7 in chunks of 2."""
    plan = by_trajectory(torch.tensor([0, 2, 3, 5, 6, 7]), [4, 4], 2)
    assert [(k, rows.tolist(), w) for k, rows, w in plan] == [(0, [0, 2], 1.0), (0, [3], 1.0), (1, [1, 2], 1.0),
                                                              (1, [3], 1.0)]
    assert by_trajectory(torch.tensor([5]), [4, 4], 2)[0][0] == 1  # a batch with no row gets none


def test_drop_keeps_the_nonzero_advantages_in_steps_of_accumulated_chunks() -> None:
    adv = torch.tensor([1.0, 0.0, -1.0, 2.0, 0.0, 0.5, -0.5, 1.0])  # [8]
    plan = plan_micro_batches(None, [4, 4], adv, zero_adv="drop", micro_batch_size=2, accumulation=3, seed=0, epoch=0)
    assert _rows(plan) == [[(0, [0, 2], 1.0), (0, [3], 1.0), (1, [1, 2], 1.0)], [(1, [3], 1.0)]]
    assert _rows(chunked_steps(None, [4, 4], torch.tensor([], dtype=torch.long), micro_batch_size=2,
                               accumulation=3)) == []  # nothing kept: no step


def test_flow_grpo_refills_zero_advantages_into_equal_seeded_steps() -> None:
    """Samples 0 and 3 have an advantage; 8 samples in micro-batches of 2 make 4 batches, so 2
    zero ones are put back: 2 optimizer steps (2 batches each) train 2 samples each, both kept
    ones among them, drawn again alike for the same (seed, epoch)."""
    adv = torch.tensor([1.0, 0.0, 0.0, -1.0, 0.0, 0.0, 0.0, 0.0])  # [8]

    def plan(epoch: int) -> list:
        return _rows(flow_grpo_steps(None, [4, 4], adv, micro_batch_size=2, accumulation=2, seed=7, epoch=epoch))

    first = plan(0)
    assert len(first) == 2 and [sum(len(rows) for _, rows, _ in step) for step in first] == [2, 2]
    trained = sorted(k * 4 + r for step in first for k, rows, _ in step for r in rows)
    assert len(set(trained)) == 4 and {0, 3} <= set(trained)
    assert plan(0) == first and first == _rows(plan_micro_batches(
        None, [4, 4], adv, zero_adv="flow_grpo", micro_batch_size=2, accumulation=2, seed=7, epoch=0))
