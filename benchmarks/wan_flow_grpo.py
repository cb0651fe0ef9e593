"""Wan 2.1 T2V-1.3B shape: WanEngine's SDE rollout vs the plain diffusers WanPipeline, and one
Flow-GRPO epoch of 8 videos.

    PYTHONPATH=packages/rl-core/src:packages/rl-models/src:packages/rl-rollout/src \
        python benchmarks/wan_flow_grpo.py                 # one H200: (a), (b), the RESULTS.md section
    python benchmarks/wan_flow_grpo.py --part rollout --cache /tmp/wanbench --model-dir /tmp/wan13
    python benchmarks/wan_flow_grpo.py --part epoch --cache /tmp/wanbench --model-dir /tmp/wan13
                                                           # the same in two commands on one machine
    python benchmarks/wan_flow_grpo.py --smoke             # tiny:wan on the CPU, no RESULTS.md

Model: Wan 2.1 T2V-1.3B's transformer (30 blocks, 1536 wide, 1.42B) and VAE (z_dim 16) at full
shape with random weights, bf16 (`rl_models.shapes.build_shape("wan", "2.1-1.3b")`); its UMT5
encoder has the real width (4096) but one layer: the prompt embeddings (226 tokens, Wan's
padding) are computed once and given to both samplers, so the encoder is outside every timing.
Scheduler: flow-matching Euler, shift 3.0 (the engine reads only its sigmas). Default shape
33 frames (9 latent frames) at 480x832, 10 steps, CFG 5.0, n = 8 videos of one prompt a call.

(a) Rollout, each variant alone: the plain `WanPipeline(...)` call (prompt and negative embeddings
    given, the engine's initial noise as `latents`, output_type "pt": decode included), eager and
    with its transformer blocks compiled exactly as the engine compiles them (regional
    torch.compile of `transformer.blocks`, fullgraph, dynamic=False: what diffusers'
    `compile_repeated_blocks` does; the PEER), against `WanEngine.sample` (SDE on every step,
    per-step log-probs and latents kept, decode included) eager and compiled. The pipeline runs
    CFG as two forwards of n rows a step, the engine as one of 2n. Per variant: the first call
    (compiling, for the compiled ones), then `--repeats` timed calls (median); videos/s, the
    ratio to the compiled and to the eager plain pipeline, the transformer's TFLOP/s (FLOPs of one
    CFG forward counted by torch.utils.flop_counter x steps) and peak GPU memory.
(b) One Flow-GRPO epoch of 8 videos, 2 prompt groups x 4 sampled in one `sample` call (SDE on all
    steps), reward = mean brightness of every frame (in process), GRPO advantages, replay of the
    first 9 steps through LoRA r=32/alpha=64 on the attention projections (peft, Wan's targets
    to_q/k/v/out of self- and cross-attention; the in-script LoRA without peft) with ppo_clip
    (1e-4) + 0.04 flow KL against the LoRA-disabled transformer, AdamW, 2 optimizer steps
    (`diffusion_grpo.replay_updates`). Eager by default, as the diffusion-grpo app runs Wan unless asked
    (`--epoch-compiled`: compiled blocks after a timed compile warm-up). Micro-batch `--micro`
    videos a replay (2 x micro rows: the CFG forward is batched); if the first replay runs out
    of GPU memory, the update starts again with the transformer's gradient checkpointing, and
    the table says so. Seconds: sampling, reward, training; peak GPU memory.

Needs torch, diffusers, transformers (+ the workspace sources on PYTHONPATH); peft optional.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
for src in ("rl-core", "rl-models", "rl-rollout"):
    sys.path.insert(0, str(REPO / "packages" / src / "src"))
sys.path.insert(0, str(REPO / "benchmarks"))
from diffusion_grpo import _sync, add_lora, bf16_peak, forward_flops, replay_updates, seconds  # noqa: E402
from results import append_results, cached_figures, load_figures, markdown_table, save_figures  # noqa: E402

from rl_core.advantages import compute_advantages  # noqa: E402

PROMPTS = ("a red fox runs through fresh snow, tracking shot", "waves break on a rocky shore at sunset")
GUIDANCE = 5.0

def variant_labels(pipeline: str) -> tuple[str, str, str, str]:
    """(plain eager, engine eager, plain compiled = the peer, engine compiled) for `pipeline`'s name."""
    return f"plain {pipeline}, eager", "engine eager", f"plain {pipeline}, compiled blocks (PEER)", "engine compiled"


PLAIN_EAGER, ENGINE_EAGER, PEER, ENGINE_COMPILED = variant_labels("WanPipeline")


def peak_gib() -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else float("nan")


def reset_peak() -> None:
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


# ----------------------------------------------------------------------------------- (a) rollout


def rollout(engine, conditioning, args, figures: dict, cache, progress: Callable[[str], None],
            labels: tuple[str, str, str, str] = (PLAIN_EAGER, ENGINE_EAGER, PEER, ENGINE_COMPILED)) -> None:
    """Measure each variant not yet in `figures["rollout"]` (kept in `cache` after each one)."""
    n, done = args.n, figures.setdefault("rollout", {})
    plain_eager, engine_eager, peer, engine_compiled = labels
    cond = conditioning.index([0] * n)
    negative = engine.negative(cond.embeds.shape[1])
    generators = [torch.Generator().manual_seed(i) for i in range(n)]
    noise = engine.initial_noise(n, args.height, args.width, generators)  # [n, C, F', h, w], the engine's seeds
    plain_inputs = dict(prompt_embeds=cond.embeds, negative_prompt_embeds=negative.embeds.expand(n, -1, -1),
                        latents=noise, num_frames=args.frames, height=args.height, width=args.width,
                        num_inference_steps=args.steps, guidance_scale=GUIDANCE, output_type="pt")

    def plain() -> object:
        return engine.pipeline(**plain_inputs).frames  # [n, F, 3, H, W]

    def ours() -> object:
        return engine.sample(["p"] * n, conditioning=cond, num_steps=args.steps, guidance_scale=GUIDANCE,
                             height=args.height, width=args.width, seeds=list(range(n)))

    if "flops_per_video" not in figures:
        with torch.no_grad():  # one CFG forward of one video (2 rows), x steps
            figures["flops_per_video"] = forward_flops(engine, conditioning, 1, args.height, args.width) * args.steps
    with torch.no_grad():
        for label, fn, compiled in ((plain_eager, plain, False), (engine_eager, ours, False),
                                    (peer, plain, True), (engine_compiled, ours, True)):
            if label in done:
                progress(f"(a) {label}: kept from {cache}")
                continue
            engine.compile = compiled
            engine._sync_compiled()  # the engine's regional compile, on the transformer the pipeline shares
            progress(f"(a) {label}" + (" (compiling)" if compiled else ""))
            reset_peak()
            first, out = seconds(fn)
            times = [seconds(fn)[0] for _ in range(args.repeats)]
            done[label] = {"first": first, "times": times, "seconds": statistics.median(times), "peak": peak_gib()}
            if compiled and engine.compile is False:  # the engine warned: a compile failure ran it eagerly
                done[label]["note"] = "compile failed: ran eagerly"
            if label == engine_eager:
                figures["log_probs_finite"] = bool(torch.isfinite(out.log_probs).all())
                figures["video_shape"] = list(out.images.shape)
            del out
            save_figures(cache, figures)
    engine.compile = False
    engine._sync_compiled()


def rollout_table(figures: dict, n: int,
                  labels: tuple[str, str, str, str] = (PLAIN_EAGER, ENGINE_EAGER, PEER, ENGINE_COMPILED)) -> list[list[str]]:
    done, peak = figures["rollout"], bf16_peak()
    rows = []
    for label in labels:
        f = done[label]
        rate = n / f["seconds"]
        tflops = figures["flops_per_video"] * rate / 1e12
        rows.append([label + (f" ({f['note']})" if "note" in f else ""), f"{rate:.3f}",
                     f"{done[labels[2]]['seconds'] / f['seconds']:.2f}x", f"{done[labels[0]]['seconds'] / f['seconds']:.2f}x",
                     f"{tflops:.3g}", f"{100 * tflops * 1e12 / peak:.0f}%" if peak == peak else "n/a",
                     f"{f['first']:.1f}", ", ".join(f"{t:.1f}" for t in f["times"]), f"{f['peak']:.1f}"])
    return rows


# ----------------------------------------------------------------------------------- (b) epoch


def compile_warmup(engine, conditioning, args, reference) -> float:
    """Seconds to compile the epoch's LoRA graphs: a one-step rollout of the epoch's batch, then one
    replay (grad, backward) and its LoRA-off reference at the micro-batch size; gradients dropped."""

    def warm() -> None:
        traj = engine.sample(["warm-up"] * args.n, conditioning=conditioning.index([0] * args.n), num_steps=1,
                             guidance_scale=GUIDANCE, height=args.height, width=args.width, seeds=list(range(args.n)))
        rows = torch.arange(min(args.micro, args.n))
        out = engine.replay(traj, 0, rows=rows)
        with torch.no_grad(), reference():
            engine.replay(traj, 0, rows=rows)
        out.log_prob.sum().backward()
        engine.transformer.zero_grad(set_to_none=True)

    return seconds(warm)[0]


def epoch(engine, conditioning, args, reference) -> dict[str, object]:
    """One Flow-GRPO epoch: `args.groups` prompts x `args.n // args.groups` videos in one call."""
    per_group = args.n // args.groups
    groups = torch.arange(args.groups).repeat_interleave(per_group)  # [N]
    out: dict[str, object] = {}
    reset_peak()
    out["sampling"], traj = seconds(lambda: engine.sample(
        [PROMPTS[g] for g in groups.tolist()], conditioning=conditioning.index(groups.tolist()),
        num_steps=args.steps, guidance_scale=GUIDANCE, height=args.height, width=args.width,
        seeds=list(range(100, 100 + args.n))))
    out["reward"], rewards = seconds(lambda: traj.images.float().mean(dim=(1, 2, 3, 4)).cpu())  # [N]
    adv = compute_advantages("grpo", rewards=rewards, mask=torch.ones(len(rewards), 1), group_ids=groups,
                             scale="group", eps=1e-4, clip=5.0)[:, 0]  # [N]
    params = [p for p in engine.transformer.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=3e-4, weight_decay=1e-4)
    train_steps = list(range(int(args.steps * 0.99)))

    def train() -> torch.Tensor:
        return replay_updates(engine, [traj], adv, micro=args.micro, train_steps=train_steps,
                              reference=reference, optimizer=optimizer)

    out["peak_sampling"] = peak_gib()
    out["checkpointing"] = args.checkpointing
    if args.checkpointing:
        engine.transformer.enable_gradient_checkpointing()
    reset_peak()
    oom = None
    try:
        out["train"], worst = seconds(train)
    except torch.OutOfMemoryError as error:
        if args.checkpointing:
            raise
        oom = str(error).splitlines()[0][:160]
    if oom is not None:  # outside the except block: its traceback (and the replay's tensors) is gone
        out["oom_without_checkpointing"] = oom
        optimizer.zero_grad(set_to_none=True)
        optimizer.state.clear()  # an update may have run: start over from the same weights' state
        _sync()
        torch.cuda.empty_cache()
        reset_peak()
        engine.transformer.enable_gradient_checkpointing()
        out["checkpointing"] = True
        out["train"], worst = seconds(train)
    out["peak_train"] = peak_gib()
    out["first_replay_max_abs_log_ratio"] = float(worst)
    out["rewards"] = [round(float(r), 4) for r in rewards]
    return out


def epoch_table(e: dict, args, warm_s: float | None) -> list[list[str]]:
    mode = "compiled" if args.epoch_compiled else "eager"
    steps = int(args.steps * 0.99)
    ckpt = "with gradient checkpointing" if e["checkpointing"] else "no gradient checkpointing"
    rows = []
    if warm_s is not None:
        rows.append(["compile warm-up s (LoRA rollout, replay + backward, reference)", f"{warm_s:.1f}"])
    rows += [
        [f"sampling s ({args.n} videos, one call, {mode})", f"{e['sampling']:.1f}"],
        ["sampling videos/s", f"{args.n / e['sampling']:.3f}"],
        ["reward s (brightness of every frame, in process)", f"{e['reward']:.2f}"],
        [f"training s (replay {steps} steps x {args.n} videos + reference + backward, micro {args.micro} video, "
         f"2 AdamW updates, {ckpt}, {mode})", f"{e['train']:.1f}"],
        ["epoch s (sampling + reward + training)", f"{e['sampling'] + e['reward'] + e['train']:.1f}"],
        ["peak GPU memory GiB, sampling", f"{e['peak_sampling']:.1f}"],
        ["peak GPU memory GiB, training", f"{e['peak_train']:.1f}"],
        ["first replay max |log ratio|", f"{e['first_replay_max_abs_log_ratio']:.3g}"],
    ]
    if "oom_without_checkpointing" in e:
        rows.append(["first replay without gradient checkpointing", f"out of memory ({e['oom_without_checkpointing']})"])
    return rows


# ----------------------------------------------------------------------------------- main


def build_engine(args, progress: Callable[[str], None]):
    from rl_rollout.wan import WanEngine

    dtype = torch.float32 if args.smoke else torch.bfloat16
    device = "cpu" if args.smoke else "cuda"
    with tempfile.TemporaryDirectory() as tmp:
        if args.smoke:
            from rl_models import tiny

            path = tiny.build("wan")
        else:
            from rl_models.shapes import build_shape

            path = Path(args.model_dir) if args.model_dir else Path(tmp) / "wan2_1_t2v_1_3b"
            if not (path / "model_index.json").exists():
                progress(f"building the Wan 2.1 T2V-1.3B shape in {path}")
                build_shape("wan", "2.1-1.3b", path, dtype="bfloat16", device="cuda")
        engine = WanEngine.from_pretrained(path, dtype=dtype, device=device, num_frames=args.frames, compile=False)
    return engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny:wan on the CPU, minutes, no RESULTS.md")
    parser.add_argument("--part", choices=("all", "rollout", "epoch"), default="all",
                        help="rollout: (a) only; epoch: (b), then the section (with --cache, (a) from an earlier command)")
    parser.add_argument("--cache", type=Path, default=None, help="keep figures here between commands")
    parser.add_argument("--model-dir", default=None, help="build the checkpoint here once (default: a temporary folder)")
    parser.add_argument("--frames", type=int, default=None, help="4k + 1 (default 33; smoke 5)")
    parser.add_argument("--height", type=int, default=None, help="default 480 (smoke 32)")
    parser.add_argument("--width", type=int, default=None, help="default 832 (smoke 48)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=2, help="timed rollout calls after the first (median)")
    parser.add_argument("--micro", type=int, default=1, help="videos per replay forward")
    parser.add_argument("--checkpointing", action="store_true", help="gradient checkpointing in the replay from the start")
    parser.add_argument("--epoch-compiled", action="store_true", help="(b) with compiled blocks (timed warm-up first)")
    args = parser.parse_args()
    args.n, args.groups = 8, 2
    args.frames = args.frames or (5 if args.smoke else 33)
    args.height = args.height or (32 if args.smoke else 480)
    args.width = args.width or (48 if args.smoke else 832)
    start = time.perf_counter()

    def progress(what: str) -> None:
        print(f"[{time.perf_counter() - start:6.0f} s] {what}", flush=True)

    cache = cached_figures(args.cache, "wan_flow_grpo")
    figures = load_figures(cache) or {}
    shape = [args.frames, args.height, args.width, args.steps]
    if figures.get("shape", shape) != shape:
        raise SystemExit(f"{cache} holds figures of another shape ({figures['shape']}); remove it or match it")
    figures["shape"] = shape
    engine = build_engine(args, progress)
    progress(f"engine loaded ({type(engine.pipeline.scheduler).__name__}, {engine.dtype})")
    conditioning = engine.encode(list(PROMPTS), max_sequence_length=226)  # [2, 226, 4096]
    if args.part in ("all", "rollout"):
        rollout(engine, conditioning, args, figures, cache, progress)
    if args.part == "rollout":
        progress("(a) done" + (f"; figures kept in {cache}" if cache else ""))
        return
    if "rollout" not in figures or len(figures["rollout"]) < 4:
        raise SystemExit("(b) writes the section with (a)'s figures: run --part rollout first with the same --cache")
    lora_kind, reference = add_lora(engine.transformer, r=32, alpha=64, family="wan")
    warm_s = None
    if args.epoch_compiled:
        engine.compile = True
        progress("(b) compiling the LoRA graphs")
        warm_s = compile_warmup(engine, conditioning, args, reference)
    progress("(b) epoch")
    figures["epoch"] = epoch(engine, conditioning, args, reference)
    figures["wall_s"] = time.perf_counter() - start
    save_figures(cache, figures)
    progress("(b) done")

    frames, h, w = args.frames, args.height, args.width
    blocks = len(engine.transformer.blocks)
    latent = (frames - 1) // 4 + 1
    tokens = latent * (h // 16) * (w // 16)
    header = [f"rollout ({args.n} videos of one prompt a call, embeds given)", "videos/s", "vs compiled plain (peer)",
              "vs eager plain", "transformer TFLOP/s", "of bf16 peak", "first call s", "timed calls s", "peak GPU GiB"]
    rows = rollout_table(figures, args.n)
    e_rows = epoch_table(figures["epoch"], args, warm_s)
    model = "tiny:wan (rl_models.tiny), float32, CPU" if args.smoke else (
        "Wan 2.1 T2V-1.3B transformer (1.42B) + VAE at full shape, random weights, bf16 "
        "(`rl_models.shapes.build_shape(\"wan\", \"2.1-1.3b\")`); UMT5 encoder 4096 wide, one layer, outside the timings")
    notes = (
        f"{model}. {frames} frames ({latent} latent frames) at {h}x{w}: {tokens} tokens a video; {args.steps} steps, "
        f"CFG {GUIDANCE}, 226-token prompt embeddings given to both samplers; flow-matching Euler scheduler, shift 3.0. "
        f"Each variant alone, n={args.n} videos of one prompt a call: the first call (compiling, for the compiled "
        f"variants), then {args.repeats} timed call(s) (videos/s from their median); peak memory over both. "
        "Plain = `WanPipeline(prompt_embeds=..., negative_prompt_embeds=..., latents=<the engine's initial noise>, "
        "output_type=\"pt\")`: Euler ODE steps, CFG as two forwards of n rows a step, VAE decode included. Engine = "
        "`WanEngine.sample`: SDE steps (noise level 0.7) with per-step log-probs, latents kept, CFG as one forward of "
        f"2n rows, VAE decode included. Compiled = each of the {blocks} transformer blocks through torch.compile("
        "fullgraph=True, dynamic=False), inductor default mode, applied to the transformer the pipeline shares "
        "(diffusers' compile_repeated_blocks recipe): the peer runs the same compiled blocks. TFLOP/s: the "
        f"transformer's FLOPs per video (torch.utils.flop_counter over one CFG forward x {args.steps} steps: "
        f"{figures['flops_per_video'] / 1e12:.3g} TFLOP) x videos/s; bf16 peak 989 TFLOP/s dense. The engine's "
        f"eager sample: videos {figures.get('video_shape')} ([B, F, 3, H, W]), log-probs finite: "
        f"{figures.get('log_probs_finite')}.\n\n"
        f"(b) One Flow-GRPO epoch of {args.n} videos ({args.groups} prompts x {args.n // args.groups}, one sample "
        f"call), LoRA: {lora_kind}, r=32/alpha=64 on to_q/to_k/to_v/to_out.0 of every block's self- and "
        "cross-attention; reward = mean brightness over every frame; GRPO advantages (per-group std); ppo_clip "
        "1e-4 + 0.04 flow KL against the LoRA-disabled transformer (one more no-grad forward a replay); AdamW "
        "lr 3e-4; the uncond half of each replayed CFG forward carries no gradient but is in the batch. Eager "
        "unless the row says compiled (the diffusion-grpo app compiles wan with model.compile = true).\n\n"
        + markdown_table(["epoch (b)", "value"],
                         [*e_rows, ["benchmark wall s (this command: load to end)", f"{figures['wall_s']:.0f}"]]))
    if args.smoke:
        print(markdown_table(header, rows))
        print(notes)
    else:
        append_results(f"Wan 2.1 T2V-1.3B shape: WanEngine vs the plain compiled WanPipeline, one Flow-GRPO epoch "
                       f"({frames} frames {h}x{w}, one GPU)", header, rows, notes)


if __name__ == "__main__":
    main()
