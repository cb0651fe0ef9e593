"""A LoRA policy's weight push to vLLM: the merged weights against the adapter alone
(`rollout.weight_push = merged | adapter`), at Qwen3-VL-2B or 8B shape.

    python benchmarks/lora_push.py            # one GPU with vLLM, ~3 minutes (two vLLM starts)
    python benchmarks/lora_push.py --size 8b  # Qwen3-VL-8B's shape (`rl_models.shapes`), ~5 minutes
    python benchmarks/lora_push.py --smoke    # tiny shapes; still needs a GPU and vLLM

Each mode runs in a fresh process: a random-weight policy at the shape with LoRA rank `--rank` on
the language model's projections (random B, so the adapter matters), its colocated vLLM engine
(`enforce_eager`, so both start alike), then `ROUNDS` times: push the policy's weights (merged:
`rl_rollout.colocated.push_weights`, every merged tensor copied into vLLM; adapter:
`push_adapter`, the adapter written to /dev/shm and handed to vLLM's LoRA path), generate 32
prompts x 128 tokens (the adapter is read at this first generate), and generate again. Reported:
bytes and seconds a push moves and takes (adapter: writing it plus the first generate's extra
time over the second), and the decode's seconds (vLLM's LoRA kernels cost decode time).
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
    torch.cuda.synchronize()
    began = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return time.perf_counter() - began, out


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
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.normal_(std=1e-3)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--rank", type=int, default=64)
    parser.add_argument("--size", choices=["2b", "8b"], default="2b", help="the policy's Qwen3-VL shape")
    parser.add_argument("--only", choices=["merged", "adapter"], help=argparse.SUPPRESS)
    parser.add_argument("--path", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.only:
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
                        "--rank", str(args.rank)], check=True)
        figures[mode] = json.loads(out.read_text())
    rows = []
    for mode, f in figures.items():
        push = statistics.mean(f["push_s"])
        load = statistics.mean(a - b for a, b in zip(f["first_generate_s"], f["generate_s"], strict=True))
        total = push + (load if mode == "adapter" else 0.0)
        rows.append([mode, f"{f['bytes'] / 2**20:.1f}", f"{push:.3f}", f"{load:.3f}" if mode == "adapter" else "",
                     f"{total:.3f}", f"{statistics.mean(f['generate_s']):.2f}"])
    merged_total, adapter_total = float(rows[0][4]), float(rows[1][4])
    rows[1].append(f"{merged_total / adapter_total:.1f}x")
    rows[0].append("1.0x")
    shape = "tiny shapes" if args.smoke else f"Qwen3-VL-{args.size.upper()} shape"
    append_results(f"LoRA weight push to vLLM: merged vs adapter only (rank {args.rank}, {shape})",
                   ["push", "MiB per version", "push s", "adapter read at next generate s", "push total s",
                    "generate s (32 x 128 tokens)", "push speed-up"], rows,
                   f"`benchmarks/lora_push.py{' --smoke' if args.smoke else f' --size {args.size}'}`: each mode in a fresh process, "
                   f"vLLM eager, means of {ROUNDS} versions; the adapter's read is the first generate's time after "
                   "the push minus the second's.")


if __name__ == "__main__":
    main()
