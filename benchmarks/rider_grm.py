"""rider-grm on one GPU: a policy and two judges at Qwen3-1.7B shape (random weights), the whole
recipe run four ways in one process —

- `policy alone`: rule reward only (no judges): the baseline peak memory;
- `swapped`: `reward.swap=always`: each judge woken only while it scores, the policy (weights and
  Adam moments) asleep meanwhile — VeRL-with-RMs' memory plan; copies go through reused pinned
  host buffers;
- `auto`: `reward.swap=auto`: step 1 swapped and measured, then the fastest plan that fits
  (everything resident / policy resident + judges swapped / swapped) — the plan is reported;
- `resident`: `reward.swap=never`: policy and both judges on the GPU all the time.

Reports, for the last step of each run, seconds per phase with each swap piece on its own
(policy offload, policy wake, each judge's wake/score/sleep), the swap share of the step and
the peak GPU memory. Goals (issue 9): swapped peak <= policy-alone peak + one judge's weights
and cache; swap <= 10% of the step time.

    uv run python benchmarks/rider_grm.py            # GPU, appends to benchmarks/RESULTS.md
    uv run python benchmarks/rider_grm.py --smoke    # CPU, tiny shapes, seconds
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import sys
import tempfile
from pathlib import Path

import torch
from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

ROOT = Path(__file__).resolve().parents[1]
APP = ROOT / "apps" / "rider-grm"
sys.path.insert(0, str(APP))
sys.path.insert(0, str(ROOT))

from benchmarks.results import append_results  # noqa: E402
from rl_models import tiny  # noqa: E402

# Qwen3-1.7B (config.json of Qwen/Qwen3-1.7B)
SHAPE_1_7B = dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                  num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
                  tie_word_embeddings=True, rope_theta=1_000_000.0)
SHAPE_SMOKE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=8, vocab_size=768, max_position_embeddings=4096,
                   tie_word_embeddings=True, rope_theta=1_000_000.0)


def load_app():
    spec = importlib.util.spec_from_file_location("rider_grm_app", APP / "__main__.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["rider_grm_app"] = module
    spec.loader.exec_module(module)
    return module


def random_checkpoint(out: Path, shape: dict, seed: int) -> Path:
    """A Qwen3 checkpoint of `shape` with random weights and the tiny Qwen tokenizer (real BPE,
    chat template; its ids are a subset of the model vocabulary)."""
    tokenizer = AutoTokenizer.from_pretrained(tiny.build("qwen3"))
    config = Qwen3Config(**shape, bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    model.generation_config.eos_token_id = [tokenizer.eos_token_id]
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    del model
    return out


MODES = {"policy alone": "never", "swapped": "always", "auto": "auto", "resident": "never"}
JUDGES = ("rubric", "yes_no")
# the loop's phases of a step (the policy offload is inside rollout, its wake inside update)
PHASES = ["rollout", "reward", "advantages", "update"]


def run(app, out: Path, policy: Path, judge: Path, mode: str, smoke: bool) -> dict[str, float]:
    judges = "[]" if mode == "policy alone" else (
        f'[{{name = "rubric", module = "rl_rewards.judges.rubric", model = "{judge}", prompt = "prompt", '
        f'weight = 0.3, max_new_tokens = {8 if smoke else 64}, engine_options = {{compile = false}}}}, '
        f'{{name = "yes_no", module = "rl_rewards.judges.yes_no", model = "{judge}", prompt = "prompt", '
        f'weight = 0.5, max_new_tokens = {4 if smoke else 16}, engine_options = {{compile = false}}}}]')
    overrides = [
        f"model.path={policy}", "model.dtype=bfloat16", f"reward.judges={judges}",
        f'reward.swap="{MODES[mode]}"', "reward.embedding.model=null",
        'data.train_files=["examples/data/rider/train.parquet"]', 'data.val_files=["examples/data/rider/val.parquet"]',
        f"rollout.max_new_tokens={8 if smoke else 256}", "rollout.n=4", f"train.batch_size={2 if smoke else 8}",
        f"train.mini_batch_size={2 if smoke else 8}", "train.micro_batch_size=8",
        "train.lr=1e-6", "train.max_steps=3", "train.save_freq=1000", "train.val_before_train=false",
        f'train.output_dir="{out / mode.replace(" ", "_")}"', "algo.replay_tolerance=0.5",
        "rollout.max_batch_size=64", "reward.rule=rider_rules:compute_score",
    ]
    run_dir = app.main(overrides)
    with (run_dir / "metrics.csv").open() as f:
        rows = list(csv.DictReader(f))
    return {k: float(v) for k, v in rows[-1].items() if v not in ("", None)}


def plan_of(m: dict[str, float]) -> str:
    """The swap plan the step ran with (from the `swap/*` metrics)."""
    if m.get("swap/offload_policy", 0.0):
        return "always"
    return "judges" if m.get("swap/sleep_judges", 0.0) else "never"


def swap_seconds(m: dict[str, float]) -> float:
    judges = sum(m.get(f"time/judge_{j}_{part}", 0.0) for j in JUDGES for part in ("wake", "sleep"))
    return m.get("time/offload_policy", 0.0) + m.get("time/wake_policy", 0.0) + judges


def peak_gib(m: dict[str, float]) -> float:
    """The step's peak GPU memory: the largest phase peak (`memory/<phase>_peak_gib`)."""
    return max((v for k, v in m.items() if k.startswith("memory/") and "/eval/" not in k), default=0.0)


def tables(results: dict[str, dict[str, float]]) -> tuple[list[str], list[list[str]], list[str], list[list[str]]]:
    header = ["run", "plan", "step s", *[f"{p} s" for p in PHASES], "swap s", "swap % of step", "peak GiB"]
    rows = []
    for mode, m in results.items():
        step = sum(m.get(f"time/{p}", 0.0) for p in PHASES)
        swap = swap_seconds(m)
        rows.append([mode, plan_of(m), f"{step:.2f}", *[f"{m.get(f'time/{p}', 0.0):.3f}" for p in PHASES],
                     f"{swap:.3f}", f"{100 * swap / step:.1f}" if step else "-", f"{peak_gib(m):.2f}"])
    judge_header = ["run", "judge", "wake s", "score s", "sleep s", "peak GiB while scoring"]
    judge_rows = [[mode, name, *[f"{m.get(f'time/judge_{name}_{part}', 0.0):.3f}" for part in ("wake", "score", "sleep")],
                   f"{m.get(f'memory/judge_{name}_score_peak_gib', 0.0):.2f}"]
                  for mode, m in results.items() if mode != "policy alone" for name in JUDGES]
    return header, rows, judge_header, judge_rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU; no RESULTS.md")
    args = parser.parse_args()
    app = load_app()
    shape = SHAPE_SMOKE if args.smoke else SHAPE_1_7B
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        policy = random_checkpoint(root / "policy", shape, 0)
        judge = random_checkpoint(root / "judge", shape, 1)
        results = {mode: run(app, root, policy, judge, mode, args.smoke) for mode in MODES}
    header, rows, judge_header, judge_rows = tables(results)
    notes = ("Qwen3-1.7B shape, random bf16 weights, policy + 2 judges (rl_rewards.judges.rubric / yes_no), "
             "8 prompts x n=4, 256 response tokens, judges 64/16 new tokens; decode not compiled (CUDA graphs "
             "would be re-captured after every wake); third step of each run (auto decided its plan after step 1). "
             "`step s` sums the phases listed (reward includes the judges' wake/score/sleep); swap = policy "
             "offload + policy wake + each judge's wake + sleep, through reused pinned host buffers.")
    if args.smoke:
        from benchmarks.results import markdown_table

        print(markdown_table(header, rows))
        print(markdown_table(judge_header, judge_rows))
        return
    append_results("rider-grm: judges swapped vs auto vs resident (Qwen3-1.7B shape)", header, rows, notes)
    append_results("rider-grm: judge wake/score/sleep", judge_header, judge_rows)


if __name__ == "__main__":
    main()
