"""`rl_core.train.end_training` at the end of a real 2-process FSDP2 run on gloo: no process
leaves while another still exports, and the processes exit cleanly (no SIGABRT from a gloo
thread still freeing the last gather while the interpreter finalizes)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("mp_shutdown_script.py")


def _launch(out: Path) -> subprocess.CompletedProcess:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port),
         str(SCRIPT), str(out)], capture_output=True, text=True, env=env, timeout=300, check=False)


def test_no_process_ends_before_rank_0_has_exported(tmp_path: Path) -> None:
    result = _launch(tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    exported = float((tmp_path / "exported").read_text())
    assert float((tmp_path / "ended-1").read_text()) >= exported  # rank 1 waited out rank 0's 1 s export
    assert float((tmp_path / "ended-0").read_text()) >= exported


# This script with Accelerate's plain `end_training()` in place of ours aborted in 3 of 40
# launches on a 2-core CPU, each time `terminate called without an active exception` from a gloo
# worker thread; with ours, in 0 of 40. 30 launches catch a 7% abort rate 9 times in 10.
LAUNCHES = 30


@pytest.mark.slow  # 30 launches of two torch processes: 5 min on 2 cores
def test_thirty_two_process_fsdp2_exits_all_end_cleanly(tmp_path: Path) -> None:
    for i in range(LAUNCHES):
        out = tmp_path / str(i)
        out.mkdir()
        result = _launch(out)
        assert result.returncode == 0, f"launch {i}: " + result.stderr[-3000:]
