# ruff: noqa: E402  (imports follow the importorskip of the optional extra)
"""Which engine a judge built from a config runs on: `auto` (the default) picks hf on a machine
without CUDA and says why in one log line; `vllm` asked for where it cannot run is refused
before anything loads, naming the setting and the reason."""

import logging

import pytest

torch = pytest.importorskip("torch")  # the [hf] extra; skipped in the torch-free session

from rl_core.errors import UserError
from rl_models.tiny import build
from rl_rewards.registry import build_scorer
from rl_rewards.samples import Sample
from rl_rewards.scorers.engines import judge_engine
from rl_rollout.hf import HFEngine

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="on a CUDA machine auto may pick vLLM")
QA = [{"question": "What colour is the ball?", "choices": ["red", "blue"], "answer": "A"}]


@no_cuda
def test_caption_qa_judge_engine_defaults_to_auto_which_picks_hf_here_and_logs_why(caplog):
    judge = str(build("qwen3"))
    with caplog.at_level(logging.INFO, logger="rl_rewards.judges"):
        scorer = build_scorer("caption_qa", model=judge, engine_options={"device": "cpu"})
    assert isinstance(scorer.engine, HFEngine)
    lines = [r.getMessage() for r in caplog.records if r.name == "rl_rewards.judges"]
    assert lines == [f"caption_qa judge {judge}: engine hf (auto: no CUDA device, vLLM needs one)"]
    # and it scores as the explicit hf judge does
    explicit = build_scorer("caption_qa", model=judge, engine="hf", engine_options={"device": "cpu"})
    sample = [Sample(completion="a red ball on the grass", reference=QA)]
    assert scorer.score(sample)[0].score == explicit.score(sample)[0].score


@no_cuda
def test_explicit_vllm_engine_without_a_gpu_is_refused_naming_the_key_before_loading():
    with pytest.raises(UserError) as info:
        build_scorer("caption_qa", model="/no/such/judge", engine="vllm")  # refused before the path is read
    assert str(info.value) == ('engine = "vllm" needs a CUDA GPU, and torch sees none on this machine: '
                               'use engine = "hf" (or "auto", which picks hf here)')
    with pytest.raises(UserError, match=r'^reward\.judge_engine = "vllm" needs a CUDA GPU'):
        judge_engine("vllm", "/no/such/judge", key="reward.judge_engine")
