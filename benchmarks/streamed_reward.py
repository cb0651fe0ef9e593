"""Streamed vs after-batch scoring: one rider-grm step against a real `rl-rewards serve` whose
reward is deliberately slow (a served rule that sleeps `--sleep-ms` per sample: a judge's
cost, without a judge).

Both runs are the same step: the tiny policy (rl_models.tiny qwen3) samples `--prompts` prompts x
`--n` replies of `--tokens` tokens, each prompt from its own seed (rollout.per_prompt_seeds), and
the one judge is the served rule (`engine = "server"`). `after batch` (reward.stream=false) sends
the batch when it is all sampled; `streamed` (reward.stream=true, the default) sends each prompt's
replies as soon as they are sampled, so the server scores prompt i while prompt i+1 samples and
while the trainer computes the log-probs. The baseline is measured in the same run; the rewards
of the two are checked equal.

    uv run python benchmarks/streamed_reward.py            # CPU, appends to RESULTS.md
    uv run python benchmarks/streamed_reward.py --smoke    # seconds, prints only
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
APP = ROOT / "apps" / "rider-grm"
sys.path.insert(0, str(APP))
sys.path.insert(0, str(ROOT))

from benchmarks.results import append_results  # noqa: E402
from benchmarks.rider_grm import load_app  # noqa: E402
from rl_rewards.server.process import ServerProcess  # noqa: E402

SPEC = "slow"
RULE = """import time


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    time.sleep({seconds})
    return len(solution_str) % 7 / 7
"""



def run(app, out: Path, url: str, stream: bool, args: argparse.Namespace) -> dict[str, list[float]]:
    """Per step (after the first, a warm-up): seconds of the step, rollout and reward; and the rewards."""
    judge = f'[{{name = "slow", engine = "server", url = "{url}", spec = "{SPEC}", weight = 1.0, combine = "add"}}]'
    overrides = {
        "train.output_dir": f'"{out}"', "reward.judges": judge, "reward.stream": str(stream).lower(),
        "reward.rule": '"rider_rules:compute_score"', "reward.embedding.model": "null",
        "rollout.per_prompt_seeds": "true", "rollout.n": args.n, "rollout.max_new_tokens": args.tokens,
        "train.batch_size": args.prompts, "train.mini_batch_size": args.prompts, "train.micro_batch_size": 8,
        "train.max_steps": args.steps + 1, "train.epochs": 100, "train.save_freq": 1000, "train.eval_freq": 0,
        "train.val_before_train": "false",
    }
    run_dir = app.main([f"{k}={v}" for k, v in overrides.items()])
    with (run_dir / "metrics.csv").open() as f:
        rows = [r for r in csv.DictReader(f) if r["step"] != "0"][1:]
    return {key: [float(r[key]) for r in rows] for key in ("time/step", "time/rollout", "time/reward", "reward/mean")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--sleep-ms", type=float, default=20.0)
    parser.add_argument("--steps", type=int, default=3, help="timed steps (after one warm-up step)")
    parser.add_argument("--smoke", action="store_true", help="2 prompts, 1 timed step, print only")
    args = parser.parse_args()
    if args.smoke:
        args.prompts, args.steps = 2, 1
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    app = load_app()
    with tempfile.TemporaryDirectory() as tmp:
        rule, config = Path(tmp) / "slow_rule.py", Path(tmp) / "server.toml"
        rule.write_text(RULE.format(seconds=args.sleep_ms / 1000))
        config.write_text(f'[rewards.{SPEC}.components.rule]\nscorer = "rule"\n'
                          f'options = {{ function = "{rule}:compute_score" }}\n')
        with ServerProcess(["--config", str(config)], log_path=Path(tmp) / "server.log") as server:
            after = run(app, Path(tmp) / "after", server.url, False, args)
            streamed = run(app, Path(tmp) / "streamed", server.url, True, args)
    if after["reward/mean"] != streamed["reward/mean"]:
        raise SystemExit(f"streamed rewards {streamed['reward/mean']} differ from after-batch {after['reward/mean']}")
    header = ["scoring", "s/step", "time/rollout (s)", "time/reward (s)", "step vs after batch"]
    base = statistics.mean(after["time/step"])
    rows = [[name, f"{statistics.mean(m['time/step']):.3f}", f"{statistics.mean(m['time/rollout']):.3f}",
             f"{statistics.mean(m['time/reward']):.3f}", f"{statistics.mean(m['time/step']) / base:.2f}x"]
            for name, m in (("after batch (reward.stream=false)", after), ("streamed (reward.stream=true)", streamed))]
    samples = args.prompts * args.n
    notes = (f"rider-grm, tiny qwen3 policy on the CPU, {args.prompts} prompts x {args.n} replies of <= {args.tokens} "
             f"tokens, seeded per prompt; the judge a served rule sleeping {args.sleep_ms:g} ms a sample "
             f"({samples * args.sleep_ms / 1000:.2f} s of scoring a step); mean of {args.steps} steps "
             "after a warm-up. Rewards equal in both runs (checked).")
    if args.smoke:
        print(header, *rows, notes, sep="\n")
        return
    append_results("Streamed vs after-batch scoring (rider-grm, served slow judge)", header, rows, notes)


if __name__ == "__main__":
    main()
