"""Where caption-rl's vLLM rollout step spends its time, against vLLM run alone.

    python benchmarks/vllm_rollout.py            # one H100/H200, ~5 minutes (three vLLM starts)
    python benchmarks/vllm_rollout.py --smoke    # tiny shapes; still needs a GPU and vLLM
    python benchmarks/vllm_rollout.py --fp8      # row 1 with rollout.precision bf16, then fp8 (two vLLM starts)
    python benchmarks/vllm_rollout.py --fp8 --profile   # and one generate of each profiled: CUDA time by kernel kind

The setting of `benchmarks/caption_rl.py --vllm`: a random-weight policy at Qwen3-VL-2B shape,
32 images x 8 captions x 256 tokens per step, `gpu_memory_utilization` 0.3, `max_model_len`
2048, the sampled tokens' log-probs returned. Three engines, each timed over `ROUNDS` rounds
after one warm-up round:

1. caption-rl's colocated engine (`rl_policy.engine.build_policy_engine("vllm", ...)`, engine
   core in this process, sleep mode), one RL step's engine work split into its parts: wake,
   generate (the app's chat messages with images), sleep, and the weight push after the
   optimizer step; then the same engine generating text-only prompts of the same token length
   (no image processing, no vision encoder), which isolates the images' cost.
2. vLLM alone in a fresh process with its defaults (engine core in a process of its own, no
   sleep mode), the same requests.
3. vLLM alone in a fresh process with its engine core in the caller's thread
   (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, what an in-process weight push needs), the same requests.

The differences between the rows say what the colocated pattern costs: (1) vs (3) is sleep mode
and the app's wrapper, (3) vs (2) is the in-thread engine core, and the text-only row is the
images' share. Rows 2 and 3 also give the CPU seconds each generate takes in the caller's
process: with split placement that process is the trainer's, whose kernel launches wait while
another of its threads holds the interpreter lock (`--only alone` prints them alone).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO))

from caption_rl import FULL, MAX_PIXELS, SMOKE, VLLM_MAX_LEN, VLLM_MEMORY, build_policy, trl_rows  # noqa: E402

ROUNDS = 3


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn: Any) -> tuple[float, Any]:
    _sync()
    began = time.perf_counter()
    out = fn()
    _sync()
    return time.perf_counter() - began, out


def requests(policy: Path, smoke: bool) -> tuple[list[Any], Any]:
    """The app's chat messages (one image, at most `MAX_PIXELS`, and the caption prompt each)
    and the sampling parameters of one RL step."""
    from rl_rollout import SamplingParams

    prompts, n, tokens, _ = SMOKE if smoke else FULL
    messages = [[{"role": "user", "content": [{"type": "image", "image": row["image"]},
                                              {"type": "text", "text": row["prompt"][0]["content"]}]}]
                for row in trl_rows(prompts)]
    return messages, SamplingParams(n=n, temperature=1.0, max_new_tokens=tokens, seed=0)


def text_only(gens: list[Any]) -> list[list[int]]:
    """Token-id prompts as long as the image prompts were in vLLM (image tokens included), made
    of random text ids: the same prefill and decode, without image processing or vision encoder."""
    lengths = {g.request_index: len(g.prompt_ids) for g in gens}
    torch.manual_seed(0)
    return [torch.randint(1000, 20000, (lengths[i],)).tolist() for i in sorted(lengths)]


# first match wins: vLLM's KV-cache kernels and inductor's fused activation quantization (named
# after every op they hold, `..._abs_clamp_cutlass_scaled_mm_div_...`) carry GEMM and FP8 words
KINDS = (("attention, KV cache", ("flash", "fmha", "attn", "attention", "paged", "reshape_and_cache")),
         ("FP8 activation quantization (fused with norms)", ("quant", "max_reduction", "abs_clamp")),
         ("FP8 GEMM", ("fp8", "e4m3", "scaled_mm")),
         ("bf16 GEMM", ("gemm", "gemv", "xmma", "cutlass", "nvjet", "sm90", "matmul", "splitk")),
         ("Triton (fused norms, rotary, activations)", ("triton",)),
         ("sampling, log-probs", ("softmax", "sort", "topk", "top_k", "sampl", "argmax", "exponential", "radix",
                                  "scan", "gather", "reduce")))


def kernel_kind(name: str) -> str:
    lowered = name.lower()
    return next((kind for kind, keys in KINDS if any(k in lowered for k in keys)), "other")


def profile_generate(generate: Any, top: int = 25) -> dict[str, float]:
    """CUDA milliseconds by kernel kind of one `generate()` (the engine core in this process, so
    its kernels are this process's), with the wall milliseconds beside: kernels adding up to
    well under the wall time mean the GPU waits on the host. Prints the `top` longest kernels."""
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.results import kernel_times

    _sync()
    began = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        generate()
        _sync()
    wall = time.perf_counter() - began
    times, kernels = kernel_times(prof, kernel_kind, top)
    return times | {"kernels total": sum(times.values()), "wall": wall * 1e3, "kernels": kernels}


def colocated(policy: Path, smoke: bool, precision: str = "bf16", profile: bool = False) -> dict[str, Any]:
    """caption-rl's engine work of one RL step, part by part (row 1); `precision` as
    `rollout.precision` (fp8: vLLM's online FP8, quantized again at each push); `profile`: one more
    generate under the CUDA profiler (`profile_generate`)."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from rl_policy.engine import build_policy_engine
    from rl_rollout.colocated import push_weights

    model = AutoModelForImageTextToText.from_pretrained(policy, dtype=torch.bfloat16).cuda()
    processor = AutoProcessor.from_pretrained(policy)
    messages, params = requests(policy, smoke)
    engine = build_policy_engine("vllm", model=model, processor=processor, path=str(policy), dtype="bfloat16",
                                 device=torch.device("cuda"), seed=0, max_batch_size=len(messages) * params.n,
                                 gpu_memory_utilization=VLLM_MEMORY, engine_options={
                                     "max_model_len": VLLM_MAX_LEN, **({"quantization": "fp8"} if precision == "fp8" else {})})
    vllm = engine.engine
    parts: dict[str, list[float]] = {"wake": [], "generate": [], "sleep": [], "weight push": [], "generate text-only": []}
    tokens: list[float] = []
    for round_ in range(ROUNDS + 1):
        wake, _ = timed(vllm.wake)
        seconds, gens = timed(lambda: vllm.generate(messages, params))
        ids = text_only(gens)
        plain, _ = timed(lambda ids=ids: vllm.generate(ids, params))
        sleep, _ = timed(vllm.sleep)
        push, _ = timed(lambda v=round_ + 1: push_weights(vllm, model, version=v))
        if round_ == 0:
            continue  # warm-up: the first generate of a shape, the first wake
        for key, value in zip(parts, (wake, seconds, sleep, push, plain), strict=True):
            parts[key].append(value)
        tokens.append(sum(len(g.completion_ids) for g in gens))
    figures = {key: statistics.fmean(values) for key, values in parts.items()} | {"tokens": statistics.fmean(tokens)}
    if profile:
        vllm.wake()
        print(f"the longest kernels of one generate, {precision}:")
        figures["profile"] = profile_generate(lambda: vllm.generate(messages, params))
    engine.close()
    return figures


def alone(policy: Path, smoke: bool, in_thread: bool) -> dict[str, Any]:
    """vLLM by itself, no sleep mode, the same requests (rows 2 and 3): `LLM.generate` timed,
    with the CPU seconds it takes in the caller's process (all its threads; an engine core in a
    process of its own not counted) and in the calling thread: with split placement that process
    is the trainer's, and its interpreter lock is held for at most that much of each rollout."""
    import os

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if in_thread else "1"
    from rl_rollout.vllm import VLLMEngine

    messages, params = requests(policy, smoke)
    engine = VLLMEngine(str(policy), dtype="bfloat16", gpu_memory_utilization=VLLM_MEMORY, seed=0,
                        max_num_seqs=len(messages) * params.n, max_model_len=VLLM_MAX_LEN, enable_sleep_mode=False)
    prompts = [engine._prompt(m, i) for i, m in enumerate(messages)]
    sampling = engine._sampling(params)
    times, tokens, process_cpu, thread_cpu = [], [], [], []
    for round_ in range(ROUNDS + 1):
        cpu, own = time.process_time(), time.thread_time()
        seconds, outs = timed(lambda: engine.llm.generate(prompts, sampling, use_tqdm=False))
        if round_:
            times.append(seconds)
            tokens.append(sum(len(s.token_ids) for o in outs for s in o.outputs))
            process_cpu.append(time.process_time() - cpu)
            thread_cpu.append(time.thread_time() - own)
    return {"generate": statistics.fmean(times), "tokens": statistics.fmean(tokens),
            "caller process cpu": statistics.fmean(process_cpu), "calling thread cpu": statistics.fmean(thread_cpu)}


def child(args: argparse.Namespace) -> None:
    figures = colocated(args.policy, args.smoke, args.precision, args.profile) if args.child == "colocated" else alone(
        args.policy, args.smoke, in_thread=args.child == "alone-in-thread")
    args.result.write_text(json.dumps(figures))
    print(f"{args.child}: {json.dumps(figures)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (GPU and vLLM still needed); appends nothing")
    parser.add_argument("--only", action="append", choices=("colocated", "alone", "alone-in-thread"),
                        help="run only these engines (repeatable); prints their figures, appends nothing")
    parser.add_argument("--child", choices=("colocated", "alone", "alone-in-thread"), help=argparse.SUPPRESS)
    parser.add_argument("--policy", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--precision", choices=("bf16", "fp8"), default="bf16", help=argparse.SUPPRESS)
    parser.add_argument("--fp8", action="store_true", help="row 1 in bf16 and in FP8 (rollout.precision), compared")
    parser.add_argument("--profile", action="store_true",
                        help="with --fp8: one generate of each precision under the CUDA profiler, time by kernel kind")
    args = parser.parse_args()
    if args.profile and not (args.fp8 or args.child):
        parser.error("--profile goes with --fp8")
    if args.child:
        return child(args)
    if not torch.cuda.is_available():
        raise SystemExit("vllm_rollout.py needs a CUDA GPU and vLLM")
    figures: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        policy = build_policy(Path(tmp) / "policy", args.smoke)
        torch.cuda.empty_cache()
        runs = [("colocated", p) for p in ("bf16", "fp8")] if args.fp8 else [
            (side, "bf16") for side in args.only or ("colocated", "alone", "alone-in-thread")]
        for side, precision in runs:  # each in a fresh process
            result = Path(tmp) / f"{side}-{precision}.json"
            subprocess.run([sys.executable, __file__, "--child", side, "--policy", str(policy), "--result", str(result),
                            "--precision", precision, *(["--smoke"] if args.smoke else []),
                            *(["--profile"] if args.profile else [])], check=True)
            figures[side if not args.fp8 else precision] = json.loads(result.read_text())
    if args.fp8:
        return report_fp8(figures, smoke=args.smoke)
    if args.only:
        print(json.dumps(figures))
        return
    report(figures, smoke=args.smoke)


def report_fp8(figures: dict[str, dict[str, Any]], *, smoke: bool) -> None:
    """caption-rl's colocated engine work in bf16 and in FP8, part by part, FP8's speed-up beside."""
    from benchmarks.results import append_results, markdown_table

    bf16, fp8 = figures["bf16"], figures["fp8"]
    for f in (bf16, fp8):
        f["step"] = f["wake"] + f["generate"] + f["sleep"] + f["weight push"]
    header = ["caption-rl colocated engine", "bf16 s", "fp8 s", "bf16 / fp8", "bf16 tokens/s", "fp8 tokens/s"]
    table = [[part, f"{bf16[part]:.2f}", f"{fp8[part]:.2f}", f"{bf16[part] / fp8[part]:.2f}x",
              f"{bf16['tokens'] / bf16[part]:,.0f}" if part in ("generate", "step") else "",
              f"{fp8['tokens'] / fp8[part]:,.0f}" if part in ("generate", "step") else ""]
             for part in ("wake", "generate", "sleep", "weight push", "step")]
    notes = ("The setting of row 1 below (random-weight Qwen3-VL-2B-shape policy, 32 images x 8 captions x 256 "
             f"tokens, gpu_memory_utilization {VLLM_MEMORY}, max_model_len {VLLM_MAX_LEN}, mean of {ROUNDS} rounds after "
             "a warm-up), each precision in a fresh process. fp8 = rollout.precision='fp8': vLLM's online FP8 "
             "(quantization='fp8', per-tensor weight scales, dynamic activation scales), the push through vLLM's "
             f"layerwise reload (quantized again). Tokens per step: bf16 {bf16['tokens']:.0f}, fp8 {fp8['tokens']:.0f}.")
    sections = [("caption-rl's vLLM rollout: bf16 vs FP8 (rollout.precision, Qwen3-VL-2B shape)", header, table, notes)]
    if "profile" in bf16:
        sections.append(profile_section(bf16["profile"], fp8["profile"], tokens=(bf16["tokens"], fp8["tokens"])))
    for title, head, rows, note in sections:
        if smoke:
            print(f"{title}\n{markdown_table(head, rows)}\n{note}")
        else:
            append_results(title, head, rows, note)


def profile_section(bf16: dict[str, float], fp8: dict[str, float], *, tokens: tuple[float, float]) -> tuple:
    """The profiled generates side by side: CUDA milliseconds per kernel kind, and the wall."""
    kinds = [kind for kind, _ in KINDS] + ["other", "kernels total", "wall"]
    for figures in (bf16, fp8):  # sorted again here: the kinds may have changed since the run
        times = defaultdict(float)
        for ms, _, name in figures["kernels"]:
            times[kernel_kind(name)] += ms
        figures.update(times)
    table = [[kind, f"{bf16.get(kind, 0.0):,.1f}", f"{fp8.get(kind, 0.0):,.1f}",
              f"{bf16.get(kind, 0.0) / fp8[kind]:.2f}x" if fp8.get(kind) else ""] for kind in kinds]
    notes = (f"One generate of row 1's step (256 captions, {tokens[0]:.0f} and {tokens[1]:.0f} tokens sampled) under "
             "torch's CUDA profiler, after the timed rounds, each precision in its own process; CUDA graphs' kernels "
             "are counted one by one. Kernels are sorted into kinds by name (benchmarks/vllm_rollout.py `KINDS`, the "
             "first match wins); 'kernels total' is their sum, 'wall' the generate's time under the profiler.")
    return ("caption-rl's vLLM rollout, bf16 vs FP8: CUDA time of one generate by kernel kind (Qwen3-VL-2B shape)",
            ["kernel kind", "bf16 ms", "fp8 ms", "bf16 / fp8"], table, notes)


def report(figures: dict[str, dict[str, Any]], *, smoke: bool) -> None:
    from benchmarks.results import append_results, markdown_table

    ours, alone_mp, alone_thread = figures["colocated"], figures["alone"], figures["alone-in-thread"]
    step = ours["wake"] + ours["generate"] + ours["sleep"] + ours["weight push"]
    row = lambda name, seconds, tokens="", cpu=None: [  # noqa: E731
        name, f"{seconds:.2f}", f"{tokens / seconds:,.0f}" if tokens else "", f"{seconds / alone_mp['generate']:.2f}x",
        f"{cpu['caller process cpu']:.2f} / {cpu['calling thread cpu']:.2f}" if cpu and "caller process cpu" in cpu else ""]
    header = ["what", "seconds", "caption tokens/s", "seconds / vLLM alone's (defaults)",
              "CPU s in the caller's process / its calling thread"]
    table = [
        row("caption-rl colocated engine: wake (weights and KV cache back)", ours["wake"]),
        row("caption-rl colocated engine: generate, 32 images x 8 captions", ours["generate"], ours["tokens"]),
        row("caption-rl colocated engine: generate, text-only prompts of the same lengths", ours["generate text-only"],
            ours["tokens"]),
        row("caption-rl colocated engine: sleep", ours["sleep"]),
        row("caption-rl colocated engine: weight push (after the optimizer step)", ours["weight push"]),
        row("caption-rl colocated engine: the step's engine work (wake + generate + sleep + push)", step, ours["tokens"]),
        row("vLLM alone, fresh process, defaults (engine core process, no sleep mode)", alone_mp["generate"],
            alone_mp["tokens"], alone_mp),
        row("vLLM alone, fresh process, engine core in the caller's thread", alone_thread["generate"],
            alone_thread["tokens"], alone_thread),
    ]
    notes = (f"Random weights at Qwen3-VL-2B shape, bf16; {FULL[0]} images x {FULL[1]} captions x {FULL[2]} tokens "
             f"(T=1, sampled tokens' log-probs); gpu_memory_utilization {VLLM_MEMORY}, max_model_len {VLLM_MAX_LEN}, "
             f"max_num_seqs {FULL[0] * FULL[1]}; means over {ROUNDS} rounds after one warm-up, each engine in a "
             "fresh process. The text-only row feeds random token ids, as many as each image prompt had in vLLM "
             "(image tokens included): the same prefill and decode without image processing or vision encoder. "
             "CPU seconds: `time.process_time` (every thread of the caller's process, not an engine core process) "
             "and `time.thread_time` (the thread calling `LLM.generate`) per generate. "
             f"Images at most {MAX_PIXELS} pixels.")
    if smoke:
        print(markdown_table(header, table))
        print(notes)
        return
    append_results("caption-rl's vLLM rollout, part by part, vs vLLM alone (Qwen3-VL-2B shape)", header, table, notes)


if __name__ == "__main__":
    main()
