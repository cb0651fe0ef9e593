"""Issue 22's multi-GPU runs on one 2- or 4-GPU machine: each app launched as a user launches it.

    python benchmarks/multi_gpu.py                       # 2 GPUs, all three apps, ~12 min: appends to RESULTS.md
    python benchmarks/multi_gpu.py --gpus 4 --only caption-speed --caption-kind DDP   # 1, 2 and 4 GPUs
    python benchmarks/multi_gpu.py --only caption        # one app (repeatable), as measured on 2 x H100:
                                                         #   caption ~4.5 min, rider ~4 min, diffusion ~3 min
    python benchmarks/multi_gpu.py --out DIR/RESULTS.md --logs DIR/logs   # append there; keep each run's log
    python benchmarks/multi_gpu.py --only caption --caption-kind FSDP2     # caption-rl: reference + FSDP2 runs only
    python benchmarks/multi_gpu.py --cpu                 # same pipeline, tiny models, 2 gloo processes; prints only

(`uv run python ...` or the workspace venv's python: the children run with the same interpreter.)
Before anything is built, each chosen app's `--help` runs in the children's environment and the modules
only its runs import (diffusion: diffusers, Ray) are looked up: a missing package stops the script at once.

Every run is a child process started as a user starts the app: `python apps/<app>/__main__.py
key=value ...` on one GPU, `python -m accelerate.commands.launch --config_file
examples/<app>/accelerate/<ddp|fsdp2>.yaml --num_processes 2 apps/<app>/__main__.py key=value ...`
on two, with PYTHONPATH = the app folder + packages/*/src; figures are read back from the run's
metrics.csv. The checkpoints are random-weight, built once per part into a temp dir with the
single-GPU benchmarks' builders (no download). Parts, in order:

1. caption-rl, 2 processes = 1 process with twice the batch for one RL step (the CPU test
   `test_two_processes_equal_one_process_with_twice_the_batch` on the GPUs): DDP and FSDP2 vs
   one process, tiny Qwen2.5-VL, float32 with TF32 off (NVIDIA_TF32_OVERRIDE=0), hf rollouts
   seeded per prompt; max |diff| of the step's metrics and of the exported weights.
2. caption-rl throughput at Qwen3-VL-2B shape, bf16: 1 GPU vs DDP and FSDP2 on 2 GPUs (and on 4
   with `--gpus 4`) at the same batch per GPU.
3. rider-grm throughput: Qwen3-1.7B-shape policy, two Qwen3-0.6B-shape judges on hf engines,
   `reward.swap=always` (judges swapped in and out on every GPU); 1 GPU vs DDP on 2 (and 4).
4. diffusion-grpo at SD3.5-Medium shape (LoRA r32, 512 px, 10 steps): (a) one GPU, rollout in
   process; (b) VRL's split preset, the trainer on GPU 0 and `rollout.workers=1
   rollout.placement=split` (one Ray actor) on GPU 1.

Scaling efficiency = N-GPU throughput / (N x 1-GPU throughput), step (epoch) times averaged
after the warm-up steps. Every process, the 1-GPU run's too, gets OMP_NUM_THREADS=1 (what
`accelerate launch` sets for its ranks), so the baseline's host threads match the ranks'. Decode and layer compilation are off in every run
(TORCH_COMPILE_DISABLE=1): caption-rl's first-step compile (~75 s on an H100) would not fit the
time limit; it changes the step time equally for 1 and 2 GPUs but makes rollout, which needs
no communication, a larger share. NVLink multicast stays off in every child (NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1). A failing run prints its log's
tail and leaves a `failed` row; each part's table is printed and appended as soon as it is done.
Run directories go to /dev/shm when it has room (the apps write and fsync a full checkpoint at
their last step); each run's checkpoints are deleted when it ends.
"""

from __future__ import annotations

import argparse
import csv
import gc
import math
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("rl-core", "rl-models", "rl-rollout", "rl-data", "rl-rewards")
# this tree's sources, here and in every child, whatever the environment has installed
sys.path[:0] = [str(REPO), *(str(REPO / "packages" / p / "src") for p in PACKAGES)]
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # every model here is local; a GPU machine may have no network

from benchmarks.results import append_results, markdown_table  # noqa: E402

NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
WARMUP = 1  # steps (epochs) left out of every mean: allocator growth, first optimizer state
BUDGET_S = 540.0  # default --budget-s: later runs are refused, not started, past it (a 600 s command limit)

# Qwen3-0.6B (config.json of Qwen/Qwen3-0.6B): the judges' shape
QWEN3_0_6B = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                  num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
                  tie_word_embeddings=True, rope_theta=1_000_000.0)


# ------------------------------------------------------------------------------ launching


@dataclass(frozen=True)
class Launch:
    """One app run, started the way a user starts it."""

    app: str  # folder under apps/
    name: str  # train.run_name, and the log's file name
    overrides: Sequence[str]
    procs: int = 1
    accelerate_config: str | None = None  # file in examples/<app>/accelerate/
    gpus: str = "0"  # CUDA_VISIBLE_DEVICES
    env: dict[str, str] = field(default_factory=dict)


@dataclass
class Bench:
    cpu: bool
    root: Path  # temp dir: the random-weight checkpoints
    runs: Path  # run directories (their checkpoints deleted after each run)
    logs: Path  # each run's output and metrics.csv
    deadline: float  # time.monotonic() after which no run starts
    budget_s: float = BUDGET_S  # what the deadline was set from (for the messages)
    caption_kinds: tuple[str, ...] = ("DDP", "FSDP2")  # the 2-process caption-rl runs (keys of CAPTION_CONFIGS)
    gpus: int = 2  # the most GPUs a throughput part runs on (2 or 4): runs at 1, 2, ..., gpus
    failures: list[str] = field(default_factory=list)


class RunFailed(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(cpu: bool, run: Launch) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # split placement starts its own Ray
    paths = [str(REPO / "apps" / run.app), *(str(REPO / "packages" / p / "src") for p in PACKAGES)]
    env["PYTHONPATH"] = os.pathsep.join(paths + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env |= {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0",
            "RAY_USAGE_STATS_ENABLED": "0", "TORCH_COMPILE_DISABLE": "1", **NO_MULTICAST}
    env["CUDA_VISIBLE_DEVICES"] = "" if cpu else run.gpus
    env["OMP_NUM_THREADS"] = "1"  # as `accelerate launch` sets for each rank: the 1-GPU baseline alike
    return env | run.env


def command(run: Launch, output_dir: Path) -> list[str]:
    """One process: `python apps/<app>/__main__.py ...` (the apps' one-GPU command); more: `accelerate
    launch` with the app's example config (which also keeps a machine's default accelerate config out)."""
    script = [str(REPO / "apps" / run.app / "__main__.py"), f'train.output_dir="{output_dir}"',
              f'train.run_name="{run.name}"', *run.overrides]
    if run.procs == 1:
        return [sys.executable, *script]
    if run.accelerate_config is None:
        raise ValueError(f"{run.app} {run.name}: {run.procs} processes need an accelerate config file")
    config = REPO / "examples" / run.app / "accelerate" / run.accelerate_config
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config), "--num_processes",
            str(run.procs), "--main_process_port", str(free_port()), "--dynamo_backend", "no", *script]


def launch(bench: Bench, run: Launch) -> Path:
    """Run to the end (or the deadline); returns the run directory, raises RunFailed with the log's tail."""
    left_s = bench.deadline - time.monotonic()
    if left_s < 30:
        raise RunFailed(f"not started: the script's {bench.budget_s:.0f} s budget is spent (--only, or more "
                        "--budget-s)")
    output_dir = bench.runs / run.app
    log = bench.logs / f"{run.app}-{run.name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    began = time.monotonic()
    with log.open("wb") as out:
        proc = subprocess.Popen(command(run, output_dir), cwd=REPO, env=child_env(bench.cpu, run), stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout=left_s)
        except subprocess.TimeoutExpired:
            stop(proc)
            code = None
    seconds = time.monotonic() - began
    print(f"  {run.app} {run.name}: {'exit ' + str(code) if code is not None else 'stopped at the budget'}"
          f" after {seconds:.0f} s", flush=True)
    if code != 0:
        tail = log.read_text(errors="replace")[-2500:]
        print(f"--- {log.name} (tail) ---\n{tail}\n---", flush=True)
        raise RunFailed(f"stopped at the script's {bench.budget_s:.0f} s budget (--only, or more --budget-s)"
                        if code is None
                        else f"exit {code}: {last_error_line(tail)}")
    run_dir = output_dir / run.name
    shutil.copy(run_dir / "metrics.csv", bench.logs / f"{run.app}-{run.name}.metrics.csv")
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)  # GBs of weights + Adam state, never read here
    return run_dir


def stop(proc: subprocess.Popen) -> None:
    """End the run's process group (the launcher, its ranks, a Ray head it started)."""
    for sig, wait_s in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=wait_s)
            return
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue


def last_error_line(tail: str) -> str:
    lines = [line.strip() for line in tail.splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line or "error" in line]
    return (errors or lines or ["(no output)"])[-1][:200]


def try_launch(bench: Bench, run: Launch) -> Path | None:
    try:
        return launch(bench, run)
    except RunFailed as e:
        bench.failures.append(f"{run.app} {run.name}: {e}")
        return None


# ------------------------------------------------------------------------------ reading runs


def metric_rows(run_dir: Path) -> list[dict[str, str]]:
    with (run_dir / "metrics.csv").open(newline="") as f:
        return list(csv.DictReader(f))


def value(row: dict[str, str], key: str) -> float:
    text = row.get(key) or ""
    return float(text) if text else math.nan


def measured(rows: list[dict[str, str]], warmup: int = WARMUP) -> list[dict[str, str]]:
    """The rows after the warm-up (all of them when there are no more)."""
    return rows[warmup:] or rows


def mean_of(rows: list[dict[str, str]], per_row: Callable[[dict[str, str]], float], warmup: int = WARMUP) -> float:
    return statistics.fmean(per_row(r) for r in measured(rows, warmup))


def efficiency(per_s: float, gpus: int, one_gpu_per_s: float) -> str:
    """Scaling efficiency: N-GPU throughput / (N x 1-GPU throughput); "-" without a 1-GPU figure."""
    return fmt(per_s / (gpus * one_gpu_per_s))


def gpu_counts(bench: Bench) -> list[int]:
    """The GPU counts of a throughput part beyond the 1-GPU baseline: 2, then 4 with --gpus 4."""
    return [g for g in (2, 4) if g <= bench.gpus]


def gpu_span(bench: Bench) -> str:
    """A table title's GPU counts: "2", or "1, 2 and 4"."""
    return "1, 2 and 4" if bench.gpus == 4 else "2"


def visible(gpus: int) -> str:
    """CUDA_VISIBLE_DEVICES for a run on the first `gpus` GPUs."""
    return ",".join(str(i) for i in range(gpus))


def fmt(x: float, digits: int | None = None) -> str:
    """`digits` decimals; by default whole numbers and figures >= 100 with none, small ones in e-notation."""
    if math.isnan(x):
        return "-"
    if digits is None:
        digits = 0 if x == int(x) or abs(x) >= 100 else 2
        if 0 < abs(x) < 0.01:
            return f"{x:.1e}"
    return f"{x:.{digits}f}"


@dataclass
class Table:
    title: str
    header: list[str]
    rows: list[list[str]]
    notes: str


Row = dict[str, str]  # one line of a run's metrics.csv


@dataclass(frozen=True)
class Scaling:
    """How one app's throughput runs become a table: every column is a per-step figure, averaged
    over the steps after the warm-up."""

    runs: dict[str, tuple[int, Launch]]  # label -> (GPUs, run); the 1-GPU baseline first
    unit: str  # the throughput column, e.g. "tokens/s (all GPUs)"
    per_s: Callable[[Row, int], float]  # (metrics row, GPUs) -> throughput of that step
    step_s: Callable[[Row], float]  # seconds of that step (listed in the notes, warm-up included)
    columns: dict[str, Callable[[Row, int], float]]  # more figures, e.g. seconds per phase
    warmup: int = WARMUP  # steps left out of the means


def scaling_table(bench: Bench, spec: Scaling) -> tuple[list[str], list[list[str]], str]:
    """Launch every run; returns (header, rows, seconds per step of each run)."""
    header = ["run", "GPUs", *spec.columns, spec.unit, "scaling efficiency"]
    rows, steps, baseline = [], [], math.nan
    for label, (gpus, run) in spec.runs.items():
        run_dir = try_launch(bench, run)
        if run_dir is None:
            rows.append([label, str(gpus), *["failed"] * (len(header) - 2)])
            continue
        table = metric_rows(run_dir)
        per_s = mean_of(table, lambda r, g=gpus: spec.per_s(r, g), spec.warmup)
        baseline = per_s if gpus == 1 else baseline
        cells = [fmt(mean_of(table, lambda r, f=f, g=gpus: f(r, g), spec.warmup)) for f in spec.columns.values()]
        rows.append([label, str(gpus), *cells, fmt(per_s), "baseline" if gpus == 1 else efficiency(per_s, gpus, baseline)])
        steps.append(f"{label}: {[round(spec.step_s(r), 2) for r in table]}")
    return header, rows, "; ".join(steps)


def phase_s(*phases: str) -> Callable[[Row], float]:
    """Seconds of a step spent in `phases` (their time/* metrics; a phase a step did not run counts 0)."""
    return lambda r: sum(value(r, f"time/{p}") if r.get(f"time/{p}") else 0.0 for p in phases)


# ------------------------------------------------------------------------------ caption-rl

CAPTION_APP = REPO / "apps" / "caption-rl"
IMAGES = REPO / "examples" / "data" / "caption_qa_images.jsonl"
CAPTION_CONFIGS = {"DDP": "ddp.yaml", "FSDP2": "fsdp2_1node.yaml"}
# Keys the CPU test compares between 1 and 2 processes (apps/caption-rl/tests/test_main.py)
EQUAL_KEYS = ("reward/mean", "reward/std", "adv/std", "loss/policy", "grad_norm", "entropy", "response/length_mean")


def caption_configs(bench: Bench) -> dict[str, str]:
    """The 2-process caption-rl runs this invocation makes: kind -> accelerate config file."""
    return {kind: CAPTION_CONFIGS[kind] for kind in bench.caption_kinds}


def caption_equality(bench: Bench) -> Table:
    """One RL step: 1 process x 4 prompts vs 2 processes x 2 prompts (DDP, FSDP2)."""
    from safetensors.torch import load_file

    from rl_models import tiny

    policy = tiny.build("qwen2_5_vl")
    step = [f'model.path="{policy}"', 'model.dtype="float32"', f'data.train_files=["{IMAGES}"]', "data.eval_size=0",
            'rollout.engine="hf"', "rollout.n=4", "rollout.max_new_tokens=8", "rollout.per_prompt_seeds=true",
            f'reward.spec="{CAPTION_APP / "tests" / "rule_reward.toml"}"', "train.batch_size=4",
            "train.micro_batch_size=3", "train.max_steps=1", "train.eval_freq=0", "train.save_freq=100",
            "train.lr=1e-4", "data.max_pixels=12544"]  # as measured before the default moved to 5e-2, 56 x 56
    exact = {"NVIDIA_TF32_OVERRIDE": "0"}  # cuBLAS / cuDNN: no TF32 in float32 matmuls and convolutions
    runs = {"1 process x 4 prompts (reference)": Launch("caption-rl", "equal-one", step, env=exact)}
    for kind, config in caption_configs(bench).items():
        runs[f"{kind}, 2 processes x 2 prompts"] = Launch("caption-rl", f"equal-{kind.lower()}", step, procs=2,
                                                          accelerate_config=config, gpus="0,1", env=exact)
    dirs = {label: try_launch(bench, run) for label, run in runs.items()}
    metric_tol, weight_tol = (2e-5, 5e-6) if bench.cpu else (1e-4, 1e-5)
    start = load_file(policy / "model.safetensors")
    reference = next(iter(dirs.values()))
    header = ["run", "loss/policy", "grad_norm", "abs Δ loss/policy", "abs Δ grad_norm",
              f"max abs Δ, {len(EQUAL_KEYS)} metrics", "max abs Δ weights", "max abs (w - w0): the step moved them",
              f"equal (metrics ≤ {metric_tol:g}, weights ≤ {weight_tol:g})"]
    rows = []
    for label, run_dir in dirs.items():
        if run_dir is None or reference is None:
            rows.append([label, *["failed" if run_dir is None else "-"] * 8])
        else:
            rows.append([label, *compare_step(reference, run_dir, start, metric_tol, weight_tol)])
    notes = (f"caption-rl, one full RL step, tiny Qwen2.5-VL (rl_models.tiny), float32, TF32 off "
             "(NVIDIA_TF32_OVERRIDE=0), hf engine, rollouts seeded per prompt (rollout.per_prompt_seeds), rule "
             "reward (apps/caption-rl/tests/rule_reward.toml), 4 prompts x 4 captions of 8 tokens, micro-batches of "
             "3, lr 1e-4: the CPU test's setup. 2-process runs launched with examples/caption-rl/accelerate/"
             f"{{{', '.join(caption_configs(bench).values())}}} (--num_processes 2). Metrics compared: {', '.join(EQUAL_KEYS)}; "
             "weights: the exported checkpoints, every tensor. Tolerance: metrics |Δ| ≤ "
             f"{metric_tol:g}, weights |Δ| ≤ {weight_tol:g} (the CPU test: 2e-05 / 5e-06); the 2-process "
             "micro-batches have other shapes, so kernels round differently.")
    return Table("caption-rl on 2 GPUs = 1 GPU with twice the batch (one RL step)", header, rows, notes)


def compare_step(reference: Path, run_dir: Path, start: dict[str, torch.Tensor], metric_tol: float,
                 weight_tol: float) -> list[str]:
    """Table cells: `run_dir`'s one-step metrics and exported weights against `reference`'s."""
    from safetensors.torch import load_file

    [a], [b] = metric_rows(reference), metric_rows(run_dir)
    w_a, w_b = (load_file(d / "export" / "model.safetensors") for d in (reference, run_dir))
    d_loss, d_grad = (abs(value(a, k) - value(b, k)) for k in ("loss/policy", "grad_norm"))
    d_metrics = max(abs(value(a, k) - value(b, k)) for k in EQUAL_KEYS)
    d_weights = max((w_a[k] - w_b[k]).abs().max().item() for k in w_a) if w_a.keys() == w_b.keys() else math.inf
    moved = max((w_b[k] - start[k]).abs().max().item() for k in w_b if k in start)
    # the CPU test's bar for "the step moved the weights": an Adam step moves each by ~lr = 1e-4
    same = d_metrics <= metric_tol and d_weights <= weight_tol and moved > 5e-5
    return [f"{value(b, 'loss/policy'):.3e}", fmt(value(b, "grad_norm"), 6), f"{d_loss:.1e}", f"{d_grad:.1e}",
            f"{d_metrics:.1e}", f"{d_weights:.1e}", f"{moved:.1e}", "yes" if same else "**no**"]


def caption_throughput(bench: Bench) -> Table:
    """1 GPU vs DDP / FSDP2 on 2 (and 4) GPUs, the same prompts per GPU, Qwen3-VL-2B shape."""
    from benchmarks.caption_rl import MAX_PIXELS, build_policy

    policy = build_policy(bench.root / "caption-policy", smoke=bench.cpu)
    release_gpu()
    prompts, n, tokens, micro, steps = (2, 2, 8, 4, 2) if bench.cpu else (8, 4, 64, 16, 5)
    warmup = 1 if bench.cpu else 2  # step 1 creates the Adam state; step 2 is the first at full speed on most runs

    def overrides(world: int) -> list[str]:
        return [f'model.path="{policy}"', f'model.dtype="{"float32" if bench.cpu else "bfloat16"}"',
                "model.gradient_checkpointing=true", f'data.train_files=["{IMAGES}"]', "data.eval_size=0",
                f"data.max_pixels={MAX_PIXELS}", 'rollout.engine="hf"', f"rollout.n={n}",
                f"rollout.max_new_tokens={tokens}", f"rollout.max_batch_size={prompts * n}",
                'rollout.offload_optimizer="never"', f'reward.spec="{CAPTION_APP / "configs" / "rule_reward.toml"}"',
                'reward.length_tokenizer="whitespace"', f"train.batch_size={prompts * world}",
                f"train.micro_batch_size={micro}", f"train.max_steps={steps}", "train.epochs=100",
                "train.eval_freq=0", "train.save_freq=1000000", "train.export=false", "algo.replay_tolerance=0.5",
                "train.lr=1e-4"]

    runs = {"1 GPU": (1, Launch("caption-rl", "speed-1gpu", overrides(1)))}
    for gpus in gpu_counts(bench):
        for kind, config in caption_configs(bench).items():
            runs[f"{kind}, {gpus} GPUs"] = (gpus, Launch("caption-rl", f"speed-{kind.lower()}-{gpus}", overrides(gpus),
                                                         procs=gpus, accelerate_config=config, gpus=visible(gpus)))
    captions = prompts * n  # per GPU per step
    header, rows, per_step = scaling_table(bench, Scaling(
        runs, "tokens/s (all GPUs)", per_s=lambda r, _: value(r, "throughput/tokens_per_s") * value(r, "world_size"),
        step_s=phase_s("step"), columns={
            "captions/step (all GPUs)": lambda _, gpus: captions * gpus,
            "s/step": lambda r, _: value(r, "time/step"),
            "rollout s": lambda r, _: value(r, "time/rollout"),
            "update s": lambda r, _: value(r, "time/update"),
            "weight gather s": lambda r, _: value(r, "time/weight_gather"),
            "captions/s": lambda r, gpus: captions * gpus / value(r, "time/step")}, warmup=warmup))
    shape = "the caption benchmark's smoke Qwen3-VL" if bench.cpu else "Qwen3-VL-2B shape (vocab 151,936)"
    notes = (f"caption-rl, random weights at {shape}, {'float32' if bench.cpu else 'bf16'}, full fine-tuning "
             f"with gradient checkpointing, hf engine (decode not compiled), {prompts} images x {n} captions x "
             f"{tokens} tokens per GPU per step, micro-batches of {micro}, rule reward, optimizer state kept on "
             f"the GPU; {steps} steps, mean after the first {warmup}. tokens/s: (prompt + caption tokens) / step "
             "seconds, all GPUs (the app's throughput/tokens_per_s x world size). Scaling efficiency: N-GPU "
             "tokens/s / (N x 1-GPU tokens/s); the 1-GPU run is unsharded. Every process with OMP_NUM_THREADS=1. "
             f"Launch: examples/caption-rl/accelerate/{{{', '.join(caption_configs(bench).values())}}} with "
             f"--num_processes {' / '.join(map(str, gpu_counts(bench)))}. "
             "Seconds per step, "
             f"warm-up included: {per_step}.")
    return Table(f"caption-rl on {gpu_span(bench)} GPUs: {' and '.join(bench.caption_kinds)} scaling", header, rows,
                 notes)


# ------------------------------------------------------------------------------ rider-grm


def rider_throughput(bench: Bench) -> Table:
    """Policy + 2 judges swapped on every GPU: 1 GPU vs DDP on 2 (and 4) GPUs, the same prompts per GPU."""
    from benchmarks.rider_grm import (
        PHASES,
        SHAPE_1_7B,
        SHAPE_SMOKE,
        random_checkpoint,
        swap_seconds,
    )

    policy = random_checkpoint(bench.root / "rider-policy", SHAPE_SMOKE if bench.cpu else SHAPE_1_7B, 0)
    judge = random_checkpoint(bench.root / "rider-judge", SHAPE_SMOKE if bench.cpu else QWEN3_0_6B, 1)
    release_gpu()
    prompts, n, tokens, judge_tokens, steps = (2, 2, 8, (8, 4), 3) if bench.cpu else (4, 4, 128, (32, 8), 4)
    # the first two steps are warm-up: step 1 creates the Adam state, step 2's swap is the first to
    # move it to (newly pinned) host buffers
    warmup = 2
    judges = ", ".join(
        f'{{name = "{name}", module = "rl_rewards.judges.{name}", model = "{judge}", prompt = "prompt", '
        f'weight = {weight}, max_new_tokens = {new}, engine = "hf", engine_options = {{compile = false}}}}'
        for name, weight, new in (("rubric", 0.3, judge_tokens[0]), ("yes_no", 0.5, judge_tokens[1])))

    def overrides(world: int) -> list[str]:
        return [f'model.path="{policy}"', f'model.dtype="{"float32" if bench.cpu else "bfloat16"}"',
                f"reward.judges=[{judges}]", 'reward.swap="always"', "reward.embedding.model=null",
                "reward.rule=rider_rules:compute_score", f"rollout.max_new_tokens={tokens}", f"rollout.n={n}",
                f"train.batch_size={prompts * world}", f"train.mini_batch_size={prompts * world}",
                "train.micro_batch_size=8", "train.lr=1e-6", f"train.max_steps={steps}", "train.epochs=100",
                "train.save_freq=1000", "train.val_before_train=false", "algo.replay_tolerance=0.5",
                "rollout.max_batch_size=64"]

    runs = {"1 GPU": (1, Launch("rider-grm", "speed-1gpu", overrides(1)))}
    for gpus in gpu_counts(bench):
        runs[f"DDP, {gpus} GPUs"] = (gpus, Launch("rider-grm", f"speed-ddp-{gpus}", overrides(gpus), procs=gpus,
                                                  accelerate_config="ddp_1node.yaml", gpus=visible(gpus)))
    step_s, responses = phase_s(*PHASES), prompts * n  # per GPU per step
    header, rows, per_step = scaling_table(bench, Scaling(
        runs, "responses/s (all GPUs)", per_s=lambda r, gpus: responses * gpus / step_s(r), step_s=step_s, columns={
            "responses/step (all GPUs)": lambda _, gpus: responses * gpus,
            "s/step": lambda r, _: step_s(r),
            "rollout s (with log-probs, policy offload)": lambda r, _: value(r, "time/rollout"),
            "reward s (judges + swaps)": lambda r, _: value(r, "time/reward"),
            "swap s": lambda r, _: swap_seconds({k: float(v) for k, v in r.items() if k.startswith("time/") and v}),
            "update s": lambda r, _: value(r, "time/update")}, warmup=warmup))
    shapes = "tiny smoke shapes" if bench.cpu else "policy at Qwen3-1.7B shape, judges at Qwen3-0.6B shape"
    notes = (f"rider-grm, random weights ({shapes}), {'float32' if bench.cpu else 'bf16'}; two judges "
             f"(rl_rewards.judges.rubric / yes_no, {judge_tokens[0]}/{judge_tokens[1]} new tokens, hf engines, not "
             "compiled) with reward.swap=always: on every GPU the policy (weights + Adam state) goes to the host "
             "while each judge is woken, scores and sleeps. "
             f"{prompts} prompts x n={n} x {tokens} response tokens per GPU per step, one optimizer step per RL "
             f"step, KL loss to the reference; {steps} steps, mean after the first {warmup} (step 1 creates the "
             "Adam state, step 2's swap first moves it to pinned host buffers). s/step sums the "
             f"phases {', '.join(PHASES)} (the last step's validation is outside it). Scaling efficiency: N-GPU "
             "responses/s / (N x 1-GPU responses/s), every process with OMP_NUM_THREADS=1. N GPUs: "
             "examples/rider-grm/accelerate/ddp_1node.yaml, "
             f"--num_processes {' / '.join(map(str, gpu_counts(bench)))}. Seconds per step, warm-up included: "
             f"{per_step}.")
    return Table(f"rider-grm on {gpu_span(bench)} GPUs, judges swapped: DDP scaling", header, rows, notes)


# ------------------------------------------------------------------------------ diffusion-grpo


def diffusion_throughput(bench: Bench) -> Table:
    """(a) 1 GPU, rollout in process; (b) trainer on GPU 0, one split-placement Ray worker on GPU 1."""
    from benchmarks.diffusion_grpo import build_pipeline_dir

    pipeline = build_pipeline_dir(bench.cpu, bench.root)
    release_gpu()
    if bench.cpu:
        size, sampling_steps, text_tokens, n, groups, epochs = 32, 4, 8, 4, 2, 2
        model = [f'model.path="{pipeline}"', 'model.dtype="float32"']
    else:
        size, sampling_steps, text_tokens, n, groups, epochs = 512, 10, 128, 8, 1, 4
        model = [f'model.path="{pipeline}"', 'model.dtype="bfloat16"', "model.lora_rank=32", "model.lora_alpha=64",
                 "model.compile=false"]  # as every run here: eager (TORCH_COMPILE_DISABLE=1)
    common = [*model, f"sampling.resolution={size}", f"sampling.num_steps={sampling_steps}",
              f"sampling.max_sequence_length={text_tokens}", f"rollout.n={n}", f"rollout.groups_per_epoch={groups}",
              f"rollout.sample_batch_size={n}", f"train.micro_batch_size={n}", "train.gradient_accumulation_steps=1",
              "reward.components={brightness=1.0}", "train.eval_freq=0", f"train.epochs={epochs}", "train.save_freq=1000",
              "algo.replay_tolerance=0.01"]
    runs = {"(a) 1 GPU, rollout in process": (1, Launch("diffusion-grpo", "speed-colocated", common)),
            "(b) trainer GPU 0 + Ray rollout worker GPU 1 (split)": (2, Launch(
                "diffusion-grpo", "speed-split", [*common, "rollout.workers=1", 'rollout.placement="split"'],
                gpus="0,1")),
            "(c) as (b), asynchronous: the worker samples epoch k+1 while epoch k trains (max_staleness=1)": (2, Launch(
                "diffusion-grpo", "speed-split-async", [*common, "rollout.workers=1", 'rollout.placement="split"',
                                                        "train.max_staleness=1"], gpus="0,1"))}
    epoch_s, images = phase_s("step"), n * groups  # per epoch (= loop step): the loop's whole step
    header, rows, per_epoch = scaling_table(bench, Scaling(
        runs, "images/s", per_s=lambda r, _: images / epoch_s(r), step_s=epoch_s, columns={
            "images/epoch": lambda *_: images,
            "rollout s": lambda r, _: value(r, "time/rollout"),
            "train s": lambda r, _: value(r, "time/update"),
            "waited for the rollout s": lambda r, _: value(r, "time/rollout_wait"),
            "epoch s": lambda r, _: epoch_s(r),
            # an epoch sampled by older weights (max_staleness=1) is not checked: its ratio is the update's
            "first replay max abs log ratio (on-policy epochs)": lambda r, _: (
                value(r, "replay/engine_diff_max") if not value(r, "rollout/staleness") > 0 else math.nan)}))
    shape = "tiny SD3 (rl_models.tiny)" if bench.cpu else "SD3.5-Medium shape (rl_models.shapes), LoRA r32/alpha 64"
    notes = (f"diffusion-grpo (Flow-GRPO), random weights, {shape}, {'float32' if bench.cpu else 'bf16'}; "
             f"{groups} prompts x {n} images per epoch at {size}x{size}, {sampling_steps} SDE steps, CFG 4.5, "
             f"brightness reward in process, replay of int(0.99 x {sampling_steps}) steps + KL reference, micro-batches "
             f"of {n}; {epochs} epochs, mean after the first {WARMUP}. epoch s = the loop's whole step (time/step); "
             "(b)'s rollout (pushing the LoRA to the worker included) and training alternate, so its gain is only "
             "what running the rollout elsewhere saves; (c) overlaps them (the rollout s is then the worker's, "
             "in the background; waited s is what the trainer waited for it). Scaling efficiency: "
             f"(b) or (c) images/s / (2 x (a) images/s), both GPUs counted. Seconds per epoch, warm-up included: {per_epoch}.")
    return Table("diffusion-grpo: trainer + Ray rollout worker on 2 GPUs (VRL split preset)", header, rows, notes)


# ------------------------------------------------------------------------------ main


def release_gpu() -> None:
    """This process built checkpoints on GPU 0: give its cached memory back before the runs."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


PARTS: dict[str, list[Callable[[Bench], Table]]] = {
    "caption": [caption_equality, caption_throughput],
    "caption-speed": [caption_throughput],  # the throughput table alone (no equality step)
    "rider": [rider_throughput],
    "diffusion": [diffusion_throughput],
}


def report(bench: Bench, table: Table, out: Path) -> None:
    failures, bench.failures = bench.failures, []
    notes = table.notes + ("" if not failures else " Failed: " + " | ".join(failures) + ".")
    if bench.cpu:
        print(f"\n## {table.title} (--cpu: not appended)\n\n{markdown_table(table.header, table.rows)}\n\n{notes}\n",
              flush=True)
        return
    notes += f" {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}."
    append_results(table.title, table.header, table.rows, notes, path=out)


PART_APPS = {"caption": "caption-rl", "caption-speed": "caption-rl", "rider": "rider-grm", "diffusion": "diffusion-grpo"}
PART_MODULES = {"diffusion": ("diffusers", "ray")}  # imported only by that part's runs (split placement: Ray)


def preflight(parts: Sequence[str], cpu: bool) -> None:
    """Before any checkpoint is built: each part's app imports (its `--help` runs in the child
    environment) and the modules only its runs import are there. A missing package stops here,
    with its name, instead of failing each run after minutes of set-up."""
    import importlib.util

    problems = [f"{part}: no module named {', '.join(missing)}" for part in parts
                if (missing := [m for m in PART_MODULES.get(part, ()) if importlib.util.find_spec(m) is None])]
    helps = {part: subprocess.Popen([sys.executable, str(REPO / "apps" / PART_APPS[part] / "__main__.py"), "--help"],
                                    cwd=REPO, env=child_env(cpu, Launch(PART_APPS[part], "preflight", ())),
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for part in parts}  # side by side: each imports torch and its app
    for part, proc in helps.items():
        output, _ = proc.communicate(timeout=300)
        if proc.returncode != 0:
            problems.append(f"{part}: `{PART_APPS[part]} --help` failed: {last_error_line(output)}")
    if problems:
        raise SystemExit("not started:\n  " + "\n  ".join(problems))


def runs_parent() -> str | None:
    """/dev/shm when it has room: the apps write (and fsync) a full checkpoint at their last step,
    ~13 GB for the 2B policy with Adam state, which on a slow disk would cost more than the run.
    None: the system temp dir."""
    shm = Path("/dev/shm")
    return str(shm) if shm.is_dir() and shutil.disk_usage(shm).free > 64 * 2**30 else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", action="append", choices=list(PARTS), help="run only this app's part (repeatable)")
    parser.add_argument("--cpu", action="store_true", help="tiny models, 2 gloo processes on the CPU; prints only")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "RESULTS.md", help="results file to append to")
    parser.add_argument("--logs", type=Path, help="keep each run's output and metrics.csv here (default: deleted)")
    parser.add_argument("--budget-s", type=float, default=BUDGET_S,
                        help="seconds for the whole script: a run is stopped, and later runs are not started, "
                             f"past it (default {BUDGET_S:.0f}: a machine that ends commands at 10 minutes)")
    parser.add_argument("--caption-kind", action="append", choices=list(CAPTION_CONFIGS),
                        help="caption-rl's 2-process runs: only this kind (repeatable; default: all); the "
                             "1-process reference always runs")
    parser.add_argument("--gpus", type=int, choices=(2, 4), default=2,
                        help="the throughput parts (caption, rider) run on 1, 2 and, with 4, 4 GPUs; the equality "
                             "step and diffusion-grpo's split stay on 2 (with --cpu: gloo processes)")
    args = parser.parse_args()
    if not args.cpu and torch.cuda.device_count() < args.gpus:
        raise SystemExit(f"needs {args.gpus} GPUs, sees {torch.cuda.device_count()}; --cpu runs the tiny pipeline "
                         "on the CPU")
    preflight(args.only or list(PARTS), args.cpu)
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="multi_gpu-") as tmp, \
            tempfile.TemporaryDirectory(prefix="multi_gpu-runs-", dir=runs_parent()) as runs:
        logs = args.logs or Path(tmp) / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        bench = Bench(cpu=args.cpu, root=Path(tmp), runs=Path(runs), logs=logs, deadline=began + args.budget_s,
                      budget_s=args.budget_s,
                      caption_kinds=tuple(args.caption_kind or CAPTION_CONFIGS), gpus=args.gpus)
        print(f"run directories in {runs}, logs in {logs}", flush=True)
        for part in args.only or list(PARTS):
            for measure in PARTS[part]:
                print(f"[{time.monotonic() - began:.0f} s] {measure.__name__}", flush=True)
                try:
                    report(bench, measure(bench), args.out)
                except Exception:  # one part's failure never loses the others'
                    traceback.print_exc()
                    bench.failures.clear()
    print(f"done in {time.monotonic() - began:.0f} s")


if __name__ == "__main__":
    main()
