"""Scorers that report where and how they were called, served by name through the server's
`[scorers]` table (`test_server_ray_serve.py` and `test_server_local_ray.py` put this folder on
the server's PYTHONPATH, which its Ray replicas inherit). Not test doubles of our code: user
scorers, as any `[scorers]` entry."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Sequence

from rl_rewards.samples import Sample, ScoreResult


class CallProbe:
    """Each sample's score is the number of samples in the scorer call it came in. A call
    appends `<pid> <samples> <time.monotonic()>` to the file `log` as it starts (one short write:
    whole lines from several processes; the monotonic clock is the machine's, shared by its
    processes), then sleeps `delay_s`: a replica busy with its batch for a while."""

    name = "call_probe"

    def __init__(self, *, log: str, delay_s: float = 0.0) -> None:
        self.log = log
        self.delay_s = delay_s

    def score(self, samples: Sequence[Sample]) -> list[ScoreResult]:
        with open(self.log, "a") as f:
            f.write(f"{os.getpid()} {len(samples)} {time.monotonic():.6f}\n")
        time.sleep(self.delay_s)
        return [ScoreResult(score=float(len(samples))) for _ in samples]


class ProcessProbe:
    """Each call appends one JSON line to the file `log`: the scoring process's `pid`,
    `executable` and `prefix` (its interpreter and environment, `sys.executable` and
    `sys.prefix`) and `cwd`, to compare with the server's. Each sample scores 1."""

    name = "process_probe"

    def __init__(self, *, log: str) -> None:
        self.log = log

    def score(self, samples: Sequence[Sample]) -> list[ScoreResult]:
        where = {"pid": os.getpid(), "executable": sys.executable, "prefix": sys.prefix, "cwd": os.getcwd()}
        with open(self.log, "a") as f:
            f.write(json.dumps(where) + "\n")
        return [ScoreResult(score=1.0) for _ in samples]
