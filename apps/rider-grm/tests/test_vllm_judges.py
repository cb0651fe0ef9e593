"""Judges on a real vLLM (opt-in `-m vllm`, needs a GPU): one vLLM engine per judge, asleep
whenever it is not scoring, in a full run of the recipe."""

from __future__ import annotations

import csv
import importlib.util
from pathlib import Path

import pytest
import torch
from conftest import REPO, app, tiny_overrides

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None or not torch.cuda.is_available(),
                       reason="needs vLLM and a GPU"),
]
# tiny:qwen3_vllm: tiny judges with 64-wide heads, which vLLM's attention kernels take; enforce_eager:
# they start in seconds instead of compiling and capturing CUDA graphs
OPTIONS = '{gpu_memory_utilization = 0.15, enforce_eager = true, dtype = "bfloat16", max_model_len = 2048}'
JUDGES = (
    f'[{{name = "score", module = "{REPO}/examples/rider-grm/reward_function/rating_judge.py", model = "tiny:qwen3_vllm:1", '
    f'weight = 0.3, combine = "add", max_new_tokens = 4, fallback = 0.25, engine = "vllm", engine_options = {OPTIONS}}}, '
    f'{{name = "consistency", module = "{REPO}/examples/rider-grm/reward_function/no_contradiction_judge.py", '
    f'model = "tiny:qwen3_vllm:2", weight = 0.5, combine = "mul", max_new_tokens = 4, fallback = 0.5, engine = "vllm", '
    f'engine_options = {OPTIONS}}}]'
)


def test_two_vllm_judges_swapped_in_a_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")  # one engine-core process per judge
    run = app.main(tiny_overrides(tmp_path, **{"reward.judges": JUDGES, "train.max_steps": 2, "model.dtype": '"float32"'}))
    with (run / "metrics.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2
    for row in rows:
        assert row["check/judges_awake_during_generate"] == "0"  # both vLLM judges asleep while the policy samples
        assert row["check/policy_awake_during_score"] == "0"
        assert row["check/policy_awake_during_consistency"] == "0"
        for name in ("score", "consistency"):
            assert float(row[f"score/{name}_mean"]) == float(row[f"score/{name}_mean"])  # finite, scored
            assert float(row[f"mem/judge_{name}_sleep_gib"]) >= 0
