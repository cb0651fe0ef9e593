"""Run under `accelerate launch --multi_gpu --num_processes 2` (CPU, gloo) by test_train_multiprocess.py:
a shared run dir, rank-0-only metrics, a checkpoint saved and reloaded by both ranks, and
bit-identical continuation after the reload on every rank."""

from __future__ import annotations

import sys

import msgspec
import torch
from accelerate import Accelerator

from rl_core.train import (
    MetricsLogger,
    end_training,
    latest_checkpoint,
    load_checkpoint,
    make_run_dir,
    save_checkpoint,
    seed_everything,
)


class Config(msgspec.Struct, kw_only=True, frozen=True):
    lr: float = 1e-2


class Counter:
    def __init__(self) -> None:
        self.seen = 0

    def state_dict(self) -> dict[str, int]:
        return {"seen": self.seen}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.seen = state["seen"]


def main(root: str) -> None:
    accelerator = Accelerator(cpu=True)
    assert accelerator.num_processes == 2, accelerator.num_processes
    seed_everything(0, rank=accelerator.process_index)
    run = make_run_dir(root, config=Config(), accelerator=accelerator)
    torch.manual_seed(0)  # same initial weights on both ranks
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.2), torch.nn.Linear(8, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=Config().lr)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    counter, logger = Counter(), MetricsLogger(run, accelerator=accelerator)

    def train(steps: int) -> list[torch.Tensor]:
        for _ in range(steps):
            x = torch.randn(8, 4)  # [B, 4] rank-specific stream
            loss = model(x).pow(2).mean()
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            counter.seen += len(x)
            logger.log(counter.seen // 8, {"loss": accelerator.reduce(loss.detach(), "mean")})
        return [p.detach().clone() for p in model.parameters()]

    seed_everything(1, rank=accelerator.process_index)
    train(3)
    save_checkpoint(run / "checkpoints", 3, state={"counter": counter, "note": "mid"},
                    accelerator=accelerator, keep_last=1)
    expected = train(3)
    seed_everything(99)  # clobber every RNG
    ckpt = latest_checkpoint(run / "checkpoints")
    info = load_checkpoint(ckpt, state={"counter": counter}, accelerator=accelerator)
    assert info == {"step": 3, "note": "mid"}, info
    assert counter.seen == 24, counter.seen
    got = train(3)
    assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True)), "not bit-identical"
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        print(f"OK {run}")
    end_training(accelerator)


if __name__ == "__main__":
    main(sys.argv[1])
