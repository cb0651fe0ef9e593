# ruff: noqa: E402  (imports follow the importorskip of the optional framework)
"""The verl adapter inside verl's own reward code (verl 0.9.1, installed by `nox -s third_party`):
the legacy NaiveRewardManager / BatchRewardManager on a real DataProto, and the reward loop's
NaiveRewardManager.run_single + RewardLoopWorker.compute_score_batch + RewardLoopManager.compute_rm_score,
whose aggregation takes the extra keys from sample 0. Only Ray's remote call is bypassed
(`ray.get` returns the worker's result directly); every line of verl's own code runs.
The batch puts a failed sample first (the worst case for "keys from sample 0") and a gated-out one."""

from __future__ import annotations

import asyncio
import pickle
import warnings
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
import numpy as np

with warnings.catch_warnings():  # verl imports Ray's deprecated experimental state API
    warnings.simplefilter("ignore", DeprecationWarning)
    verl = pytest.importorskip("verl")
    from verl import DataProto
    from verl.experimental.reward_loop import reward_loop as verl_reward_loop
    from verl.experimental.reward_loop.reward_manager.naive import (
        NaiveRewardManager as LoopNaiveRewardManager,
    )
    from verl.workers.reward_manager import BatchRewardManager, NaiveRewardManager

pytestmark = [pytest.mark.third_party, pytest.mark.filterwarnings("ignore::DeprecationWarning"),
              pytest.mark.filterwarnings("ignore::FutureWarning")]

from rl_rewards.adapters import as_verl_compute_score
from rl_rewards.composition import build_reward
from rl_rewards.samples import ScoreResult

SPEC = {
    "components": {
        "fmt": {"scorer": "timestamp_format"},
        "len": {"scorer": "length", "weight": 0.5, "options": {"tokenizer": "whitespace", "l1": 2, "l2": 4},
                "gate": {"component": "fmt", "threshold": 1.0}},
        "ref": {"scorer": "x"},
    }
}
ROWS = [  # (response, ground truth): failed first, then gated out, then scored
    ("[00:01] cat", "BAD"),
    ("no stamp cat", "cat"),
    ("[00:01] cat", "cat"),
]
KEYS = ["score", "failed", "fmt", "len", "len.n_tokens", "ref"]
EXPECTED = {  # hand-worked: failed -> error_score -1; gated out -> 0 + ref 1; scored -> 1 + 0.5 * 1 + 1
    "score": [-1.0, 1.0, 2.5], "failed": [1.0, 0.0, 0.0], "fmt": [1.0, 0.0, 1.0],
    "len": [1.0, 0.0, 1.0], "len.n_tokens": [2.0, 0.0, 2.0], "ref": [0.0, 1.0, 1.0],
}


class ReferenceMatch:
    name = "reference_match"

    def score(self, samples):
        return [ScoreResult.failed("unusable reference") if s.reference == "BAD"
                else ScoreResult(score=float(str(s.reference) in s.completion)) for s in samples]


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from rl_models.tiny import build

    return AutoTokenizer.from_pretrained(build("qwen3"))


def data_proto(tokenizer) -> DataProto:
    """A rollout batch as verl's trainer hands it to the reward manager: left-padded prompts,
    right-padded responses, one attention mask over both."""
    prompt = tokenizer("Describe the video.", add_special_tokens=False)["input_ids"]
    responses = [tokenizer(r, add_special_tokens=False)["input_ids"] for r, _ in ROWS]
    width = max(len(r) for r in responses)
    pad = tokenizer.pad_token_id
    prompts = torch.tensor([prompt] * len(ROWS))  # [B, P]
    resp = torch.tensor([r + [pad] * (width - len(r)) for r in responses])  # [B, R]
    mask = torch.tensor([[1] * len(prompt) + [1] * len(r) + [0] * (width - len(r)) for r in responses])  # [B, P + R]
    return DataProto.from_dict(
        tensors={"prompts": prompts, "responses": resp, "attention_mask": mask},
        non_tensors={
            "data_source": np.array(["caption"] * len(ROWS), dtype=object),
            "reward_model": np.array([{"ground_truth": gt} for _, gt in ROWS], dtype=object),
            "extra_info": np.array([{"index": i} for i in range(len(ROWS))], dtype=object),
        },
    )


def test_legacy_naive_reward_manager_collects_equal_length_extras(tokenizer):
    compute_score = as_verl_compute_score(build_reward(SPEC, scorers={"ref": ReferenceMatch()}), error_score=-1.0)
    manager = NaiveRewardManager(tokenizer=tokenizer, num_examine=0, compute_score=compute_score)
    out = manager(data_proto(tokenizer), return_dict=True)
    extras = out["reward_extra_info"]
    assert list(extras) == KEYS
    assert {k: list(v) for k, v in extras.items()} == EXPECTED
    # the trainer turns each into one array per key: equal lengths are what makes that work
    assert all(np.array(v).shape == (3,) for v in extras.values())
    assert out["reward_tensor"].sum(-1).tolist() == EXPECTED["score"]


def test_legacy_batch_reward_manager(tokenizer):
    compute_score = as_verl_compute_score(build_reward(SPEC, scorers={"ref": ReferenceMatch()}), batch=True,
                                          error_score=-1.0)
    manager = BatchRewardManager(tokenizer=tokenizer, num_examine=0, compute_score=compute_score)
    out = manager(data_proto(tokenizer), return_dict=True)
    assert {k: list(v) for k, v in out["reward_extra_info"].items()} == EXPECTED


def reward_loop(tokenizer, compute_score, monkeypatch) -> DataProto:
    """verl's reward loop for one worker: RewardLoopWorker.compute_score_batch (one
    NaiveRewardManager.run_single per sample), then RewardLoopManager.compute_rm_score."""
    config = SimpleNamespace(reward=SimpleNamespace(custom_reward_function=SimpleNamespace(path="reward.py")))

    async def run_worker(chunk):
        worker = SimpleNamespace(config=config)
        worker.reward_manager = LoopNaiveRewardManager(config, tokenizer, compute_score=compute_score)
        worker.compute_score = lambda data: verl_reward_loop.RewardLoopWorker.compute_score(worker, data)
        return await verl_reward_loop.RewardLoopWorker.compute_score_batch(worker, chunk)

    handle = SimpleNamespace(compute_score_batch=SimpleNamespace(remote=lambda chunk: asyncio.run(run_worker(chunk))))
    manager = SimpleNamespace(reward_model_manager=None, reward_loop_workers=[handle],
                              reward_manager_cls=LoopNaiveRewardManager)
    monkeypatch.setattr(verl_reward_loop.ray, "get", lambda refs: refs)  # the only part of Ray we skip
    return verl_reward_loop.RewardLoopManager.compute_rm_score(manager, data_proto(tokenizer))


def test_reward_loop_keeps_every_key_when_sample_zero_failed(tokenizer, monkeypatch):
    compute_score = as_verl_compute_score(build_reward(SPEC, scorers={"ref": ReferenceMatch()}), error_score=-1.0)
    out = reward_loop(tokenizer, compute_score, monkeypatch)
    assert out.meta_info["reward_extra_keys"] == KEYS
    assert {k: out.non_tensor_batch[k].tolist() for k in KEYS} == EXPECTED
    assert out.batch["rm_scores"].sum(-1).tolist() == EXPECTED["score"]


def test_reward_loop_drops_or_breaks_on_uneven_keys(tokenizer, monkeypatch):
    # the hazard the adapter avoids, shown on verl's own code: keys differ between samples
    def uneven(data_source, solution_str, ground_truth, extra_info=None, **kw):
        return {"score": 0.0} if ground_truth == "BAD" else {"score": 1.0, "fmt": 1.0}

    dropped = reward_loop(tokenizer, uneven, monkeypatch)
    assert dropped.meta_info["reward_extra_keys"] == ["score"]  # "fmt" silently gone for the batch
    global ROWS
    rows, ROWS = ROWS, ROWS[::-1]  # now sample 0 has "fmt" and the failed one does not
    try:
        with pytest.raises(KeyError, match="fmt"):
            reward_loop(tokenizer, uneven, monkeypatch)
    finally:
        ROWS = rows


SERVED = """
default_reward = "caption"
[rewards.caption.components.fmt]
scorer = "timestamp_format"
[rewards.caption.components.len]
scorer = "length"
weight = 0.5
options = { tokenizer = "whitespace", l1 = 2, l2 = 4 }
gate = { component = "fmt", threshold = 1.0 }
"""


def test_url_adapter_pickles_through_ray_and_keeps_keys_in_the_reward_loop(tokenizer, monkeypatch, tmp_path):
    import ray.cloudpickle

    from rl_rewards.server.process import ServerProcess

    (tmp_path / "server.toml").write_text(SERVED)
    with ServerProcess(["--config", str(tmp_path / "server.toml")], log_path=tmp_path / "server.log") as server:
        compute_score = as_verl_compute_score(server.url, error_score=-1.0)
        assert compute_score(data_source="d", solution_str="[00:01] cat", ground_truth=None)["score"] == 1.5
        # verl's `remote` reward manager hands the function to Ray actors: Ray's serializer
        shipped = ray.cloudpickle.loads(ray.cloudpickle.dumps(compute_score))
        copy = pickle.loads(pickle.dumps(compute_score))
        assert copy.scorer.url == server.url
        copy.scorer.close()
        out = reward_loop(tokenizer, shipped, monkeypatch)
        compute_score.scorer.close()
        shipped.scorer.close()
    assert out.meta_info["reward_extra_keys"] == ["score", "failed", "fmt", "len", "len.n_tokens"]
    # served reward (no ref component): 1 + 0.5 * 1 | gated out: 0 | 1 + 0.5
    assert out.non_tensor_batch["score"].tolist() == [1.5, 0.0, 1.5]
    assert out.non_tensor_batch["len.n_tokens"].tolist() == [2.0, 0.0, 2.0]
