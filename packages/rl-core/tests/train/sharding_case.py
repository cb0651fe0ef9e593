"""The shared case of test_train_sharding.py and its 2-process script: a two-block token model,
8 sequences with per-token advantages, two AdamW steps with gradient clipping that engages."""

from __future__ import annotations

from typing import ClassVar

import torch

from rl_core.train import NonFiniteGuard, UpdateStats, optimizer_step

VOCAB, WIDTH = 11, 8
TOKENS = torch.arange(8 * 5).reshape(8, 5) * 7 % VOCAB  # [8, 5]
ADV = torch.linspace(-1.0, 1.0, 8 * 4).reshape(8, 4)  # [8, 4] one per predicted token


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(WIDTH, 2 * WIDTH), torch.nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x)))  # [B, T, W]


class Toy(torch.nn.Module):
    """Embedding -> 2 blocks -> head; `_no_split_modules` names the blocks, as transformers does."""

    _no_split_modules: ClassVar[list[str]] = ["Block"]

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.blocks = torch.nn.ModuleList([Block(), Block()])
        self.head = torch.nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens[:, :-1])  # [B, T-1, W]
        for block in self.blocks:
            x = block(x)
        logp = self.head(x).log_softmax(-1)  # [B, T-1, V]
        return logp.gather(-1, tokens[:, 1:, None])[..., 0]  # [B, T-1]


def make_model() -> Toy:
    torch.manual_seed(0)
    return Toy()


def make_optimizer(model: torch.nn.Module):
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    # constant: Accelerate steps a prepared scheduler once per process, so a decaying one would
    # differ between 1 and 2 processes (under DDP as well)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)


def train(acc, model, optimizer, scheduler, rows: list[int], steps: int) -> tuple[dict[str, float], list[float]]:
    """`steps` optimizer steps over this process's `rows` in micro-batches of 2: token-mean
    `-sum(adv * logp) / global tokens`, gradient norm clipped to 0.05."""

    def loss_fn(micro: list[int], num_valid: torch.Tensor):
        logp = model(TOKENS[micro].to(acc.device))  # [b, 4]
        loss = -(ADV[micro].to(acc.device) * logp).sum() / num_valid
        return loss, {"loss/policy": float(loss.detach()), "logp": float(logp.detach().mean())}

    stats, norms = UpdateStats(), []
    for _ in range(steps):
        micro = [rows[i : i + 2] for i in range(0, len(rows), 2)]
        step = optimizer_step(acc, model, optimizer, micro, loss_fn, units=lambda m: 4.0 * len(m), grad_clip=0.05,
                              guard=NonFiniteGuard(), stats=stats, scheduler=scheduler)
        norms.append(step.grad_norm)
    return stats.reduce(acc), norms


def checksum(state: dict[str, torch.Tensor]) -> float:
    """sum over parameters of sum(w * (1 + index)): moves with any change of any weight."""
    return float(sum((w.double().flatten() * torch.arange(1, w.numel() + 1)).sum() for _, w in sorted(state.items())))
