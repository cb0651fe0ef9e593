"""Full fine-tuning (`model.lora_rank = 0`) on the tiny SD3 and Wan: every transformer weight
trains, the KL and DPO reference is a frozen copy of the starting weights, a resume is exact, the
asynchronous rollout samples from a whole copy, and the export is the transformer itself."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch
from conftest import flat, tiny_config, train
from diffusers import SD3Transformer2DModel

from rl_core.train import ConfigError
from rl_models import tiny


def _rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return [r for r in csv.DictReader(f) if r.get("reward/mean")]


def _start() -> dict[str, torch.Tensor]:
    """The tiny SD3 transformer's starting parameters (its buffers left out)."""
    model = SD3Transformer2DModel.from_pretrained(tiny.build("sd3") / "transformer")
    return {name: p.detach() for name, p in model.named_parameters()}


@pytest.fixture(scope="module")
def full_run(app, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("full")
    return train(app, tiny_config(app, "sd3", out, "model.lora_rank=0", "train.epochs=2", "train.save_freq=1",
                                  "train.lr=1e-3"))


def test_every_weight_trains_against_a_frozen_reference_and_exports_whole(full_run: Path) -> None:
    start = _start()
    state = torch.load(full_run / "checkpoints" / "checkpoint-2" / "lora.pt", weights_only=True)
    assert set(state) == set(start) and not any(".lora_" in name for name in state)  # the transformer's own names
    # the last block's text-token queries reach no output (context_pre_only): no gradient, only weight decay
    moved = [name for name in start if not torch.allclose(state[name].float(), start[name].float(), atol=1e-6)]
    assert len(moved) >= len(start) - 4, sorted(set(start) - set(moved))
    rows = _rows(full_run / "metrics.csv")
    kl = [float(r["loss/kl"]) for r in rows]  # to the starting weights, which the policy leaves step by step
    assert 0.0 < kl[0] < kl[1], kl
    for folder in ("transformer", "transformer_ema"):
        exported = SD3Transformer2DModel.from_pretrained(full_run / "checkpoint-final" / folder)
        assert isinstance(exported, SD3Transformer2DModel)
    final = SD3Transformer2DModel.from_pretrained(full_run / "checkpoint-final" / "transformer").state_dict()
    torch.testing.assert_close(final["proj_out.weight"], state["proj_out.weight"].to(final["proj_out.weight"].dtype))
    assert not (full_run / "checkpoint-final" / "lora").exists()
    assert not (full_run / "checkpoints" / "checkpoint-2" / "transformer").exists()  # the state holds the weights


def test_a_resumed_full_fine_tune_equals_the_uninterrupted_run(app, full_run: Path, tmp_path: Path) -> None:
    extra = ("model.lora_rank=0", "train.save_freq=1", "train.lr=1e-3")
    first = train(app, tiny_config(app, "sd3", tmp_path, "train.epochs=1", *extra))
    resumed = train(app, tiny_config(app, "sd3", tmp_path, "train.epochs=2", *extra), resume="latest")
    assert resumed == first
    for name in ("lora.pt", "ema.pt", "optimizer.pt"):
        a = torch.load(full_run / "checkpoints" / "checkpoint-2" / name, weights_only=True)
        b = torch.load(resumed / "checkpoints" / "checkpoint-2" / name, weights_only=True)
        assert json.dumps(flat(a)) == json.dumps(flat(b)), name


@pytest.mark.parametrize("method", ["nft", "async"])
def test_wan_fully_fine_tuned_by_nft_or_asynchronously(app, tmp_path: Path, method: str) -> None:
    """DiffusionNFT's old policy and the asynchronous rollout's weights are whole copies that follow
    the trained transformer by version; both runs train every weight."""
    extra = ["train.method=nft", "sampling.guidance_scale=1"] if method == "nft" else ["train.max_staleness=1"]
    run = train(app, tiny_config(app, "wan", tmp_path, "model.lora_rank=0", "train.epochs=2", "train.save_freq=1",
                                 *extra))
    first = torch.load(run / "checkpoints" / "checkpoint-1" / "lora.pt", weights_only=True)
    last = torch.load(run / "checkpoints" / "checkpoint-2" / "lora.pt", weights_only=True)
    assert len(last) > 10 and not any(".lora_" in name for name in last)
    assert sum(not torch.equal(first[n], last[n]) for n in last) > len(last) // 2
    rows = _rows(run / "metrics.csv")
    assert [r["rollout/weight_version"] for r in rows] == (["0.0", "0.0"] if method == "async" else ["0.0", "2.0"])  # optimizer steps


def test_full_fine_tuning_is_refused_where_it_does_not_apply(app, tmp_path: Path) -> None:
    for extra, message in ((("model.family=janus",), "set a LoRA rank for janus"),
                           (("rollout.precision=fp8",), "or rollout.precision='fp8'")):
        with pytest.raises(ConfigError, match=message):
            app.RECIPE.check(tiny_config(app, "sd3", tmp_path, "model.lora_rank=0", *extra), 1)
