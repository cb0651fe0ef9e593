"""A judge's sleep/wake through the pinned offloaders (their unit tests live with them in rl-core:
tests/train/test_train_offload.py; the swap plans' in rl-policy: tests/test_swap.py)."""

from __future__ import annotations

import pytest
import torch
from judging import Judge, RecordingEngine

from rl_core.train import PhaseTimer, PinnedOffload
from rl_models import tiny
from rl_rewards.scorers.judge import JudgeScorer
from rl_rollout.hf import HFEngine


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
