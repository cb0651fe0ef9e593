"""Run by test_train_shutdown.py under `python -m torch.distributed.run --nproc_per_node 2`.

The end of caption-rl's FSDP2 run, shrunk: the policy sharded with FSDP2 on gloo, one update, the
full weights gathered on every process (`FullWeights.gathered()`), then rank 0 alone "exports"
(a 1 s write) while rank 1 has nothing left to do, and both call `end_training`. Each rank writes
when it finished (`ended-<rank>`); rank 0 also when its export was written (`exported`)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
from accelerate import Accelerator
from torch.distributed.fsdp import fully_shard

from rl_core.train import FullWeights, end_training

out = Path(sys.argv[1])
acc = Accelerator(cpu=True)
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
full = FullWeights(model, device="cpu")
for layer in model:
    fully_shard(layer)
fully_shard(model)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
model(torch.randn(4, 64)).square().mean().backward()
optimizer.step()
with full.gathered() as whole:
    state = {name: p.detach().clone() for name, p in whole.state_dict().items()}
if acc.is_main_process:
    time.sleep(1.0)
    torch.save(state, out / "export.pt")
    (out / "exported").write_text(repr(time.time()))
end_training(acc)
(out / f"ended-{acc.process_index}").write_text(repr(time.time()))
