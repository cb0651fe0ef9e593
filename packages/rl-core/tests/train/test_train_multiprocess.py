"""rl_core.train under a real 2-process Accelerate run on CPU (gloo): one shared run directory,
a checkpoint both ranks save and reload, bit-identical continuation on each rank.

Note: `accelerate launch --cpu --num_processes 2` starts ONE process unless mpirun is set up;
`--multi_gpu --num_processes 2` with `Accelerator(cpu=True)` gives two gloo CPU processes.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("mp_checkpoint_script.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow  # two torch+accelerate processes: ~30 s idle, ~100 s on a busy 2-core box
def test_two_process_save_and_resume(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    result = subprocess.run(
        [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
         "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
         "--main_process_port", str(_free_port()), str(SCRIPT), str(tmp_path)],
        capture_output=True, text=True, env=env, timeout=300, check=False,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    runs = [p for p in tmp_path.iterdir() if p.name.startswith("run-")]
    assert len(runs) == 1, runs  # both ranks agreed on one timestamped name
    run = runs[0]
    assert f"OK {run}" in result.stdout
    ckpt = run / "checkpoints" / "checkpoint-3"
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["checkpoint-3"]
    assert {"random_states_0.pkl", "random_states_1.pkl", "counter.pt", "meta.json"} <= {
        p.name for p in ckpt.iterdir()}
    lines = (run / "metrics.csv").read_text().splitlines()
    assert lines[0] == "step,loss"
    assert [line.split(",")[0] for line in lines[1:]] == ["1", "2", "3", "4", "5", "6",
                                                          "4", "5", "6"]
    assert (run / "config.toml").read_text() == "lr = 0.01\n"
