"""`ray_pool.connect()` starting a local Ray from a script run with `uv run`, as `uv run apps/...`
runs a recipe with Ray rollout workers: with Ray's uv hook as a user has it (on), a worker runs
this interpreter (not `uv run` in an upload of the working directory, for which uv would build
an environment of its own), and the node is bound to the loopback."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("ray")

UV = shutil.which("uv")
SCRIPT = """
import json, os, sys
import ray
from rl_rollout.ray_pool import connect

started = connect(num_cpus=1)

@ray.remote(num_cpus=1)
def where():
    import os, sys
    import psutil
    return {"executable": sys.executable, "cwd": os.getcwd(), "parent": psutil.Process().parent().name()}

print(json.dumps({"started": started, "gcs": ray.get_runtime_context().gcs_address, **ray.get(where.remote())}))
ray.shutdown()
"""


@pytest.mark.skipif(UV is None, reason="needs uv on PATH (the launcher this test reproduces)")
def test_a_local_ray_under_uv_run_runs_workers_in_this_interpreter_on_the_loopback(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in {"RAY_ENABLE_UV_RUN_RUNTIME_ENV", "RAY_ADDRESS"}}
    try:  # with the hook on, Ray retries a worker that cannot start for minutes before it fails
        out = subprocess.run([str(UV), "run", "--offline", "--no-project", "--python", sys.executable, "python", "-c",
                              SCRIPT], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"no worker answered in {e.timeout} s: {(e.stderr or b'')[-3000:]!r}")
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["started"] is True
    assert seen["gcs"].startswith("127.0.0.1:")
    assert (seen["executable"], seen["cwd"], seen["parent"]) == (sys.executable, str(tmp_path), "raylet")
