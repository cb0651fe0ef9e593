"""Response and reward-component statistics of a step's rollouts over every process (the
reward and advantage statistics come from `rl_core.train.group_advantages`)."""

from __future__ import annotations

from typing import Any

import torch
from accelerate.utils import gather_object


def response_metrics(acc: Any, generations: list, results: list) -> dict[str, float]:
    """Response lengths, truncation, reward components and the token count (prompt +
    completion, for throughput) over the samples of every process."""
    rows = gather_object([(x.components, len(g.completion_ids), len(g.prompt_ids), g.finish_reason == "length")
                          for g, x in zip(generations, results, strict=True)])
    lengths = torch.tensor([float(r[1]) for r in rows])
    out = {"response/length_mean": lengths.mean().item(), "response/length_max": lengths.max().item(),
           "response/truncation_rate": sum(r[3] for r in rows) / len(rows),
           "tokens": float(sum(r[1] + r[2] for r in rows))}
    for name in sorted({k for r in rows for k in r[0]}):
        values = [r[0][name] for r in rows if name in r[0]]
        out[f"reward/{name}"] = sum(values) / len(values)
    return out
