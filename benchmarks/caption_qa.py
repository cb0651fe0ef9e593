"""caption_qa throughput: the `exact` estimator vs CapRL-style `sample`, same engine, same run.

Workload (issue 5): 128 captions of ~800 judge tokens, 8 questions each (4 options + "cannot
answer"), judge with random weights at Qwen3-4B's published shape (`rl_models.shapes`, built in
GPU memory, no download; the tiny trained Qwen tokenizer, whose " A".." I" are single tokens).

- `exact`: every question once, one `HFEngine.score_next_tokens` call per caption (system prompt +
  few-shot examples + caption prefilled once, the 8 questions as suffixes).
- `sample` (CapRL++): qa_num=8 draws per caption, one prompt per draw, sampled decode of up to
  10 tokens (temperature 0.6) through `HFEngine.generate` — with random weights no draw stops
  early, so every draw decodes all 10 tokens, as CapRL's worst case.

Both run once untimed first on the same captions (CUDA graph capture / compile for the decode
step and for each packed scoring length, allocator warm-up), then timed. Goal: exact >= 8x the captions/s of sample.

With vLLM importable on a GPU (`--engines hf,vllm`, the default there), the same judge weights are
saved and served by a `VLLMEngine` too (prefix caching on, as CapRL++ runs it), and both
estimators run on it: `sample` on vLLM *is* CapRL++'s reward setup, so every row's ratio is also
given against it. `exact` on vLLM sends one request per caption+question (the caption prefix is
cached across its questions) decoding one token restricted to the option letters.
Goals (issue 35): exact (vLLM) >= 3x and exact (hf) >= 2x CapRL++'s setup, in one run.

The peer runs at vLLM's defaults: its engine core in a process of its own (the benchmark used to
set VLLM_ENABLE_V1_MULTIPROCESSING=0, which runs it in the caller's thread and slowed vLLM by
0.78x in benchmarks/engines.py on an H200). It is checked as engines.py checks its peer: CapRL++'s
setup is timed again with vLLM alone in a fresh process (no HF model, no compiled engine beside
it), and the run exits with an error, without writing RESULTS.md, when the two differ by more
than 10%.

    python benchmarks/caption_qa.py            # GPU, appends to RESULTS.md
    python benchmarks/caption_qa.py --smoke    # tiny judge on CPU, seconds, prints only
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.results import append_results, markdown_table, seconds_from_fresh_process

ALONE_MARK = "caption-qa-vllm-alone: "  # the fresh-process peer's result line on stdout (vLLM logs there too)
PEER_TOLERANCE = 0.10  # the peer in this run may differ from vLLM alone by this much
# the VLLMEngine of both vLLM runs (in this process and alone): vLLM's defaults otherwise, the
# engine core in its own process included; 0.45 leaves the hf judge its share of the GPU
VLLM_SETTINGS = {"dtype": "bfloat16", "gpu_memory_utilization": 0.45, "max_model_len": 4096, "seed": 0}

WORDS = ["man", "woman", "child", "dog", "cat", "car", "street", "tree", "house", "window", "door", "table", "chair", "red", "blue", "green", "yellow", "small", "large", "walks", "runs", "sits", "opens", "holds", "looks", "turns", "picks", "places", "the", "a", "of", "in", "on", "with", "near", "behind", "under", "slowly", "quickly", "kitchen", "garden", "river", "bridge", "camera", "light", "shadow", "bottle", "plate", "phone", "screen", "book", "bag", "hat", "coat", "shelf"]


def make_samples(tokenizer, n_captions: int, caption_tokens: int, n_questions: int, seed: int = 0):
    from rl_rewards.samples import Sample

    rng = random.Random(seed)
    samples = []
    for _ in range(n_captions):
        text = " ".join(rng.choice(WORDS) for _ in range(caption_tokens))
        ids = tokenizer(text, add_special_tokens=False)["input_ids"][:caption_tokens]
        caption = tokenizer.decode(ids)
        qa = [
            {
                "question": f"What does the {rng.choice(WORDS)} do near the {rng.choice(WORDS)}?",
                "choices": [" ".join(rng.choice(WORDS) for _ in range(3)) for _ in range(4)],
                "answer": rng.choice("ABCD"),
            }
            for _ in range(n_questions)
        ]
        samples.append(Sample(completion=caption, reference=qa))
    return samples


def vllm_judge(path: Path):
    """A `VLLMEngine` (bf16, prefix caching, vLLM's default engine-core process) on the judge
    saved at `path`. In the main run CUDA is initialised already (the hf judge), so vLLM starts
    that process by spawn, which re-imports this script: its work stays under the `__main__` guard."""
    from rl_rollout.vllm import VLLMEngine

    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") != "1":
        raise SystemExit("VLLM_ENABLE_V1_MULTIPROCESSING is set to something other than 1: unset it, the peer runs at "
                         "vLLM's defaults")
    return VLLMEngine(str(path), **VLLM_SETTINGS)


def sample_scorer(judge, tokenizer, qa_num: int):
    """CapRL++'s estimator: `qa_num` sampled answers per caption, up to 10 tokens at T=0.6."""
    from rl_rewards.scorers.caption_qa import CaptionQAScorer

    return CaptionQAScorer(judge, tokenizer, estimator="sample", qa_num=qa_num, max_new_tokens=10, seed=0)


def vllm_alone(path: Path, args: argparse.Namespace) -> float:
    """Seconds of CapRL++'s setup (`sample` on vLLM) on the same captions with vLLM alone in a
    fresh process: the peer as its users run it."""
    cmd = [sys.executable, __file__, "--vllm-alone", str(path), "--captions", str(args.captions),
           "--caption-tokens", str(args.caption_tokens), "--questions", str(args.questions), "--qa-num", str(args.qa_num)]
    return seconds_from_fresh_process(cmd, ALONE_MARK)


def vllm_alone_main(args: argparse.Namespace) -> None:
    """`--vllm-alone PATH`: CapRL++'s setup on the judge at PATH, warmed up on the whole set, then
    timed; prints its seconds as JSON after ALONE_MARK."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.vllm_alone)
    samples = make_samples(tokenizer, args.captions, args.caption_tokens, args.questions)  # the parent's captions
    scorer = sample_scorer(vllm_judge(Path(args.vllm_alone)), tokenizer, args.qa_num)
    scorer.score(samples)
    secs, results = timed(scorer, samples, "cpu")  # LLM.generate returns finished outputs: no CUDA sync (or context) here
    failed = [r.error for r in results if r.error is not None]
    if failed:
        raise SystemExit(f"vLLM alone: {len(failed)} samples failed, first: {failed[0]}")
    print(ALONE_MARK + json.dumps({"seconds": secs}), flush=True)


def load_judge(smoke: bool, device: str):
    """(engine, tokenizer): the tiny qwen3 for --smoke, else random weights at Qwen3-4B shape."""
    from rl_rollout.hf import HFEngine

    if smoke:
        from rl_models.tiny import build

        engine = HFEngine.from_pretrained(build("qwen3"), device=device, max_batch_size=256)
        return engine, engine.tokenizer
    from transformers import Qwen3ForCausalLM

    from rl_models.shapes import qwen3_config
    from rl_models.tokenization import build_qwen_tokenizer

    tokenizer = build_qwen_tokenizer()
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3ForCausalLM(qwen3_config("4b")).to(torch.bfloat16)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    # 128 rows: with a sleeping vLLM engine beside it (~10 GiB kept), 256 rows of ~1,700-token
    # sampling prompts do not fit the static KV cache on an 80 GB GPU
    return HFEngine(model, tokenizer, device=device, max_batch_size=128), tokenizer


class count_decoder_tokens:
    """Counts the tokens each forward feeds the judge's decoder (padding included), until removed."""

    def __init__(self, engine) -> None:
        self.tokens = 0
        self.hook = engine.model.get_decoder().register_forward_pre_hook(self._count, with_kwargs=True)

    def _count(self, _module, _args, kwargs) -> None:
        self.tokens += kwargs["input_ids"].numel()

    def remove(self) -> None:
        self.hook.remove()


def non_embedding_params(model) -> int:
    embed = model.get_input_embeddings().weight
    return sum(p.numel() for p in model.parameters() if p is not embed)


def timed(scorer, samples, device: str) -> tuple[float, list]:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    start = time.perf_counter()
    results = scorer.score(samples)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - start, results


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny judge on CPU, small sizes, no RESULTS.md")
    parser.add_argument("--captions", type=int, default=128)
    parser.add_argument("--caption-tokens", type=int, default=800)
    parser.add_argument("--questions", type=int, default=8)
    parser.add_argument("--qa-num", type=int, default=8)
    parser.add_argument("--hf-sample", action=argparse.BooleanOptionalAction, default=None,
                        help="also time CapRL-style sampling on the hf engine (not one of the goals; default: with --smoke "
                             "only, it takes ~2 minutes on an H100)")
    parser.add_argument("--engines", default=None, help="hf or hf,vllm (default: hf,vllm where vLLM and a GPU are there)")
    parser.add_argument("--vllm-alone", metavar="PATH", help=argparse.SUPPRESS)  # the fresh-process peer
    args = parser.parse_args()
    if args.smoke:
        args.captions, args.caption_tokens, args.questions, args.qa_num = 4, 60, 3, 3
    if args.hf_sample is None:
        args.hf_sample = args.smoke
    return args


def run_judges(engines: dict, tokenizer, samples: list, args: argparse.Namespace, device: str):
    """Warm-up, then timed `exact` (and `sample`) on each judge: (seconds per (engine, estimator),
    hf's achieved TFLOP/s, exact rewards per engine). vLLM first, then asleep, so the hf runs'
    buffers have the GPU."""
    from rl_rewards.scorers.caption_qa import CaptionQAScorer

    times: dict[tuple[str, str], float] = {}
    tflops: dict[str, float] = {}
    exact_scores: dict[str, list[float]] = {}
    for name, judge in engines.items():
        exact = CaptionQAScorer(judge, tokenizer, estimator="exact")
        sample = sample_scorer(judge, tokenizer, args.qa_num)
        run_sample = name == "vllm" or args.hf_sample
        exact.score(samples)  # the whole set: every packed forward length has its compiled kernel before timing
        if run_sample:
            sample.score(samples)
        fed = count_decoder_tokens(judge) if name == "hf" else None
        times[name, "exact"], r_exact = timed(exact, samples, device)
        print(f"{name} exact: {times[name, 'exact']:.2f} s for {len(samples)} captions", flush=True)
        if fed is not None:
            fed.remove()
            tflops[name] = 2 * non_embedding_params(judge.model) * fed.tokens / times[name, "exact"] / 1e12
            print(f"hf exact: {fed.tokens} tokens through the judge ({fed.tokens / len(samples):.0f} per caption), "
                  f"{tflops[name]:.0f} TFLOP/s (2 x non-embedding parameters x tokens)", flush=True)
        r_sample = []
        if run_sample:
            times[name, "sample"], r_sample = timed(sample, samples, device)
            print(f"{name} sample: {times[name, 'sample']:.2f} s for {len(samples)} captions", flush=True)
        failed = [r.error for r in r_exact + r_sample if r.error is not None]
        if failed:
            raise SystemExit(f"{name}: {len(failed)} samples failed, first: {failed[0]}")
        exact_scores[name] = [float(r.score) for r in r_exact]
        if name == "vllm":
            judge.sleep()  # weights to host memory, KV cache freed
            torch.cuda.empty_cache()
    return times, tflops, exact_scores


def main() -> None:
    args = parse_args()
    if args.vllm_alone:
        vllm_alone_main(args)
        return
    device = "cpu" if args.smoke or not torch.cuda.is_available() else "cuda"
    if args.engines is None:
        import importlib.util

        args.engines = "hf,vllm" if device == "cuda" and importlib.util.find_spec("vllm") else "hf"
    engine, tokenizer = load_judge(args.smoke, device)
    samples = make_samples(tokenizer, args.captions, args.caption_tokens, args.questions)
    engines = {"hf": engine}
    alone = None
    tmp = tempfile.TemporaryDirectory()
    if "vllm" in args.engines.split(","):
        engine.model.save_pretrained(tmp.name)
        tokenizer.save_pretrained(tmp.name)
        torch.cuda.empty_cache()
        alone = vllm_alone(Path(tmp.name), args)  # first, while this process holds only the hf judge
        print(f"CapRL++'s setup, vLLM alone in a fresh process: {alone:.2f} s for {len(samples)} captions", flush=True)
        engines = {"vllm": vllm_judge(Path(tmp.name)), "hf": engine}
    times, tflops, exact_scores = run_judges(engines, tokenizer, samples, args, device)
    report(args, engine, tokenizer, samples, times, tflops, exact_scores, alone)
    tmp.cleanup()


def report(args, engine, tokenizer, samples, times, tflops, exact_scores, alone: float | None) -> None:
    """The table (ratios against CapRL++'s setup measured in this run), the goals' ratios, and the
    peer check: beyond PEER_TOLERANCE from vLLM alone, exit with an error and write no RESULTS.md."""
    from rl_rewards.scorers.caption_qa import CaptionQAScorer

    drift = (max(abs(a - b) for a, b in zip(exact_scores["hf"], exact_scores["vllm"], strict=True))
             if "vllm" in exact_scores else 0.0)
    prompt_tokens = len(CaptionQAScorer(engine, tokenizer).prompter.ids(samples[0].completion, "q"))
    base = next(key for key in [("vllm", "sample"), ("hf", "sample"), ("hf", "exact")] if key in times)
    rate = {key: len(samples) / secs for key, secs in times.items()}
    header = ["estimator", "engine", "judge calls", "seconds", "captions/s", f"vs {base[1]} ({base[0]})"]
    label = {"sample": "sample (CapRL: qa_num draws, 10 sampled tokens)", "exact": "exact (letter probabilities)"}
    calls = {"sample": f"generate x{len(samples) * args.qa_num}", "exact": f"{len(samples) * args.questions} prefix+question scorings"}
    rows = [[label[est] + (" = CapRL++'s setup" if (name, est) == ("vllm", "sample") else ""), name, calls[est],
             f"{times[name, est]:.2f}", f"{rate[name, est]:.2f}", f"{rate[name, est] / rate[base]:.2f}x"]
            for name in exact_scores for est in ("sample", "exact") if (name, est) in times]
    if alone is not None:
        rows.append(["CapRL++'s setup, vLLM alone in a fresh process (peer check)", "vllm", calls["sample"],
                     f"{alone:.2f}", f"{len(samples) / alone:.2f}", f"{len(samples) / alone / rate[base]:.2f}x"])
    notes = (
        f"{len(samples)} captions x {args.questions} questions (4 options + cannot-answer), caption "
        f"{args.caption_tokens} tokens, full judge prompt ~{prompt_tokens} tokens; qa_num={args.qa_num}; "
        f"judge: {'tiny qwen3 (smoke)' if args.smoke else 'Qwen3-4B shape, random bf16 weights'}; "
        "hf: one HFEngine (max_batch_size 128); vllm: the same weights in a VLLMEngine at vLLM's defaults (engine "
        "core in its own process; prefix caching, gpu_memory_utilization 0.45, run first, then put to sleep), beside "
        "the hf judge in this process. Goals (issue 35): exact (vLLM) >= 3x and exact (hf) >= 2x CapRL++'s setup "
        "(sample on vLLM)."
    )
    if "hf" in tflops:
        layers = "compiled" if engine.compile and not engine._scoring_compile_failed else "eager"
        notes += (f" hf exact ({engine.score_attention} attention, {layers} decoder layers, score_token_budget "
                  f"{engine.score_token_budget}): {tflops['hf']:.0f} TFLOP/s achieved (2 x non-embedding parameters x tokens fed to the judge).")
    if "vllm" in exact_scores:
        notes += f" exact on vLLM vs on hf, every caption: max |reward difference| {drift:.4f} (bf16 kernels)."
    if base == ("vllm", "sample"):
        notes += (f" Ratios to CapRL++'s setup: exact (vLLM) {rate['vllm', 'exact'] / rate[base]:.2f}x (goal 3x), "
                  f"exact (hf) {rate['hf', 'exact'] / rate[base]:.2f}x (goal 2x).")
    peer_off = alone is not None and abs(times["vllm", "sample"] / alone - 1) > PEER_TOLERANCE
    if args.smoke or peer_off:
        print(markdown_table(header, rows))
        print(notes)
    else:
        append_results("caption_qa: exact vs CapRL-style sample, on hf and on vLLM", header, rows, notes)
    if peer_off:
        raise SystemExit(f"CapRL++'s setup in this run ({times['vllm', 'sample']:.2f} s) differs from vLLM alone in a "
                         f"fresh process ({alone:.2f} s) by more than {PEER_TOLERANCE:.0%}: the peer is not at its best; "
                         "RESULTS.md not written")


if __name__ == "__main__":
    main()
