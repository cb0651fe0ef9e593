"""The long-tail length workload of the RL-step benchmarks: the same for every trainer compared.

Random weights never choose to stop, so a benchmark gives each sample a length drawn from a
stated distribution (`length`: 95% log-normal, median 260, sigma 0.35, clipped to 100-600; 5%
uniform 800-2048). `benchmarks/partial_rollouts.py` hands those lengths to our engine as
per-request budgets. An RL step of a whole trainer cannot take per-sample budgets (TRL's
`trl vllm-serve` has one `max_tokens` a call), so there the lengths are imposed inside vLLM by
a logits processor (`long_tail_stop.LongTailStop`) installed as a plugin (entry point group
`vllm.logits_processors`) that every vLLM engine of the run loads, ours and TRL's alike:
`plugin_env(dir)` writes the plugin's metadata into `dir` and returns the environment that
installs it for child processes. With a custom logits processor vLLM 0.26 runs its V1 model
runner instead of V2, for every engine of the run alike.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

GROUP, NAME = "vllm.logits_processors", "rl-long-tail"


def length(seed: int, scale: int = 1) -> int:
    """One response length: 95% log-normal (median 260, sigma 0.35) in 100-600, 5% uniform 800-2048."""
    rng = random.Random(seed)
    raw = rng.uniform(800, 2048) if rng.random() < 0.05 else min(600.0, max(100.0, rng.lognormvariate(5.56, 0.35)))
    return max(2, round(raw / scale))


def plugin_env(where: Path) -> dict[str, str]:
    """The environment under which every vLLM engine started by a child process loads
    `LongTailStop` (a dist-info in `where`, this directory on PYTHONPATH)."""
    info = where / "rl_long_tail-0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {NAME}\nVersion: 0\n")
    (info / "entry_points.txt").write_text(f"[{GROUP}]\nlong_tail = long_tail_stop:LongTailStop\n")
    path = [str(where), str(Path(__file__).resolve().parent), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in path if p)}
