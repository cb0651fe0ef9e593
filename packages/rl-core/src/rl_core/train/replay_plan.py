"""The micro-batch plan of a replayed update (`replay_update`'s `plan`): which of this process's
stored samples each optimizer step trains, in micro-batches of one sampled batch each, and how
samples with a zero advantage are handled. diffusion-grpo's SD3 and Janus families share it.

    plan = plan_micro_batches(acc, sizes=[4, 4], advantages=adv, zero_adv="drop", micro_batch_size=2,
                              accumulation=2, seed=0, epoch=3)
    plan[0]  # [(sampled batch k, its rows [b], loss weight), ...]: the first optimizer step's

Every process plans the same number of optimizer steps (`rl_core.train.optimizer_step` pairs
the micro-batch counts); a process with fewer micro-batches repeats its last one with weight 0.
`accelerator` None plans for one process.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import torch
from torch import Tensor

from rl_core.advantages import nonzero_advantage_indices
from rl_core.train.groups import gather_rows
from rl_core.train.seeding import sample_seed

__all__ = ["Micro", "by_trajectory", "chunked_steps", "flow_grpo_steps", "plan_micro_batches", "trained_samples"]

Micro = tuple[int, Tensor, float]  # (sampled batch, its rows [b], loss weight)


def plan_micro_batches(accelerator: Any, sizes: Sequence[int], advantages: Tensor, *,
                       zero_adv: Literal["drop", "flow_grpo"], micro_batch_size: int, accumulation: int, seed: int,
                       epoch: int) -> list[list[Micro]]:
    """The epoch's optimizer steps, each a list of micro-batches of this process's sampled
    batches (`sizes`: samples per sampled batch; `advantages` `[N]`, in sample order). How
    zero-advantage samples are handled is `zero_adv`:

    - `drop`: the kept (non-zero advantage) rows of each sampled batch in chunks of
      `micro_batch_size`, `accumulation` chunks per step (`chunked_steps`).
    - `flow_grpo`: `flow_grpo_steps`.
    """
    if zero_adv == "flow_grpo":
        return flow_grpo_steps(accelerator, sizes, advantages, micro_batch_size=micro_batch_size,
                               accumulation=accumulation, seed=seed, epoch=epoch)
    return chunked_steps(accelerator, sizes, (advantages != 0).nonzero().flatten(), micro_batch_size=micro_batch_size,
                         accumulation=accumulation)


def chunked_steps(accelerator: Any, sizes: Sequence[int], rows: Tensor, *, micro_batch_size: int,
                  accumulation: int) -> list[list[Micro]]:
    """This process's sorted sample indices `rows` `[b]` in chunks of `micro_batch_size` of one
    sampled batch each, `accumulation` chunks per optimizer step; a process with fewer chunks
    repeats its last one with weight 0, so the steps line up."""
    plan = by_trajectory(rows, sizes, micro_batch_size)
    count = len(plan)
    if accelerator is not None:
        count = accelerator.gather(torch.tensor([len(plan)], device=accelerator.device)).max().item()
    filler = (plan[-1][0], plan[-1][1], 0.0) if plan else (0, torch.tensor([0]), 0.0)
    plan += [filler] * (count - len(plan))
    return [plan[start:start + accumulation] for start in range(0, len(plan), accumulation)]


def flow_grpo_steps(accelerator: Any, sizes: Sequence[int], advantages: Tensor, *, micro_batch_size: int,
                    accumulation: int, seed: int, epoch: int) -> list[list[Micro]]:
    """Flow-GRPO's zero-advantage filter (`scripts/train_sd3.py`) over the global batch: the
    non-zero advantages kept, randomly chosen zero ones put back until the count divides into the
    B = samples per process / micro_batch_size batches (`nonzero_advantage_indices`), shuffled,
    cut into B equal batches, `accumulation` per optimizer step. The draws are seeded with
    (seed, epoch): the same on every process and on resume. Every kept sample, refilled ones
    included (advantage 0, still under the KL term), weighs the same."""
    everything, own = gather_rows(advantages, accelerator)  # [N * world]
    num_batches = sum(sizes) // micro_batch_size
    generator = torch.Generator().manual_seed(sample_seed(seed, epoch))
    kept = nonzero_advantage_indices(everything.cpu(), num_batches=num_batches, generator=generator)  # [K]
    shuffled = kept[torch.randperm(len(kept), generator=generator)]  # [K]
    batches = shuffled.tensor_split(num_batches)
    steps = []
    for first in range(0, num_batches, accumulation):
        chosen = torch.cat(batches[first:first + accumulation])  # [b] global indices
        local = chosen[(chosen >= own.start) & (chosen < own.stop)].sort().values - own.start  # [b_r]
        steps.append(by_trajectory(local, sizes, micro_batch_size))
    return steps


def by_trajectory(rows: Tensor, sizes: Sequence[int], size: int) -> list[Micro]:
    """This process's sorted sample indices `[b]` -> micro-batches of at most `size` rows of one
    sampled batch each; sampled batches with no row get none. (SD3 regroups each optimizer
    step's rows into forwards across sampled batches: `rl_rollout.diffusion.pack_rows`.)"""
    out, start = [], 0
    for k, n in enumerate(sizes):
        mine = rows[(rows >= start) & (rows < start + n)] - start  # [b_k]
        out += [(k, chunk, 1.0) for chunk in mine.split(size) if len(chunk)]
        start += n
    return out


def trained_samples(plan: Sequence[Sequence[Micro]], accelerator: Any = None) -> float:
    """The samples a plan trains, weighted (a filler's 0), summed over every process."""
    trained = torch.tensor(float(sum(len(rows) * weight for micro in plan for _, rows, weight in micro)))
    return float(trained if accelerator is None else accelerator.reduce(trained.to(accelerator.device), reduction="sum"))
