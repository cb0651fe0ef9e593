"""caption-rl synchronous against asynchronous (`train.max_staleness`) on one GPU, colocated.

    python benchmarks/async_rl.py                 # Qwen3-VL-2B shape, hf engine, one GPU
    python benchmarks/async_rl.py --vllm          # the same with rollout.engine=vllm
    python benchmarks/async_rl.py --smoke         # tiny, CPU: prints, appends nothing
    python benchmarks/async_rl.py --two-gpus      # 2 GPUs: DDP synchronous vs split asynchronous
    python benchmarks/async_rl.py --two-gpus --vllm --cache DIR   # the same on vLLM, and TRL's server mode
    python benchmarks/async_rl.py --two-gpus --vllm --long-tail --cache DIR   # caption lengths with a long tail

The setting is benchmarks/caption_rl.py's (32 images x 8 captions x 256 tokens per step, rule
reward, bf16 full fine-tuning, one optimizer step per RL step), one engine call per step (not
seeded per prompt, which would make 32 calls of 8 rows). Each
run is its own process (clean CUDA peak). Staleness N >= 1 samples step j + 1 on a rollout thread
(its own CUDA stream, its own copy of the trained weights) while step j updates, with
`algo.rollout_correction=token_truncate`. Reported: samples/s (all processes' samples per second
of step time), seconds per step and per phase, and the overlap limit beside it: with rollout R
and the rest of the step U (reward, log-probs, update) in series, overlapping them at best gives
(R + U) / max(R, U) — when one GPU runs both, less, since they share its compute.

`--two-gpus`: the same batch on 2 GPUs, synchronous DDP (2 processes, 16 prompts each) against
asynchronous split placement (1 trainer process on GPU 0, its rollout engine on GPU 1:
`rollout.placement=split`, `rollout.engine=hf`), each launched with `accelerate launch`.

`--two-gpus --vllm`: the same with vLLM rollouts, against TRL's 2-GPU server mode. Synchronous:
DDP, each process with its colocated vLLM engine asleep during the update (`VLLM_MEMORY` of its
GPU). Asynchronous: 1 trainer process on GPU 0, its vLLM engine on GPU 1 (its engine core in a
process of its own, awake throughout, `SPLIT_VLLM_MEMORY` of that GPU: its KV cache and the
published versions' weight copies share the card), each version pushed between requests as
CUDA IPC handles. TRL:
`GRPOTrainer(use_vllm=True, vllm_mode="server")`, `trl vllm-serve` on GPU 1 and the trainer on
GPU 0 (benchmarks/caption_rl.py --trl-server). Compared as tokens/s on the 2 GPUs (prompt +
caption tokens per second of step time). `--cache DIR` keeps each run's figures in DIR and
reuses them, so the runs fit separate commands of a time-limited machine (`--only NAME`).

`--long-tail` (with `--two-gpus --vllm`): caption lengths drawn per sample, most 150-400 tokens
with a tail to 2k, imposed inside every vLLM engine of the run, ours and TRL's
(benchmarks/long_tail.py). Its runs add partial rollouts (`PARTIAL`: K = 1, 128 tokens a round):
`sync-ddp-partial` (DDP, each process keeping its groups in flight) and `async-split-partial`
(split placement with max_staleness=1 as above, the rollout thread sampling partial rollouts) and
`async-ddp-partial` (DDP, each process's colocated engine awake, sampling the next step's partial
rollouts on the rollout thread while its GPU updates: a long tail leaves that GPU mostly idle).
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from caption_rl import APP, WARMUP, build_policy, caption_rl_args, run_figures, run_side
from results import append_results

SETTINGS = {0: [], 1: ["train.max_staleness=1", "algo.rollout_correction=token_truncate"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU; prints, appends nothing")
    parser.add_argument("--vllm", action="store_true", help="rollout.engine=vllm (colocated, stays awake when async)")
    parser.add_argument("--steps", type=int, default=None, help="training steps (the first two are warm-up)")
    parser.add_argument("--two-gpus", action="store_true", help="DDP synchronous vs split asynchronous on 2 GPUs")
    parser.add_argument("--cache", type=Path, default=None,
                        help="--two-gpus --vllm: keep each run's figures in DIR/<run>.json and reuse them")
    parser.add_argument("--long-tail", action="store_true",
                        help="with --two-gpus --vllm: caption lengths with a tail to 2k, and the partial-rollout runs")
    parser.add_argument("--only", choices=tuple(VLLM_RUNS), action="append", default=None,
                        help="--two-gpus --vllm: run only these (repeatable); report once all are cached")
    args = parser.parse_args()
    steps = args.steps or (WARMUP + 3 if args.smoke else WARMUP + 5)
    if args.long_tail and not (args.two_gpus and args.vllm):
        parser.error("--long-tail imposes its lengths inside vLLM on 2 GPUs: it goes with --two-gpus --vllm")
    if args.two_gpus and args.vllm:
        if args.long_tail:
            from caption_rl import use_long_tail

            use_long_tail()
        two_gpus_vllm(steps, args.cache, args.only, args.long_tail)
        return
    if args.two_gpus:
        two_gpus(steps)
        return
    figures: dict[int, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        policy = build_policy(Path(tmp) / "policy", args.smoke)
        gc.collect()
        for staleness, overrides in SETTINGS.items():
            out = Path(tmp) / f"s{staleness}"
            out.mkdir()
            figures[staleness] = run_side("caption-rl", args.smoke, steps, policy, out,
                                          overrides, args.vllm)
    report(figures, smoke=args.smoke, vllm=args.vllm)


def report(figures: dict[int, dict], *, smoke: bool, vllm: bool) -> None:
    sync = figures[0]
    header = ["schedule", "samples/s", "s/step", "rollout s", "waited s", "reward s", "logprob s", "update s",
              "peak GiB", "vs sync"]
    rows = []
    for staleness, f in figures.items():
        peak = f["device_peak_gib"] if vllm else f["peak_gib"]
        rows.append([f"max_staleness={staleness}", f"{f['throughput/samples_per_s']:.2f}", f"{f['time/step']:.2f}",
                     f"{f['time/rollout']:.2f}", f"{f['time/rollout_wait']:.2f}" if staleness else "",
                     f"{f['time/reward']:.3f}", f"{f['time/logprob']:.2f}", f"{f['time/update']:.2f}", f"{peak:.1f}",
                     f"{f['throughput/samples_per_s'] / sync['throughput/samples_per_s']:.2f}x"])
    rollout, rest = sync["time/rollout"], sync["time/step"] - sync["time/rollout"]
    limit = (rollout + rest) / max(rollout, rest)
    notes = (f"caption-rl at Qwen3-VL-2B shape (random weights, bf16, full fine-tuning, gradient checkpointing), "
             f"32 images x 8 captions x 256 tokens per step, rule reward, rollout.engine={'vllm' if vllm else 'hf'} "
             "colocated on one GPU, each schedule in its own process; means over the "
             f"steps after the first {WARMUP} (and, asynchronous, before the last: it has nothing to overlap). max_staleness=1: the rollout thread (own CUDA stream, own weight copy) "
             "samples step j+1 while step j trains, algo.rollout_correction=token_truncate. Overlap limit from the "
             f"synchronous run: (rollout {rollout:.2f} s + rest {rest:.2f} s) / max = {limit:.2f}x (one GPU shares "
             "its compute between the two, so less is reachable). Goal: async >= 1.2x sync on one GPU. Seconds per "
             "step, warm-up included: " + "; ".join(f"N={n}: {f['steps/step']}" for n, f in figures.items()) + ".")
    title = (f"caption-rl asynchronous vs synchronous on one GPU ({'vLLM' if vllm else 'hf'} engine, "
             "Qwen3-VL-2B shape)")
    if smoke:
        print(json.dumps({"header": header, "rows": rows, "notes": notes}, indent=1))
        return
    append_results(title, header, rows, notes)


def launch(processes: int, policy: Path, out: Path, steps: int, overrides: list[str]) -> dict:
    """caption-rl under `accelerate launch` with `processes` processes; figures from metrics.csv."""
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(processes),
                "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                *(["--multi_gpu"] if processes > 1 else [])]
    subprocess.run([*launcher, str(APP / "__main__.py"),
                    *caption_rl_args(policy, out, smoke=False, steps=steps, overrides=overrides)], check=True)
    [run] = [d for d in out.iterdir() if d.is_dir() and d.name.startswith("run-")]
    return run_figures(run)


SPLIT = ["rollout.engine=hf", "rollout.placement=split", *SETTINGS[1]]
# the rollout thread's decode as CUDA graphs: one launch per token instead of one per kernel, so it
# holds the interpreter lock (shared with the trainer's thread) far less
SPLIT_GRAPHS = [*SPLIT, "rollout.compile_mode=reduce-overhead", "rollout.release_cache=false"]


def two_gpus(steps: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        policy = build_policy(Path(tmp) / "policy", False)
        gc.collect()
        runs = {"DDP synchronous (2 processes)": launch(2, policy, Path(tmp) / "ddp", steps, ["rollout.engine=hf"]),
                "split asynchronous, max_staleness=1": launch(1, policy, Path(tmp) / "split", steps, SPLIT),
                "split asynchronous, decode as CUDA graphs": launch(1, policy, Path(tmp) / "graphs", steps,
                                                                    SPLIT_GRAPHS)}
    sync = runs["DDP synchronous (2 processes)"]
    header = ["schedule on 2 GPUs", "samples/s", "s/step", "rollout s", "waited s", "prepare s", "update s", "vs sync"]
    rows = [[name, f"{f['throughput/samples_per_s']:.2f}", f"{f['time/step']:.2f}", f"{f['time/rollout']:.2f}",
             f"{f['time/rollout_wait']:.2f}" if name.startswith("split") else "", f"{f.get('time/prepare', 0.0):.2f}",
             f"{f['time/update']:.2f}", f"{f['throughput/samples_per_s'] / sync['throughput/samples_per_s']:.2f}x"]
            for name, f in runs.items()]
    notes = ("caption-rl at Qwen3-VL-2B shape (random weights, bf16, full fine-tuning, gradient checkpointing), 32 "
             "images x 8 captions x 256 tokens per step on 2 GPUs, hf engine. DDP: 2 processes of 16 prompts, each "
             "rolling out and training in series on its GPU. Split: 1 trainer process (GPU 0) with its rollout "
             "engine on GPU 1 sampling the next step meanwhile (rollout.placement=split, max_staleness=1, "
             "token_truncate), its decode compiled as fused kernels (default) or as CUDA graphs "
             "(rollout.compile_mode=reduce-overhead). Means over the steps after the first "
             f"{WARMUP} (split: before the last). Goal (issue 31): async split >= 1.8x our synchronous run on the "
             "same 2 GPUs. Seconds per step, warm-up included: "
             + "; ".join(f"{name}: {f['steps/step']} (update {f['steps/update']}, rollout {f['steps/rollout']})"
                         for name, f in runs.items()) + ".")
    append_results("caption-rl on 2 GPUs: synchronous DDP vs asynchronous split placement (Qwen3-VL-2B shape)",
                   header, rows, notes)


SPLIT_VLLM_MEMORY = 0.6
VLLM_RUNS = {
    "sync-ddp": "DDP synchronous (2 processes), vLLM colocated",
    "async-split": "split asynchronous, max_staleness=1, vLLM on GPU 1",
    "async-ray": "split asynchronous, max_staleness=1, vLLM in a Ray actor on GPU 1",
    "trl-server": "TRL GRPOTrainer, vllm_mode=server (trl vllm-serve on GPU 1)",
    "sync-ddp-partial": "DDP synchronous (2 processes), vLLM colocated, partial rollouts K=1",
    "async-split-partial": "split asynchronous, max_staleness=1, vLLM on GPU 1, partial rollouts K=1",
    "async-ddp-partial": "DDP asynchronous (2 processes), max_staleness=1, vLLM colocated and awake, partial rollouts K=1",
    "async-ddp-partial2": "DDP asynchronous (2 processes), max_staleness=1, vLLM colocated and awake, partial rollouts K=2",
}
# `--long-tail`'s partial rollouts: K = 1, 128 tokens a round, room for the (K + 1) x 256 samples in flight
PARTIAL = ["train.partial_rollouts.steps=1", "train.partial_rollouts.chunk_tokens=128", "rollout.max_batch_size=512",
           "algo.rollout_correction=token_truncate"]


def two_gpus_vllm(steps: int, cache: Path | None, only: list[str] | None, long_tail: bool = False) -> None:
    from caption_rl import VLLM_MAX_LEN, VLLM_MEMORY, vllm_overrides
    from results import cached_figures, load_figures, save_figures

    names = [n for n in VLLM_RUNS if long_tail or "-partial" not in n]
    wanted = only or names
    prefix = "two-gpus-long-tail" if long_tail else "two-gpus"
    got = {name: kept for name in names if (kept := load_figures(cached_figures(cache, f"{prefix}-{name}")))}
    with tempfile.TemporaryDirectory() as tmp:
        policy = None
        for name in (n for n in wanted if n not in got):
            if name == "trl-server":
                trl_cache = cache or Path(tmp)
                subprocess.run([sys.executable, str(Path(__file__).with_name("caption_rl.py")), "--vllm", "--only", "trl",
                                "--trl-server", "--cache", str(trl_cache), "--steps", str(steps),
                                *(["--long-tail"] if long_tail else [])], check=True)
                got[name] = load_figures(cached_figures(trl_cache, "trl-vllm-server" + ("-long-tail" if long_tail else "")))
            else:
                policy = policy or build_policy(Path(tmp) / "policy", False)
                gc.collect()
                ddp = "-ddp" in name  # 2 processes, each with its colocated engine
                overrides = ([*vllm_overrides(), *(SETTINGS[1] if name.startswith("async") else [])] if ddp else
                             ["rollout.engine=vllm", "rollout.placement=split", *SETTINGS[1],
                              f"rollout.gpu_memory_utilization={SPLIT_VLLM_MEMORY}",
                              f"rollout.engine_options.max_model_len={VLLM_MAX_LEN}",
                              *(["rollout.workers=1"] if name == "async-ray" else [])])
                overrides += PARTIAL if "-partial" in name else []
                overrides += ["train.partial_rollouts.steps=2", "rollout.max_batch_size=768"] if name.endswith("2") else []
                out = cache / name if cache else Path(tmp) / name  # with --cache, the run directory stays there too
                shutil.rmtree(out, ignore_errors=True)
                processes = 2 if ddp else 1
                got[name] = {**launch(processes, policy, out, steps, overrides), "processes": processes}
            save_figures(cached_figures(cache, f"{prefix}-{name}"), got[name])
    missing = [n for n in ("sync-ddp", "trl-server") if n not in got]
    if missing or not any(n.startswith("async") for n in got):
        print(f"cached: {sorted(got)}; run {missing or 'an async placement'} to report")
        return
    # on the 2 GPUs: ours per process times processes; TRL's figure is per GPU, its total kept beside it
    total = {n: f.get("throughput/tokens_per_s_all_gpus", f["throughput/tokens_per_s"] * f.get("processes", 1))
             for n, f in got.items()}
    sync, trl = total["sync-ddp"], total["trl-server"]
    header = ["on 2 GPUs", "tokens/s", "s/step", "rollout s", "waited s", "update s", "update s, slowest process",
              "caption tokens", "vs our sync", "vs TRL server"]
    rows = []
    for name, f in got.items():
        ours = name != "trl-server"
        rows.append([VLLM_RUNS[name], f"{total[name]:.0f}", f"{f['time/step']:.2f}",
                     f"{f['time/rollout']:.2f}" if ours else "", f"{f['time/rollout_wait']:.2f}" if name.startswith("async") else "",
                     f"{f['time/update']:.2f}" if ours else "",
                     f"{f['time_max/update']:.2f}" if "time_max/update" in f else "", f"{f['response/length_mean']:.0f}",
                     f"{total[name] / sync:.2f}x", f"{total[name] / trl:.2f}x"])
    bounds = []
    for name, split in got.items():
        if name.startswith("async"):
            rest = split["time/step"] - split["time/rollout_wait"]  # the trainer's own work per step
            bounds.append(f"{name} {(split['time/rollout'] + rest) / max(split['time/rollout'], rest):.2f}x")
    lengths = ("captions of lengths drawn per sample (95% log-normal, median 260, sigma 0.35, in 100-600 tokens; 5% "
               "uniform in 800-2048), imposed inside every vLLM engine of the run, ours and TRL's, by the logits "
               "processor of benchmarks/long_tail.py (V1 model runner for all)" if long_tail else "captions x 256 tokens")
    notes = ("caption-rl at Qwen3-VL-2B shape (random weights, bf16, full fine-tuning, gradient checkpointing), 32 "
             f"images x 8 {lengths} per step on 2 GPUs, rule reward, vLLM rollouts with max_model_len "
             f"{VLLM_MAX_LEN}. DDP: 2 processes of 16 prompts, each with its colocated vLLM engine "
             f"(gpu_memory_utilization {VLLM_MEMORY}, asleep during the update). Split: 1 trainer process on GPU 0, its "
             f"vLLM engine on GPU 1 (gpu_memory_utilization {SPLIT_VLLM_MEMORY}, awake), sampling step j+1 while step j "
             "trains (max_staleness=1, token_truncate); in a Ray actor (rollout.workers=1): the whole engine, vLLM's "
             "client included, outside the trainer's process. Partial rollouts (K=1, or K=2 where named): (K + 1) x a step's groups in flight, "
             "128 tokens a round, a step training the first groups to finish (token_truncate). TRL: GRPOTrainer "
             "use_vllm=True, vllm_mode='server', trl "
             "vllm-serve on GPU 1, the trainer on GPU 0, same data, lengths, loss and reward (benchmarks/caption_rl.py "
             "--trl-server). tokens/s: prompt + caption tokens per second of step time, on the 2 GPUs. Means over the "
             f"steps after the first {WARMUP} (split: before the last). Goals: asynchronous >= 1.8x our "
             "synchronous run on the same 2 GPUs and >= 2x TRL's server mode. Overlap bound of each split run "
             f"(rollout and the rest of its step in series, over max of the two): {', '.join(bounds)}. Seconds per step, "
             "warm-up included: " + "; ".join(f"{n}: {f['steps/step']}" for n, f in got.items()) + ".")
    append_results("caption-rl on 2 GPUs with vLLM rollouts: synchronous DDP, asynchronous split, TRL server mode "
                   f"(Qwen3-VL-2B shape{', long-tail caption lengths' if long_tail else ''})", header, rows, notes)


if __name__ == "__main__":
    if torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = True
    main()
