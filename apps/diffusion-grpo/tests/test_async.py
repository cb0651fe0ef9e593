"""Asynchronous rollouts (`train.max_staleness`): the rollout thread samples with its own copy of
the LoRA model (or Ray workers' pushed copies) while the trainer updates. 2 processes equal 1
process with twice the batch, a resume from a checkpoint with rollouts in flight equals the
uninterrupted run bit for bit, and the Ray workers sample the versions the schedule names."""

from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import APP, CONFIGS, flat, tiny_config, tiny_overrides, train
from grpo_config import compiles_blocks, first_replay_tolerance
from safetensors.torch import load_file

from rl_core.train import ConfigError, load_config

REPO = APP.parents[1]

# what torch.compile warns on CUDA (each an error under this suite's filterwarnings; a user's run
# only prints them): inductor on float32 matmuls with TF32 off, dynamo reading `.grad` of non-leaf
# fake tensors while tracing the replay, inductor splitting a softmax reduction (Janus's decode)
COMPILE_NOTES = ("ignore:TensorFloat32 tensor cores for float32 matrix multiplication:UserWarning",
                 "ignore:The .grad attribute of a Tensor that is not a leaf:UserWarning",
                 r"ignore:\s*Online softmax is disabled on the fly:UserWarning")


def rows(run: Path) -> list[dict[str, str]]:
    with (run / "metrics.csv").open(newline="") as f:
        return [r for r in csv.DictReader(f) if r.get("reward/mean")]


def lora(run: Path, folder: str = "lora") -> dict[str, torch.Tensor]:
    return load_file(run / "checkpoint-final" / folder / "adapter_model.safetensors")


def test_two_processes_equal_one_process_with_twice_the_batch(app, tmp_path: Path) -> None:
    """Staleness 1 over 2 epochs: epoch 2 trains on rollouts of the starting weights, sampled by
    the rollout thread of each process while epoch 1 updated."""
    common = ("train.epochs=2", "train.save_freq=1", "train.max_staleness=1")
    single = train(app, tiny_config(app, "sd3", tmp_path / "one", *common,
                                   "train.gradient_accumulation_steps=2"))  # both groups in one optimizer step
    launcher = Path(sys.executable).with_name("accelerate")
    result = subprocess.run(
        [str(launcher), "launch", "--multi_gpu", "--num_machines", "1", "--mixed_precision", "no", "--num_processes",
         "2", "--dynamo_backend", "no", str(APP / "__main__.py"), "--config", str(CONFIGS["sd3"]),
         *tiny_overrides(tmp_path / "two", *common)],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(APP), "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
        timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    two = (tmp_path / "two" / "latest").resolve()
    a, b = rows(single), rows(two)
    for r in (a, b):
        assert [float(x["rollout/staleness"]) for x in r] == [0, 1]
        assert [x["rollout/weight_version"] for x in r] == ["0.0", "0.0"]  # epoch 2: the starting weights sampled
        assert [float(x["optimizer_steps"]) for x in r] == [1, 1]
    assert float(a[0]["replay/engine_diff_max"]) == 0.0  # epoch 1 is on-policy: checked, bit-exact
    assert float(a[1]["replay/engine_diff_max"]) > 0  # epoch 2's ratio is not 1: logged, not checked
    # epoch 2 (stale, sampled by each process's rollout thread) to 1e-3: its rewards are ~0.51 with a
    # spread of ~0.0017, so a last-bit difference of one image's latents moves reward/std and adv/std
    # by ~1.5e-4 relative (measured on a 2-core x86 CI machine; reward/mean stays equal) and
    # engine_diff_mean (~9.5e-6) by ~1e-8. A wrong version sampled moves them by far more, and the
    # versions themselves are asserted above.
    for ra, rb in zip(a, b, strict=True):
        rel, abs_ = (1e-4, 1e-6) if ra["step"] == "1" else (1e-3, 1e-7)
        for key in ("reward/mean", "reward/std", "adv/std", "loss/total", "loss/kl", "grad_norm",
                    "replay/engine_diff_mean", "image/brightness"):
            assert float(rb[key]) == pytest.approx(float(ra[key]), rel=rel, abs=abs_), (ra["step"], key, ra[key], rb[key])
    # each process saved its own rollouts in flight (epoch 2's, at checkpoint 1)
    pipeline = two / "checkpoints" / "checkpoint-1" / "pipeline"
    assert sorted(p.name for p in pipeline.iterdir()) == ["rank0.pt", "rank1.pt"]
    # Not to 1e-6 as one epoch: a process of two samples in other last bits than the single process
    # (latents 2e-6 apart after 4 steps, synchronous runs too), so one image of epoch 2 lands on
    # another 8-bit pixel value (reward/mean 0.5095234 vs 0.5095239); Adam's normalised second step
    # turns that into up to ~2% of lr = 3e-4 (seen 5.8e-6). Other rollouts would differ at ~lr.
    for folder in ("lora", "lora_ema"):
        wa, wb = lora(single, folder), lora(two, folder)
        assert wa.keys() == wb.keys()
        for k in wa:
            torch.testing.assert_close(wb[k], wa[k], atol=2e-5, rtol=0, msg=f"{folder}: {k}")


@pytest.mark.parametrize(("family", "staleness"), [("sd3", 1), ("sd3", 2), ("janus", 1)])
def test_resume_with_rollouts_in_flight_is_bit_identical(app, tmp_path: Path, family: str, staleness: int) -> None:
    """4 epochs straight against a copy of the run resumed from checkpoint 2 (`--resume PATH`),
    whose `pipeline/rank0.pt` holds the rollouts of epochs 3 .. 2 + N, sampled before the save."""
    args = [*tiny_overrides(tmp_path, "train.epochs=4", "train.save_freq=1", "train.keep_last=9",
                            f"train.max_staleness={staleness}", family=family)]
    if family == "janus":
        args = ["--config", str(CONFIGS["janus"]), *args]
    straight = app.main([*args, "train.run_name=straight"])
    ckpt = straight / "checkpoints" / "checkpoint-2"
    in_flight = torch.load(ckpt / "pipeline" / "rank0.pt", weights_only=False)
    assert [s.step for s in in_flight["items"]] == list(range(3, 3 + staleness))
    cut = tmp_path / "cut"
    shutil.copytree(straight, cut)
    for later in ("checkpoints/checkpoint-3", "checkpoints/checkpoint-4", "checkpoint-final"):
        shutil.rmtree(cut / later)  # written again by the resumed run, not copied
    resumed = app.main([*args, "--resume", str(cut / "checkpoints" / "checkpoint-2")])
    assert resumed == cut
    a, b = rows(straight), rows(resumed)
    assert [r["step"] for r in b] == ["1", "2", "3", "4"]
    assert [float(r["rollout/staleness"]) for r in a] == [min(j - 1, staleness) for j in range(1, 5)]
    keys = ("reward/mean", "adv/std", "loss/total", "grad_norm", "rollout/staleness", "rollout/weight_version",
            "replay/engine_diff_max", "image/brightness")
    for ra, rb in zip(a, b, strict=True):
        assert {k: ra[k] for k in keys} == {k: rb[k] for k in keys}
    for name in ("lora.pt", "ema.pt", "optimizer.pt", "sampler.pt"):
        sa = torch.load(straight / "checkpoints" / "checkpoint-4" / name, weights_only=True)
        sb = torch.load(resumed / "checkpoints" / "checkpoint-4" / name, weights_only=True)
        assert json.dumps(flat(sa)) == json.dumps(flat(sb)), name
    wa, wb = lora(straight), lora(resumed)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_an_asynchronous_checkpoint_resumed_synchronously(app, tmp_path: Path) -> None:
    """train.max_staleness=0 after a checkpoint with a rollout in flight: that (stale) rollout is
    trained first, its ratio not checked; then each epoch samples on-policy (checked, exact)."""
    args = tiny_overrides(tmp_path, "train.epochs=3", "train.save_freq=1", "train.keep_last=9")
    run = app.main([*args, "train.max_staleness=1", "train.run_name=mixed"])
    resumed = app.main([*args, "train.max_staleness=0", "--resume", str(run / "checkpoints" / "checkpoint-1")])
    table = rows(resumed)
    assert [r["rollout/staleness"] for r in table] == ["0.0", "1.0", ""]
    assert [r["rollout/weight_version"] for r in table] == ["0.0", "0.0", "4.0"]
    assert float(table[1]["replay/engine_diff_max"]) > 0 and float(table[2]["replay/engine_diff_max"]) == 0


@pytest.mark.slow  # ~30 s on 2 cores: opt-in (nox -s slow) to keep the default suite under 30 minutes
def test_ray_workers_sample_the_scheduled_versions(app, ray_cluster, tmp_path: Path) -> None:
    """rollout.workers=2 (split placement): each rollout pushes the LoRA published for its
    version; the run equals the in-process asynchronous one (to the float rounding of the
    workers' smaller batches, as test_ray_rollout.py's synchronous runs)."""
    runs = {}
    for workers in (2, 0):
        overrides = tiny_overrides(tmp_path / str(workers), "train.epochs=3", "train.save_freq=1",
                                   "train.max_staleness=1", f"rollout.workers={workers}", "rollout.placement=split")
        runs[workers] = train(app, load_config(app.Config, app.DEFAULT_CONFIG, overrides))
    ray_rows, local_rows = rows(runs[2]), rows(runs[0])
    for r in (ray_rows, local_rows):  # 2 optimizer steps per epoch; epoch 3 samples with the weights of epoch 1
        assert [r_["rollout/weight_version"] for r_ in r] == ["0.0", "0.0", "2.0"]
        assert [float(r_["rollout/staleness"]) for r_ in r] == [0, 1, 1]
    assert float(ray_rows[0]["replay/engine_diff_max"]) == 0.0  # on-policy: the workers' log-probs replayed exactly
    for key, tolerance in (("reward/mean", {"rel": 1e-4}), ("image/brightness", {"rel": 1e-4}),
                           ("loss/total", {"abs": 1e-5}), ("grad_norm", {"rel": 1e-3})):
        assert [float(r[key]) for r in ray_rows] == pytest.approx([float(r[key]) for r in local_rows], **tolerance), key
    a, b = lora(runs[2]), lora(runs[0])
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=3e-5, msg=k)


def test_a_sharded_policy_with_ray_workers_is_refused(app, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"train\.max_staleness=1 with rollout\.workers=1 and train\.sharding='fsdp2': "
                                          r"a sharded LoRA is not published to Ray workers yet"):
        train(app, load_config(app.Config, app.DEFAULT_CONFIG, tiny_overrides(
            tmp_path, "train.max_staleness=1", 'train.sharding="fsdp2"', "rollout.workers=1")))


@pytest.mark.parametrize("tuned", ["lora", "full"])
def test_a_sharded_policy_samples_asynchronously_as_an_unsharded_one(app, tmp_path: Path, tuned: str) -> None:
    """train.sharding=fsdp2 with max_staleness=1 (FSDP2 on a gloo group of this one process): the
    rollout thread samples from a whole copy of the LoRA model made from one gather, each version's
    LoRA all-gathered on the trainer's thread. Three epochs follow the unsharded run's schedule and
    numbers: the same versions sampled, rewards, losses and final LoRA (float tolerance: sharded and
    whole parameters reduce in other orders). `full`: the same, fully fine-tuned (every weight)."""
    from conftest import in_process_group

    def config(out: Path, *extra: str):
        return load_config(app.Config, app.DEFAULT_CONFIG, tiny_overrides(
            out, "train.epochs=3", "train.save_freq=3", "train.max_staleness=1", *extra,
            *(["model.lora_rank=0"] if tuned == "full" else [])))

    whole = train(app, config(tmp_path / "whole"))
    sharded = in_process_group(app, config(tmp_path / "sharded", 'train.sharding="fsdp2"'))
    a, b = rows(whole), rows(sharded)
    versions = [float(x["rollout/weight_version"]) for x in a]
    assert versions == [0, 0, float(a[0]["optimizer_steps"])] and versions[2] > 0
    assert [float(x["rollout/weight_version"]) for x in b] == versions
    for key in ("reward/mean", "loss/total", "grad_norm"):
        for x, y in zip(a, b, strict=True):
            # full: the grad norm sums every weight's square, in other orders (seen 1.2e-4 apart)
            rel = 5e-4 if tuned == "full" and key == "grad_norm" else 1e-4
            assert float(y[key]) == pytest.approx(float(x[key]), rel=rel, abs=1e-6), (key, x[key], y[key])
    assert float(b[0]["replay/engine_diff_max"]) == 0.0  # the copy samples the gathered weights exactly
    if tuned == "full":  # the exported transformer
        wa, wb = ({k: v for f in (run / "checkpoint-final" / "transformer").glob("*.safetensors") for k, v in load_file(f).items()}
                  for run in (whole, sharded))
    else:
        wa, wb = lora(whole), lora(sharded)
    assert wa.keys() == wb.keys() and wa
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], atol=1e-6, rtol=0, msg=k)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.filterwarnings(*COMPILE_NOTES)
@pytest.mark.parametrize("family", ["sd3", "janus"])
def test_staleness_on_a_gpu(app, tmp_path: Path, family: str) -> None:
    """On CUDA the rollout thread samples on a CUDA stream of its own, from its copy of the LoRA
    model, while the trainer updates on the default stream: the copies must be finished before that
    stream reads them. 3 epochs at staleness 1 follow the schedule (epochs 1 and 2 sample the
    starting weights, epoch 3 those after epoch 1's optimizer steps), with finite losses and the
    first epoch's replay within the ratio check's bound. sd3 runs at the CUDA defaults: its blocks
    compiled (model.compile unset), the automatic tolerance (1e-4 in float32)."""
    cfg = tiny_config(app, family, tmp_path, "train.epochs=3", "train.save_freq=1", "train.max_staleness=1")
    compiled = compiles_blocks(cfg, "cuda")
    assert compiled == (family == "sd3")
    run = train(app, cfg)
    r = rows(run)
    assert [float(x["rollout/staleness"]) for x in r] == [0, 1, 1]
    assert [float(x["rollout/weight_version"]) for x in r] == [0, 0, float(r[0]["optimizer_steps"])]
    assert float(r[0]["optimizer_steps"]) >= 1
    assert float(r[0]["replay/engine_diff_max"]) <= first_replay_tolerance(cfg, compiled)
    if compiled:  # the rollout thread's and the trainer's first calls built the blocks' graphs
        assert float(r[0]["compile/graphs"]) > 0
    for x in r:
        assert torch.isfinite(torch.tensor([float(x["loss/total"]), float(x["grad_norm"])])).all(), x


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.filterwarnings(*COMPILE_NOTES)
def test_the_default_config_compiles_the_blocks_on_a_gpu(app, tmp_path: Path) -> None:
    """The synchronous default on CUDA: model.compile unset compiles SD3's blocks for the rollout
    and the replay; every epoch's first replay stays inside the automatic tolerance (float32:
    1e-4), the second epoch builds no new graph, and the LoRA trains."""
    cfg = tiny_config(app, "sd3", tmp_path, "train.epochs=2", "train.save_freq=2")
    assert compiles_blocks(cfg, "cuda") and first_replay_tolerance(cfg, compiled=True) == 1e-4
    run = train(app, cfg)
    r = rows(run)
    assert float(r[0]["compile/graphs"]) > 0 and float(r[1]["compile/graphs"]) == 0, [x["compile/graphs"] for x in r]
    diffs = [float(x["replay/engine_diff_max"]) for x in r if x.get("replay/engine_diff_max")]
    assert diffs and max(diffs) <= 1e-4, diffs
    assert any(v.abs().sum() > 0 for k, v in lora(run).items() if "lora_B" in k)
