"""A scorer that reports the environment it runs in, served by name through the server's
`[scorers]` table (`test_server_environments.py` puts this folder on the server's PYTHONPATH,
which its workers inherit). `clash_dep` stands for a dependency two rewards need in different
versions (transformers, say): each test environment has its own `clash_dep.py`."""

from __future__ import annotations

import os
from collections.abc import Sequence

import clash_dep

from rl_rewards.samples import Sample, ScoreResult


class Where:
    """Each sample scores `clash_dep.VERSION`; components `pid` (the scoring process). Building it
    where `clash_dep` is older than `needs` fails, as a scorer does that needs a newer library."""

    name = "where"

    def __init__(self, *, needs: float = 0.0) -> None:
        if needs > clash_dep.VERSION:
            raise ImportError(f"this scorer needs clash_dep >= {needs}, found {clash_dep.VERSION} in {clash_dep.__file__}")

    def score(self, samples: Sequence[Sample]) -> list[ScoreResult]:
        return [ScoreResult(score=clash_dep.VERSION, components={"pid": float(os.getpid())}) for _ in samples]
