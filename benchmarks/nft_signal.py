"""Does one DiffusionNFT update follow its reward on the tiny SD3? (CPU, about 3 minutes)

    uv run --package diffusion-grpo python benchmarks/nft_signal.py [--lr 0.1] [--no-append]
    ... --method grpo --lr 0.05     # the control: Flow-GRPO's update from the embedded default as it is
    ... --accumulation 4            # NFT with one optimizer step an epoch (the default takes four)

diffusion-grpo's embedded default with `train.method=nft` (the old policy's ODE samples, no CFG,
beta 1) at `--lr`, or (`--method grpo`) with Flow-GRPO's update as the default has it: one epoch
is sampled (32 images, seed 42), rewarded, trained (4 optimizer steps of 8 images, or 4 /
`--accumulation`), and sampled again with the same seeds. Two rewards, each with both signs, from the same
start: the images' grey level (the app's `brightness` scorer), and the mean of the clean latents
(a feature the transformer's output moves directly). Reported per run: the reward's quantity
before and after the update, and how strongly the brightness follows each latent channel's mean
over the 32 samples (Pearson r). An update that follows its reward moves its quantity up with
sign +1 and down with sign -1.

The run drives the recipe's hooks as the app's tests do (their `setup_state` and `advantages`
helpers), so the update is the app's own.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "apps" / "diffusion-grpo" / "tests"
sys.path[:0] = [str(ROOT), str(TESTS)]

from benchmarks.results import append_results, markdown_table  # noqa: E402


def grey(images: list) -> torch.Tensor:
    """`[N]` the `brightness` scorer's mean grey level in [0, 1] of each image."""
    from rl_rewards.samples import Sample
    from rl_rewards.scorers.media import BrightnessScorer

    results = BrightnessScorer().score([Sample(completion="", metadata={"image": image}) for image in images])
    return torch.tensor([r.score for r in results])


def latent_means(batch) -> torch.Tensor:
    """`[N, C]` each sample's clean latents averaged per channel."""
    return torch.cat([t.latents[:, -1] for t in batch.samples]).mean(dim=(2, 3))


def one_update(app, method: str, reward: str, sign: int, lr: float, accumulation: int, out: Path) -> list[object]:
    from conftest import advantages, setup_state

    from rl_core.train import load_config

    nft = ["train.method=nft", "sampling.kind=ode", "sampling.guidance_scale=1"] if method == "nft" else []
    cfg = load_config(app.Config, TESTS.parent / "configs" / "default.toml",
                      [f"train.output_dir={out / f'{method}-{reward}{sign:+d}'}", *nft, f"train.lr={lr}", "train.eval_freq=0",
                       f"train.gradient_accumulation_steps={accumulation}"])
    state = setup_state(app, cfg)
    batch = app.RECIPE.rollout(state, 1)
    before = grey(batch.images) if reward == "brightness" else latent_means(batch).mean(dim=1)  # [N]
    app.RECIPE.update(state, 1, batch, advantages(app, state, batch, sign * before))
    again = app.RECIPE.rollout(state, 1)  # the same seeds, sampled by the updated (old) policy
    after = grey(again.images) if reward == "brightness" else latent_means(again).mean(dim=1)  # [N]
    channels = latent_means(batch)  # [N, C]
    follow = [float(torch.corrcoef(torch.stack([grey(batch.images), channels[:, c]]))[0, 1])
              for c in range(channels.shape[1])]
    return [reward, f"{sign:+d}", f"{before.mean():.4f}", f"{after.mean():.4f}", f"{after.mean() - before.mean():+.4f}",
            " / ".join(f"{r:.2f}" for r in follow)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--method", choices=("nft", "grpo"), default="nft")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--accumulation", type=int, default=1, help="micro-batches of 8 images per optimizer step")
    parser.add_argument("--no-append", action="store_true", help="print the table only")
    parser.add_argument("--out", type=Path, default=Path("/tmp/nft_signal"))
    args = parser.parse_args()
    from conftest import _load_app

    app = _load_app()
    rows = [one_update(app, args.method, reward, sign, args.lr, args.accumulation, args.out) for reward in ("brightness", "latent_mean")
            for sign in (1, -1)]
    header = ["reward", "sign", "quantity before", "after one epoch", "change", "r(brightness, latent channel 0-3)"]
    name = {"nft": "DiffusionNFT", "grpo": "Flow-GRPO"}[args.method]
    title = (f"{name} on the tiny SD3: does one update follow its reward? (CPU, lr {args.lr}, "
             f"{4 // args.accumulation} optimizer step(s) an epoch)")
    notes = "`benchmarks/nft_signal.py` (its docstring: the setting)."
    if args.no_append:
        print(markdown_table(header, rows))
    else:
        append_results(title, header, rows, notes)


if __name__ == "__main__":
    main()
