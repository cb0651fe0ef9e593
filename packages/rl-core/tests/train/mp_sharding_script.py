"""Run by test_train_sharding.py under `accelerate launch --multi_gpu --num_processes 2` (CPU, gloo):
FSDP2 (`prepare_policy(ShardingPlan("fsdp2"))`) over 2 processes holding 3 and 5 of the 8 sequences.

Writes `result.pt` (rank 0): the reduced update stats, the gradient norms, the full weights after
two optimizer steps (`full_state_dict`), those gathered by `FullWeights` and the devices they were
gathered to; on a CPU, the same two steps with `cpu_offload` (fused AdamW); and checks on every
rank that a sharded checkpoint taken after step 1 resumes step 2 bit-identically.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from accelerate import Accelerator
from sharding_case import make_model, make_optimizer, train

from rl_core.train import (
    FullWeights,
    ShardingPlan,
    end_training,
    full_state_dict,
    is_sharded,
    load_checkpoint,
    prepare_policy,
    save_checkpoint,
    sharded_state,
)

out = Path(sys.argv[1])
acc = Accelerator(cpu=not torch.cuda.is_available())  # the gpu test launches one CUDA process
rows = list(range(8)) if acc.num_processes == 1 else [0, 1, 2] if acc.process_index == 0 else [3, 4, 5, 6, 7]
model = make_model()
full = FullWeights(model, device=acc.device)
optimizer, scheduler = make_optimizer(model)
model, optimizer, scheduler = prepare_policy(acc, model, optimizer, scheduler, ShardingPlan("fsdp2"))
assert is_sharded(model) and (acc.num_processes == 1 or len(model.head.weight.to_local()) < len(model.head.weight))
stats, norms = train(acc, model, optimizer, scheduler, rows, 1)
save_checkpoint(out / "checkpoints", 1, state=sharded_state(model, optimizer), accelerator=acc)
stats2, norms2 = train(acc, model, optimizer, scheduler, rows, 1)
after = {n: p.to_local().clone() for n, p in model.named_parameters()}
weights = full_state_dict(model)
with full.gathered() as copy:
    gathered = {n: p.detach().clone() for n, p in copy.named_parameters()}
    devices = sorted({str(t.device) for t in [*copy.parameters(), *copy.buffers()]})
assert all(p.numel() == 0 for p in full.model.parameters()), "gathered weights not freed"
load_checkpoint(out / "checkpoints" / "checkpoint-1", state=sharded_state(model, optimizer), accelerator=acc)
train(acc, model, optimizer, scheduler, rows, 1)
for n, p in model.named_parameters():
    assert torch.equal(p.to_local(), after[n]), f"resumed step differs at {n}"
offload = {}
if not torch.cuda.is_available():  # on a GPU offload needs a gloo group beside NCCL (accelerator_kwargs)
    model = make_model()
    optimizer, scheduler = make_optimizer(model)
    model, optimizer, scheduler = prepare_policy(acc, model, optimizer, scheduler, ShardingPlan("fsdp2", cpu_offload=True))
    train(acc, model, optimizer, scheduler, rows, 1)
    stats_o, norms_o = train(acc, model, optimizer, scheduler, rows, 1)
    offload = {"stats": stats_o, "norms": norms_o, "weights": full_state_dict(model),
               "fused": optimizer.param_groups[0]["fused"]}
if acc.is_main_process:
    gathered = {n: w.cpu() for n, w in gathered.items()}
    torch.save({"stats": stats2, "norms": norms + norms2, "weights": weights, "gathered": gathered,
                "gathered_devices": devices, "gather_seconds": full.pop_metrics()["time/weight_gather"],
                "offload": offload}, out / "result.pt")
end_training(acc)
