"""A LoRA policy's weight push to vLLM: the merged weights against the adapter alone
(`rollout.weight_push = merged | adapter`), at Qwen3-VL-2B or 8B shape.

    python benchmarks/lora_push.py            # one GPU with vLLM, ~3 minutes (two vLLM starts)
    python benchmarks/lora_push.py --size 8b  # Qwen3-VL-8B's shape (`rl_models.shapes`), ~5 minutes
    python benchmarks/lora_push.py --smoke    # tiny shapes; still needs a GPU and vLLM
    python benchmarks/lora_push.py --ray      # to a vLLM engine in a Ray actor, through the object store
    python benchmarks/lora_push.py --ray --smoke  # the same with hf actors on the CPU: prints, appends nothing

Each mode runs in a fresh process: a random-weight policy at the shape with LoRA rank `--rank` on
the language model's projections (random B, so the adapter matters), its colocated vLLM engine
(`enforce_eager`, so both start alike), then `ROUNDS` times: push the policy's weights (merged:
`rl_rollout.colocated.push_weights`, every merged tensor copied into vLLM; adapter:
`push_adapter`, the adapter written to /dev/shm and handed to vLLM's LoRA path), generate 32
prompts x 128 tokens (the adapter is read at this first generate), and generate again. Reported:
bytes and seconds a push moves and takes (adapter: writing it plus the first generate's extra
time over the second), and the decode's seconds (vLLM's LoRA kernels cost decode time).

`--ray`: the pushes a run with `rollout.workers=1` on a Ray cluster makes (`build_policy_engine`
with a `ray_address`: each version as host copies through Ray's object store, as to an actor on
another node; here a head started in the process, the actor on the same GPU). merged: the whole
merged model a version; adapter: the LoRA alone, which the actor merges over the weights it keeps
from the checkpoint (`rl_rollout.policy_pool.load_adapter_merged`). Its push is the optimizer step's
`stepped()` (every byte loaded in the actor's engine when it returns); both decode merged weights.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from results import append_results  # noqa: E402

ROUNDS = 3


def timed(fn):
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    began = time.perf_counter()
    out = fn()
    sync()
    return time.perf_counter() - began, out


def new_version(model: torch.nn.Module) -> None:
    """A new version of the LoRA: fresh random B (so the adapter matters)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=1e-3)


def one_mode(mode: str, path: Path, rank: int, out: Path) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from transformers import AutoModelForImageTextToText

    from rl_models.lora import add_lora, merged_named_weights
    from rl_rollout import SamplingParams
    from rl_rollout.colocated import push_adapter, push_weights
    from rl_rollout.vllm import VLLMEngine

    model = add_lora(AutoModelForImageTextToText.from_pretrained(path, dtype=torch.bfloat16).cuda(),
                     family="qwen3_vl", r=rank)
    lora = {"enable_lora": True, "max_lora_rank": rank, "max_loras": 1} if mode == "adapter" else {}
    engine = VLLMEngine(str(path), dtype="bfloat16", gpu_memory_utilization=0.3, max_model_len=2048,
                        enforce_eager=True, seed=0, **lora)
    prompts = [[100 + (7 * i + j) % 1000 for j in range(64)] for i in range(32)]
    params = SamplingParams(temperature=1.0, max_new_tokens=128, seed=0)
    root = Path(tempfile.mkdtemp(dir="/dev/shm"))
    figures: dict[str, list[float]] = {"push_s": [], "first_generate_s": [], "generate_s": []}
    for version in range(1, ROUNDS + 1):
        new_version(model)
        if mode == "adapter":
            seconds, folder = timed(lambda v=version: push_adapter(engine, model, v, root))
            size = sum(f.stat().st_size for f in folder.iterdir())
        else:
            seconds, _ = timed(lambda v=version: push_weights(engine, model, v))
            size = sum(t.numel() * t.element_size() for _, t in merged_named_weights(model))
        figures["push_s"].append(seconds)
        figures["first_generate_s"].append(timed(lambda: engine.generate(prompts, params))[0])
        figures["generate_s"].append(timed(lambda: engine.generate(prompts, params))[0])
        print(mode, version, {k: round(v[-1], 3) for k, v in figures.items()}, size, flush=True)
    out.write_text(json.dumps({"bytes": size, **figures}))


def one_ray_mode(mode: str, path: Path, rank: int, out: Path, smoke: bool) -> None:
    """`--ray`'s run of one mode (`merged` or `adapter`), in this fresh process."""
    import ray
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from rl_models.lora import adapter_tensors, add_lora, merged_named_weights
    from rl_policy.engine import build_policy_engine
    from rl_rollout import SamplingParams

    cuda = torch.cuda.is_available()
    model = add_lora(AutoModelForImageTextToText.from_pretrained(path, dtype=torch.bfloat16).to("cuda" if cuda else "cpu"),
                     family="qwen3_vl", r=rank)
    ray.init(num_cpus=4, num_gpus=1 if cuda else 0, include_dashboard=False, log_to_driver=False)
    policy = build_policy_engine(
        "vllm" if cuda else "hf", model=model, processor=AutoProcessor.from_pretrained(path), path=str(path),
        dtype="bfloat16", device=torch.device("cuda" if cuda else "cpu"), seed=0, max_batch_size=64,
        gpu_memory_utilization=0.3, engine_options={"max_model_len": 2048, "enforce_eager": True} if cuda else {},
        workers=1, gpus_per_worker=0.5 if cuda else 0.0, ray_address=ray.get_runtime_context().gcs_address,
        weight_push=mode)
    prompts = [[100 + (7 * i + j) % 1000 for j in range(64)] for i in range(32 if not smoke else 4)]
    params = SamplingParams(temperature=1.0, max_new_tokens=128 if not smoke else 8, seed=0)
    pushed = adapter_tensors(model).values() if mode == "adapter" else (t for _, t in merged_named_weights(model))
    size = sum(t.numel() * t.element_size() for t in pushed)
    figures: dict[str, list[float]] = {"push_s": [], "first_generate_s": [], "generate_s": []}
    for version in range(1, ROUNDS + 1):
        new_version(model)
        figures["push_s"].append(timed(policy.stepped)[0])
        figures["first_generate_s"].append(timed(lambda: policy.engine.generate(prompts, params))[0])
        figures["generate_s"].append(timed(lambda: policy.engine.generate(prompts, params))[0])
        print(mode, version, {k: round(v[-1], 3) for k, v in figures.items()}, size, flush=True)
    policy.close()
    ray.shutdown()
    out.write_text(json.dumps({"bytes": size, **figures}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--rank", type=int, default=64)
    parser.add_argument("--size", choices=["2b", "8b"], default="2b", help="the policy's Qwen3-VL shape")
    parser.add_argument("--ray", action="store_true", help="push to a Ray actor's engine through the object store")
    parser.add_argument("--only", choices=["merged", "adapter"], help=argparse.SUPPRESS)
    parser.add_argument("--path", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.only:
        if args.ray:
            one_ray_mode(args.only, args.path, args.rank, args.out, args.smoke)
        else:
            one_mode(args.only, args.path, args.rank, args.out)
        return
    from caption_rl import build_policy

    work = Path(tempfile.mkdtemp())
    if args.size == "8b" and not args.smoke:
        from transformers import GenerationConfig

        from rl_models.shapes import build_shape

        path = build_shape("qwen3_vl", "8b", work / "policy", dtype="bfloat16", device="cuda")
        GenerationConfig(eos_token_id=[]).save_pretrained(path)  # every generation runs its 128 tokens, as build_policy's
    else:
        path = build_policy(work / "policy", args.smoke)
    figures = {}
    for mode in ("merged", "adapter"):
        out = work / f"{mode}.json"
        subprocess.run([sys.executable, __file__, "--only", mode, "--path", str(path), "--out", str(out),
                        "--rank", str(args.rank), *(["--ray"] if args.ray else []), *(["--smoke"] if args.smoke else [])],
                       check=True)
        figures[mode] = json.loads(out.read_text())
    rows = []
    for mode, f in figures.items():
        push = statistics.mean(f["push_s"])
        load = statistics.mean(a - b for a, b in zip(f["first_generate_s"], f["generate_s"], strict=True))
        read = mode == "adapter" and not args.ray  # vLLM's LoRA path reads the adapter at the next generate
        total = push + (load if read else 0.0)
        rows.append([mode, f"{f['bytes'] / 2**20:.1f}", f"{push:.3f}", f"{load:.3f}" if read else "",
                     f"{total:.3f}", f"{statistics.mean(f['generate_s']):.2f}"])
    merged_total, adapter_total = float(rows[0][4]), float(rows[1][4])
    rows[1].append(f"{merged_total / adapter_total:.1f}x")
    rows[0].append("1.0x")
    shape = "tiny shapes" if args.smoke else f"Qwen3-VL-{args.size.upper()} shape"
    where = "a Ray actor's vLLM engine through the object store" if args.ray else "vLLM"
    header = ["push", "MiB per version", "push s", "adapter read at next generate s", "push total s",
              "generate s (32 x 128 tokens)", "push speed-up"]
    notes = (f"`benchmarks/lora_push.py{' --ray' if args.ray else ''}{' --smoke' if args.smoke else f' --size {args.size}'}`: "
             f"each mode in a fresh process, vLLM eager, means of {ROUNDS} versions; the adapter's read is the first "
             "generate's time after the push minus the second's"
             + (" (the actor merges at the push, so it reads nothing later)." if args.ray else "."))
    title = f"LoRA weight push to {where}: merged vs adapter only (rank {args.rank}, {shape})"
    if args.ray and args.smoke:
        print(title, header, *rows, notes, sep="\n")
        return
    append_results(title, header, rows, notes)


if __name__ == "__main__":
    main()
