"""Run by test_training.py under `accelerate launch --multi_gpu --num_processes 2` (gloo): each
process updates the tiny Qwen3 on 2 of the 4 rollouts; rank 0 writes the weights and metrics."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from accelerate import Accelerator
from test_training import ADVANTAGES

from rl_core.train import NonFiniteGuard, end_training
from rl_models import tiny
from rl_models.text import load_causal_lm
from rl_policy.training import LossOptions, Policy, token_update

out = Path(sys.argv[1])
acc = Accelerator(cpu=True)
torch.manual_seed(0)
model, _ = load_causal_lm(str(tiny.build("qwen3")), dtype="float32")
policy, optimizer = acc.prepare(Policy(model), torch.optim.AdamW(model.parameters(), lr=1e-3))
mine = slice(2 * acc.process_index, 2 * acc.process_index + 2)
rollouts = torch.load(out / "rollouts.pt", weights_only=False)[mine]
metrics = token_update(acc, policy, optimizer, rollouts, [torch.full((len(r.completion_ids),), a) for r, a in
                                                           zip(rollouts, ADVANTAGES[mine], strict=True)],
                       options=LossOptions(), old=None, ref=None, num_minibatches=1, micro_batch_size=1, ppo_epochs=1,
                       grad_clip=1.0, guard=NonFiniteGuard(), pad_id=0, check_tolerance=1e-4)
if acc.is_main_process:
    weights = {k: v.detach().clone() for k, v in acc.unwrap_model(policy).model.state_dict().items()}
    torch.save({"weights": weights, "metrics": metrics}, out / "result.pt")
end_training(acc)
