"""`rollout.precision = "fp8"` on the tiny SD3 (the FP8 matmuls emulated on the CPU): the rollout
samples in FP8, the trainer rescores the old log-probs in the weights' dtype before the update,
logs the gap every step and corrects it; where it does not apply it is refused in one line."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
from conftest import checked, tiny_config, train
from grpo_config import first_replay_tolerance

from rl_core.train import ConfigError, unknown_metric_names

FP8 = ("rollout.precision=fp8",)


def _rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def test_fp8_rollouts_are_rescored_and_their_gap_is_logged_and_corrected(app, tmp_path: Path) -> None:
    """Two epochs with TIS: each update logs the FP8 rollout's log-prob gap to the rescore (about
    1e-4 per element-mean step log-prob on the tiny model, Flow-GRPO's clip: unrescored, the
    first replay would already clip), its KL and the TIS weights around 1; the first replay
    equals the rescored log-probs (eager blocks, same micro-batches: the automatic
    algo.replay_tolerance of 1e-5 would stop the run otherwise). The tolerance follows the precision: FP8 with other
    micro-batches keeps 1e-5, since the rescore runs the replay's own batches."""
    cfg = tiny_config(app, "sd3", tmp_path, *FP8, "algo.rollout_correction=token_truncate", "train.epochs=2",
                      "train.micro_batch_size=2")
    assert first_replay_tolerance(cfg, False) == 1e-5
    run = train(app, cfg)
    rows = [r for r in _rows(run / "metrics.csv") if r.get("replay/engine_diff_mean")]
    assert len(rows) == 2 and not unknown_metric_names(rows[0])
    for row in rows:  # every epoch's gap, over every trained step (not only the first replay's)
        gap, peak = float(row["replay/engine_diff_mean"]), float(row["replay/engine_diff_max"])
        assert 1e-6 < gap <= peak < 1e-2 and 0 <= float(row["replay/engine_kl"]) < 1e-4
        assert abs(float(row["policy/is_ratio_mean"]) - 1) < 1e-2
    bf16 = train(app, tiny_config(app, "sd3", tmp_path / "bf16", "train.epochs=1"))
    [row] = [r for r in _rows(bf16 / "metrics.csv") if r.get("replay/engine_diff_max")]
    assert float(row["replay/engine_diff_max"]) == 0.0 and not row.get("policy/is_ratio_mean")  # exact, uncorrected


def test_nft_samples_with_its_old_policy_in_fp8_and_rescores_nothing(app, tmp_path: Path) -> None:
    """DiffusionNFT trains on the clean images, not on log-probs: its old policy's engine (a copy
    over the trainer's) samples in FP8 and the update runs without a rescore or a gap to log."""
    from conftest import setup_state

    cfg = tiny_config(app, "sd3", tmp_path, *FP8, "train.method=nft", "sampling.kind=ode", "sampling.guidance_scale=1",
                      "train.epochs=1")
    state = setup_state(app, cfg)
    assert state.family.old.engine.precision == "fp8" and state.family.engine.precision == "fp8"
    run = train(app, cfg)
    [row] = [r for r in _rows(run / "metrics.csv") if r.get("reward/mean")]
    assert float(row["optimizer_steps"]) >= 1 and not row.get("replay/engine_diff_mean")


@pytest.mark.parametrize(("extra", "message"), [
    (("train.ratio_norm=true",), r"train\.ratio_norm=true \(GRPO-Guard\) .* rollout\.precision='fp8' rescores"),
    (("rollout.precision=int8",), r"rollout\.precision"),
])
def test_fp8_is_refused_where_it_does_not_apply(app, extra: tuple[str, ...], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        checked(app, *extra, *FP8)


def test_janus_samples_in_fp8_and_its_update_is_rescored(app, tmp_path: Path) -> None:
    """The Janus family: the engine decodes and scores its tokens in FP8, the trainer rescores
    them (the KL reference's forward included: the replay callback's) and logs the gap."""
    run = train(app, tiny_config(app, "janus", tmp_path, *FP8, "algo.rollout_correction=token_truncate",
                                 "train.epochs=1"))
    [row] = [r for r in _rows(run / "metrics.csv") if r.get("replay/engine_diff_mean")]
    assert 1e-6 < float(row["replay/engine_diff_mean"]) < 0.5 and abs(float(row["policy/is_ratio_mean"]) - 1) < 0.5
