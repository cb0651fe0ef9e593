"""The trainer loop's invariant checks, for any recipe's tests (torchtune's recipe tests are the
model). The loop's own tests run them on a tiny bandit recipe; an app runs the same checks on
its own recipe with a few lines:

    from rl_core.train.testing import assert_resume_is_bit_identical, assert_two_processes_equal_one

    def test_two_processes_equal_one(tmp_path):
        assert_two_processes_equal_one(app.main, APP / "__main__.py", ["train.batch_size=4", ...], tmp_path,
                                       keys=("reward/mean", "loss/policy", "grad_norm"))

Both read the weights the loop checkpointed at the last step (`accelerator.save_state`'s
`model.safetensors`), so they need `train.save_freq` to reach it (the last step is always saved).
`run_cli` runs an app as a user types it and says whether torch was imported: `--help` and
config errors must answer without it (`rl_core.train.parse_run`).
"""

from __future__ import annotations

import csv
import os
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["CliRun", "assert_resume_is_bit_identical", "assert_two_processes_equal_one", "checkpoint_weights",
           "launch", "metric_rows", "run_cli"]

Main = Callable[[list[str]], Path | None]


def metric_rows(run_dir: Path) -> list[dict[str, str]]:
    """metrics.csv of a run, one dict per row."""
    with (run_dir / "metrics.csv").open(newline="") as f:
        return list(csv.DictReader(f))


def checkpoint_weights(run_dir: Path, step: int | None = None) -> dict[str, torch.Tensor]:
    """The prepared model's weights in checkpoint `step` (default: the latest)."""
    from safetensors.torch import load_file

    root = run_dir / "checkpoints"
    folder = root / f"checkpoint-{step}" if step is not None else max(
        root.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    return load_file(folder / "model.safetensors")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(script: Path, args: Sequence[str], *, processes: int = 2, cwd: Path | None = None,
           timeout: float = 900) -> subprocess.CompletedProcess[str]:
    """`accelerate launch --multi_gpu --num_processes N script args` on CPU: N gloo processes (the
    launcher's `--cpu` alone starts one without MPI). Raises with the tail of stderr on failure.

    The processes start from an empty tiny-checkpoint cache (`RL_MODELS_CACHE`), as a user's
    first multi-process run does: a warm cache would hide a race between the ranks' builds."""
    with tempfile.TemporaryDirectory(prefix="rl-models-cache-") as cache:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "RL_MODELS_CACHE": cache, "PYTHONPATH": os.pathsep.join(
            [str(script.parent), *filter(None, [os.environ.get("PYTHONPATH")])])}
        return _launch(script, args, processes, cwd, timeout, env)


def _launch(script: Path, args: Sequence[str], processes: int, cwd: Path | None, timeout: float,
            env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(processes),
         "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port",
         str(_free_port()), str(script), *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout,
        check=False)
    if done.returncode != 0:
        raise AssertionError(f"{script} failed with {done.returncode}:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    return done


@dataclass(frozen=True)
class CliRun:
    """What `run_cli` saw: the exit code, stdout, stderr (without `-X importtime`'s lines) and
    whether the process imported torch."""

    returncode: int
    stdout: str
    stderr: str
    imported_torch: bool


def run_cli(app: Path, *args: str, cwd: Path | None = None, timeout: float = 300) -> CliRun:
    """`python -X importtime APP ARGS...` (an app directory or script, as a user runs it) in a fresh
    process: its output, and whether torch was among the modules it imported."""
    done = subprocess.run([sys.executable, "-X", "importtime", str(app), *args], capture_output=True, text=True,
                          cwd=cwd, timeout=timeout, check=False)
    lines = done.stderr.splitlines(keepends=True)
    imports = [line.rsplit("|", 1)[-1].strip() for line in lines if line.startswith("import time:")]
    return CliRun(done.returncode, done.stdout, "".join(line for line in lines if not line.startswith("import time:")),
                  "torch" in imports)


def assert_two_processes_equal_one(main: Main, script: Path, overrides: Sequence[str], tmp_path: Path, *,
                                   keys: Sequence[str], atol: float = 1e-6, cwd: Path | None = None) -> None:
    """The same run in one process (`main`, in this process) and in two (`script` under
    `accelerate launch`): every logged `keys` and the checkpointed weights agree within `atol`.
    `overrides` must make the samples independent of the process count (per-sample seeds)."""
    args = [*overrides, f"train.output_dir={tmp_path}"]
    single = main([*args, "train.run_name=one"])
    assert single is not None
    launch(script, [*args, "train.run_name=two"], cwd=cwd)
    a, b = metric_rows(single), metric_rows(tmp_path / "two")
    assert {r["world_size"] for r in a} == {"1"} and {r["world_size"] for r in b} == {"2"}
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for ra, rb in zip(a, b, strict=True):
        for key in keys:
            assert float(rb[key]) == float(ra[key]) or abs(float(rb[key]) - float(ra[key])) <= atol, (
                ra["step"], key, ra[key], rb[key])
    wa, wb = checkpoint_weights(single), checkpoint_weights(tmp_path / "two")
    assert set(wa) == set(wb)
    for name in wa:
        torch.testing.assert_close(wb[name], wa[name], atol=atol, rtol=0, msg=name)


def assert_resume_is_bit_identical(main: Main, overrides: Sequence[str], tmp_path: Path, *, steps: int,
                                   keys: Sequence[str]) -> None:
    """`steps` steps straight, against `steps - 1` steps then `--resume` to `steps`: the same
    logged `keys` and bit-identical checkpointed weights; the resumed run keeps its directory and
    its metrics.csv reads as one uninterrupted run."""
    args = [*overrides, f"train.output_dir={tmp_path}", "train.save_freq=1"]
    straight = main([*args, f"train.max_steps={steps}", "train.run_name=straight"])
    first = main([*args, f"train.max_steps={steps - 1}", "train.run_name=cut"])
    assert straight is not None and first is not None
    resumed = main([*args, f"train.max_steps={steps}", "--resume", str(first)])
    assert resumed == first
    a, b = metric_rows(straight), metric_rows(resumed)
    assert [r["step"] for r in b] == [str(k) for k in range(1, steps + 1)]
    for key in keys:
        assert [r[key] for r in a] == [r[key] for r in b], key
    wa, wb = checkpoint_weights(straight, steps), checkpoint_weights(resumed, steps)
    for name in wa:
        assert torch.equal(wa[name], wb[name]), name
