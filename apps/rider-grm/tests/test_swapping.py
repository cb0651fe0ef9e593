"""Swap plans (hand-worked memory budgets) and a judge's sleep/wake through the pinned offloaders
(their unit tests live with them in rl-core: tests/train/test_train_offload.py)."""

from __future__ import annotations

import pytest
import torch
from judging import Judge, RecordingEngine
from swapping import PLANS, compute_swap_plan

from rl_core.train import PhaseTimer, PinnedOffload
from rl_models import tiny
from rl_rewards.scorers.judge import JudgeScorer
from rl_rollout.hf import HFEngine


def test_swap_plan_keeps_everything_resident_when_it_fits() -> None:
    # never = max(30 + 20, 25 + 20 + 20 - 10, 25 + 20 + 20 - 10) = 55 <= 80
    assert compute_swap_plan(30, 20, [10, 10], [25, 25], capacity=80) == "never"


def test_swap_plan_keeps_the_policy_when_only_one_judge_fits_beside_it() -> None:
    # never = max(30 + 20, 25 + 20 + 10, 35 + 20 + 10) = 65 > 60; judges = 35 + 20 = 55 <= 60
    assert compute_swap_plan(30, 20, [10, 10], [25, 35], capacity=60) == "judges"


def test_swap_plan_swaps_everything_when_a_judge_and_the_policy_do_not_fit() -> None:
    # judges = 35 + 20 = 55 > 50
    assert compute_swap_plan(30, 20, [10, 10], [25, 35], capacity=50) == "always"


def test_swap_plan_without_judges_and_bad_input() -> None:
    assert compute_swap_plan(30, 20, [], [], capacity=1) == "never"
    with pytest.raises(ValueError, match="2 judge weights but 1 judge peaks"):
        compute_swap_plan(30, 20, [1, 2], [3], capacity=80)
    assert [PLANS[n].offload_policy for n in ("always", "judges", "never")] == [True, False, False]
    assert [PLANS[n].sleep_judges for n in ("always", "judges", "never")] == [True, True, False]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_pinned_offload_frees_the_gpu_and_the_engine_moves_nothing_more() -> None:
    """On CUDA: after a judge's `sleep` its weights live in pinned host buffers (memory freed), the
    engine is asleep; `wake` restores them bit-exactly and a second sleep reuses the buffers."""
    engine = HFEngine.from_pretrained(tiny.build("qwen3"), device="cuda")
    offload = PinnedOffload(engine.model, torch.device("cuda"))
    scorer = JudgeScorer(engine, engine.tokenizer, "rl_rewards.judges.yes_no")
    judge = Judge("j", 0, scorer, PhaseTimer(), engine=RecordingEngine(engine), offload=offload)
    expected = {k: v.clone() for k, v in engine.model.state_dict().items()}
    torch.cuda.synchronize()
    awake = torch.cuda.memory_allocated()
    judge.sleep()
    assert engine.state == "asleep" and all(h.is_pinned() for h in offload.host)
    assert awake - torch.cuda.memory_allocated() >= offload.nbytes
    first = [h.data_ptr() for h in offload.host]
    judge.wake()
    assert engine.state == "awake" and next(engine.model.parameters()).is_cuda
    assert all(torch.equal(v, expected[k]) for k, v in engine.model.state_dict().items())
    judge.sleep()
    assert [h.data_ptr() for h in offload.host] == first
