"""Step metrics reduced over every process: reward / advantage / response statistics of the
rollouts, and the update's loss, clip fraction, KL and grad norm."""

from __future__ import annotations

import torch
from accelerate import Accelerator
from accelerate.utils import gather_object


def reduce_update_stats(acc: Accelerator, sums: dict[str, float]) -> dict[str, float]:
    keys = sorted(k for k in sums if k != "ratio_max")
    total = dict(zip(keys, acc.reduce(torch.tensor([sums[k] for k in keys], device=acc.device), "sum").tolist(), strict=True))
    steps = total.pop("optimizer_steps") / acc.num_processes
    tokens = max(total.pop("tokens"), 1.0)
    out = {"loss/policy": total.pop("loss/policy") / steps, "grad_norm": total.pop("grad_norm") / acc.num_processes / steps}
    if "loss/kl" in total:
        out["loss/kl"] = total.pop("loss/kl") / steps
    out.update({k: v / tokens for k, v in total.items()})  # token-weighted means
    out["ratio_max"] = acc.reduce(torch.tensor(sums["ratio_max"], device=acc.device), "max").item()
    return out


def rollout_metrics(generations: list, results: list, adv: torch.Tensor) -> dict[str, float]:
    """Reward, advantage and response statistics over the samples of every process."""
    rows = gather_object([(x.score, x.components, len(g.completion_ids), len(g.prompt_ids), g.finish_reason == "length",
                           float(a)) for g, x, a in zip(generations, results, adv, strict=True)])
    scores = torch.tensor([r[0] for r in rows if r[0] is not None])
    lengths = torch.tensor([float(r[2]) for r in rows])
    advs = torch.tensor([r[5] for r in rows if r[0] is not None])
    out = {"reward/mean": scores.mean().item(), "reward/std": scores.std().item() if len(scores) > 1 else 0.0,
           "reward/failed": float(len(rows) - len(scores)),
           "adv/mean": advs.mean().item(), "adv/std": advs.std().item() if len(advs) > 1 else 0.0,
           "adv/min": advs.min().item(), "adv/max": advs.max().item(),
           "response/length_mean": lengths.mean().item(), "response/length_max": lengths.max().item(),
           "response/truncation_rate": sum(r[4] for r in rows) / len(rows),
           "tokens": float(sum(r[2] + r[3] for r in rows))}
    for name in sorted({k for r in rows for k in r[1]}):
        values = [r[1][name] for r in rows if name in r[1]]
        out[f"reward/{name}"] = sum(values) / len(values)
    return out
