"""caption-rl against TRL's GRPOTrainer: one RL step on a random-weight policy at Qwen3-VL-2B shape.

    uv run --package caption-rl python benchmarks/caption_rl.py            # one H100/H200
    uv run --package caption-rl python benchmarks/caption_rl.py --smoke    # tiny, CPU, ~1 minute
    python benchmarks/caption_rl.py --vllm     # both on vLLM: rollout.engine=vllm vs TRL's colocate mode
    python benchmarks/caption_rl.py --vllm --caption-rl-engine hf   # caption-rl's hf engine vs TRL's colocate mode
    python benchmarks/caption_rl.py --vllm --fp8   # and caption-rl with rollout.precision=fp8: three trainers
    python benchmarks/caption_rl.py --trl-server   # 2 GPUs: rollout.engine=vllm vs TRL's server mode (vLLM on GPU 1)
    python benchmarks/caption_rl.py --trl-server --long-tail   # the same, caption lengths with a long tail

`--vllm`: caption-rl's colocated vLLM engine (asleep during the update, LoRA-merged or full
weights pushed after every optimizer step) against TRL's fast path, `use_vllm=True,
vllm_mode="colocate"` with sleep mode, both with `gpu_memory_utilization` `VLLM_MEMORY` and
`max_model_len` `VLLM_MAX_LEN`. vLLM allocates outside torch's caching allocator, so the peak
reported there is the device's (total - free, sampled every 20 ms), not torch's.

`--trl-server` (2 GPUs, implies `--vllm`): TRL's other vLLM mode, `vllm_mode="server"`, against
the same one-GPU caption-rl run. `trl vllm-serve` runs alone on GPU 1, with `gpu_memory_utilization`
`VLLM_SERVER_MEMORY` (TRL's default, the GPU being the server's own) and `max_model_len`
`VLLM_MAX_LEN`; the trainer runs alone on GPU 0 and pushes its weights into the server over NCCL
after every optimizer step. In TRL 1.16 `trl vllm-serve` only execs `vllm serve` with
VLLM_SERVER_DEV_MODE=1, `--weight-transfer-config '{"backend": "nccl"}'`, `--logprobs-mode
processed_logprobs` and `--max-logprobs -1` (`--enable-scale-out` from vLLM 0.30 only: vLLM 0.26
serves `/v1/chat/completions/render` and `/inference/v1/generate`, which TRL sends images
through, without it). Its tokens/s is per GPU (divided by 2, verl's definition), its peak GiB the
trainer GPU's; cached as `trl-vllm-server`.

`--long-tail` (with `--vllm`): caption lengths drawn per sample, most 150-400 tokens with a tail
to 2k, imposed inside every vLLM engine of the run, ours and TRL's (benchmarks/long_tail.py),
with `LONG_TAIL_TOKENS` as the length cap and `LONG_TAIL_MAX_LEN` as `max_model_len`.

Both trainers get the same checkpoint, the same 32 images x n=8 captions of 256 tokens per
step, the same in-process rule reward (timestamp format + length:
apps/caption-rl/configs/rule_reward.toml), pure-bf16 full fine-tuning with gradient
checkpointing, micro-batches of 16 captions, one optimizer step per RL step, clip 0.2/0.28,
token-mean loss, no KL. Each runs in its own process (clean CUDA peak and Accelerate state).
Reported: verl's throughput (prompt + response tokens per step / step seconds / GPUs), seconds
per phase (caption-rl) and peak GPU memory, averaged over the steps after the first `WARMUP` ones.

TRL is not a dependency of this workspace: the benchmark environment needs `trl` and `datasets`
importable; without them the run stops and names what is missing. On a machine that already
has torch, transformers, accelerate, pyarrow, numpy and python-dateutil (this workspace's
environment), six wheels are enough (what trl 1.16 and datasets 5.2 import at load time):

    pip download --no-deps --python-version 3.12 --only-binary=:all: -d wheels \
        --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
        trl==1.16.0 datasets==5.2.0 pandas==3.1.1 dill==0.4.1 multiprocess==0.70.19 xxhash==4.1.0
    pip install --no-deps --target /tmp/trlpkgs wheels/*.whl
    PYTHONPATH=/tmp/trlpkgs python benchmarks/caption_rl.py
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import gc
import itertools
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
APP = REPO / "apps" / "caption-rl"
sys.path.insert(0, str(APP))
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

# Qwen3-VL-2B-Instruct text and vision shapes (config.json of the released checkpoint).
QWEN3_VL_2B_TEXT = {"hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 28, "num_attention_heads": 16,
                    "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 32768}
QWEN3_VL_2B_VISION = {"depth": 24, "hidden_size": 1024, "intermediate_size": 4096, "num_heads": 16, "out_hidden_size": 2048,
                      "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2,
                      "num_position_embeddings": 2304, "deepstack_visual_indexes": [5, 11, 17]}
SMOKE_TEXT = {**QWEN3_VL_2B_TEXT, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 1024}
SMOKE_VISION = {**QWEN3_VL_2B_VISION, "depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 4,
                "out_hidden_size": 64, "num_position_embeddings": 64, "deepstack_visual_indexes": [1]}


def build_policy(out: Path, smoke: bool) -> Path:
    """Random weights at the chosen shape with the tiny Qwen tokenizer and a Qwen3-VL processor
    (Qwen's pixel budget at full shape). Ids beyond the tokenizer decode to nothing, which only
    shortens caption *text*; token counts and compute are those of the real shape."""
    from transformers import GenerationConfig, Qwen3VLConfig, Qwen3VLForConditionalGeneration

    from rl_models.tiny_vl import qwen3_vl_processor, vision_token_ids
    from rl_models.tokenization import build_qwen_tokenizer

    tokenizer = build_qwen_tokenizer()
    text = SMOKE_TEXT if smoke else QWEN3_VL_2B_TEXT
    config = Qwen3VLConfig(
        text_config={**text, "rope_parameters": {"rope_type": "default", "rope_theta": 5_000_000.0,
                                                 "mrope_section": [24, 20, 20] if not smoke else [2, 3, 3],
                                                 "mrope_interleaved": True},
                     "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id},
        vision_config=SMOKE_VISION if smoke else QWEN3_VL_2B_VISION,
        tie_word_embeddings=True, **vision_token_ids(tokenizer),
    )
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = Qwen3VLForConditionalGeneration(config).to(torch.bfloat16)
    # never stop early: every caption is exactly max_new_tokens long, as the benchmark specifies
    model.generation_config = GenerationConfig(eos_token_id=[], pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(out)
    pixels = {"shortest_edge": 32 * 32 * 4, "longest_edge": 64 * 64} if smoke else None
    qwen3_vl_processor(tokenizer, pixels).save_pretrained(out)
    return out


MAX_PIXELS = 448 * 448  # per image, both trainers
# Steps left out of the means, for both trainers: step 1 compiles (caption-rl's decode step) and
# step 2 is the first with optimizer state (caption-rl allocates its page-locked host buffers for
# the Adam moments then, once). Every step's time is still printed in the notes.
WARMUP = 2
# (prompts per step, captions per prompt, caption tokens, captions per micro-batch)
FULL, SMOKE = (32, 8, 256, 16), (4, 2, 16, 4)


VLLM_MEMORY, VLLM_MAX_LEN = 0.3, 2048
LONG_TAIL_TOKENS, LONG_TAIL_MAX_LEN = 2048, 2560  # `--long-tail`: the caption cap, and room for the prompt
# `--trl-server`: `trl vllm-serve`'s default share, the server having a GPU of its own; seconds it may take to start
VLLM_SERVER_MEMORY, VLLM_SERVER_START_S = 0.9, 600


class DevicePeak:
    """Peak GPU memory in use on the device (total - free), sampled by a thread: counts what
    vLLM allocates outside torch's caching allocator."""

    def __init__(self) -> None:
        import threading

        self.peak, self.stop = 0, threading.Event()
        self.thread = threading.Thread(target=self._poll, daemon=True)
        if torch.cuda.is_available():
            self.thread.start()

    def _poll(self) -> None:
        while not self.stop.wait(0.02):
            free, total = torch.cuda.mem_get_info()
            self.peak = max(self.peak, total - free)

    def gib(self) -> float:
        self.stop.set()
        return self.peak / 2**30 if torch.cuda.is_available() else float("nan")


def use_long_tail() -> None:
    """`--long-tail`: this process's settings, and the vLLM plugin for every child process."""
    from long_tail import plugin_env

    global FULL, VLLM_MAX_LEN
    FULL, VLLM_MAX_LEN = (*FULL[:2], LONG_TAIL_TOKENS, FULL[3]), LONG_TAIL_MAX_LEN
    os.environ.update(plugin_env(Path(tempfile.gettempdir()) / "rl-long-tail-plugin"))


def caption_rl_args(policy: Path, out: Path, *, smoke: bool, steps: int, overrides: list[str]) -> list[str]:
    """The app's command line for this benchmark's setting; `overrides` come last (`--set`)."""
    images = REPO / "examples" / "data" / "caption_qa_images.jsonl"
    prompts, n, tokens, micro = SMOKE if smoke else FULL
    return [
        f"model.path={policy}", "model.dtype=bfloat16", "model.gradient_checkpointing=true",
        f"data.train_files=[\"{images}\"]", f"data.max_pixels={MAX_PIXELS}",
        f"rollout.n={n}", f"rollout.max_new_tokens={tokens}", f"rollout.max_batch_size={prompts * n}",
        f"reward.spec={APP / 'configs' / 'rule_reward.toml'}", "reward.length_tokenizer=whitespace",
        f"train.batch_size={prompts}", f"train.micro_batch_size={micro}", f"train.max_steps={steps}",
        "train.epochs=100", "train.eval_freq=0", "train.save_freq=1000000", "train.export=false",
        f"train.output_dir={out}", "algo.replay_tolerance=0.5", "algo.clip_low=0.2", "algo.clip_high=0.28",
        "algo.agg=token-mean", "algo.kl_coef=0", "train.lr=1e-4", *overrides,
    ]


def run_caption_rl(policy: Path, out: Path, *, smoke: bool, steps: int, overrides: list[str]) -> dict[str, float]:
    """The app's own loop (`apps/caption-rl`), figures from its metrics.csv; `overrides` are extra
    `key=value` settings of the app (`--set`). `time/rollout` of an asynchronous run
    (train.max_staleness >= 1) is the rollout thread's, overlapped with the update."""
    run = _load_app().main(caption_rl_args(policy, out, smoke=smoke, steps=steps, overrides=overrides))
    figures = run_figures(run)
    figures["peak_gib"] = _peak_gib()
    return figures


def run_figures(run: Path) -> dict:
    """Means over the steps after the warm-up of a caption-rl run directory's metrics.csv."""
    with (run / "metrics.csv").open() as f:
        every = list(csv.DictReader(f))
    # an asynchronous run's last step has no next rollout to overlap: left out of its means
    rows = every[WARMUP:-1] if every[-1].get("rollout/staleness") else every[WARMUP:]
    mean = lambda key: statistics.fmean(float(r[key]) if r.get(key) else 0.0 for r in rows)  # noqa: E731
    figures = {key: mean(key) for key in ("throughput/tokens_per_s", "throughput/samples_per_s", "time/step",
                                          "time/rollout", "time/rollout_wait", "time/prepare", "time/reward", "time/logprob",
                                          "time/update", "time/rollout_wake", "time/rollout_sleep", "time/weight_sync",
                                          "response/length_mean", "rollout/staleness")}
    # a phase a step did not run (the trainer thread's rollout in an asynchronous run) has an empty cell
    figures.update({key: max((float(r[key]) for r in rows if r[key]), default=0.0) for key in rows[0]
                    if key.startswith("memory/")})
    figures.update({key: mean(key) for key in rows[0] if key.startswith("time_max/")})  # the slowest process
    for phase in ("step", "rollout", "update"):  # every step, warm-up included, for the notes
        figures[f"steps/{phase}"] = [round(float(r[f"time/{phase}"]), 1) for r in every]
    if rows and "time/compile" in rows[0]:  # a long run's rate: the steps' one-time compiling left out
        figures["throughput/tokens_per_s_without_compile"] = statistics.fmean(
            float(r["throughput/tokens_per_s"]) * float(r["time/step"])
            / max(float(r["time/step"]) - float(r["time/compile"] or 0.0), 1e-9) for r in rows)
    for key in ("compile/graphs", "time/compile", "response/truncation_rate"):  # what explains a slow step
        if key in every[0]:
            figures[f"steps/{key}"] = [round(float(r[key]), 3) if r.get(key) else 0.0 for r in every]
    return figures


def vllm_overrides() -> list[str]:
    return ["rollout.engine=vllm", f"rollout.gpu_memory_utilization={VLLM_MEMORY}",
            f"rollout.engine_options.max_model_len={VLLM_MAX_LEN}"]


def _load_app():
    import importlib.util

    spec = importlib.util.spec_from_file_location("caption_rl_app", APP / "__main__.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _peak_gib() -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else float("nan")


def trl_rows(prompts: int) -> list[dict]:
    """The app's prompts and images for TRL: conversational prompt text plus an `image` column
    (TRL puts the image before the text, where the records' `<image>` placeholder is), resized
    to the same pixel budget as the app's `data.max_pixels`."""
    from caption_data import load_records, prompt_text

    from rl_data import chat_messages

    images = REPO / "examples" / "data" / "caption_qa_images.jsonl"
    records = load_records([str(images)], [], eval_size=0, task="image", seed=0).train
    rows = []
    for record in (records * prompts)[:prompts]:
        messages = chat_messages(record.prompt, record.images, record.videos, fps=1.0, max_frames=1,
                                 max_pixels=MAX_PIXELS)
        [image] = [part["image"] for m in messages for part in m["content"] if part["type"] == "image"]
        rows.append({"prompt": [{"role": "user", "content": prompt_text(record)}], "image": image})
    return rows


def run_trl(policy: Path, out: Path, *, smoke: bool, steps: int, vllm: bool = False,
            server: dict | None = None) -> dict[str, float]:
    """`trl.GRPOTrainer` with the app's data, group size, lengths, micro-batch, loss and reward:
    one optimizer step per RL step (gradient accumulation over the whole generation batch).
    `server`: the `vllm_server_*` settings of a running `trl vllm-serve` (`run_trl_server`), for
    `vllm_mode="server"` instead of colocate."""
    try:
        import datasets
        import trl
    except ImportError as e:
        raise SystemExit(f"TRL side needs `trl` and `datasets` importable ({e}); see this file's docstring") from None
    from transformers import AutoModelForImageTextToText, AutoProcessor, TrainerCallback

    from rl_rewards import build_reward
    from rl_rewards.adapters import as_trl_reward

    prompts, n, tokens, micro = SMOKE if smoke else FULL
    engine = ({"vllm_mode": "server", **server} if server else
              {"vllm_mode": "colocate", "vllm_gpu_memory_utilization": VLLM_MEMORY, "vllm_enable_sleep_mode": True,
               "vllm_max_model_length": VLLM_MAX_LEN})
    args = trl.GRPOConfig(
        output_dir=str(out), per_device_train_batch_size=micro, gradient_accumulation_steps=prompts * n // micro,
        num_generations=n, max_completion_length=tokens, max_steps=steps, learning_rate=1e-5, bf16=False,
        gradient_checkpointing=True, temperature=1.0, top_p=1.0, top_k=0, beta=0.0, epsilon=0.2, epsilon_high=0.28,
        loss_type="dapo", num_iterations=1, logging_steps=1, report_to="none", save_strategy="no",
        use_cpu=not torch.cuda.is_available(), dataloader_num_workers=0, seed=0,
        **({"use_vllm": True, **engine, "generation_kwargs": {"logit_bias": placeholder_bias(policy)}} if vllm else {}))
    model = AutoModelForImageTextToText.from_pretrained(policy, dtype=torch.bfloat16)
    trainer = trl.GRPOTrainer(model=model, reward_funcs=as_trl_reward(build_reward(APP / "configs" / "rule_reward.toml")),
                              args=args, train_dataset=datasets.Dataset.from_list(trl_rows(prompts * steps)),
                              processing_class=AutoProcessor.from_pretrained(policy))
    times: list[float] = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *args, **kwargs):
            self.began = time.perf_counter()

        def on_step_end(self, *args, **kwargs):
            times.append(time.perf_counter() - self.began)

    trainer.add_callback(StepTimer())
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "num_tokens" in entry]
    seen = [0.0] + [float(entry["num_tokens"]) for entry in logs]  # cumulative prompt + completion tokens
    per_step = [b - a for a, b in itertools.pairwise(seen)]
    return {"trl_version": trl.__version__,
            "throughput/tokens_per_s": statistics.fmean(t / s for t, s in list(zip(per_step, times, strict=True))[WARMUP:]),
            "time/step": statistics.fmean(times[WARMUP:]), "steps/step": [round(t, 1) for t in times],
            "response/length_mean": statistics.fmean(float(e["completions/mean_length"]) for e in logs[WARMUP:]),
            "peak_gib": _peak_gib()}


def serve_command(policy: Path, port: int) -> list[str]:
    """`trl vllm-serve` (the console script's entry point, `trl.cli:main`) for `--trl-server`."""
    return [sys.executable, "-c", "import sys, trl.cli; sys.exit(trl.cli.main())", "vllm-serve",
            "--model", str(policy), "--host", "127.0.0.1", "--port", str(port),
            "--gpu_memory_utilization", str(VLLM_SERVER_MEMORY), "--max_model_len", str(VLLM_MAX_LEN),
            "--dtype", "bfloat16"]


def run_trl_server(policy: Path, out: Path, *, smoke: bool, steps: int, server_gpu: str = "1") -> dict[str, float]:
    """`run_trl` in TRL's server mode, for two GPUs: `trl vllm-serve` on `server_gpu` (a physical id;
    this process should see only the trainer's GPU), log in `out/vllm-serve.log`, stopped with its
    whole process group however the run ends. tokens/s is per GPU: divided by the 2 GPUs."""
    out.mkdir(parents=True, exist_ok=True)
    log, (port, group_port) = out / "vllm-serve.log", _free_ports(2)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))  # a terminated run still stops the server
    with log.open("w") as sink:
        server = subprocess.Popen(serve_command(policy, port), stdin=subprocess.DEVNULL, stdout=sink,
                                  stderr=subprocess.STDOUT, start_new_session=True,
                                  env={**os.environ, "CUDA_VISIBLE_DEVICES": server_gpu})
    try:
        _wait_healthy(server, f"http://127.0.0.1:{port}/health", log)
        try:
            figures = run_trl(policy, out, smoke=smoke, steps=steps, vllm=True, server={
                "vllm_server_host": "127.0.0.1", "vllm_server_port": port, "vllm_group_port": group_port,
                "vllm_server_timeout": 60.0})
        except Exception:
            print(f"the end of {log} (`trl vllm-serve`, exit code {server.poll()}):\n{_tail(log)}")
            raise
    finally:
        _stop(server)
    total = figures["throughput/tokens_per_s"]
    return {**figures, "gpus": 2, "throughput/tokens_per_s": total / 2, "throughput/tokens_per_s_all_gpus": total}


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _wait_healthy(server: subprocess.Popen, url: str, log: Path) -> None:
    deadline = time.monotonic() + VLLM_SERVER_START_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"`trl vllm-serve` exited with code {server.returncode} before answering {url}; "
                             f"the end of {log}:\n{_tail(log)}")
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(2)
    raise SystemExit(f"`trl vllm-serve` did not answer {url} within {VLLM_SERVER_START_S} s; "
                     f"the end of {log}:\n{_tail(log)}")


def _tail(log: Path, lines: int = 40) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


def _stop(server: subprocess.Popen) -> None:
    """SIGTERM to the server's process group (vLLM's engine processes too), SIGKILL to what is left."""
    for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        try:
            os.killpg(server.pid, sig)
        except ProcessLookupError:
            return
        with contextlib.suppress(subprocess.TimeoutExpired):
            server.wait(timeout=wait)


def placeholder_bias(policy: Path) -> dict[int, float]:
    """vLLM `logit_bias` that keeps TRL from sampling the image/video placeholder tokens: a random
    policy samples one now and then, and TRL's training forward then fails on more image tokens
    than image features (transformers' Qwen3-VL check). caption-rl leaves such rows out of the
    update instead (`response/placeholder_rows`)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(policy)
    names = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
    return {int(getattr(config, name)): -100.0 for name in names}


def run_side(side: str, smoke: bool, steps: int, policy: Path, out: Path, overrides: list[str], vllm: bool,
             engine: str, trl_server: bool = False, long_tail: bool = False) -> dict:
    """One trainer in a fresh process; its figures come back as JSON. TRL's server mode: the process
    sees only the first GPU and starts `trl vllm-serve` on the second. `caption-rl-fp8` is the
    caption-rl side (its `overrides` say the precision)."""
    result = out / f"{side}.json"
    cmd = [sys.executable, __file__, "--side", side.removesuffix("-fp8"), "--policy", str(policy), "--result", str(result),
           "--steps", str(steps), *(["--smoke"] if smoke else []), *(["--vllm"] if vllm else []),
           f"--caption-rl-engine={engine}", *(f"--set={o}" for o in overrides), *(["--long-tail"] if long_tail else [])]
    env = None
    if side == "trl" and trl_server:
        trainer_gpu, server_gpu = (os.environ.get("CUDA_VISIBLE_DEVICES") or "0,1").split(",")[:2]
        cmd += ["--trl-server", f"--server-gpu={server_gpu}"]
        # vLLM's NCCL rendezvous address for the trainer: loopback, both ends on this host
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": trainer_gpu, "VLLM_HOST_IP": "127.0.0.1"}
    subprocess.run(cmd, check=True, env=env)
    return json.loads(result.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU; prints, appends nothing")
    parser.add_argument("--steps", type=int, default=None, help="training steps (first is warm-up)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="extra caption-rl setting, e.g. --set rollout.compile_mode=reduce-overhead (repeatable)")
    parser.add_argument("--vllm", action="store_true", help="both trainers roll out with a colocated vLLM (GPU)")
    parser.add_argument("--caption-rl-engine", choices=("vllm", "hf"), default=None,
                        help="caption-rl's rollout engine (default: vllm with --vllm, else hf). `--vllm "
                             "--caption-rl-engine hf`: caption-rl on its hf engine (decode compiled on CUDA) against TRL "
                             "on vLLM colocate (caption-rl's rollout.engine=auto would pick vLLM there)")
    parser.add_argument("--trl-server", action="store_true",
                        help="TRL in server mode on 2 GPUs (`trl vllm-serve` on the second, the trainer on the first) "
                             "instead of colocate; implies --vllm; its tokens/s is per GPU")
    parser.add_argument("--fp8", action="store_true",
                        help="with --vllm: caption-rl also with rollout.precision=fp8 (vLLM's online FP8), a third trainer")
    parser.add_argument("--long-tail", action="store_true",
                        help="with --vllm: caption lengths drawn per sample with a tail to 2k (benchmarks/long_tail.py), "
                             "imposed inside every vLLM engine of the run")
    parser.add_argument("--only", choices=("caption-rl", "caption-rl-fp8", "trl"),
                        help="run one trainer only; prints its figures, appends nothing")
    parser.add_argument("--cache", type=Path, default=None,
                        help="keep each trainer's figures in DIR/<trainer>-<engine>.json and reuse them: with --only, run the "
                             "two sides in separate commands on one machine, then once more without --only to report")
    parser.add_argument("--side", choices=("caption-rl", "trl"), help=argparse.SUPPRESS)
    parser.add_argument("--policy", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--server-gpu", default="1", help=argparse.SUPPRESS)
    args = parser.parse_args()
    steps = args.steps or (WARMUP + 1 if args.smoke else WARMUP + 5)
    if args.trl_server and args.smoke:
        parser.error("--trl-server runs TRL against a vLLM server on a second GPU; --smoke is CPU-only and has no vLLM")
    args.vllm = args.vllm or args.trl_server
    if args.long_tail and not args.vllm:
        parser.error("--long-tail imposes its lengths inside vLLM: it goes with --vllm or --trl-server")
    if args.long_tail:
        use_long_tail()
    engine = args.caption_rl_engine or ("vllm" if args.vllm else "hf")
    if engine == "vllm" and not args.vllm:
        parser.error("--caption-rl-engine vllm needs --vllm (TRL on vLLM too)")
    if (args.fp8 or args.only == "caption-rl-fp8") and (engine != "vllm" or args.trl_server):
        parser.error("--fp8 quantizes caption-rl's vLLM engine: it goes with --vllm (colocate), not with the hf engine "
                     "or --trl-server")
    if args.side is not None:  # a child process: one trainer
        out = args.result.parent / f"{args.side}-run"
        device = DevicePeak()
        if args.side == "caption-rl":
            # hf named: rollout.engine=auto would pick vLLM wherever it imports on CUDA
            overrides = (vllm_overrides() if engine == "vllm" else ["rollout.engine=hf"]) + args.overrides
            figures = run_caption_rl(args.policy, out, smoke=args.smoke, steps=steps, overrides=overrides)
        elif args.trl_server:
            figures = run_trl_server(args.policy, out, smoke=args.smoke, steps=steps, server_gpu=args.server_gpu)
        else:
            figures = run_trl(args.policy, out, smoke=args.smoke, steps=steps, vllm=args.vllm)
        figures["device_peak_gib"] = device.gib()
        args.result.write_text(json.dumps(figures))
        print(f"{args.side} figures: {json.dumps(figures)}")  # in the log too, if the other side fails
        return
    sides = [args.only] if args.only else ["caption-rl", *(["caption-rl-fp8"] if args.fp8 else []), "trl"]
    from benchmarks.results import cached_figures, load_figures, save_figures

    trl_key = "trl-vllm-server" if args.trl_server else "trl-vllm" if args.vllm else "trl-hf"
    keys = {"caption-rl": f"caption-rl-{engine}", "caption-rl-fp8": f"caption-rl-{engine}-fp8", "trl": trl_key}
    keys = {side: f"{key}-long-tail" if args.long_tail else key for side, key in keys.items()}
    cached = {side: cached_figures(args.cache, keys[side]) for side in sides}
    got = {side: kept for side in sides if (kept := load_figures(cached[side])) is not None}
    for side in got:
        print(f"{side} figures from {cached[side]}")
    if args.trl_server and "trl" in sides and "trl" not in got and torch.cuda.device_count() < 2:
        parser.error(f"--trl-server needs 2 GPUs (the vLLM server on its own), this machine has "
                     f"{torch.cuda.device_count()}")
    if len(got) < len(sides):
        with tempfile.TemporaryDirectory() as tmp:
            policy = build_policy(Path(tmp) / "policy", args.smoke)
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()  # the children measure their own peaks; this process keeps no weights
            for side in (s for s in sides if s not in got):
                overrides = {"caption-rl": args.overrides, "caption-rl-fp8": [*args.overrides, "rollout.precision=fp8"]}
                got[side] = run_side(side, args.smoke, steps, policy, Path(tmp), overrides.get(side, []), args.vllm,
                                     engine, args.trl_server, args.long_tail)
                save_figures(cached[side], got[side])
    if args.only:
        print(json.dumps(got[args.only]))
        return
    if args.fp8:
        return report_fp8(got["caption-rl"], got["caption-rl-fp8"], got["trl"], smoke=args.smoke)
    report(got["caption-rl"], got["trl"], smoke=args.smoke, vllm=args.vllm, engine=engine, trl_server=args.trl_server)


def report(ours: dict[str, float], theirs: dict[str, float], *, smoke: bool, vllm: bool = False,
           engine: str = "hf", trl_server: bool = False) -> None:
    if vllm:  # vLLM's memory is outside torch's allocator: compare what the device had in use
        ours, theirs = {**ours, "peak_gib": ours["device_peak_gib"]}, {**theirs, "peak_gib": theirs["device_peak_gib"]}
    header = ["trainer", "tokens/s", "s/step", "rollout s", "reward s", "logprob s", "update s", "caption tokens",
              "peak GiB"]
    table = [[f"caption-rl (rollout.engine={engine})", f"{ours['throughput/tokens_per_s']:.0f}", f"{ours['time/step']:.2f}",
              f"{ours['time/rollout']:.2f}", f"{ours['time/reward']:.3f}", f"{ours['time/logprob']:.2f}",
              f"{ours['time/update']:.2f}", f"{ours['response/length_mean']:.0f}", f"{ours['peak_gib']:.1f}"],
             ["trl GRPOTrainer" + (" (server mode, 2 GPUs)" if trl_server else ""),
              f"{theirs['throughput/tokens_per_s']:.0f}", f"{theirs['time/step']:.2f}", "", "", "", "",
              f"{theirs['response/length_mean']:.0f}", f"{theirs['peak_gib']:.1f}"]]
    ratio = ours["throughput/tokens_per_s"] / theirs["throughput/tokens_per_s"]
    on_gpu = theirs["peak_gib"] == theirs["peak_gib"]  # NaN without CUDA
    memory = f"{ours['peak_gib'] / theirs['peak_gib']:.2f}x" if on_gpu else "n/a (CPU)"
    table.append(["ratio caption-rl / TRL", f"{ratio:.2f}x", f"{theirs['time/step'] / ours['time/step']:.2f}x faster",
                  "", "", "", "", "", memory])
    steady = ours.get("throughput/tokens_per_s_without_compile")
    compiled = sum(ours.get("steps/time/compile", [])[WARMUP:])
    if steady is not None and compiled > 0.5:  # torch.compile built graphs after the warm-up steps
        table.append(["ratio, caption-rl's one-time compiling after the warm-up left out",
                      f"{steady / theirs['throughput/tokens_per_s']:.2f}x", "", "", "", "", "", "", ""])
    if trl_server:
        caption_rl = {"vllm": f"rollout.engine=vllm, colocated with gpu_memory_utilization {VLLM_MEMORY}",
                      "hf": "its hf engine, decode compiled on CUDA"}[engine]
        setup = ("GRPOTrainer with use_vllm=True, vllm_mode='server' on 2 GPUs: `trl vllm-serve` alone on the "
                 f"second (gpu_memory_utilization {VLLM_SERVER_MEMORY}, TRL's default, max_model_len {VLLM_MAX_LEN}), "
                 "the trainer alone on the first, weights pushed over NCCL after every optimizer step (caption-rl: one "
                 f"GPU, {caption_rl}); TRL's tokens/s is divided by its 2 GPUs, its peak GiB is the trainer GPU's "
                 "(total - free, sampled every 20 ms, as caption-rl's; the server's GPU holds "
                 f"{VLLM_SERVER_MEMORY} of its memory by design),")
    elif vllm:
        setup = ("GRPOTrainer with use_vllm=True, vllm_mode='colocate', sleep mode ("
                 + ("caption-rl: rollout.engine=vllm), both with " if engine == "vllm" else
                    "caption-rl: its hf engine, decode compiled on CUDA), vLLM with ")
                 + f"gpu_memory_utilization {VLLM_MEMORY} and max_model_len {VLLM_MAX_LEN}; peak GiB is the device's "
                 "(total - free, sampled every 20 ms), since vLLM allocates outside torch,")
    else:
        setup = "GRPOTrainer (transformers generate, no vLLM)"
    notes = ("Policy: random weights at Qwen3-VL-2B shape (vocab 151,936), bf16, full fine-tuning with gradient "
             "checkpointing; 32 images x 8 captions x 256 tokens per step, rule reward, one optimizer step per RL "
             f"step, micro-batches of 16; mean over the steps after the first {WARMUP} (warm-up) of each trainer. TRL {theirs['trl_version']} "
             + setup
             + " on the same checkpoint, images, group size, lengths, loss "
             "(dapo token-mean, clip 0.2/0.28, beta 0) and reward, each trainer in its own process. tokens/s is "
             "verl's: (prompt + response tokens) / step seconds / GPUs; TRL's from its num_tokens log. Goal: "
             ">= 1.5x TRL's throughput at no more peak memory.")
    notes += (f" Seconds per step, warm-up included: caption-rl {ours['steps/step']} (rollout {ours['steps/rollout']},"
              f" update {ours['steps/update']}); TRL {theirs['steps/step']}.")
    if "steps/compile/graphs" in ours:
        notes += (f" caption-rl's torch.compile per step: graphs {ours['steps/compile/graphs']}, seconds "
                  f"{ours['steps/time/compile']}; truncation rate {ours.get('steps/response/truncation_rate')} "
                  "(below 1: some caption stopped early, its micro-batch padded).")
    notes += (f" caption-rl's engine layer per step: wake {ours['time/rollout_wake']:.2f} s and sleep "
              f"{ours['time/rollout_sleep']:.2f} s (inside rollout s), weight push {ours['time/weight_sync']:.2f} s "
              "(inside update s).")
    phases = {k.removeprefix("memory/").removesuffix("_peak_gib"): v for k, v in ours.items() if k.startswith("memory/")}
    if phases and on_gpu:
        notes += " caption-rl peak GiB per phase: " + ", ".join(f"{k} {v:.1f}" for k, v in phases.items()) + "."
    if smoke:
        from benchmarks.results import markdown_table

        print(markdown_table(header, table))
        print(notes)
        return
    from benchmarks.results import append_results

    on_vllm = {"vllm": ", both rolling out on vLLM (TRL colocate)", "hf": ", caption-rl on its hf engine, TRL on vLLM (colocate)"}
    on_server = {"vllm": ", TRL in server mode on 2 GPUs (vLLM on its own GPU), caption-rl on one (rollout.engine=vllm)",
                 "hf": ", TRL in server mode on 2 GPUs (vLLM on its own GPU), caption-rl on one (its hf engine)"}
    title = "caption-rl vs TRL GRPOTrainer" + ((on_server if trl_server else on_vllm)[engine] if vllm else "")
    append_results(f"{title}: RL step throughput at Qwen3-VL-2B shape", header, table, notes)


def report_fp8(bf16: dict[str, float], fp8: dict[str, float], trl: dict[str, float], *, smoke: bool) -> None:
    """`--fp8`: caption-rl's step with bf16 and FP8 vLLM rollouts, and TRL's colocate step, from
    one lease; each ratio is against the row named."""
    rows = {"caption-rl, rollout.precision=bf16": bf16, "caption-rl, rollout.precision=fp8": fp8,
            "trl GRPOTrainer (vLLM colocate, bf16)": trl}
    header = ["trainer", "tokens/s", "s/step", "rollout s", "update s", "peak GiB", "tokens/s / caption-rl bf16",
              "tokens/s / TRL"]
    tokens = {name: f["throughput/tokens_per_s"] for name, f in rows.items()}
    table = [[name, f"{tokens[name]:.0f}", f"{f['time/step']:.2f}", f"{f['time/rollout']:.2f}" if f is not trl else "",
              f"{f['time/update']:.2f}" if f is not trl else "", f"{f['device_peak_gib']:.1f}",
              f"{tokens[name] / bf16['throughput/tokens_per_s']:.2f}x", f"{tokens[name] / trl['throughput/tokens_per_s']:.2f}x"]
             for name, f in rows.items()]
    table.append(["rollout phase, bf16 / fp8", "", "", f"{bf16['time/rollout'] / fp8['time/rollout']:.2f}x", "", "", "", ""])
    notes = ("The setting of 'caption-rl vs TRL GRPOTrainer, both rolling out on vLLM' (random weights at Qwen3-VL-2B "
             f"shape, 32 images x 8 captions x 256 tokens, vLLM colocated with gpu_memory_utilization {VLLM_MEMORY}, "
             f"mean over the steps after the first {WARMUP}), each trainer in its own process, one after another on "
             "one GPU. fp8: rollout.precision='fp8' (vLLM's online FP8: per-tensor weight scales, dynamic activation "
             "scales, weights quantized again at each push). TRL samples in bf16 (its colocate mode as its docs give "
             f"it). Seconds per step, warm-up included: bf16 {bf16['steps/step']}, fp8 {fp8['steps/step']}, TRL "
             f"{trl['steps/step']}; rollout per step: bf16 {bf16['steps/rollout']}, fp8 {fp8['steps/rollout']}. "
             f"Weight push per step (inside update s): bf16 {bf16['time/weight_sync']:.2f} s, fp8 "
             f"{fp8['time/weight_sync']:.2f} s. Goal: FP8's rollout phase >= 1.3x bf16's.")
    from benchmarks.results import append_results, markdown_table

    title = "caption-rl with FP8 vLLM rollouts vs bf16 and TRL (vLLM colocate), RL step at Qwen3-VL-2B shape"
    if smoke:
        print(f"{title}\n{markdown_table(header, table)}\n{notes}")
    else:
        append_results(title, header, table, notes)


if __name__ == "__main__":
    main()
