"""The shared case of test_train_phases.py and its 2-process script: 8 samples in 3 groups, one
failed reward (NaN), one group left with a single valid sample, a linear 'policy'."""

from __future__ import annotations

import torch

SCORES = torch.tensor([1.0, 0.0, 0.5, float("nan"), 2.0, 1.0, 0.0, 3.0])  # [8]
GROUPS = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2])  # group 1: one valid sample (row 4) -> no baseline
# The same scores as two components (c1, c2) weighted (1, 0.5), for normalize_then_sum (GDPO).
OBJECTIVES = torch.tensor([[1.0, 0.0], [0.0, 0.0], [0.0, 1.0], [float("nan")] * 2,
                           [1.0, 2.0], [0.0, 2.0], [0.0, 0.0], [2.0, 2.0]])  # [8, 2]
WEIGHTS = [1.0, 0.5]
FEATURES = torch.arange(8 * 3, dtype=torch.float32).reshape(8, 3) / 10  # [8, 3]


def make_model() -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(3, 1, bias=False)


def split_rows(rows: list[int], size: int) -> list[list[int]]:
    return [rows[i : i + size] for i in range(0, len(rows), size)]


def loss_fn(model: torch.nn.Module):
    """-sum(adv * f(x)) / num_valid over a micro-batch `(rows, advantages)`; `model` is the
    prepared (DDP-wrapped) module, so its backward synchronizes gradients."""

    def fn(micro, num_valid):
        rows, adv = micro
        y = model(FEATURES[rows])[:, 0]  # [b]
        d = y.detach()
        loss = -(adv * y).sum() / num_valid
        return loss, {"score": float(d.mean()), "loss/policy": float(loss.detach()), "y_max": float(d.max())}

    return fn
