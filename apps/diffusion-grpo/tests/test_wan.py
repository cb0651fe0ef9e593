"""`model.family = "wan"` and `"cosmos"`: Flow-GRPO on the tiny Wan 2.1 text-to-video and
Cosmos-Predict2.5 text-to-world pipelines, the presets a user runs (`configs/wan_tiny.toml`,
`configs/cosmos_tiny.toml`), and what the video families refuse before any model loads."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch
from conftest import APP, checked
from grpo_config import reward_spec
from safetensors.torch import load_file

from rl_core.train import ConfigError

WAN = APP / "configs" / "wan_tiny.toml"
COSMOS = APP / "configs" / "cosmos_tiny.toml"


@pytest.mark.parametrize("preset", [WAN, COSMOS], ids=["wan", "cosmos"])
def test_the_tiny_video_runs_train_on_videos_and_write_them(app, preset: Path, tmp_path: Path, capsys) -> None:
    """`uv run apps/diffusion-grpo --config .../wan_tiny.toml` (or cosmos_tiny.toml) as a user runs it: every epoch's
    first replay equals the rollout's log-probs (on-policy, one kernel path), the policy's version
    counts its optimizer steps, both reward components are logged (brightness folded over the
    frames, temporal consistency of the whole video), the eval writes each video as a file and a
    contact sheet of first frames, and the exported LoRA moved off its zero init."""
    run = app.main(["--config", str(preset), f"train.output_dir={tmp_path}"])
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
    lora = load_file(run / "checkpoint-final" / "lora" / "adapter_model.safetensors")
    assert any(name.endswith("lora_B.weight") and bool(t.abs().sum() > 0) for name, t in lora.items())
    assert torch.isfinite(torch.cat([t.flatten() for t in lora.values()])).all()
    assert "diffusion-grpo finished: 4 steps" in capsys.readouterr().out


@pytest.mark.parametrize(("extra", "message"), [
    (("rollout.workers=1",), r"Ray rollout workers serve the sd3 family only; set rollout\.workers=0 for model\.family='wan'"),
    (("train.sharding=fsdp2",), r"model\.family='wan' trains with DDP"),
    (("reward.url=http://127.0.0.1:1",), r"videos are not sent to a reward server yet"),
    (("sampling.num_frames=6",), r"sampling\.num_frames=6: Wan's VAE takes 4k \+ 1 frames"),
    (("model.family=cosmos", "model.path=tiny:cosmos", "sampling.num_frames=8"), r"num_frames=8: Wan's VAE takes 4k"),
    (("train.method=nft", "sampling.kind=ode", "sampling.guidance_scale=1"), r"model\.family='wan' is not done"),
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
