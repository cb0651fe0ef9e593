"""`model.family = "wan"` and `"cosmos"`: Flow-GRPO on the tiny Wan 2.1 text-to-video and
Cosmos-Predict2.5 text-to-world pipelines, the presets a user runs (`configs/wan_tiny.toml`,
`configs/cosmos_tiny.toml`), and what the video families refuse before any model loads."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch
from conftest import APP, checked, world_rows
from grpo_config import reward_spec
from grpo_recipe import given_frames
from safetensors.torch import load_file
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from rl_core.train import ConfigError, UserError
from rl_data import load_frames

WAN = APP / "configs" / "wan_tiny.toml"
COSMOS = APP / "configs" / "cosmos_tiny.toml"
COSMOS_NFT = APP.parents[1] / "examples" / "diffusion-grpo" / "cosmos_nft.toml"
TINY_VIDEO = ["model.path=tiny:cosmos", "model.dtype=float32", "model.lora_rank=8", "model.lora_alpha=16",
              "sampling.resolution=32", "sampling.num_frames=5", "sampling.num_steps=4", "sampling.max_sequence_length=64",
              "rollout.n=4", "rollout.groups_per_epoch=2", "rollout.sample_batch_size=4", "train.epochs=4",
              "train.micro_batch_size=4", "train.gradient_accumulation_steps=1", "train.lr=0.05", "train.save_freq=2",
              "train.eval_freq=4", "eval.max_prompts=4", "eval.num_steps=4", "eval.batch_size=4",
              "data.manifest=examples/data/ocr/train.txt", "data.eval_manifest=examples/data/ocr/test.txt",
              "reward.components={brightness = 1.0}", "nft.old_decay_start=0"]


@pytest.mark.parametrize("preset", [WAN, COSMOS], ids=["wan", "cosmos"])
def test_the_tiny_video_runs_train_on_videos_and_write_them(app, preset: Path, tmp_path: Path, capsys) -> None:
    """`uv run apps/diffusion-grpo --config .../wan_tiny.toml` (or cosmos_tiny.toml) as a user runs it: every epoch's
    first replay equals the rollout's log-probs (on-policy, one kernel path), the policy's version
    counts its optimizer steps, both reward components are logged (brightness folded over the
    frames, temporal consistency of the whole video), the eval writes each video as a file and a
    contact sheet of first frames (both sent to the TensorBoard tracker), and the exported LoRA
    moved off its zero init."""
    run = app.main(["--config", str(preset), f"train.output_dir={tmp_path}", "train.log_with=[tensorboard]"])
    with (run / "metrics.csv").open(newline="") as f:
        rows = [r for r in csv.DictReader(f) if r.get("reward/mean")]
    assert [int(float(r["rollout/weight_version"])) for r in rows] == [0, 2, 4, 6]  # 2 optimizer steps an epoch
    assert all(float(r["replay/engine_diff_max"]) == 0.0 for r in rows)
    for row in rows:
        brightness, steady = float(row["reward/brightness"]), float(row["reward/temporal_consistency"])
        assert 0 < brightness < 1 and 0 < steady <= 1
        assert float(row["reward/mean"]) == pytest.approx(brightness + 0.1 * steady, abs=1e-6)
    videos = sorted((run / "eval_epoch_4" / "images").iterdir())
    assert len(videos) == 4 and all(v.suffix in (".mp4", ".gif") and v.stat().st_size > 0 for v in videos)
    assert (run / "eval_epoch_4" / "contact_sheet.png").is_file()
    logged = EventAccumulator(str(run / "diffusion-grpo"), size_guidance={"images": 0}).Reload()  # the trackers got them
    assert {(tag, e.step) for tag in logged.Tags()["images"] for e in logged.Images(tag)} >= {
        ("eval/contact_sheet", 4), *((f"eval/video_{i:03d}", 4) for i in range(4))}
    lora = load_file(run / "checkpoint-final" / "lora" / "adapter_model.safetensors")
    assert any(name.endswith("lora_B.weight") and bool(t.abs().sum() > 0) for name, t in lora.items())
    assert torch.isfinite(torch.cat([t.flatten() for t in lora.values()])).all()
    assert "diffusion-grpo finished: 4 steps" in capsys.readouterr().out


@pytest.mark.parametrize(("extra", "message"), [
    (("sampling.num_frames=6",), r"sampling\.num_frames=6: Wan's VAE takes 4k \+ 1 frames"),
    (("model.family=cosmos", "model.path=tiny:cosmos", "sampling.num_frames=8"), r"num_frames=8: Wan's VAE takes 4k"),
])
def test_what_the_wan_family_refuses_is_one_line_before_any_model_loads(app, extra, message) -> None:
    with pytest.raises(ConfigError, match=message):
        checked(app, "--config", str(WAN), *extra)


def test_image_scorers_score_every_frame_and_video_scorers_the_video(app) -> None:
    spec = reward_spec(checked(app, "--config", str(WAN), "reward.frame_aggregate=min", "reward.frames=3").reward,
                       tiny=True, video=True)
    bright, steady = spec.components["brightness"], spec.components["temporal_consistency"]
    assert (bright.scorer, bright.weight, steady.scorer, steady.weight) == ("per_frame", 1.0, "temporal_consistency", 0.1)
    assert bright.options == {"scorer": "brightness", "options": {}, "aggregate": "min", "frames": 3}
    judged = reward_spec(checked(app, "--config", str(WAN), "reward.components={vl_judge = 1.0}",
                                 'reward.kwargs={vl_judge = {model = "tiny:qwen2_5_vl"}}').reward, tiny=True, video=True)
    assert judged.components["vl_judge"].scorer == "vl_judge"  # a VLM sees the whole video, not frame by frame


def test_the_cosmos_nft_preset_shows_what_vrl_asks_before_it_promotes_the_recipe(app, tmp_path: Path) -> None:
    """examples/diffusion-grpo/cosmos_nft.toml (DiffusionNFT on Cosmos-Predict2.5) on the tiny
    checkpoint at CPU sizes, brightness for OCR: VRL promotes the recipe once a run shows
    optimizer updates, non-flat rewards, generated artifacts and changed LoRA weights."""
    cfg = checked(app, "--config", str(COSMOS_NFT))
    assert (cfg.model.family, cfg.train.method, cfg.sampling.kind, cfg.sampling.guidance_scale) == ("cosmos", "nft", "ode", 1.0)
    run = app.main(["--config", str(COSMOS_NFT), *TINY_VIDEO, f"train.output_dir={tmp_path}"])
    with (run / "metrics.csv").open(newline="") as f:
        rows = [r for r in csv.DictReader(f) if r.get("reward/mean")]
    assert [int(float(r["rollout/weight_version"])) for r in rows] == [0, 2, 4, 6]  # optimizer updates, counted
    assert all(float(r["grad_norm"]) > 0 and float(r["nft/old_decay"]) > 0 for r in rows)
    assert all(float(r["reward/std"]) > 0 for r in rows)  # non-flat rewards within the epoch
    videos = sorted((run / "eval_epoch_4" / "images").iterdir())  # generated artifacts
    assert len(videos) == 4 and all(v.suffix in (".mp4", ".gif") and v.stat().st_size > 0 for v in videos)
    lora = load_file(run / "checkpoint-final" / "lora" / "adapter_model.safetensors")  # changed LoRA weights
    assert any(name.endswith("lora_B.weight") and bool(t.abs().sum() > 0) for name, t in lora.items())


def test_a_reward_server_scores_the_videos_the_trainer_wrote(app, tmp_path: Path) -> None:
    """reward.url: each video goes to a real `rl-rewards serve` as the path of the MP4 (GIF without
    PyAV) the trainer wrote, which the server decodes; its per-frame brightness equals the in-process
    reward's on the same samples up to the codec's rounding of a grey level or two."""
    import os
    import signal
    import socket
    import subprocess
    import sys

    from rl_rewards.client import RewardClient

    (tmp_path / "rewards.toml").write_text('[rewards.bright.components.brightness]\nscorer = "per_frame"\n'
                                           'options = { scorer = "brightness" }\n')
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cli = Path(sys.executable).with_name("rl-rewards")
    server = subprocess.Popen([str(cli), "serve", "--config", str(tmp_path / "rewards.toml"), "--port", str(port),
                               "--media-root", str(tmp_path), "--workers", "0"], start_new_session=True,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        with RewardClient(f"http://127.0.0.1:{port}") as client:
            client.wait_ready(timeout=120)
        runs = {}
        for name, reward in (("served", [f"reward.url=http://127.0.0.1:{port}", "reward.server_reward=bright"]),
                             ("local", ["reward.components={brightness=1.0}"])):
            run = app.main(["--config", str(WAN), "train.epochs=1", "train.eval_freq=0", "train.save_freq=100",
                            f"train.output_dir={tmp_path / name}", *reward])
            with (run / "metrics.csv").open(newline="") as f:
                [runs[name]] = [r for r in csv.DictReader(f) if r.get("reward/mean")]
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)
    assert float(runs["served"]["reward/failed"]) == 0
    assert float(runs["served"]["reward/mean"]) == pytest.approx(float(runs["local"]["reward/mean"]), abs=3 / 255)
    assert list((tmp_path / "served").rglob("rollouts/step_1/rank_0/*.mp4")) or list(
        (tmp_path / "served").rglob("rollouts/step_1/rank_0/*.gif"))


def test_cosmos_starts_each_sample_from_its_rows_image_or_video(app, tmp_path: Path) -> None:
    """data.manifest rows with an `image` (or a `video`: 5 frames spaced over the clip) start each
    cosmos sample from it: the sampler holds the picture's latents as the first latent frame at
    every step, the first replay gives ratio 1 with them, and a run with its eval completes."""
    from conftest import setup_state

    from rl_core.train import load_config

    rows = world_rows(tmp_path, ["image", "image", "image", "image"])
    overrides = [*TINY_VIDEO, "model.family=cosmos", f"data.manifest={rows}", f"data.eval_manifest={rows}",
                 "train.epochs=1", "train.eval_freq=1", f"train.output_dir={tmp_path / 'runs'}"]
    cfg = load_config(app.Config, COSMOS, overrides)
    state = setup_state(app, cfg)
    batch = app.RECIPE.sample(state, 1)
    engine = state.family.engine
    for traj, records in zip(batch.samples, [batch.records[:4], batch.records[4:]], strict=True):
        frames = torch.stack([torch.from_numpy(load_frames(r.media, size=32, video_frames=5)) for r in records])
        given = engine.encode_world([r.prompt for r in records], frames.movedim(-1, -3).float() / 255,
                                    max_sequence_length=64)
        held = given.held[:, None, :, :1].expand(-1, traj.latents.shape[1], -1, -1, -1, -1)  # [B, S + 1, C, 1, h, w]
        torch.testing.assert_close(traj.latents[:, :, :, :1], held)
        assert given.held_mask.flatten().tolist() == [1.0, 0.0] * 4
    app.RECIPE.close(state)
    run = app.main(overrides)
    with (run / "metrics.csv").open(newline="") as f:
        [first, *_] = [r for r in csv.DictReader(f) if r.get("reward/mean")]
    assert float(first["replay/engine_diff_max"]) == 0.0
    assert len(list((run / "eval_epoch_1" / "images").iterdir())) == 4
    # a video row: 5 of its frames, 2 latent frames held; 9 frames leave one to generate
    clip = world_rows(tmp_path, ["video", "image"])
    nine = load_config(app.Config, COSMOS, [*overrides, f"data.manifest={clip}", "sampling.num_frames=9"])
    state = setup_state(app, nine)
    given = given_frames(state, state.prompts)
    assert given.held_mask.flatten().tolist() == [1.0, 1.0, 0.0, 1.0, 0.0, 0.0]
    app.RECIPE.close(state)


@pytest.mark.parametrize(("family", "media", "message"), [
    ("wan", ["image", "image"], r"data.manifest, row 1: an image or video to start from needs model.family = 'cosmos'"),
    ("cosmos", ["image", None], r"data.manifest, row 2: .* and one on every row"),
])
def test_rows_to_start_from_are_refused_where_they_cannot_be_held(app, tmp_path: Path, family, media, message) -> None:
    """A picture to start from needs cosmos, and every row of the source to have one: the error
    names the source's key and row before any model loads."""
    rows = world_rows(tmp_path, [m or "image" for m in media])
    lines = rows.read_text().splitlines()
    lines = [line if m else json.dumps({"prompt": json.loads(line)["prompt"]}) for line, m in zip(lines, media, strict=True)]
    rows.write_text("\n".join(lines) + "\n")
    with pytest.raises(UserError, match=message):
        app.main([*TINY_VIDEO, f"model.family={family}", f"model.path=tiny:{family}", f"data.manifest={rows}",
                  f"train.output_dir={tmp_path}"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("case", ["wan-full", "cosmos-full-nft", "cosmos-world"])
def test_the_video_families_train_on_a_gpu(app, tmp_path: Path, case: str) -> None:
    """On CUDA in bf16, 2 epochs each: Wan fully fine-tuned with Flow-GRPO and its KL to the frozen
    copy, Cosmos fully fine-tuned with DiffusionNFT, and Cosmos's LoRA starting each sample from its
    row's image (video to world): finite losses, and most trained weights moved between the epochs."""
    extra = {"wan-full": ["model.family=wan", "model.lora_rank=0", "train.lr=1e-4", "algo.kl_coef=0.04"],
             "cosmos-full-nft": ["model.lora_rank=0", "train.lr=1e-4", "train.method=nft", "sampling.kind=ode",
                                 "sampling.guidance_scale=1"],
             "cosmos-world": [f"data.manifest={world_rows(tmp_path, ['image'] * 4)}"]}[case]
    preset = WAN if case.startswith("wan") else COSMOS
    run = app.main(["--config", str(preset), *TINY_VIDEO, *(["model.path=tiny:wan"] if preset == WAN else []),
                    "model.dtype=bfloat16", "train.epochs=2", "train.save_freq=1", "train.eval_freq=0",
                    f"train.output_dir={tmp_path / 'runs'}", *extra])
    with (run / "metrics.csv").open(newline="") as f:
        rows = [r for r in csv.DictReader(f) if r.get("reward/mean")]
    assert len(rows) == 2
    for r in rows:
        assert torch.isfinite(torch.tensor([float(r["loss/total"]), float(r["grad_norm"])])).all(), r
    first, last = (torch.load(run / "checkpoints" / f"checkpoint-{k}" / "lora.pt", weights_only=True) for k in (1, 2))
    assert sum(not torch.equal(first[n], last[n]) for n in last) > len(last) // 2
