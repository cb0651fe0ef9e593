"""caption-rl throughput: the app's own loop on a random-weight policy at Qwen3-VL-2B shape.

    uv run --package caption-rl python benchmarks/caption_rl.py            # one H100/H200
    uv run --package caption-rl python benchmarks/caption_rl.py --smoke    # tiny, CPU, seconds

32 images x n=8 captions of 256 tokens per step, in-process rule reward (timestamp format +
length: apps/caption-rl/configs/rule_reward.toml), full fine-tuning in bf16. Reports verl's
throughput (prompt + response tokens per step / step seconds / GPUs), seconds per phase
(generate, reward, logprob, update) and peak GPU memory, averaged over the steps after the
first (warm-up). When TRL is importable, `trl.GRPOTrainer` runs the same model, images, group
size, lengths and reward in the same process for the ratio; TRL is not a dependency of this
workspace, so install it into the benchmark environment to get that row.
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
APP = REPO / "apps" / "caption-rl"
sys.path.insert(0, str(APP))
sys.path.insert(0, str(REPO))

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


def run_app(policy: Path, out: Path, *, smoke: bool, steps: int) -> dict[str, float]:
    from caption_parts import load_records

    app = _load_app()
    images = REPO / "examples" / "data" / "caption_qa_images.jsonl"
    prompts, n, tokens = (4, 2, 16) if smoke else (32, 8, 256)
    assert len(load_records([str(images)], [], eval_size=0, task="auto", seed=0).train) == 16
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    run = app.main([
        f"model.path={policy}", "model.dtype=bfloat16", "model.gradient_checkpointing=true",
        f"data.train=[\"{images}\"]", "data.max_pixels=200704",
        f"rollout.n={n}", f"rollout.max_new_tokens={tokens}", f"rollout.max_batch_size={prompts * n}",
        f"reward.spec={APP / 'configs' / 'rule_reward.toml'}", "reward.length_tokenizer=whitespace",
        f"train.batch_size={prompts}", f"train.micro_batch_size={4 if smoke else 16}", f"train.max_steps={steps}",
        "train.epochs=100", "train.eval_freq=0", "train.save_freq=1000000", "train.export=false",
        f"train.output_dir={out}", "algo.replay_tolerance=0.5",
    ])
    with (run / "metrics.csv").open() as f:
        rows = list(csv.DictReader(f))[1:]  # drop the warm-up step
    mean = lambda key: statistics.fmean(float(r[key]) for r in rows)  # noqa: E731
    figures = {key: mean(key) for key in ("throughput/tokens_per_s", "time/step", "time/generate", "time/reward",
                                          "time/logprob", "time/update", "response/length_mean")}
    figures["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else float("nan")
    return figures


def _load_app():
    import importlib.util

    spec = importlib.util.spec_from_file_location("caption_rl_app", APP / "__main__.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def run_trl(policy: Path, *, smoke: bool, steps: int) -> dict[str, float] | None:
    """TRL's GRPOTrainer on the same model, images, group size, lengths and rule reward; None
    when TRL is not installed. Not run in this workspace's CI (TRL is not a dependency)."""
    try:
        import trl
    except ImportError:
        return None
    from datasets import Dataset
    from transformers import AutoModelForImageTextToText, AutoProcessor, TrainerCallback

    from rl_data import load_image, read_caption_qa
    from rl_rewards import build_reward
    from rl_rewards.adapters import as_trl_reward

    prompts, n, tokens = (4, 2, 16) if smoke else (32, 8, 256)
    records = list(read_caption_qa(REPO / "examples" / "data" / "caption_qa_images.jsonl"))
    rows = [{"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Please describe this image in detail."}]}],
             "image": load_image(r.images[0])} for r in (records * 2)[:prompts]]
    reward = as_trl_reward(build_reward(APP / "configs" / "rule_reward.toml"))
    args = trl.GRPOConfig(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=prompts * n, num_generations=n,
                          max_completion_length=tokens, max_steps=steps, learning_rate=1e-5, bf16=torch.cuda.is_available(),
                          gradient_checkpointing=True, logging_steps=1, report_to=[], save_strategy="no",
                          temperature=1.0, beta=0.0)
    model = AutoModelForImageTextToText.from_pretrained(policy, dtype=torch.bfloat16)
    trainer = trl.GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=Dataset.from_list(rows),
                              processing_class=AutoProcessor.from_pretrained(policy))
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    times: list[float] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, *args, **kwargs):
            self.began = time.perf_counter()

        def on_step_end(self, *args, **kwargs):
            times.append(time.perf_counter() - self.began)

    trainer.add_callback(Timer())
    trainer.train()
    return {"time/step": statistics.fmean(times[1:]) if len(times) > 1 else times[0],
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else float("nan")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU; prints, appends nothing")
    parser.add_argument("--steps", type=int, default=None, help="training steps (first is warm-up)")
    args = parser.parse_args()
    steps = args.steps or (2 if args.smoke else 4)
    with tempfile.TemporaryDirectory() as tmp:
        policy = build_policy(Path(tmp) / "policy", args.smoke)
        ours = run_app(policy, Path(tmp) / "runs", smoke=args.smoke, steps=steps)
        trl_figures = run_trl(policy, smoke=args.smoke, steps=steps)
    header = ["trainer", "tokens/s", "s/step", "generate s", "reward s", "logprob s", "update s", "peak GiB"]
    table = [["caption-rl", f"{ours['throughput/tokens_per_s']:.0f}", f"{ours['time/step']:.2f}",
              f"{ours['time/generate']:.2f}", f"{ours['time/reward']:.3f}", f"{ours['time/logprob']:.2f}",
              f"{ours['time/update']:.2f}", f"{ours['peak_gib']:.1f}"]]
    notes = ("Policy: random weights at Qwen3-VL-2B shape (vocab 151,936), bf16, full fine-tuning with gradient "
             "checkpointing; 32 images x 8 captions x 256 tokens per step, rule reward; mean over the steps after "
             "the first. tokens/s is verl's: (prompt + response tokens) / step seconds / GPUs.")
    if trl_figures is None:
        notes += " TRL not installed in this environment: no GRPOTrainer row (install trl to measure the ratio)."
    else:
        tokens_per_step = ours["throughput/tokens_per_s"] * ours["time/step"]  # same data, lengths, one GPU
        table.append(["trl GRPOTrainer", f"{tokens_per_step / trl_figures['time/step']:.0f}",
                      f"{trl_figures['time/step']:.2f}", "", "", "", "", f"{trl_figures['peak_gib']:.1f}"])
        notes += f" Step-time ratio TRL/caption-rl: {trl_figures['time/step'] / ours['time/step']:.2f}x."
    if args.smoke:
        from benchmarks.results import markdown_table

        print(markdown_table(header, table))
        print(notes)
        return
    from benchmarks.results import append_results

    append_results("caption-rl: RL step throughput at Qwen3-VL-2B shape", header, table, notes)


if __name__ == "__main__":
    main()
