"""SDE windows as config choices (Flow-GRPO-Fast's random window, MixGRPO's sliding one): only
the window's steps are sampled stochastically, carry log-probs and are replayed.

The tiny run has 4 sampling steps and train.timestep_fraction 0.99, so the trained steps are
k < int(4 x 0.99) = 3: a window lies in [0, 3).

- sliding, 2 steps, moved every epoch by 1: epoch 0 trains [0, 2), epoch 1 [1, 3), epoch 2 the
  last position [2, 3) (cut at 3), epoch 3 [0, 2) again.
- random, 2 steps: the first step is 0 or 1, drawn per sampled batch.
"""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
from conftest import checked, tiny_config, train

from rl_core.train import ConfigError, load_config


def _sliding(app, *extra: str):
    return load_config(app.Config, app.DEFAULT_CONFIG, ["sampling.sde_window_mode=sliding", "sampling.sde_window_size=2",
                                                        "sampling.shift_interval=1", *extra])


@pytest.mark.parametrize(("epoch", "window"), [(0, (0, 2)), (1, (1, 3)), (2, (2, 3)), (3, (0, 2))])
def test_sliding_window_per_epoch_in_the_tiny_run(app, epoch: int, window: tuple) -> None:
    assert app.sde_window(_sliding(app), epoch, 0) == window


def test_random_window_is_seeded_per_batch(app) -> None:
    cfg = load_config(app.Config, app.DEFAULT_CONFIG, ["sampling.sde_window_mode=random", "sampling.sde_window_size=2"])
    firsts = {app.sde_window(cfg, 0, first)[0] for first in range(0, 200, 4)}
    assert firsts == {0, 1}  # both places drawn over 50 batches, and nothing else
    assert app.sde_window(cfg, 5, 8) == app.sde_window(cfg, 5, 8)  # a resumed run draws it again


@pytest.mark.slow
def test_sliding_window_run_replays_the_window_each_epoch(app, tmp_path: Path) -> None:
    """3 epochs of the tiny run end to end (~9 s): the metrics show 2, 2, 1 replayed steps from 0, 1, 2."""
    cfg = tiny_config(app, "sd3", tmp_path, "sampling.sde_window_mode=sliding", "sampling.sde_window_size=2",
                      "sampling.shift_interval=1", "train.epochs=3", "algo.kl_coef=0")
    run_dir = train(app, cfg)
    with open(run_dir / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("replay/steps_per_batch")]
    got = [(float(r["replay/steps_per_batch"]), float(r["replay/first_step"]), float(r["replay/last_step"]))
           for r in rows]
    assert got == [(2, 0, 1), (2, 1, 2), (1, 2, 2)]


def test_window_options_are_checked(app) -> None:
    with pytest.raises(ConfigError, match=r"sampling\.sde_window=\[0, 2\] is the fixed window"):
        checked(app, "sampling.sde_window_mode=random", "sampling.sde_window=[0,2]")
    with pytest.raises(ConfigError, match=r"sde_window_size=5 does not fit"):
        checked(app, "sampling.sde_window_mode=random", "sampling.sde_window_size=5", "sampling.sde_window_range=[0,3]")
    steps = "sampling.num_steps=10"  # int(10 x 0.99) = 9 trained steps
    with pytest.raises(ConfigError, match=r"must lie in the 9 trained steps"):
        checked(app, steps, "sampling.sde_window_mode=sliding", "sampling.sde_window_range=[0,10]")
    cfg = checked(app, steps, "sampling.sde_window_mode=sliding", "sampling.sde_window_range=[2,9]")
    assert [app.sde_window(cfg, e, 0) for e in (24, 50, 150, 175)] == [(2, 4), (4, 6), (8, 9), (2, 4)]  # 7 places
