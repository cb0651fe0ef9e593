"""rl_core.train.metrics: CSV with growing columns, resume truncation, tracker forwarding,
PhaseTimer."""

from __future__ import annotations

import csv
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from rl_core.train.metrics import MetricsLogger, PhaseTimer


def _rows(path: Path) -> tuple[list[str], list[dict[str, str]]]:
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        rows = list(reader)
        return list(reader.fieldnames or []), rows


def test_csv_columns_grow_and_old_rows_get_empty_cells(tmp_path: Path) -> None:
    logger = MetricsLogger(tmp_path)
    logger.log(1, {"reward": torch.tensor(0.5), "loss": 2})
    logger.log(2, {"reward": np.float32(0.75), "loss": 1})
    logger.log(3, {"loss": 0.5, "time/generate": 1.25, "phase": "eval"})
    columns, rows = _rows(tmp_path / "metrics.csv")
    assert columns == ["step", "reward", "loss", "time/generate", "phase"]
    assert rows == [
        {"step": "1", "reward": "0.5", "loss": "2", "time/generate": "", "phase": ""},
        {"step": "2", "reward": "0.75", "loss": "1", "time/generate": "", "phase": ""},
        {"step": "3", "reward": "", "loss": "0.5", "time/generate": "1.25", "phase": "eval"},
    ]
    assert not list(tmp_path.glob(".*tmp"))


def test_reopening_appends_and_start_step_drops_rows_after_the_checkpoint(tmp_path: Path) -> None:
    logger = MetricsLogger(tmp_path)
    for step in range(1, 6):
        logger.log(step, {"reward": step / 10})
    resumed = MetricsLogger(tmp_path, start_step=3)  # crashed after step 5, checkpoint at 3
    resumed.log(4, {"reward": 0.0})
    columns, rows = _rows(tmp_path / "metrics.csv")
    assert columns == ["step", "reward"]
    assert [(r["step"], r["reward"]) for r in rows] == [
        ("1", "0.1"), ("2", "0.2"), ("3", "0.3"), ("4", "0.0")]


@pytest.mark.parametrize(("value", "error", "pattern"), [
    (torch.ones(3), ValueError, r"'bad' must be a scalar, got a tensor of shape \(3,\)"),
    ([1.0], TypeError, "'bad' must be a number, string or 1-element tensor, got list"),
])
def test_bad_metric_values_name_the_key(tmp_path: Path, value: Any, error: type, pattern: str) -> None:
    with pytest.raises(error, match=pattern):
        MetricsLogger(tmp_path).log(1, {"bad": value})


def test_forwards_to_accelerate_trackers(tmp_path: Path) -> None:
    """A custom tracker through Accelerate's GeneralTracker API (stands in for wandb/tensorboard,
    which need a service or an extra package)."""
    from accelerate import Accelerator
    from accelerate.tracking import GeneralTracker

    class RecordingTracker(GeneralTracker):
        name = "recording"
        requires_logging_directory = False

        def __init__(self) -> None:
            super().__init__()
            self.logged: list[tuple[int, dict[str, Any]]] = []

        @property
        def tracker(self) -> Any:
            return self

        def store_init_configuration(self, values: dict[str, Any]) -> None:
            pass

        def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
            self.logged.append((step, dict(values)))

    tracker = RecordingTracker()
    accelerator = Accelerator(cpu=True, log_with=[tracker])
    accelerator.init_trackers("test")
    MetricsLogger(tmp_path, accelerator=accelerator).log(7, {"reward": torch.tensor(1.5)})
    assert tracker.logged == [(7, {"reward": 1.5})]
    assert (tmp_path / "metrics.csv").read_text() == "step,reward\n7,1.5\n"
    accelerator.end_training()


def test_phase_timer_sums_phases_and_resets() -> None:
    timer = PhaseTimer()
    with timer("generate"):
        time.sleep(0.05)
    with timer("reward"):
        pass
    with timer("generate"):
        time.sleep(0.05)
    times = timer.pop()
    assert list(times) == ["time/generate", "time/reward"]
    assert 0.1 <= times["time/generate"] < 1.0
    assert 0.0 <= times["time/reward"] < 0.05
    assert timer.pop() == {}


def test_phase_timer_records_a_phase_that_raises() -> None:
    timer = PhaseTimer()
    with pytest.raises(KeyError), timer("update"):
        time.sleep(0.02)
        raise KeyError("x")
    assert timer.pop()["time/update"] >= 0.02


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only behaviour; with CUDA the memory keys are "
                    "checked by test_phase_timer_peak_memory_per_phase")
def test_phase_timer_reports_no_memory_without_cuda() -> None:
    timer = PhaseTimer()
    with timer("update"):
        pass
    assert list(timer.pop()) == ["time/update"]


@pytest.mark.gpu
def test_phase_timer_peak_memory_per_phase() -> None:
    timer = PhaseTimer()
    torch.zeros(1, device="cuda")  # CUDA in use
    with timer("big"):
        block = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")  # 0.25 GiB
        del block
    with timer("small"):
        torch.empty(2**20, dtype=torch.uint8, device="cuda")
    out = timer.pop()
    assert out["memory/big_peak_gib"] >= 0.25
    assert out["memory/small_peak_gib"] < out["memory/big_peak_gib"] - 0.2  # the peak was reset


def test_metric_table_covers_a_judges_eval_counters_and_no_other_deep_eval_name() -> None:
    """rider-grm logs its judges' counters on the held-out evaluation (`eval/judge/<name>/<metric>`);
    other eval names stay at most two segments deep."""
    from rl_core.train import unknown_metric_names

    names = ["eval/judge/rubric/scored", "eval/judge/rubric/parse_failures", "eval/reward/mean", "eval/reward/qa",
             "eval/judge/rubric/scored/extra", "eval/reward/qa/extra"]
    assert unknown_metric_names(names) == ["eval/judge/rubric/scored/extra", "eval/reward/qa/extra"]


def test_the_docs_show_the_table_of_metric_names() -> None:
    """docs/metrics.md's table is the one in code, row for row (docs are code)."""
    from pathlib import Path

    from rl_core.train.metric_names import METRIC_NAMES

    readme = (Path(__file__).resolve().parents[4] / "docs" / "metrics.md").read_text(encoding="utf-8")
    rows = [line for line in readme.splitlines() if line.startswith("| `")]
    shown = {line.split("`")[1]: line.split(" | ", 1)[1].removesuffix(" |") for line in rows if "`" in line}
    assert {k: shown.get(k) for k in METRIC_NAMES} == METRIC_NAMES


def test_phases_nest_and_a_scope_names_them_apart() -> None:
    import time

    from rl_core.train import PhaseTimer

    timer = PhaseTimer()
    with timer("update"):
        with timer("logprob"):
            time.sleep(0.02)
        time.sleep(0.01)
    with timer("eval"), timer.scope("eval/"), timer("rollout"):
        time.sleep(0.01)
    out = timer.pop()
    assert out["time/update"] >= out["time/logprob"] + 0.009 and out["time/logprob"] >= 0.019
    assert out["time/eval/rollout"] >= 0.009 and "time/rollout" not in out and out["time/eval"] >= out["time/eval/rollout"]
    assert timer.peak_gib("update") is None and timer.pop() == {}  # no CUDA: no memory figures; pop resets


def test_the_run_plot_has_a_panel_per_logged_family(tmp_path) -> None:
    from rl_core.train.plots import plot_panels, plot_reward_curve

    header = ["step", "reward/mean", "reward/std", "reward/failed", "reward/qa", "reward/format",
              "reward/length.n_tokens", "eval/reward/mean", "policy/entropy", "loss/policy", "loss/kl",
              "policy/approx_kl", "time/step"]
    lines = [",".join(header), "0,,,,,,,0.15,,,,,", "1,0.2,0.1,0,0.3,0,40,,6.4,0.01,0,0.0,1.0",
             "2,0.4,0.1,0,0.5,0,38,0.45,6.3,0.02,0,0.0,1.0"]
    (tmp_path / "metrics.csv").write_text("\n".join(lines) + "\n")
    from rl_core.train.plots import _read

    assert plot_panels(_read(tmp_path / "metrics.csv")) == [
        # no counts, spreads or sub-components; a component at 0 throughout is drawn (not learnt)
        ("reward", ["reward/mean", "reward/qa", "reward/format", "eval/reward/mean"]),
        ("entropy", ["policy/entropy"]), ("loss", ["loss/policy"])]  # no KL panel: 0 throughout is off
    out = plot_reward_curve(tmp_path, title="app: run-1")
    assert out == tmp_path / "reward_curve.png" and out.stat().st_size > 10_000
    assert not list(tmp_path.glob(".*tmp*"))  # written through a temporary file, renamed


def test_compile_watch_counts_the_graphs_built_since_the_last_pop():
    """A first compile, a call that reuses its graph, a recompile for a new shape (dynamo's
    automatic dynamic shapes), then a call the dynamic graph serves: 1, 0, 1, 0 graphs."""
    from rl_core.train.metrics import CompileWatch

    watch = CompileWatch()
    double = torch.compile(lambda x: x * 2 + 1, backend="eager")
    seen = []
    for rows in (3, 3, 5, 7):
        double(torch.ones(rows))
        seen.append(watch.pop())
    assert [row["compile/graphs"] for row in seen] == [1.0, 0.0, 1.0, 0.0]
    assert seen[0]["time/compile"] > 0 and seen[1]["time/compile"] == 0
