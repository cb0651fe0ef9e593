"""Partial rollouts against whole-batch rollouts on a long-tail length workload (hf engine).

    python benchmarks/partial_rollouts.py               # one GPU: Qwen3-1.7B shape, ~4 minutes
    python benchmarks/partial_rollouts.py --smoke       # tiny checkpoint on the CPU, ~1 minute

The workload (issue: asynchronous training that pays): response lengths drawn per sample from a
stated distribution, most 150-400 tokens with a tail to 2k (`lengths`: 95% log-normal with median
260 and sigma 0.35, clipped to 100-600; 5% uniform 800-2048; `--smoke` divides them by 16).
Random weights never choose to stop, so each sample stops at its drawn length (the engine's stop
tokens are switched off): the same lengths, from the same seed, for every mode compared.

Two ways to roll out `--steps` steps of `--prompts` groups x `--n` samples, 64-token prompts:

- `whole`: each step's groups in one engine call to the step's longest drawn length, each sample
  cut at its own (what a synchronous rollout of those lengths costs: the batch decodes until its
  longest sample ends);
- `partial`: `rl_rollout.partial.PartialRollouts` with K = 1: (K + 1) x the groups in flight,
  `--chunk` tokens a round, a step returns the first groups to finish.

No update runs between steps (the weights stay), so the figures are the rollout's alone: seconds
per step, and the kept tokens (each sample up to its drawn length) per second. The first step of
each mode is a warm-up and left out.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from results import append_results  # noqa: E402

from rl_rollout import PartialRollouts, SamplingParams  # noqa: E402
from rl_rollout.hf import HFEngine  # noqa: E402


def lengths(seed: int, count: int, scale: int) -> list[int]:
    """`count` response lengths: 95% log-normal (median 260, sigma 0.35) in 100-600, 5% uniform 800-2048."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        raw = rng.uniform(800, 2048) if rng.random() < 0.05 else min(600.0, max(100.0, rng.lognormvariate(5.56, 0.35)))
        out.append(max(2, round(raw / scale)))
    return out


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny checkpoint on the CPU")
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--prompts", type=int, default=None, help="groups per step (default 32; smoke 4)")
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--chunk", type=int, default=None, help="tokens per round (default 128; smoke 8)")
    args = parser.parse_args()
    smoke = args.smoke or not torch.cuda.is_available()
    prompts_per_step = args.prompts or (4 if smoke else 32)
    chunk = args.chunk or (8 if smoke else 128)
    scale = 16 if smoke else 1
    if smoke:
        from rl_models import tiny

        path, dtype, device = tiny.build("qwen3"), torch.float32, "cpu"
    else:
        from rl_models.shapes import build_shape

        path, dtype, device = build_shape("qwen3", "1.7b", Path(tempfile.mkdtemp()) / "q17"), torch.bfloat16, "cuda"
    engine = HFEngine.from_pretrained(path, dtype=dtype, device=device, max_batch_size=2 * prompts_per_step * args.n)
    engine.stop_token_ids = []  # each sample stops at its drawn length
    vocab = engine.tokenizer.vocab_size
    cap = round(2048 / scale)
    params = SamplingParams(n=args.n, temperature=1.0, max_new_tokens=cap)
    prompt_rng = random.Random(1)

    def prompt(key: int) -> list[int]:
        return [prompt_rng.randrange(100, vocab - 1) for _ in range(64)]

    def budget(key: int, j: int) -> int:
        return lengths(key * 1000 + j, 1, scale)[0]

    rows, figures = [], {}
    for mode in ("whole", "partial"):
        drawn = [0]

        def draw(count: int) -> tuple[list[int], list[list[int]], list[int]]:
            keys = list(range(drawn[0], drawn[0] + count))
            drawn[0] += count
            return keys, [prompt(k) for k in keys], keys

        partial = PartialRollouts(chunk, 1, engine.tokenizer.decode)
        seconds, kept = [], []
        for step in range(args.steps):
            sync()
            began = time.perf_counter()
            if mode == "whole":
                keys, reqs, _ = draw(prompts_per_step)
                longest = max(budget(k, j) for k in keys for j in range(args.n))
                gens = engine.generate(reqs, SamplingParams(n=args.n, temperature=1.0, max_new_tokens=longest, seed=step))
                tokens = sum(min(len(g.completion_ids), budget(keys[g.request_index], i % args.n))
                             for i, g in enumerate(gens))
            else:
                keys, gens = partial.run(engine.generate, draw, prompts_per_step, params, version=step, budgets=budget)
                tokens = sum(len(g.completion_ids) for g in gens)
            sync()
            seconds.append(time.perf_counter() - began)
            kept.append(tokens)
            print(f"{mode} step {step}: {seconds[-1]:.2f} s, {tokens} tokens kept", flush=True)
        s, t = statistics.mean(seconds[1:]), statistics.mean(kept[1:])
        figures[mode] = (s, t)
        rows.append([mode, f"{s:.2f}", f"{t:.0f}", f"{t / s:.0f}"])
    whole, part = figures["whole"], figures["partial"]
    rows[1].append(f"{(part[1] / part[0]) / (whole[1] / whole[0]):.2f}x")
    rows[0].append("1.00x")
    shape = "tiny qwen3 on the CPU" if smoke else "Qwen3-1.7B shape, bf16, one GPU"
    notes = (f"`benchmarks/partial_rollouts.py{' --smoke' if smoke else ''}`: {shape}, hf engine, {prompts_per_step} "
             f"groups x {args.n} samples a step, 64-token prompts, lengths drawn per sample (95% log-normal median 260 "
             f"sigma 0.35 in 100-600, 5% uniform 800-2048{', divided by 16' if smoke else ''}), stop tokens off; "
             f"partial: K = 1, {chunk} tokens a round. Means over steps 2-{args.steps}; no update between steps.")
    if not smoke:
        append_results("Partial rollouts vs whole-batch rollouts on long-tail lengths (hf engine, Qwen3-1.7B shape)",
                       ["rollout", "s/step", "kept tokens/step", "kept tokens/s", "vs whole"], rows, notes)
    else:
        print(rows, notes)


if __name__ == "__main__":
    main()
