"""caption_qa throughput: the `exact` estimator vs CapRL-style `sample`, same engine, same run.

Workload (issue 5): 128 captions of ~800 judge tokens, 8 questions each (4 options + "cannot
answer"), judge with random weights at Qwen3-4B's published shape (`rl_models.shapes`, built in
GPU memory, no download; the tiny trained Qwen tokenizer, whose " A".." I" are single tokens).

- `exact`: every question once, one `HFEngine.score_next_tokens` call per caption (system prompt +
  few-shot examples + caption prefilled once, the 8 questions as suffixes).
- `sample` (CapRL++): qa_num=8 draws per caption, one prompt per draw, sampled decode of up to
  10 tokens (temperature 0.6) through `HFEngine.generate` — with random weights no draw stops
  early, so every draw decodes all 10 tokens, as CapRL's worst case.

Both run once untimed first (CUDA graph capture / compile for the decode step, allocator
warm-up), then timed. Goal: exact >= 8x the captions/s of sample.

    python benchmarks/caption_qa.py            # GPU, appends to RESULTS.md
    python benchmarks/caption_qa.py --smoke    # tiny judge on CPU, seconds, prints only
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.results import append_results, markdown_table

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
    return HFEngine(model, tokenizer, device=device, max_batch_size=256), tokenizer


def timed(scorer, samples, device: str) -> tuple[float, list]:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    start = time.perf_counter()
    results = scorer.score(samples)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - start, results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny judge on CPU, small sizes, no RESULTS.md")
    parser.add_argument("--captions", type=int, default=128)
    parser.add_argument("--caption-tokens", type=int, default=800)
    parser.add_argument("--questions", type=int, default=8)
    parser.add_argument("--qa-num", type=int, default=8)
    args = parser.parse_args()
    if args.smoke:
        args.captions, args.caption_tokens, args.questions, args.qa_num = 4, 60, 3, 3
    device = "cpu" if args.smoke or not torch.cuda.is_available() else "cuda"

    from rl_rewards.scorers.caption_qa import CaptionQAScorer

    engine, tokenizer = load_judge(args.smoke, device)
    samples = make_samples(tokenizer, args.captions, args.caption_tokens, args.questions)
    exact = CaptionQAScorer(engine, tokenizer, estimator="exact")
    sample = CaptionQAScorer(engine, tokenizer, estimator="sample", qa_num=args.qa_num, max_new_tokens=10, seed=0)
    warm = samples[: max(2, len(samples) // 8)]
    exact.score(warm)
    sample.score(warm)
    t_exact, r_exact = timed(exact, samples, device)
    t_sample, r_sample = timed(sample, samples, device)
    failed = [r.error for r in r_exact + r_sample if r.error is not None]
    if failed:
        raise SystemExit(f"{len(failed)} samples failed, first: {failed[0]}")

    prompt_tokens = len(exact.prompter.ids(samples[0].completion, "q"))
    rate_exact, rate_sample = len(samples) / t_exact, len(samples) / t_sample
    header = ["estimator", "judge calls", "seconds", "captions/s", "vs sample"]
    rows = [
        ["sample (CapRL: qa_num draws, 10 sampled tokens)", f"generate x{len(samples) * args.qa_num}",
         f"{t_sample:.2f}", f"{rate_sample:.2f}", "1.00x"],
        ["exact (shared-prefix letter probabilities)", f"score_next_tokens x{len(samples)}",
         f"{t_exact:.2f}", f"{rate_exact:.2f}", f"{rate_exact / rate_sample:.2f}x"],
    ]
    notes = (
        f"{len(samples)} captions x {args.questions} questions (4 options + cannot-answer), caption "
        f"{args.caption_tokens} tokens, full judge prompt ~{prompt_tokens} tokens; qa_num={args.qa_num}; "
        f"judge: {'tiny qwen3 (smoke)' if args.smoke else 'Qwen3-4B shape, random bf16 weights'}; "
        "one HFEngine (max_batch_size 256) for both. Goal: exact >= 8x."
    )
    if args.smoke:
        print(markdown_table(header, rows))
        print(notes)
    else:
        append_results("caption_qa: exact vs CapRL-style sample", header, rows, notes)


if __name__ == "__main__":
    main()
