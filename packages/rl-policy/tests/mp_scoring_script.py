"""Run by test_scoring.py under `accelerate launch --multi_gpu --num_processes 2` (gloo): rank 0
scores prompts 0 and 1 of test_scoring's case, rank 1 prompt 2; each writes its group ids, its
advantages (statistics over both) and the response metrics to `result-<rank>.pt`."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from accelerate import Accelerator
from test_scoring import LENGTHS, SCORES, answers, results

from rl_core.train import end_training, group_advantages
from rl_policy.scoring import group_scores

acc = Accelerator(cpu=True)
rows = slice(0, 4) if acc.process_index == 0 else slice(4, 6)
gens = answers(LENGTHS[rows], n=2)  # request indices from 0 on each process
scores = group_scores(acc, results(SCORES[rows]), gens, prompts_per_rank=2, estimator="grpo")
adv = group_advantages(scores.estimator, scores.rewards, scores.group_ids, accelerator=acc)
torch.save({"groups": scores.group_ids.tolist(), "advantages": adv.advantages.tolist(), "metrics": scores.metrics},
           Path(sys.argv[1]) / f"result-{acc.process_index}.pt")
end_training(acc)
