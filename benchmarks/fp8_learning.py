"""Does an FP8 rollout learn what the unquantized one does? diffusion-grpo's embedded default (tiny
SD3, brightness reward, 12 epochs, on the CPU: the FP8 matmuls emulated) over several seeds,
`rollout.precision = "bf16"` against `"fp8"` with TIS (`algo.rollout_correction =
"token_truncate"`).

    uv run python benchmarks/fp8_learning.py              # 4 seeds x 2 precisions, ~10 minutes on 2 cores
    uv run python benchmarks/fp8_learning.py --seeds 1    # one seed each, no RESULTS.md

Per run: the train reward of the first and the last 3 epochs (means) and the FP8 run's mean
log-prob gap. The goal: FP8 + TIS ends within 5% of bf16's final reward, and its gain (last 3 -
first 3) is read beside bf16's, since the tiny model's brightness moves by about 0.01 on 0.5.
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from results import append_results, markdown_table  # noqa: E402

PRECISIONS = {"bf16": [], "fp8 + TIS": ["rollout.precision=fp8", "algo.rollout_correction=token_truncate"]}


def run(seed: int, overrides: list[str], out: Path) -> dict[str, float]:
    """One embedded-default run (`uv run apps/diffusion-grpo`), its rewards and gap from metrics.csv."""
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    subprocess.run([sys.executable, str(REPO / "apps" / "diffusion-grpo"), f"train.seed={seed}", "train.eval_freq=0",
                    f"train.output_dir={out}", *overrides], check=True, env=env, stdout=subprocess.DEVNULL)
    [metrics] = out.glob("run-*/metrics.csv")
    with metrics.open(newline="") as f:
        rows = list(csv.DictReader(f))
    rewards = [float(r["reward/mean"]) for r in rows if r.get("reward/mean")]
    gaps = [float(r["replay/engine_diff_mean"]) for r in rows if r.get("replay/engine_diff_mean")]
    return {"first": statistics.fmean(rewards[:3]), "last": statistics.fmean(rewards[-3:]),
            "gap": statistics.fmean(gaps) if gaps else 0.0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=4)
    args = parser.parse_args()
    results: dict[str, list[dict[str, float]]] = {name: [] for name in PRECISIONS}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in range(args.seeds):
            for name, overrides in PRECISIONS.items():
                results[name].append(run(seed, overrides, Path(tmp) / f"{name.split()[0]}-{seed}"))
                r = results[name][-1]
                print(f"seed {seed} {name}: first {r['first']:.4f} last {r['last']:.4f} gap {r['gap']:.2g}", flush=True)
    rows = []
    for seed in range(args.seeds):
        a, b = results["bf16"][seed], results["fp8 + TIS"][seed]
        rows.append([str(seed), f"{a['first']:.4f} -> {a['last']:.4f}", f"{b['first']:.4f} -> {b['last']:.4f}",
                     f"{a['last'] - a['first']:+.4f}", f"{b['last'] - b['first']:+.4f}",
                     f"{100 * (b['last'] / a['last'] - 1):+.2f}%", f"{b['gap']:.2g}"])
    final = {name: statistics.fmean(r["last"] for r in runs) for name, runs in results.items()}
    gain = {name: statistics.fmean(r["last"] - r["first"] for r in runs) for name, runs in results.items()}
    rows.append(["mean", f"{final['bf16']:.4f}", f"{final['fp8 + TIS']:.4f}", f"{gain['bf16']:+.4f}",
                 f"{gain['fp8 + TIS']:+.4f}", f"{100 * (final['fp8 + TIS'] / final['bf16'] - 1):+.2f}%", ""])
    header = ["seed", "bf16 reward first 3 -> last 3", "fp8 + TIS", "bf16 gain", "fp8 + TIS gain",
              "fp8 final vs bf16", "fp8 mean log-prob gap"]
    notes = ("diffusion-grpo's embedded default (tiny SD3 in float32, brightness, 12 epochs, lr 0.05, evals off) "
             "on the CPU, FP8 emulated (row-scaled e4m3 weights and activations, float32 products); "
             "'bf16' = rollout.precision='bf16' (no quantization: the weights' float32). train.seed = the seed.")
    if args.seeds < 4:
        print(markdown_table(header, rows))
        print(notes)
    else:
        append_results("FP8 rollouts: learning on the tiny task, bf16 vs fp8 + TIS (CPU emulation)", header, rows, notes)


if __name__ == "__main__":
    main()
