"""rl_core.train.progress: shown on a terminal with step/total and metrics; silent otherwise."""

from __future__ import annotations

import io

from rich.console import Console

from rl_core.train.progress import TrainProgress


def test_shows_step_total_metrics_and_phase_times_on_a_terminal() -> None:
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=160)
    with TrainProgress(10, initial=2, show=("reward/mean",), console=console) as bar:
        assert bar.enabled
        bar.update(3, {"reward/mean": 0.51234, "loss": 9.0, "time/generate": 1.2})
    text = out.getvalue()
    assert "3/10" in text
    assert "reward/mean=0.5123" in text
    assert "generate 1.20s" in text
    assert "loss" not in text


def test_silent_when_not_a_terminal() -> None:
    out = io.StringIO()
    with TrainProgress(10, console=Console(file=out, force_terminal=False)) as bar:
        bar.update(5, {"reward": 1.0})
    assert not bar.enabled
    assert out.getvalue() == ""
