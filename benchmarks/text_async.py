"""A text recipe's RL step on 2 GPUs against TRL 1.16's `AsyncGRPOTrainer`, reply lengths with a
long tail (issue 52's text row).

    python benchmarks/text_async.py --cache DIR --only NAME   # 2 GPUs with vLLM: one run a command
    python benchmarks/text_async.py --cache DIR               # every run not cached yet, then the table
    python benchmarks/text_async.py --smoke                   # our runs at tiny shape on the CPU: prints

rider-grm with random weights at Qwen3-1.7B shape (bf16, full fine-tuning, gradient
checkpointing), the 16 prompts of examples/data/rider a step x 8 replies, its rule reward alone
(no judges), replies capped at 2,048 tokens, one optimizer step a batch. As AsyncGRPOTrainer has
no reference model, ours runs without the KL loss (`algo.use_kl_loss=false`), and takes its old
log-probs from the update's own forward (`algo.old_logprobs=auto`), as TRL takes vLLM's. The lengths are drawn per sample (95% log-normal,
median 260, in 100-600 tokens; 5% in 800-2,048) and imposed inside every vLLM engine of a run,
ours and TRL's server alike, by the logits-processor plugin of `benchmarks/long_tail.py`.

Runs (`--only`):
- `sync-ddp`: 2 processes, each with its colocated vLLM engine, synchronous;
- `async-ddp-partial`: the same with `train.max_staleness=1` and partial rollouts (K = 1, 128
  tokens a round): each engine samples the next step while its GPU updates;
- `async-ddp-partial2`: the same with K = 2 (a group may wait two steps: more groups in flight
  to pick the first finished from);
- `async-split`: 1 trainer process on GPU 0, its vLLM engine on GPU 1, `max_staleness=1`;
- `async-ray-partial`: the same placement with the engine in a Ray actor (`rollout.workers=1`:
  its decoding out of the trainer's interpreter, versions by CUDA IPC) and partial rollouts;
- `trl-async`: `trl.experimental.async_grpo.AsyncGRPOTrainer`, the trainer on GPU 0 and the
  `vllm serve` it needs on GPU 1 (`trl vllm-serve`: NCCL weight transfer, dev mode), 128 samples a
  step (per_device_train_batch_size 8 x gradient_accumulation_steps 16), its other defaults
  (max_staleness 4, token-budget packing), the same prompts, lengths and rule (`rider_reward`,
  picklable as its rollout process needs). Its first step waits for vLLM while the server fills
  a queue of samples ahead, which the next steps drain: its mean skips the first `TRL_WARMUP`
  of `TRL_STEPS` steps.

Reported: reply tokens trained per second of step time (ours: `response/length_mean` x samples
over `time/step`; TRL: `batch/trained_tokens_per_step` over the step's wall time), seconds per
step, and ratios. Goal: ours >= 1.5x TRL's AsyncGRPOTrainer on the same 2 GPUs.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
APP = ROOT / "apps" / "rider-grm"
sys.path[:0] = [str(ROOT), str(APP), str(Path(__file__).resolve().parent)]

from benchmarks.results import append_results, markdown_table  # noqa: E402

WARMUP, STEPS, PROMPTS, N = 2, 8, 16, 8
TRL_WARMUP, TRL_STEPS = 4, 12
MAX_TOKENS, MAX_LEN, VLLM_MEMORY, SPLIT_MEMORY, SERVER_MEMORY = 2048, 2560, 0.3, 0.85, 0.9
RUNS = {
    "sync-ddp": "rider-grm, DDP synchronous (2 processes), vLLM colocated",
    "async-ddp-partial": "rider-grm, DDP asynchronous (2 processes), max_staleness=1, partial rollouts K=1",
    "async-ddp-partial2": "rider-grm, DDP asynchronous (2 processes), max_staleness=1, partial rollouts K=2",
    "async-split": "rider-grm, split asynchronous, max_staleness=1, vLLM on GPU 1",
    "async-ray-partial": "rider-grm, split asynchronous, vLLM in a Ray actor on GPU 1, partial rollouts K=1",
    "trl-async": "TRL AsyncGRPOTrainer, vllm serve on GPU 1",
}


def rider_reward(completions: list, **_: object) -> list[float]:
    """rider-grm's rule (`rider_rules.compute_score`) for TRL: module level, so picklable."""
    from rider_rules import compute_score

    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    return [compute_score("rider_synthetic", text, None)["score"] for text in texts]


def ours(name: str, policy: Path, out: Path, smoke: bool, steps: int) -> dict:
    """rider-grm under `accelerate launch`; figures from rank 0's metrics.csv."""
    processes = 2 if "ddp" in name else 1
    engine = ["rollout.engine=hf"] if smoke else [
        "rollout.engine=vllm", f"rollout.engine_options.max_model_len={MAX_LEN}",
        f"rollout.gpu_memory_utilization={SPLIT_MEMORY if 'ddp' not in name else VLLM_MEMORY}"]
    overrides = [
        f"model.path={policy}", "model.dtype=bfloat16", "reward.judges=[]", "reward.embedding.model=null",
        "reward.rule=rider_rules:compute_score", 'data.train_files=["examples/data/rider/train.parquet"]',
        'data.val_files=["examples/data/rider/val.parquet"]', f"rollout.max_new_tokens={8 if smoke else MAX_TOKENS}",
        f"rollout.n={N}", f"train.batch_size={PROMPTS}", f"train.mini_batch_size={PROMPTS}", "train.micro_batch_size=4",
        "train.lr=1e-6", f"train.epochs={steps}", f"train.max_steps={steps}", "train.save_freq=1000",
        "train.val_before_train=false", f'train.output_dir="{out}"', "algo.replay_tolerance=0.5",
        "rollout.max_batch_size=512", "algo.use_kl_loss=false", "algo.old_logprobs=auto", *engine,
        *([] if name == "sync-ddp" else ["train.max_staleness=1", "algo.rollout_correction=token_truncate"]),
        *(["rollout.placement=split"] if name in ("async-split", "async-ray-partial") else []),
        *(["rollout.workers=1"] if name == "async-ray-partial" else []),
        *([f"train.partial_rollouts.steps={2 if name.endswith('partial2') else 1}",
           "train.partial_rollouts.chunk_tokens=128"] if "partial" in name else []),
    ]
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(processes),
                "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                *(["--multi_gpu"] if processes > 1 else [])]
    subprocess.run([*launcher, str(APP / "__main__.py"), *overrides], check=True, cwd=ROOT)
    [run] = [d for d in out.iterdir() if d.is_dir() and d.name.startswith("run-")]
    with (run / "metrics.csv").open() as f:
        rows = [r for r in csv.DictReader(f) if r.get("step")]
    kept = rows[WARMUP:-1] if "async" in name else rows[WARMUP:]
    mean = lambda key: statistics.fmean(float(r[key]) if r.get(key) else 0.0 for r in kept)  # noqa: E731
    step = mean("time/step")
    return {"tokens_per_s": mean("response/length_mean") * PROMPTS * N / step, "step_s": step,
            "rollout_s": mean("time/rollout"), "waited_s": mean("time/rollout_wait"), "update_s": mean("time/update"),
            "rank_wait_s": mean("time/rank_wait"),
            "reply_tokens": mean("response/length_mean"), "processes": processes,
            "steps": [round(float(r["time/step"]), 1) for r in rows]}


# AsyncGRPOTrainer's packed "tree" attention calls FlashAttention-3 fetched from the Hub at the first update
# (`kernels.get_kernel("kernels-community/flash-attn3")`), which a machine without the Hub cannot do. This stand-in
# `kernels` module gives it torch's own variable-length flash attention (FlashAttention-2 kernels) instead.
KERNELS_SHIM = """
import inspect, types
import torch
from torch.nn.attention.varlen import varlen_attn

_CAUSAL = "is_causal" in inspect.signature(varlen_attn).parameters


def flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=None, causal=False,
                           window_size=(-1, -1), **_):
    extra = {"is_causal": causal} if _CAUSAL else {"window_size": (window_size[0], 0) if causal else window_size}
    if k.shape[1] != q.shape[1]:  # grouped-query attention: one K/V head per group of query heads
        k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
    return varlen_attn(q, k, v, cu_q, cu_k, int(max_q), int(max_k), scale=softmax_scale, **extra)


def get_kernel(*_, **__):
    return types.SimpleNamespace(flash_attn_varlen_func=flash_attn_varlen_func)
"""


def trl_async(policy: Path, out: Path, steps: int) -> dict:
    """AsyncGRPOTrainer against `trl vllm-serve` on GPU 1 (this process sees GPU 0 only)."""
    from caption_rl import _free_ports, _stop, _tail, _wait_healthy

    [port] = _free_ports(1)
    log = out / "vllm-serve.log"
    out.mkdir(parents=True, exist_ok=True)
    serve = [sys.executable, "-c", "import sys, trl.cli; sys.exit(trl.cli.main())", "vllm-serve",
             "--model", str(policy), "--host", "127.0.0.1", "--port", str(port), "--gpu_memory_utilization", str(SERVER_MEMORY),
             "--max_model_len", str(MAX_LEN), "--dtype", "bfloat16"]
    with log.open("wb") as sink:
        server = subprocess.Popen(serve, stdin=subprocess.DEVNULL, stdout=sink, stderr=subprocess.STDOUT,
                                  start_new_session=True, env={**os.environ, "CUDA_VISIBLE_DEVICES": "1"})
    try:
        _wait_healthy(server, f"http://127.0.0.1:{port}/health", log)
        shim = out / "kernels-shim"
        shim.mkdir(exist_ok=True)
        (shim / "kernels.py").write_text(KERNELS_SHIM)
        path = os.pathsep.join(filter(None, [str(shim), os.environ.get("PYTHONPATH")]))
        child = subprocess.run([sys.executable, __file__, "--trl-child", str(policy), "--out", str(out),
                                "--steps", str(steps), "--port", str(port)],
                               env={**os.environ, "CUDA_VISIBLE_DEVICES": "0", "PYTHONPATH": path}, cwd=ROOT)
        if child.returncode:
            raise SystemExit(f"AsyncGRPOTrainer failed ({child.returncode}); the end of {log}:\n{_tail(log)}")
    finally:
        _stop(server)
    return json.loads((out / "trl.json").read_text())


def trl_child(policy: Path, out: Path, steps: int, port: int) -> None:
    """The trainer's side of `trl-async`, in a process that sees GPU 0 only."""
    import pyarrow.parquet as pq
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl.chat_template_utils import qwen3_template
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    table = pq.read_table(ROOT / "examples/data/rider/train.parquet").to_pylist()
    data = Dataset.from_list([{"prompt": row["prompt"]} for row in table] * (steps + 4))
    ends: list[float] = []
    entries: list[dict] = []

    class Clock(TrainerCallback):
        def on_step_end(self, *args, **kwargs):
            ends.append(time.perf_counter())

        def on_log(self, args, state, control, logs=None, **kwargs):
            entries.append(dict(logs or {}))

    config = AsyncGRPOConfig(
        output_dir=str(out / "trl"), vllm_server_base_url=f"http://127.0.0.1:{port}", dtype="bfloat16",
        num_generations=N, max_completion_length=MAX_TOKENS, per_device_train_batch_size=8,
        gradient_accumulation_steps=PROMPTS * N // 8, learning_rate=1e-6, max_steps=steps, logging_steps=1,
        save_strategy="no", report_to="none", temperature=1.0)
    # The tiny Qwen tokenizer's chat template is not one TRL recognizes, so its rollout worker cannot pick a
    # response parser (used for tool calls; rider has none): give it TRL's own Qwen3 one.
    tokenizer = AutoTokenizer.from_pretrained(policy)
    tokenizer.response_template = qwen3_template
    trainer = AsyncGRPOTrainer(model=str(policy), reward_funcs=rider_reward, args=config, train_dataset=data,
                               processing_class=tokenizer, callbacks=[Clock()])
    began = time.perf_counter()
    trainer.train()
    seconds = [b - a for a, b in zip([began, *ends[:-1]], ends, strict=True)]
    logs = [entry for entry in entries if "batch/trained_tokens_per_step" in entry]  # one a step (logging_steps=1)
    trained = [float(entry["batch/trained_tokens_per_step"]) for entry in logs]
    kept = slice(TRL_WARMUP, None)
    step = statistics.fmean(seconds[kept])
    (out / "trl.json").write_text(json.dumps({
        "tokens_per_s": statistics.fmean(trained[kept]) / step, "step_s": step,
        "waited_s": statistics.fmean(float(e.get("perf/rollout_wait_s", 0.0)) for e in logs[kept]),
        "reply_tokens": statistics.fmean(trained[kept]) / (PROMPTS * N), "processes": 1,
        "steps": [round(s, 1) for s in seconds]}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="our runs, tiny shape, hf engine on the CPU: prints")
    parser.add_argument("--cache", type=Path, help="keep each run's figures in DIR/<run>.json and reuse them")
    parser.add_argument("--only", choices=tuple(RUNS), action="append", help="run only these (repeatable)")
    parser.add_argument("--steps", type=int, default=STEPS, help="steps a run (the first two are warm-up)")
    parser.add_argument("--trl-child", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trl_child:
        trl_child(args.trl_child, args.out, args.steps, args.port)
        return
    import torch

    if not args.smoke and torch.cuda.device_count() < 2:
        parser.error("the runs need 2 GPUs with vLLM; --smoke runs ours on a CPU")
    from long_tail import plugin_env
    from rider_grm import SHAPE_1_7B, SHAPE_SMOKE, random_checkpoint

    if not args.smoke:
        os.environ.update(plugin_env(Path(tempfile.gettempdir()) / "rl-long-tail-plugin"))
    names = [n for n in RUNS if not (args.smoke and n in ("trl-async", "async-split"))]
    cache = args.cache
    got = {n: json.loads((cache / f"text-async-{n}.json").read_text()) for n in names
           if cache and (cache / f"text-async-{n}.json").is_file()}
    with tempfile.TemporaryDirectory() as tmp:
        policy = None
        for name in [n for n in (args.only or names) if n not in got]:
            policy = policy or random_checkpoint(Path(tmp) / "policy", SHAPE_SMOKE if args.smoke else SHAPE_1_7B, 0)
            out = (cache or Path(tmp)) / name
            got[name] = trl_async(policy, out, max(args.steps, TRL_STEPS)) if name == "trl-async" else ours(
                name, policy, out, args.smoke, args.steps)
            if cache:
                cache.mkdir(parents=True, exist_ok=True)
                (cache / f"text-async-{name}.json").write_text(json.dumps(got[name]))
    base = "sync-ddp"
    peer = got.get("trl-async")
    header = ["on 2 GPUs", "reply tokens/s", "s/step", "rollout s", "waited s", "rank wait s", "update s", "reply tokens",
              "vs our sync", "vs TRL AsyncGRPOTrainer"]
    rows = [[RUNS[n], f"{f['tokens_per_s']:.0f}", f"{f['step_s']:.2f}", f"{f.get('rollout_s', 0):.2f}",
             f"{f['waited_s']:.2f}", f"{f.get('rank_wait_s', 0):.2f}", f"{f.get('update_s', 0):.2f}", f"{f['reply_tokens']:.0f}",
             f"{f['tokens_per_s'] / got[base]['tokens_per_s']:.2f}x" if base in got else "",
             f"{f['tokens_per_s'] / peer['tokens_per_s']:.2f}x" if peer else ""] for n, f in got.items()]
    notes = ("`benchmarks/text_async.py` (module docstring: setting, runs, how the lengths are imposed). Means over "
             f"the steps after the first {WARMUP} (TRL's: {TRL_WARMUP}; asynchronous runs of ours: before the last). "
             "Seconds per step, "
             "warm-up included: " + "; ".join(f"{n} {f['steps']}" for n, f in got.items()) + ".")
    title = "A text recipe's RL step on 2 GPUs against TRL's AsyncGRPOTrainer (Qwen3-1.7B shape, long-tail lengths)"
    if args.smoke or set(got) != set(RUNS):
        print(f"{title}\n{markdown_table(header, rows)}\n{notes}\ncached: {sorted(got)}")
        return
    append_results(title, header, rows, notes)


if __name__ == "__main__":
    main()
