"""Judges on a real vLLM (opt-in `-m vllm`, needs a GPU): one vLLM engine per judge, asleep
whenever it is not scoring, in a full run of the recipe with the policy on the hf engine."""

from __future__ import annotations

import csv
import importlib.util
from pathlib import Path

import pytest
import torch
from conftest import VLLM_JUDGES, app, tiny_overrides

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None or not torch.cuda.is_available(),
                       reason="needs vLLM and a GPU"),
]


def test_two_vllm_judges_swapped_in_a_run(tmp_path: Path) -> None:
    """Each judge's engine core runs in a process of its own whatever VLLM_ENABLE_V1_MULTIPROCESSING
    says (a GPU machine's environment may set it to 0 for colocated engines): `rl_rollout.colocated.vllm_engine_core`
    sets it for each engine it builds."""
    run = app.main(tiny_overrides(tmp_path, **{"reward.judges": VLLM_JUDGES, "train.max_steps": 2,
                                               "model.dtype": '"float32"', "rollout.engine": '"hf"'}))
    with (run / "metrics.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2
    for row in rows:
        assert row["check/judges_awake_during_rollout"] == "0"  # both vLLM judges asleep while the policy samples
        assert row["check/policy_awake_during_score"] == "0"
        assert row["check/policy_awake_during_consistency"] == "0"
        for name in ("score", "consistency"):
            assert float(row[f"reward/{name}"]) == float(row[f"reward/{name}"])  # finite, scored
            assert float(row[f"memory/judge_{name}_sleep_peak_gib"]) >= 0
