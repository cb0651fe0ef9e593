"""Naive vs chunked token log-probs from hidden states, forward + backward.

    PYTHONPATH=packages/rl-core/src python benchmarks/logprobs.py            # GPU, full size
    PYTHONPATH=packages/rl-core/src python benchmarks/logprobs.py --smoke    # CPU, tiny, no RESULTS.md

Naive: `logits = hidden @ W.T` (bf16), `log_softmax(logits.float())`, gather: it holds the
`[B*T, V]` logits in bf16 and float32 and the float32 log-softmax, and as much again in backward.
Chunked: `rl_core.logprobs.token_logprobs_from_hidden`, which keeps one `[chunk, V]` block at a
time and recomputes it in backward. Both get bf16 `hidden` and `weight` with requires_grad.
Figures: median seconds of forward + backward (after warm-up, with cuda synchronize) and peak
memory above the inputs (`max_memory_allocated` minus the baseline; includes the gradients).
Goal (issue 2): chunked peak <= 25% of naive, time <= 1.2x naive. Several chunk sizes are
tried; the best one that meets the memory goal is reported.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results import append_results, markdown_table

from rl_core.logprobs import token_logprobs_from_hidden

GIB = 1024**3


@dataclass(frozen=True)
class Figures:
    seconds: float
    peak_bytes: int
    logp: torch.Tensor  # [B, T] from the last run
    grad_hidden: torch.Tensor  # [B, T, H]


def naive(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = hidden @ weight.t()  # [B, T, V] bf16
    logp = torch.log_softmax(logits.float(), dim=-1)  # [B, T, V] float32
    return logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1)  # [B, T]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(
    fn: Callable, inputs: tuple, device: torch.device, warmup: int, repeats: int
) -> Figures:
    hidden, weight, labels, upstream = inputs
    times, peak = [], 0
    for i in range(warmup + repeats):
        hidden.grad = weight.grad = None
        sync(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
        start = time.perf_counter()
        out = fn(hidden, weight, labels)
        (out * upstream).sum().backward()
        sync(device)
        elapsed = time.perf_counter() - start
        if device.type == "cuda":
            peak = max(peak, torch.cuda.max_memory_allocated(device) - base)
        if i >= warmup:
            times.append(elapsed)
    grad_hidden = hidden.grad.detach().clone()
    hidden.grad = weight.grad = None
    return Figures(statistics.median(times), peak, out.detach(), grad_hidden)


def make_inputs(batch: int, length: int, size: int, vocab: int, device: torch.device) -> tuple:
    gen = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(batch, length, size, device=device, generator=gen).to(torch.bfloat16)
    weight = (torch.randn(vocab, size, device=device, generator=gen) * size**-0.5).to(
        torch.bfloat16
    )
    labels = torch.randint(0, vocab, (batch, length), device=device, generator=gen)
    upstream = torch.randn(batch, length, device=device, generator=gen)  # as from a policy loss
    return hidden.requires_grad_(True), weight.requires_grad_(True), labels, upstream


def run_naive(args: argparse.Namespace, device: torch.device) -> tuple[Figures, tuple, int]:
    """Measure naive at the requested batch; halve the batch while it runs out of memory."""
    batch = args.batch
    while True:
        inputs = make_inputs(batch, args.length, args.hidden, args.vocab, device)
        try:
            return measure(naive, inputs, device, args.warmup, args.repeats), inputs, batch
        except torch.OutOfMemoryError:
            if batch == 1:
                raise
        # out of the except block, so the traceback no longer pins the failed run's tensors
        del inputs
        torch.cuda.empty_cache()
        print(f"naive ran out of memory at batch {batch}; retrying at {batch // 2}")
        batch //= 2


HEADER = [
    "method",
    "chunk",
    "seconds",
    "peak extra GiB",
    "time / naive",
    "memory / naive",
    "max abs dlogp / rel grad err",
]


def gib(fig: Figures, device: torch.device) -> str:
    return f"{fig.peak_bytes / GIB:.2f}" if device.type == "cuda" else "n/a (CPU)"


def compare(
    base: Figures,
    inputs: tuple,
    chunk_sizes: list[int],
    args: argparse.Namespace,
    device: torch.device,
) -> tuple[list[list[object]], dict[int, Figures]]:
    """Measure the chunked path at each chunk size; table rows and figures by chunk size."""
    rows: list[list[object]] = [
        ["naive", "-", f"{base.seconds:.4f}", gib(base, device), "1.00", "1.00", "-"]
    ]
    results = {}
    for chunk in chunk_sizes:
        fig = measure(
            lambda h, w, y, c=chunk: token_logprobs_from_hidden(h, w, y, chunk_size=c),
            inputs,
            device,
            args.warmup,
            args.repeats,
        )
        results[chunk] = fig
        err = float((fig.logp - base.logp).abs().max())
        ref = base.grad_hidden.float()
        rel_grad = float((fig.grad_hidden.float() - ref).norm() / ref.norm())
        mem_ratio = f"{fig.peak_bytes / base.peak_bytes:.3f}" if base.peak_bytes else "n/a"
        rows.append(
            [
                "chunked",
                chunk,
                f"{fig.seconds:.4f}",
                gib(fig, device),
                f"{fig.seconds / base.seconds:.2f}",
                mem_ratio,
                f"{err:.1e} / {rel_grad:.1e}",
            ]
        )
    return rows, results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on CPU; nothing written")
    parser.add_argument("--chunk-sizes", default="1024,2048,4096,8192")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    if args.smoke:
        device, chunk_sizes = torch.device("cpu"), [16, 64]
        args.batch, args.length, args.hidden, args.vocab = 2, 64, 32, 1000
        args.warmup, args.repeats = 1, 2
    else:
        if not torch.cuda.is_available():
            raise SystemExit("the full benchmark needs a CUDA GPU; use --smoke on CPU")
        device = torch.device("cuda")
        args.batch, args.length, args.hidden, args.vocab = 8, 4096, 2560, 151_936
        chunk_sizes = [int(c) for c in args.chunk_sizes.split(",")]

    base, inputs, batch = run_naive(args, device)
    rows, results = compare(base, inputs, chunk_sizes, args, device)
    fits = [c for c in chunk_sizes if results[c].peak_bytes <= 0.25 * base.peak_bytes]
    best = min(fits or chunk_sizes, key=lambda c: results[c].seconds)
    shape = f"{batch} x {args.length} tokens, hidden {args.hidden}, vocab {args.vocab:,}, bf16"
    notes = (
        f"Forward + backward of token log-probs from hidden states ({shape}; requires_grad on "
        f"hidden and weight). Median of {args.repeats} after {args.warmup} warm-up runs. Best chunk "
        f"size: {best} ({results[best].seconds / base.seconds:.2f}x naive time, "
        f"{results[best].peak_bytes / max(base.peak_bytes, 1):.1%} of naive peak memory). "
        "Goal: memory <= 25% and time <= 1.2x of naive."
    )
    if batch != args.batch:
        notes += f" Naive did not fit at batch {args.batch}, so both ran at batch {batch}."
    if args.smoke:
        print(markdown_table(HEADER, rows))
        print(notes)
        return
    append_results("Token log-probs from hidden states: naive vs chunked", HEADER, rows, notes)


if __name__ == "__main__":
    main()
