"""`hf` engine vs plain transformers: batched generation and shared-prefix scoring.

    python benchmarks/engines.py            # GPU: random weights at Qwen3-4B shape, bf16
    python benchmarks/engines.py --smoke    # CPU, tiny shape, seconds, no RESULTS.md

(a) Generation, 64 prompts x 256 tokens in, 256 out (no EOS: the model's generation config has
    none, so every row runs to length). Tokens/s of
      - plain `model.generate(...)` with default settings (dynamic cache, greedy),
      - `HFEngine` (static cache, sampling at temperature 1 with per-token log-probs), compiled
        decode step (CUDA graphs) and eager,
      - transformers continuous batching `model.generate_batch(...)` (greedy), when it runs,
      - vLLM (where it imports, on a GPU): the same weights saved and loaded by `vllm.LLM`
        (CUDA graphs, prefix caching, T=1 with per-token log-probs, `ignore_eos`), the peer,
    against the decode roofline of docs/reference.md §5:
      tokens/s <= B * bandwidth / (weight bytes + B * mean context * KV bytes per token).
    Goals: HFEngine >= 3x plain generate; HFEngine >= 0.75x vLLM.
(b) Scoring, 64 captions (~1,000 tokens) x 8 questions (~60 tokens), 6 candidates:
    one forward per full prompt (512 left-padded prompts in batches of 32, `logits_to_keep=1`) vs
      - `HFEngine.score_next_tokens`, one call per caption (packed: prefix + its 8 questions in one
        row with a 4-D mask, the prefix computed once),
      - `HFEngine.score_next_tokens_batch`, all 64 captions in one call (packed rows batched into
        forwards of `score_token_budget` tokens).
    Goal: >= 5x fewer seconds. Reported: max |Δ logprob| of each table vs the independent one and
    vs an fp32 reference (each prompt alone, weights in float32) on the first 16 prompts, which
    tells bf16 rounding apart from a mask/position error.
    python benchmarks/engines.py --only scoring   # this part only (< 3 minutes on an H100/H200)
Timings: median of `--repeats` runs after a warm-up run, with `torch.cuda.synchronize`.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, Qwen3Config

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results import append_results, hbm_bandwidth, markdown_table, seconds_from_fresh_process

from rl_models import tiny
from rl_rollout import SamplingParams
from rl_rollout.hf import HFEngine

ALONE_MARK = "vllm-alone-result: "  # the fresh-process row's line on stdout (vLLM logs there too)


@dataclass(frozen=True)
class Sizes:
    batch: int
    prompt: int
    new: int
    captions: int
    caption_len: int
    questions: int
    question_len: int
    candidates: int


FULL = Sizes(batch=64, prompt=256, new=256, captions=64, caption_len=1000, questions=8, question_len=60, candidates=6)
SMOKE = Sizes(batch=4, prompt=16, new=16, captions=2, caption_len=40, questions=3, question_len=6, candidates=6)


def model_config(smoke: bool, vocab: int) -> Qwen3Config:
    """Qwen3-4B's published shape (or a tiny one for --smoke)."""
    if smoke:
        return Qwen3Config(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
                           max_position_embeddings=4096)
    return Qwen3Config(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
                       max_position_embeddings=40960, rope_theta=1_000_000.0)


def build_model(config: Qwen3Config, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """Random weights, initialised directly on the device."""
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.generation_config = GenerationConfig(eos_token_id=None, pad_token_id=0, do_sample=False)
    return model.eval()


def timed(fn: Callable[[], object], device: torch.device, repeats: int, warmup: Callable[[], object] | None = None) -> float:
    """Median seconds of `fn` over `repeats` runs, after one warm-up call (`warmup`, else `fn`)."""
    (warmup or fn)()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def roofline(model: torch.nn.Module, config: Qwen3Config, s: Sizes, device: torch.device) -> float | None:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
    bandwidth = hbm_bandwidth(name)
    if bandwidth is None:
        return None
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    kv_per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 2  # K+V, bf16
    context = s.prompt + s.new / 2
    return s.batch * bandwidth / (weight_bytes + s.batch * context * kv_per_token)


def decode_profile(engine: HFEngine, prompts: list[list[int]], params: SamplingParams, steps: int) -> str:
    """Where a decode step's time goes: one profiled `generate` of `steps` tokens (after the
    timed runs, so graphs are captured), GPU kernel time per step by kernel name (top 12) and
    the host's wall time per step."""
    from torch.profiler import ProfilerActivity, profile

    short = SamplingParams(temperature=params.temperature, max_new_tokens=steps, seed=0)
    engine.generate(prompts, short)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        engine.generate(prompts, short)
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    kernels = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    gpu_us = sum(e.self_device_time_total for e in kernels)
    lines = [f"profile of one generate of {len(prompts)} rows x {steps} tokens (prefill included): wall "
             f"{wall * 1e3:.1f} ms, GPU kernels {gpu_us / 1e3:.1f} ms, i.e. {wall * 1e3 / steps:.2f} ms wall and "
             f"{gpu_us / 1e3 / steps:.2f} ms of kernels per token step; top kernels (ms per step, calls per step):"]
    for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[:12]:
        lines.append(f"  {e.self_device_time_total / 1e3 / steps:7.3f} ms  {e.count / steps:6.1f}  {e.key[:110]}")
    return "\n".join(lines)


@dataclass(frozen=True)
class StopCase:
    """The RL-like case: 4 batches of prompts whose completions end at a stop token, lengths
    geometric (a stop token is drawn with probability ~1/`mean_new` per step under random
    weights), capped at `Sizes.new`; rows that finish early leave the batch in vLLM, not in
    HFEngine (whose chunk of `batch` rows runs until its longest row ends)."""

    prompts: list[list[int]]
    stops: list[int]


def stop_case(tokenizer, vocab: int, s: Sizes, mean_new: int = 128) -> StopCase:
    """Prompts from the tokenizer's ids; stop ids from the model's whole vocabulary (what random
    weights sample from)."""
    gen = torch.Generator().manual_seed(2)
    prompts = torch.randint(10, len(tokenizer), (4 * s.batch, s.prompt), generator=gen).tolist()  # [4B, T]
    stops = torch.randperm(vocab, generator=gen)[: max(1, vocab // mean_new)].tolist()
    return StopCase(prompts, stops)


def bench_stop_case_hf(engine: HFEngine, case: StopCase, s: Sizes, device, repeats: int) -> tuple[float, int]:
    """(median seconds, tokens generated) of HFEngine on the stop-token case."""
    engine.stop_token_ids = case.stops
    params = SamplingParams(temperature=1.0, max_new_tokens=s.new, seed=0)
    out: list = []
    secs = timed(lambda: out.__setitem__(slice(None), engine.generate(case.prompts, params)), device, repeats)
    return secs, sum(len(g.completion_ids) for g in out)


def bench_generation(model, tokenizer, config, s: Sizes, device, repeats: int, methods: set[str],
                     notes: list[str]) -> list[list[object]]:
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(10, len(tokenizer), (s.batch, s.prompt), generator=gen)  # [B, T]
    case = stop_case(tokenizer, config.vocab_size, s)
    stop_rows: list[list[object]] = []
    tokens = s.batch * s.new
    rows: list[list[object]] = []
    plain_s = float("nan")

    def plain(new: int = s.new) -> None:
        out = model.generate(input_ids=prompts.to(device), attention_mask=torch.ones_like(prompts, device=device),
                             max_new_tokens=new)
        assert out.shape[1] == s.prompt + new  # no EOS in the generation config: full length

    def vs_plain(secs: float) -> str:
        return f"{plain_s / secs:.2f}x" if "plain" in methods else ""

    if "plain" in methods:
        plain_s = timed(plain, device, repeats, warmup=lambda: plain(8))
        rows.append(["plain generate (dynamic cache, greedy)", f"{plain_s:.2f}", f"{tokens / plain_s:,.0f}", "1.00x"])
    params = SamplingParams(temperature=1.0, max_new_tokens=s.new, seed=0)
    short_params = SamplingParams(temperature=1.0, max_new_tokens=8, seed=0)
    # (compiled, grouped decode attention): the engine as shipped, then the model's own sdpa
    # attention (KV heads repeated to the query heads) for comparison, then eager
    variants = [(True, True), (True, False), (False, True)] if device.type == "cuda" else [(False, True)]
    variants = [v for i, v in enumerate(variants) if ("hf" in methods and i == 0) or ("hf-variants" in methods and i > 0)]
    for compile_, grouped in variants:
        engine = HFEngine(model, tokenizer, device=device, max_batch_size=s.batch, compile=compile_, stop_token_ids=[])
        engine._grouped_decode = grouped
        try:
            attention = "grouped decode attention" if grouped else "model's sdpa decode attention (repeat_kv)"
            label = f"HFEngine static cache, {'compiled' if compile_ else 'eager'}, {attention} (T=1, log-probs)"
            if "fixed" in methods:
                # the compiled step is specialised to the cache shape, so it warms up at full length
                warm = None if compile_ else (lambda e=engine: e.generate(prompts.tolist(), short_params))
                secs = timed(lambda e=engine: e.generate(prompts.tolist(), params), device, repeats, warmup=warm)
                rows.append([label, f"{secs:.2f}", f"{tokens / secs:,.0f}", vs_plain(secs)])
                if compile_ and device.type == "cuda":
                    notes.append(f"{label}: " + decode_profile(engine, prompts.tolist(), params, steps=64))
            if (compile_, grouped) == variants[0] and "stop" in methods:
                secs, made = bench_stop_case_hf(engine, case, s, device, repeats)
                stop_rows.append(["HFEngine (as above)", f"{secs:.2f}", f"{made:,}", f"{made / secs:,.0f}"])
        except Exception as exc:  # report, keep benchmarking the rest
            rows.append([f"HFEngine compile={compile_} grouped={grouped}", "failed", repr(exc)[:120], ""])
        engine.close()
    if "batch" in methods:
        try:
            config_cb = GenerationConfig(max_new_tokens=s.new, do_sample=False, eos_token_id=None, pad_token_id=0)
            secs = timed(lambda: model.generate_batch(inputs=prompts.tolist(), generation_config=config_cb), device, repeats)
            rows.append(["transformers generate_batch (continuous batching)", f"{secs:.2f}", f"{tokens / secs:,.0f}", vs_plain(secs)])
        except Exception as exc:
            rows.append(["transformers generate_batch", "failed", repr(exc)[:120], ""])
    if "vllm" in methods and device.type == "cuda" and importlib.util.find_spec("vllm") is not None:
        keep = Path(tempfile.mkdtemp(prefix="engines-vllm-"))
        try:
            model.save_pretrained(keep)
            tokenizer.save_pretrained(keep)
            torch.cuda.empty_cache()
            if "fixed" in methods:  # the fresh processes first, while this one holds only the HF model
                alone = vllm_alone(keep, s, repeats, multiprocessing=True)
                serial = vllm_alone(keep, s, repeats, multiprocessing=False)
            secs, stop_secs, made = bench_vllm(prompts, case, s, repeats, methods, keep)
            if "fixed" in methods:
                rows.append([f"vLLM {importlib.metadata.version('vllm')} (LLM.generate, vLLM defaults: CUDA graphs, engine "
                             "core process; T=1, log-probs), in this process", f"{secs:.2f}", f"{tokens / secs:,.0f}",
                             vs_plain(secs)])
                rows.append(["vLLM alone in a fresh process (same settings)", f"{alone:.2f}", f"{tokens / alone:,.0f}",
                             vs_plain(alone)])
                rows.append(["vLLM alone, VLLM_ENABLE_V1_MULTIPROCESSING=0 (engine core in the caller's thread, as a "
                             "colocated trainer runs it)", f"{serial:.2f}", f"{tokens / serial:,.0f}", vs_plain(serial)])
                if abs(secs / alone - 1) > 0.10:
                    raise SystemExit(f"the vLLM peer row ({tokens / secs:,.0f} tok/s) differs from vLLM alone "
                                     f"({tokens / alone:,.0f} tok/s) by more than 10%: the peer is not at its best")
            if "stop" in methods:
                stop_rows.append(["vLLM (as above, continuous batching)", f"{stop_secs:.2f}", f"{made:,}", f"{made / stop_secs:,.0f}"])
        except SystemExit:
            raise
        except Exception as exc:
            rows.append(["vLLM", "failed", repr(exc)[:160], ""])
        finally:
            shutil.rmtree(keep, ignore_errors=True)
    bound = roofline(model, config, s, device)
    if bound is not None:
        rows.append(["decode roofline (docs/reference.md §5)", "", f"{bound:,.0f}", ""])
    if stop_rows:
        if len(stop_rows) == 2:
            hf_rate, vllm_rate = (float(str(r[3]).replace(",", "")) for r in stop_rows)
            stop_rows[0].append(f"{hf_rate / vllm_rate:.2f}x")
            stop_rows[1].append("1.00x")
        notes.append(
            f"Stop-token case ({len(case.prompts)} prompts x {s.prompt} tokens, at most {s.new} new, {len(case.stops)} "
            f"stop token ids so lengths are geometric with mean ~128, {s.batch} rows decoded together):\n\n"
            + markdown_table(["engine", "seconds", "tokens generated", "tokens/s", "vs vLLM"][: len(stop_rows[0])], stop_rows))
    peer = next((float(str(r[2]).replace(",", "")) for r in rows if str(r[0]).startswith("vLLM") and r[1] != "failed"), None)
    # the peer: vLLM with its defaults in this run (checked against vLLM alone above)
    for r in rows:  # the ratio that matters: to vLLM measured in this run
        rate = str(r[2]).replace(",", "")
        r.append(f"{float(rate) / peer:.2f}x" if peer and r[1] not in ("", "failed") else "")
    return rows


def vllm_llm(path: str, s: Sizes):
    """`vllm.LLM` on a saved checkpoint, with vLLM's defaults (CUDA graphs, prefix caching, the
    engine core in its own process unless VLLM_ENABLE_V1_MULTIPROCESSING=0 says otherwise)."""
    import vllm

    return vllm.LLM(model=path, dtype="bfloat16", gpu_memory_utilization=0.45, max_model_len=s.prompt + s.new + 16,
                    max_num_seqs=s.batch, seed=0, logprobs_mode="processed_logprobs")


def vllm_fixed_seconds(llm, prompts: list[list[int]], s: Sizes, repeats: int) -> float:
    """Median seconds for the batch, every row to full length (T=1, the sampled token's log-prob)."""
    import vllm

    requests = [{"prompt_token_ids": row} for row in prompts]
    params = vllm.SamplingParams(temperature=1.0, max_tokens=s.new, ignore_eos=True, logprobs=0, seed=0)
    outputs: list = []

    def run() -> None:
        outputs[:] = llm.generate(requests, params, use_tqdm=False)

    secs = timed(run, torch.device("cuda"), repeats)
    assert all(len(o.outputs[0].token_ids) == s.new for o in outputs)
    return secs


def bench_vllm(prompts: torch.Tensor, case: StopCase, s: Sizes, repeats: int, methods: set[str],
               keep: Path) -> tuple[float, float, int]:
    """The same weights (saved in `keep`) through `vllm.LLM` in this process: median seconds for
    the batch, and median seconds and tokens generated for the stop-token case (nan / 0 where not
    in `methods`)."""
    import vllm

    llm = vllm_llm(str(keep), s)
    secs, stop_secs, made = float("nan"), float("nan"), 0
    if "fixed" in methods:
        secs = vllm_fixed_seconds(llm, prompts.tolist(), s, repeats)
    stop_requests = [{"prompt_token_ids": row} for row in case.prompts]
    stop_params = vllm.SamplingParams(temperature=1.0, max_tokens=s.new, stop_token_ids=case.stops, logprobs=0, seed=0)
    outputs: list = []

    def run_stop() -> None:
        outputs[:] = llm.generate(stop_requests, stop_params, use_tqdm=False)

    if "stop" in methods:
        stop_secs = timed(run_stop, torch.device("cuda"), repeats)
        made = sum(len(o.outputs[0].token_ids) for o in outputs)
    return secs, stop_secs, made


def vllm_alone(keep: Path, s: Sizes, repeats: int, *, multiprocessing: bool) -> float:
    """Median seconds of the fixed-length batch with vLLM alone in a fresh process (no HF model,
    no compiled engine beside it): the peer as its users run it."""
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1" if multiprocessing else "0"}
    return seconds_from_fresh_process([sys.executable, __file__, "--vllm-alone", str(keep), "--repeats", str(repeats)],
                                      ALONE_MARK, env=env)


def vllm_alone_main(path: str, repeats: int) -> None:
    """`--vllm-alone PATH`: time the fixed batch on the checkpoint at PATH, print JSON seconds."""
    tokenizer = AutoTokenizer.from_pretrained(path)
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(10, len(tokenizer), (FULL.batch, FULL.prompt), generator=gen)  # [B, T] as the parent's
    llm = vllm_llm(path, FULL)
    print(ALONE_MARK + json.dumps({"seconds": vllm_fixed_seconds(llm, prompts.tolist(), FULL, repeats)}), flush=True)


def baseline_scores(model, prompts: list[list[int]], candidates: list[int], device, batch: int) -> torch.Tensor:
    """Score every full prompt independently: left-padded batches, last-position logits."""
    out = []
    cand = torch.tensor(candidates, device=device)
    with torch.inference_mode():
        for start in range(0, len(prompts), batch):
            chunk = prompts[start : start + batch]
            width = max(len(p) for p in chunk)
            ids = torch.zeros(len(chunk), width, dtype=torch.long)  # [b, W]
            mask = torch.zeros(len(chunk), width, dtype=torch.long)  # [b, W]
            for i, p in enumerate(chunk):
                ids[i, width - len(p) :], mask[i, width - len(p) :] = torch.tensor(p), 1
            ids, mask = ids.to(device), mask.to(device)
            positions = (mask.cumsum(-1) - 1).clamp(min=0)  # [b, W]
            logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, logits_to_keep=1).logits[:, -1]
            out.append(torch.log_softmax(logits.float(), -1)[:, cand].cpu())  # [b, C]
    return torch.cat(out)


def make_scoring_data(tokenizer, s: Sizes) -> tuple[list[list[int]], list[list[list[int]]], list[int]]:
    """Random captions (~caption_len +- 20 tokens) with `questions` random questions each
    (~question_len +- 10 tokens), and the candidate token ids."""
    gen = torch.Generator().manual_seed(1)
    vocab = len(tokenizer)
    captions = [torch.randint(10, vocab, (s.caption_len + int(torch.randint(-20, 21, (1,), generator=gen)),), generator=gen).tolist() for _ in range(s.captions)]
    questions = [[torch.randint(10, vocab, (max(1, s.question_len + int(torch.randint(-10, 11, (1,), generator=gen))),), generator=gen).tolist()
                  for _ in range(s.questions)] for _ in range(s.captions)]
    return captions, questions, list(range(100, 100 + s.candidates))


def fp32_reference(model, prompts: list[list[int]], candidates: list[int], device) -> torch.Tensor:
    """Log-probs `[n, C]` of a few prompts, each alone and unpadded, with the weights in float32
    (bf16 -> fp32 -> bf16 is exact, so the model is restored bit for bit)."""
    dtype = model.dtype
    model.float()
    try:
        with torch.inference_mode():
            rows = [model(input_ids=torch.tensor([p], device=device), logits_to_keep=1).logits[0, -1] for p in prompts]  # [V] each
            return torch.log_softmax(torch.stack(rows).float(), -1)[:, candidates].cpu()  # [n, C]
    finally:
        model.to(dtype)


def bench_scoring(model, tokenizer, s: Sizes, device, repeats: int, budgets: list[int]) -> list[list[object]]:
    captions, questions, candidates = make_scoring_data(tokenizer, s)
    items = list(zip(captions, questions, strict=True))
    full = [c + q for c, qs in items for q in qs]
    n_ref = min(len(full), 2 * s.questions)  # fp32 reference rows: the first two captions
    ref32 = fp32_reference(model, full[:n_ref], candidates, device)
    out: dict[str, torch.Tensor] = {}

    def independent() -> None:
        out["independent"] = baseline_scores(model, full, candidates, device, batch=32)

    base_s = timed(independent, device, repeats)
    base = out["independent"]
    rows: list[list[object]] = []

    def row(label: str, secs: float, scores: torch.Tensor) -> None:
        vs_base = (scores - base).abs().max().item()
        vs_32 = (scores[:n_ref] - ref32).abs().max().item()
        rows.append([label, f"{secs:.2f}", f"{len(full) / secs:,.1f}", f"{base_s / secs:.2f}x", f"{vs_base:.2e}", f"{vs_32:.2e}"])

    row("independent full prompts (batched 32, logits_to_keep=1)", base_s, base)
    engine = HFEngine(model, tokenizer, device=device)  # compiled layers for flex scoring on CUDA

    def per_caption() -> None:
        out["per_caption"] = torch.cat([engine.score_next_tokens(c, q, candidates) for c, q in items])

    row(f"score_next_tokens, one call per caption ({engine.score_attention})", timed(per_caption, device, repeats),
        out["per_caption"])
    for attention in ["flex", "mask"] if device.type == "cuda" else ["mask", "flex"]:
        engine.score_attention = attention
        for budget in budgets:
            engine.score_token_budget = budget

            def batched() -> None:
                out["batched"] = torch.cat(engine.score_next_tokens_batch(items, candidates))

            secs = timed(batched, device, repeats)
            how = ("flex_attention, rows end to end" if attention == "flex" else "dense 4-D mask, rows padded side by side")
            row(f"score_next_tokens_batch, all captions, {how}, {budget:,} tokens/forward", secs, out["batched"])
    engine.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shape on CPU; no RESULTS.md")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--only", choices=["generation", "scoring"], default=None, help="run one part only")
    parser.add_argument("--methods", default="plain,hf,hf-variants,batch,vllm,fixed,stop",
                        help="generation rows to run, comma-separated: plain, hf (the engine as shipped), hf-variants "
                             "(compiled with the model's sdpa decode attention, and eager), batch, vllm; and the "
                             "workloads of hf and vllm: fixed (every row to full length), stop (the stop-token case)")
    parser.add_argument("--vllm-alone", metavar="PATH", help=argparse.SUPPRESS)  # the fresh-process peer row
    args = parser.parse_args()
    if args.vllm_alone:
        vllm_alone_main(args.vllm_alone, args.repeats or 1)
        return
    sizes = SMOKE if args.smoke else FULL
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    dtype = torch.float32 if args.smoke else torch.bfloat16
    repeats = args.repeats or 1
    tokenizer = AutoTokenizer.from_pretrained(tiny.build("qwen3"))
    config = model_config(args.smoke, vocab=len(tokenizer))
    model = build_model(config, device, dtype)
    shape = "tiny (smoke)" if args.smoke else "Qwen3-4B shape, random weights, bf16"
    tables = []
    if args.only in (None, "generation"):
        title = f"rl-rollout engines: generation, {sizes.batch} prompts x {sizes.prompt} in, {sizes.new} out ({shape})"
        header = ["method", "seconds", "tokens/s", "vs plain generate", "vs vLLM"]
        notes: list[str] = []
        rows = bench_generation(model, tokenizer, config, sizes, device, repeats, set(args.methods.split(",")), notes)
        tables.append((title, header, rows, "\n\n".join(["Goals: HFEngine >= 3x plain generate, >= 0.75x vLLM.", *notes])))
    if args.only in (None, "scoring"):
        title = (f"rl-rollout engines: scoring, {sizes.captions} captions x ~{sizes.caption_len} tokens x "
                 f"{sizes.questions} questions x ~{sizes.question_len} tokens, {sizes.candidates} candidates ({shape})")
        header = ["method", "seconds", "prompts/s", "speed-up", "max abs Δ logprob vs independent",
                  f"max abs Δ logprob vs fp32, first {2 * sizes.questions} prompts"]
        budgets = [64, 16384] if args.smoke else [16384, 65536]
        rows = bench_scoring(model, tokenizer, sizes, device, repeats, budgets)
        notes = ("Goal: >= 5x fewer seconds with prefix reuse. The fp32 column compares with each prompt "
                 "alone, unpadded, with the same weights in float32 (bf16 rounding of every method).")
        tables.append((title, header, rows, notes))
    for title, header, rows, notes in tables:
        if args.smoke:
            print(f"{title}\n{markdown_table(header, rows)}\n\n{notes}\n")
        else:
            append_results(title, header, rows, notes=notes)  # prints the table too


if __name__ == "__main__":
    main()
