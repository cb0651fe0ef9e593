"""Run by test_train_phases.py under `accelerate launch --multi_gpu --num_processes 2` (gloo).

Rank 0 holds 3 samples, rank 1 holds 5 (uneven, as when ranks drop different prompts). Writes
`result-<rank>.pt` with this rank's advantages (grpo, and normalize_then_sum over two reward
components), the mean of the finite scores over both ranks and the weights after one optimizer step, for the test to compare with one process
holding all 8 samples.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from accelerate import Accelerator
from phases_case import GROUPS, OBJECTIVES, SCORES, WEIGHTS, loss_fn, make_model, split_rows

from rl_core.train import (
    NonFiniteGuard,
    UpdateStats,
    end_training,
    gathered_means,
    group_advantages,
    optimizer_step,
)

acc = Accelerator(cpu=True)
rank = acc.process_index
rows = [0, 1, 2] if rank == 0 else [3, 4, 5, 6, 7]
result = group_advantages("grpo", SCORES[rows], GROUPS[rows], accelerator=acc)
gdpo = group_advantages("grpo", SCORES[rows], GROUPS[rows], accelerator=acc, aggregation="normalize_then_sum",
                        objectives=OBJECTIVES[rows], weights=WEIGHTS)
model = make_model()
model, optimizer = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.5))
stats = UpdateStats()
micro = split_rows(rows, 2)  # rank 0: 2 micro-batches, rank 1: 3
optimizer_step(acc, model, optimizer, [(m, result.advantages[[rows.index(i) for i in m]]) for m in micro],
               loss_fn(model), units=lambda m: float(len(m[0])), grad_clip=None,
               guard=NonFiniteGuard(), stats=stats)
means = gathered_means({"score": [float(x) for x in SCORES[rows] if x == x], "empty": []}, acc)  # NaN left out
torch.save({"adv": result.advantages, "metrics": result.metrics, "stats": stats.reduce(acc), "means": means,
            "gdpo_adv": gdpo.advantages, "gdpo_metrics": gdpo.metrics,
            "weight": acc.unwrap_model(model).weight.detach().clone()}, Path(sys.argv[1]) / f"result-{rank}.pt")
end_training(acc)
