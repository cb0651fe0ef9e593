"""Partial rollouts against whole-batch rollouts on a long-tail length workload.

    python benchmarks/partial_rollouts.py               # one GPU with vLLM: Qwen3-1.7B shape, ~4 minutes
    python benchmarks/partial_rollouts.py --smoke       # tiny checkpoint, hf engine on the CPU, ~1 minute

The workload (issue: asynchronous training that pays): response lengths drawn per sample from a
stated distribution, most 150-400 tokens with a tail to 2k (`lengths`: 95% log-normal with median
260 and sigma 0.35, clipped to 100-600; 5% uniform 800-2048; `--smoke` divides them by 16).
Random weights never choose to stop, so each sample stops at its drawn length (the engine's stop
tokens are off: vLLM's `ignore_eos`, the hf engine's empty `stop_token_ids`): the same lengths,
from the same seed, for every mode compared.

Two ways to roll out `--steps` steps of `--prompts` groups x `--n` samples, 64-token prompts:

- `whole`: each step's samples in one engine call, each with its own budget and seed (vLLM
  drops a sample from its batch when it ends; the step lasts as long as its longest sample), as a
  synchronous rollout of those lengths runs at its best;
- `partial K`: `rl_rollout.partial.PartialRollouts`, (K + 1) x the groups in flight, `--chunk`
  tokens a round; a step returns the first groups to finish.

No update runs between steps (the weights stay), so the figures are the rollout's alone: seconds
per step and the kept tokens per second. The first step of each mode is a warm-up, left out.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from long_tail import length  # noqa: E402
from results import append_results  # noqa: E402

from rl_rollout import PartialRollouts, SamplingParams  # noqa: E402
from rl_rollout.partial import round_generator  # noqa: E402


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class Prompts:
    """draw(count): the next `count` groups (keys 0, 1, ...), 64 random token ids each, seed = key."""

    def __init__(self, vocab: int) -> None:
        self.vocab, self.taken = vocab, 0

    def draw(self, count: int) -> tuple[list[int], list[list[int]], list[int]]:
        keys = list(range(self.taken, self.taken + count))
        self.taken += count
        return keys, [[random.Random(k).randrange(100, self.vocab - 1) for _ in range(64)] for k in keys], keys


def build_engine(engine: str, smoke: bool, batch: int) -> Any:
    if smoke:
        from rl_models import tiny

        path = tiny.build("qwen3_vllm" if engine == "vllm" else "qwen3")
    else:
        from rl_models.shapes import build_shape

        path = build_shape("qwen3", "1.7b", Path(tempfile.mkdtemp()) / "qwen3-1.7b")
    if engine == "hf":
        from rl_rollout.hf import HFEngine

        hf = HFEngine.from_pretrained(path, dtype=torch.float32 if smoke else torch.bfloat16,
                                      device="cpu" if smoke else "cuda", max_batch_size=batch, compile=False)
        hf.stop_token_ids = []
        return hf
    import os

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from rl_rollout.vllm import VLLMEngine

    class NoStopVLLM(VLLMEngine):
        def _sampling(self, params: SamplingParams) -> Any:
            sampling = super()._sampling(params)
            sampling.ignore_eos = True
            return sampling

    return NoStopVLLM(str(path), dtype="bfloat16", gpu_memory_utilization=0.6, max_model_len=4096, seed=0,
                      max_num_seqs=batch)


def run_mode(engine: Any, mode: str, k: int, steps: int, prompts: int, n: int, chunk: int, scale: int,
             log: Callable[[str], None]) -> tuple[list[float], list[int]]:
    source = Prompts(engine.tokenizer.vocab_size)
    generate = round_generator(engine)
    params = SamplingParams(n=n, temperature=1.0, max_new_tokens=round(2048 / scale))

    def budget(key: int, j: int) -> int:
        return length(key * 1000 + j, scale)

    partial = PartialRollouts(chunk, k, engine.tokenizer.decode, seeded=False)  # vLLM's fast unseeded sampling
    seconds, kept = [], []
    for step in range(steps):
        sync()
        began = time.perf_counter()
        if mode == "whole":
            keys, reqs, _ = source.draw(prompts)
            rows = [(key, req, j) for key, req in zip(keys, reqs, strict=True) for j in range(n)]
            gens = generate([r for _, r, _ in rows], SamplingParams(temperature=1.0, max_new_tokens=params.max_new_tokens),
                            [budget(key, j) for key, _, j in rows], None)
        else:
            _, gens = partial.run(generate, source.draw, prompts, params, version=step, budgets=budget)
        sync()
        seconds.append(time.perf_counter() - began)
        kept.append(sum(len(g.completion_ids) for g in gens))
        log(f"{mode} K={k} step {step}: {seconds[-1]:.2f} s, {kept[-1]} tokens")
    return seconds, kept


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny checkpoint, hf engine, on the CPU")
    parser.add_argument("--engine", choices=["vllm", "hf"], default=None, help="default: vllm on a GPU, hf with --smoke")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--prompts", type=int, default=None, help="groups per step (default 32; smoke 4)")
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--chunk", type=int, default=None, help="tokens per round (default 128; smoke 8)")
    parser.add_argument("--k", type=int, nargs="+", default=[1, 2], help="partial rollouts' K values to run")
    args = parser.parse_args()
    smoke = args.smoke or not torch.cuda.is_available()
    engine_kind = args.engine or ("hf" if smoke else "vllm")
    prompts = args.prompts or (4 if smoke else 32)
    chunk, scale = args.chunk or (8 if smoke else 128), 16 if smoke else 1
    engine = build_engine(engine_kind, smoke, (max(args.k, default=0) + 1) * prompts * args.n)
    rows, rates = [], {}
    for mode, k in [("whole", 0)] + [("partial", k) for k in args.k]:
        seconds, kept = run_mode(engine, mode, k, args.steps, prompts, args.n, chunk, scale, print)
        s, t = statistics.mean(seconds[1:]), statistics.mean(kept[1:])
        rates[(mode, k)] = t / s
        label = "whole batch" if mode == "whole" else f"partial, K={k}, {chunk} tokens a round"
        rows.append([label, f"{s:.2f}", f"{t:.0f}", f"{t / s:.0f}", f"{t / s / rates[('whole', 0)]:.2f}x",
                     " ".join(f"{x:.1f}" for x in seconds)])
    shape = "tiny qwen3 on the CPU" if smoke else "Qwen3-1.7B shape, bf16, one GPU"
    notes = (f"`benchmarks/partial_rollouts.py{' --smoke' if smoke else ''}`: {shape}, {engine_kind} engine, "
             f"{prompts} groups x {args.n} samples a step, 64-token prompts, lengths drawn per sample (95% log-normal "
             f"median 260 sigma 0.35 in 100-600, 5% uniform 800-2048{', divided by 16' if smoke else ''}), stop "
             f"tokens off. Means over steps 2-{args.steps}; no update between steps; the last column lists every "
             "step's seconds, warm-up included.")
    table = ["rollout", "s/step", "kept tokens/step", "kept tokens/s", "vs whole batch", "s per step"]
    if smoke:
        print(rows, notes, sep="\n")
    else:
        append_results(f"Partial rollouts vs whole-batch rollouts on long-tail lengths ({engine_kind}, Qwen3-1.7B shape)",
                       table, rows, notes)


if __name__ == "__main__":
    main()
