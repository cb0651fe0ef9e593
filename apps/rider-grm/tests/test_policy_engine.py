"""`rollout.engine` on a CPU machine: `auto` picks hf and says why; `vllm` stops at once with one
line naming the key and what is missing. (The vLLM route itself runs on a GPU: test_vllm_policy.py.)"""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch
from conftest import app, tiny_overrides

from rl_core.train import run_app

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="checks what a machine without CUDA does")
FAST = {"reward.judges": "[]", "reward.embedding.model": "null", "reward.rule": '"rider_rules:letter_e_share"',
        "train.max_steps": 1}


def test_auto_picks_hf_without_cuda_and_says_why(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = app.main(tiny_overrides(tmp_path, **FAST, **{"rollout.engine": '"auto"'}))  # the embedded default pins hf
    assert "rollout.engine: hf (auto: no CUDA device, vLLM needs one)" in capsys.readouterr().out.splitlines()
    with (run / "metrics.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [r["rollout/weight_version"] for r in rows] == ["0.0"]  # the hf engine decodes with the trained weights


def test_vllm_without_cuda_is_a_one_line_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = run_app("rider-grm", app.main, tiny_overrides(tmp_path, **FAST, **{"rollout.engine": '"vllm"'}))
    err = capsys.readouterr().err
    assert code == 2
    assert err.splitlines() == [
        'rider-grm: error: rollout.engine = "vllm" needs a CUDA GPU, and torch sees none on this machine: '
        'use rollout.engine = "hf" (or "auto", which picks hf here)']
    assert not list(tmp_path.iterdir())  # stopped before loading or writing anything
