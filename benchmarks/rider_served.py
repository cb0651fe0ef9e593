"""rider-grm on one GPU with a served judge on the critical path: synchronous against asynchronous.

    python benchmarks/rider_served.py            # one GPU with vLLM: policy and judge at Qwen3-1.7B shape
    python benchmarks/rider_served.py --smoke    # tiny checkpoints, hf engines on the CPU: prints, appends nothing

The judge (`rl_rewards.judges.yes_no` over a random-weight judge at the policy's shape) runs in a
real `rl-rewards serve` process on the same GPU (its vLLM engine with `JUDGE_MEMORY` of the GPU);
rider-grm reaches it with `engine = "server"` and scores each prompt's replies as they finish
(`reward.stream`). The policy's vLLM engine is colocated (`POLICY_MEMORY`). Both schedules take
their old log-probs from the update's own forward (`algo.old_logprobs=auto`: one optimizer step a batch).

- `sync`: each step samples, waits for the last judgement (`time/reward`), then updates;
- `async`: `train.max_staleness=1` with `algo.rollout_correction=token_truncate`: the rollout
  thread samples step j + 1 and the server judges it while step j updates.

Each run is its own process, with the same server. Reported: samples per second of step time,
seconds per step and phase, the trainer's wait for the rollout thread, and async / sync. The
overlap bound beside it: the rollout (with its judging) and the rest of the step in series,
over the larger of the two. Goal (issue 52): asynchronous >= 1.3x synchronous.
"""

from __future__ import annotations

import argparse
import csv
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
APP = ROOT / "apps" / "rider-grm"
sys.path.insert(0, str(ROOT))

from benchmarks.results import append_results, markdown_table  # noqa: E402
from benchmarks.rider_grm import SHAPE_1_7B, SHAPE_SMOKE, random_checkpoint  # noqa: E402
from rl_rewards.server.process import ServerProcess  # noqa: E402

POLICY_MEMORY, JUDGE_MEMORY, MAX_LEN = 0.3, 0.25, 4096
WARMUP = 2  # steps left out of the means: compiles, first optimizer state
PROMPTS = 16  # a step: every prompt of examples/data/rider/train.parquet (an epoch a step)
MODES = {"sync": [], "async": ["train.max_staleness=1", "algo.rollout_correction=token_truncate"]}
PHASES = ("rollout", "rollout_wait", "prepare", "reward", "logprob", "update", "weight_sync", "weight_publish")


def server_config(where: Path, judge: Path, smoke: bool) -> Path:
    """The server's one reward, `judge`: the yes/no judge module on the random judge."""
    engine = 'engine = "hf"' if smoke else (
        f'engine = "vllm", engine_options = {{ gpu_memory_utilization = {JUDGE_MEMORY}, max_model_len = {MAX_LEN} }}')
    path = where / "server.toml"
    path.write_text("[rewards.judge.components.judge]\nscorer = \"judge\"\n"
                    f"options = {{ module = \"rl_rewards.judges.yes_no\", model = \"{judge}\", temperature = 0.7, "
                    f"max_new_tokens = {4 if smoke else 64}, {engine} }}\n")
    return path


def run(mode: str, policy: Path, url: str, out: Path, smoke: bool, steps: int,
        keep: Path | None = None) -> list[dict[str, str]]:
    """rider-grm in a fresh process; its metrics.csv rows (copied into `keep` too)."""
    judges = f'[{{name = "j", engine = "server", url = "{url}", spec = "judge", weight = 0.5}}]'
    engine = ["rollout.engine=hf"] if smoke else [
        "rollout.engine=vllm", f"rollout.gpu_memory_utilization={POLICY_MEMORY}",
        f"rollout.engine_options.max_model_len={MAX_LEN}"]
    overrides = [
        f"model.path={policy}", "model.dtype=bfloat16", f"reward.judges={judges}", "reward.embedding.model=null",
        "reward.rule=rider_rules:compute_score", 'data.train_files=["examples/data/rider/train.parquet"]',
        'data.val_files=["examples/data/rider/val.parquet"]', f"rollout.max_new_tokens={8 if smoke else 256}",
        "rollout.n=8", f"train.batch_size={2 if smoke else PROMPTS}", f"train.mini_batch_size={2 if smoke else PROMPTS}",
        "train.micro_batch_size=8", "train.lr=1e-6", f"train.epochs={steps}", f"train.max_steps={steps}", "train.save_freq=1000",
        "train.val_before_train=false", f'train.output_dir="{out / mode}"',
        "algo.replay_tolerance=0.5", "algo.old_logprobs=auto", "rollout.max_batch_size=256", *engine, *MODES[mode],
    ]
    subprocess.run([sys.executable, str(APP / "__main__.py"), *overrides], check=True, cwd=ROOT)
    [run_dir] = [d for d in (out / mode).iterdir() if d.is_dir() and d.name.startswith("run-")]
    if keep:
        keep.mkdir(parents=True, exist_ok=True)
        shutil.copy(run_dir / "metrics.csv", keep / f"{mode}-metrics.csv")
    with (run_dir / "metrics.csv").open() as f:
        return list(csv.DictReader(f))


def figures(rows: list[dict[str, str]]) -> dict[str, float]:
    """Means over the steps after the warm-up (an asynchronous run's last step, with nothing to
    overlap, left out too)."""
    kept = rows[WARMUP:-1] if rows[-1].get("rollout/staleness") not in (None, "", "0.0") else rows[WARMUP:]
    mean = lambda key: statistics.fmean(float(r[key]) if r.get(key) else 0.0 for r in kept)  # noqa: E731
    return {"step": mean("time/step"), "samples_per_s": mean("throughput/samples_per_s"),
            **{p: mean(f"time/{p}") for p in PHASES}, "steps": [round(float(r["time/step"]), 1) for r in rows],
            "phases": {k.removeprefix("time/"): round(mean(k), 2) for k in rows[0] if k.startswith("time/")
                       and k != "time/step" and "/eval" not in k and mean(k) >= 0.01}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU; prints, appends nothing")
    parser.add_argument("--steps", type=int, default=None, help="training steps (the first two are warm-up)")
    parser.add_argument("--keep", type=Path, help="copy each run's metrics.csv into DIR (<schedule>-metrics.csv)")
    args = parser.parse_args()
    if not args.smoke and not torch.cuda.is_available():
        parser.error("the full run needs a CUDA GPU (vLLM engines for the policy and the judge); --smoke runs on a CPU")
    steps = args.steps or (WARMUP + 2 if args.smoke else WARMUP + 5)
    shape = SHAPE_SMOKE if args.smoke else SHAPE_1_7B
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        policy, judge = random_checkpoint(root / "policy", shape, 0), random_checkpoint(root / "judge", shape, 1)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # the runs and the server measure their own memory
        env = {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        with ServerProcess(["--config", str(server_config(root, judge, args.smoke))], env=env,
                           log_path=root / "server.log", ready_timeout=600) as server:
            got = {mode: figures(run(mode, policy, server.url, root, args.smoke, steps, args.keep)) for mode in MODES}
    sync = got["sync"]
    header = ["schedule", "samples/s", "s/step", *[f"{p} s" for p in PHASES], "other s", "vs sync", "overlap bound"]
    rows = []
    for mode, f in got.items():
        rest = f["step"] - f["rollout_wait"] if mode == "async" else f["step"] - f["rollout"] - f["reward"]
        sampled = f["rollout"] + (0.0 if mode == "async" else f["reward"])  # the rollout with its judging
        bound = (sampled + rest) / max(sampled, rest) if mode == "async" else 1.0
        other = f["step"] - sum(f[p] for p in PHASES if p != "rollout" or mode == "sync")  # the step's unnamed time
        rows.append([mode, f"{f['samples_per_s']:.2f}", f"{f['step']:.2f}", *[f"{f[p]:.2f}" for p in PHASES], f"{other:.2f}",
                     f"{f['samples_per_s'] / sync['samples_per_s']:.2f}x", f"{bound:.2f}x"])
    notes = (f"rider-grm, policy and judge at {'tiny' if args.smoke else 'Qwen3-1.7B'} shape (random bf16 weights), "
             f"{2 if args.smoke else PROMPTS} prompts x 8 replies of {8 if args.smoke else 256} tokens a step, rule + a "
             "served yes/no judge (weight 0.5) whose server shares the GPU"
             + ("" if args.smoke else f" (vLLM, gpu_memory_utilization {JUDGE_MEMORY}; the policy's {POLICY_MEMORY})")
             + f". Means over the steps after the first {WARMUP} (async: before the last). Seconds per step, "
             "warm-up included: " + "; ".join(f"{m} {f['steps']}" for m, f in got.items()) + ". Every phase timed "
             "(`time/*`, seconds): " + "; ".join(f"{m} {f['phases']}" for m, f in got.items()) + ".")
    title = "rider-grm on one GPU with a served judge: synchronous vs asynchronous (Qwen3-1.7B shape)"
    if args.smoke:
        print(f"{title}\n{markdown_table(header, rows)}\n{notes}")
        return
    append_results(title, header, rows, notes)


if __name__ == "__main__":
    main()
