"""diffusion-grpo's update invariants, pinned for one full epoch: 2 processes x 1 prompt group = 1
process x 2 groups (under `accelerate launch --multi_gpu --num_processes 2` on CPU: two gloo
processes, `--cpu` alone would start one), unsharded (DDP) and with the transformer sharded by
FSDP2 over the two; gradient accumulation over micro-batches = one micro-batch; a run resumed
from a sharded checkpoint = the uninterrupted run. A sample's noise depends on its place in the
epoch, not on the process count, so the runs draw the same images."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import APP, flat, in_process_group, tiny_overrides
from safetensors.torch import load_file

from rl_core.train import load_config

REPO = APP.parents[1]
DEAD = "transformer_blocks.1.attn.add_q_proj.lora_B"  # reaches no output (see test_recipe.py)
# one process, 2 groups x 4 images, one optimizer step (pinned on the 2-core CPU)
PINNED = {"reward/mean": 0.5058244, "grad_norm": 0.0053476}


def rows(run: Path) -> list[dict[str, str]]:
    with (run / "metrics.csv").open(newline="") as f:
        return [r for r in csv.DictReader(f) if r.get("reward/mean")]


def lora(run: Path, epoch: int = 1, folder: str = "lora") -> dict[str, torch.Tensor]:
    """The PEFT export of `checkpoint-<epoch>`: written from the whole weights, sharded or not."""
    return load_file(run / "checkpoints" / f"checkpoint-{epoch}" / folder / "adapter_model.safetensors")


def one_epoch(out: Path, *extra: str) -> list[str]:
    return tiny_overrides(out, "train.epochs=1", "train.save_freq=1", "train.kl_beta=0.04", *extra)


@pytest.fixture(scope="module")
def single(app, tmp_path_factory) -> Path:
    """One process, both groups in one optimizer step."""
    return app.train(load_config(app.Config, app.DEFAULT_CONFIG, one_epoch(
        tmp_path_factory.mktemp("one"), "train.gradient_accumulation_steps=2")))


@pytest.mark.parametrize("sharding", ["none", "fsdp2"])
def test_two_processes_equal_one_process_with_twice_the_batch(single: Path, tmp_path: Path, sharding: str) -> None:
    """`fsdp2`: launched with examples/diffusion-grpo/accelerate/fsdp2_1node.yaml, which Accelerate
    does not turn on on a CPU but the app does (FSDP2 on gloo): the transformer sharded over the two
    processes, rollouts sampled from its gathered copy, the EMA and exports from gathered weights."""
    launcher = Path(sys.executable).with_name("accelerate")
    how = (["--config_file", str(REPO / "examples" / "diffusion-grpo" / "accelerate" / "fsdp2_1node.yaml")]
           if sharding == "fsdp2" else ["--multi_gpu", "--num_machines", "1", "--mixed_precision", "no"])
    result = subprocess.run(
        [str(launcher), "launch", *how, "--num_processes", "2", "--dynamo_backend", "no", str(APP / "__main__.py"),
         *one_epoch(tmp_path / "two")],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(APP), "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
        timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    two = (tmp_path / "two" / "latest").resolve()
    [a], [b] = rows(single), rows(two)
    assert (a["world_size"], b["world_size"]) == ("1", "2")
    assert a["optimizer_steps"] == b["optimizer_steps"] == "1"
    assert float(a["reward/mean"]) == pytest.approx(PINNED["reward/mean"], abs=2e-6)
    assert float(a["grad_norm"]) == pytest.approx(PINNED["grad_norm"], rel=1e-3)
    for key in ("reward/mean", "reward/std", "adv/std", "loss/total", "loss/kl", "grad_norm"):
        assert float(b[key]) == pytest.approx(float(a[key]), rel=1e-4, abs=1e-6), (key, a[key], b[key])
    assert float(b["diag/first_replay_max_abs_log_ratio"]) == 0.0  # replay bit-exact on each rank
    for folder in ("lora", "lora_ema"):
        wa, wb = lora(single, folder=folder), lora(two, folder=folder)
        assert [DEAD in k for k in wa if torch.equal(wa[k], torch.zeros_like(wa[k]))].count(False) < len(wa)
        for k in wa:
            torch.testing.assert_close(wb[k], wa[k], atol=1e-6, rtol=0, msg=f"{folder}: {k}")
    if sharding == "fsdp2":
        assert float(b["time/weight_gather"]) > 0
        assert (two / "checkpoints" / "checkpoint-1" / "sharded" / ".metadata").is_file()


def test_gradient_accumulation_equals_one_micro_batch(app, tmp_path: Path) -> None:
    big = app.train(load_config(app.Config, app.DEFAULT_CONFIG, one_epoch(
        tmp_path / "big", "rollout.sample_batch_size=8", "train.micro_batch_size=8", "train.gradient_accumulation_steps=1")))
    small = app.train(load_config(app.Config, app.DEFAULT_CONFIG, one_epoch(
        tmp_path / "small", "rollout.sample_batch_size=8", "train.micro_batch_size=2", "train.gradient_accumulation_steps=4")))
    [a], [b] = rows(big), rows(small)
    assert a["optimizer_steps"] == b["optimizer_steps"] == "1"
    assert float(b["loss/total"]) == pytest.approx(float(a["loss/total"]), abs=1e-6)
    wa, wb = lora(big), lora(small)
    for k in wa:  # replays of 2 rows vs 8 rows round differently on the CPU: float tolerance
        torch.testing.assert_close(wb[k], wa[k], atol=2e-6, rtol=0, msg=k)


def test_resume_from_a_sharded_checkpoint_equals_uninterrupted_run(app, tmp_path: Path) -> None:
    """train.sharding=fsdp2: 2 epochs = 1 epoch, then --resume for the second, bit for bit: the
    LoRA and optimizer shards (DCP), the EMA and the sampler come back exactly."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    def config(out: Path, epochs: int):
        return load_config(app.Config, app.DEFAULT_CONFIG, tiny_overrides(
            out, f"train.epochs={epochs}", "train.save_freq=1", 'train.sharding="fsdp2"'))

    whole = in_process_group(app, config(tmp_path / "whole", 2))
    first = in_process_group(app, config(tmp_path / "parts", 1))
    resumed = in_process_group(app, config(tmp_path / "parts", 2), resume="latest")
    assert resumed == first
    a, b = whole / "checkpoints" / "checkpoint-2", resumed / "checkpoints" / "checkpoint-2"
    assert json.loads((b / "meta.json").read_text())["sharded"] == ["sharded"]
    for name in ("ema.pt", "sampler.pt"):
        sa, sb = torch.load(a / name, weights_only=True), torch.load(b / name, weights_only=True)
        assert json.dumps(flat(sa)) == json.dumps(flat(sb)), name
    dcp_to_torch_save(a / "sharded", tmp_path / "a.pt")
    dcp_to_torch_save(b / "sharded", tmp_path / "b.pt")
    sa, sb = torch.load(tmp_path / "a.pt", weights_only=False), torch.load(tmp_path / "b.pt", weights_only=False)
    # the LoRA and the buffers; the frozen base weights are not checkpointed
    assert {k for k in sa["model"] if ".lora_" not in k} == {"base_model.model.pos_embed.pos_embed"}
    assert sa["optim"]["state"] and json.dumps(flat(sa)) == json.dumps(flat(sb))
    for folder in ("lora", "lora_ema"):
        wa, wb = lora(whole, 2, folder), lora(resumed, 2, folder)
        assert all(torch.equal(wa[k], wb[k]) for k in wa), folder
    ema, raw = lora(whole, 2, "lora_ema"), lora(whole, 2)
    assert any(not torch.equal(ema[k], raw[k]) for k in raw)  # the EMA export is not the raw LoRA
    steps = [int(r["step"]) for r in rows(resumed)]
    assert steps == [1, 2]
