"""Which images each optimizer step of a diffusion-grpo epoch trains (`train.zero_adv`), and
which denoising steps are replayed (`train.timestep_fraction`)."""

from __future__ import annotations

from typing import Any

import torch
from grpo_config import TrainConfig

from rl_core.advantages import nonzero_advantage_indices
from rl_core.train import gather_rows, sample_seed
from rl_rollout.diffusion import Trajectory

Micro = tuple[int, torch.Tensor, float]  # (trajectory index, its rows [b], loss weight)


def plan_micro_batches(t: TrainConfig, acc: Any, sizes: list[int], adv: torch.Tensor, epoch: int) -> list[list[Micro]]:
    """The epoch's optimizer steps, each a list of micro-batches of this process's trajectories
    (`sizes`: images per trajectory). Every process plans the same number of steps. How
    zero-advantage images are handled is `train.zero_adv`:

    - `drop`: the kept (non-zero advantage) rows of each trajectory in chunks of
      `micro_batch_size`, `gradient_accumulation_steps` chunks per step; a process with fewer
      chunks repeats its last one with weight 0, so the steps line up.
    - `flow_grpo`: `flow_grpo_steps`.
    """
    if t.zero_adv == "flow_grpo":
        return flow_grpo_steps(t, acc, sizes, adv, epoch)
    plan = by_trajectory((adv != 0).nonzero().flatten(), sizes, t.micro_batch_size)
    count = acc.gather(torch.tensor([len(plan)], device=acc.device)).max().item()
    filler = (plan[-1][0], plan[-1][1], 0.0) if plan else (0, torch.tensor([0]), 0.0)
    plan += [filler] * (count - len(plan))
    accum = t.gradient_accumulation_steps
    return [plan[start:start + accum] for start in range(0, len(plan), accum)]


def flow_grpo_steps(t: TrainConfig, acc: Any, sizes: list[int], adv: torch.Tensor, epoch: int) -> list[list[Micro]]:
    """Flow-GRPO's zero-advantage filter (`scripts/train_sd3.py`) over the global batch: keep the
    non-zero advantages, put back randomly chosen zero ones until the kept count divides into
    the B = images per process / micro_batch_size batches of the epoch
    (`rl_core.advantages.nonzero_advantage_indices`), shuffle, cut into B equal batches and
    train `gradient_accumulation_steps` batches per optimizer step. The random draws come from
    a generator seeded with (train.seed, epoch): the same selection on every process, and on
    resume. A process trains its own images of each batch (grouped by trajectory, at most
    micro_batch_size per forward); every kept image, refilled ones included (advantage 0,
    still under the KL term), weighs the same in the epoch."""
    everything, own = gather_rows(adv, acc)  # [N * world]
    num_batches = sum(sizes) // t.micro_batch_size
    generator = torch.Generator().manual_seed(sample_seed(t.seed, epoch))
    kept = nonzero_advantage_indices(everything.cpu(), num_batches=num_batches, generator=generator)  # [K]
    shuffled = kept[torch.randperm(len(kept), generator=generator)]  # [K]
    batches = shuffled.tensor_split(num_batches)
    steps = []
    for first in range(0, num_batches, t.gradient_accumulation_steps):
        chosen = torch.cat(batches[first:first + t.gradient_accumulation_steps])  # [b] global indices
        local = chosen[(chosen >= own.start) & (chosen < own.stop)].sort().values - own.start  # [b_r]
        steps.append(by_trajectory(local, sizes, t.micro_batch_size))
    return steps


def by_trajectory(rows: torch.Tensor, sizes: list[int], size: int) -> list[Micro]:
    """This process's sorted sample indices `[b]` -> micro-batches of at most `size` rows of one
    trajectory each (a forward replays one trajectory); trajectories with no row get none."""
    out, start = [], 0
    for k, n in enumerate(sizes):
        mine = rows[(rows >= start) & (rows < start + n)] - start  # [b_k]
        out += [(k, chunk, 1.0) for chunk in mine.split(size) if len(chunk)]
        start += n
    return out


def trained_steps(traj: Trajectory, fraction: float) -> list[int]:
    limit = max(1, int(traj.num_steps * fraction))
    return [k for k in range(limit) if bool(traj.sde_steps[k])]
