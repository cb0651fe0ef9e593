"""The OpenRLHF adapter and server route inside OpenRLHF's own code (openrlhf 0.11.2, installed
without its GPU dependencies by `nox -s third_party`): SingleTurnAgentExecutor loads the reward
file, calls `reward_func` once per query (or POSTs one query per request to the server), and the
per-sample Experiences are concatenated and split by OpenRLHF's Experience code, which checks
that every info key has one value per sample. Two parts cannot run here and are stood in for:
the policy's vLLM engine (a stub that "generates" the given response tokens) and
samples_generator._process_response_into_experience (it imports vLLM), whose four lines that turn
`extra_logs` into `info` tensors are restated in `experience()`."""

from __future__ import annotations

import asyncio
import textwrap
import warnings
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
with warnings.catch_warnings():  # openrlhf.utils.math_utils has invalid escape sequences
    warnings.simplefilter("ignore")
    pytest.importorskip("openrlhf")
    from openrlhf.trainer.ppo_utils.experience import Experience, split_experience_batch
    from openrlhf.utils.agent import SingleTurnAgentExecutor

pytestmark = [pytest.mark.third_party, pytest.mark.filterwarnings("ignore::DeprecationWarning"),
              pytest.mark.filterwarnings("ignore::UserWarning")]

REWARD_FILE = '''
from rl_rewards.adapters import as_openrlhf_reward_func
from rl_rewards.composition import build_reward
from rl_rewards.samples import ScoreResult


class ReferenceMatch:
    name = "reference_match"

    def score(self, samples):
        return [ScoreResult.failed("unusable reference") if s.reference == "BAD"
                else ScoreResult(score=float(str(s.reference) in s.completion)) for s in samples]


SPEC = {"components": {
    "fmt": {"scorer": "timestamp_format"},
    "len": {"scorer": "length", "weight": 0.5, "options": {"tokenizer": "whitespace", "l1": 2, "l2": 4},
            "gate": {"component": "fmt", "threshold": 1.0}},
    "ref": {"scorer": "x"},
}}
reward_func = as_openrlhf_reward_func(build_reward(SPEC, scorers={"ref": ReferenceMatch()}), error_score=-1.0)
'''
ROWS = [  # (response, label): failed, gated out, scored
    ("[00:01] cat", "BAD"),
    ("no stamp cat", "cat"),
    ("[00:01] cat", "cat"),
]


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from rl_models.tiny import build

    return AutoTokenizer.from_pretrained(build("qwen3"))


class PolicyStub:
    """Stands in for the policy's vLLM engine (GPU only): answers with the given response."""

    def __init__(self, tokenizer, response):
        self.ids = tokenizer(response, add_special_tokens=False)["input_ids"]

    async def generate(self, prompt_token_ids, params, multi_modal_data=None):
        return SimpleNamespace(outputs=[SimpleNamespace(token_ids=self.ids, finish_reason="stop", logprobs=None)])


def rollouts(executor, tokenizer, prompt="Describe the video: ") -> list[dict]:
    params = SimpleNamespace(max_tokens=32, logprobs=None)

    async def run():
        return [await executor.execute(prompt, label, params, 256, tokenizer, PolicyStub(tokenizer, response))
                for response, label in ROWS]

    return asyncio.run(run())


def experience(response: dict) -> Experience:
    """One rollout as an Experience; `info` built as samples_generator.py does (0.11.2, lines 279-292)."""
    info = {"response_clip_ratio": torch.tensor([False])}
    if response["reward"] is not None:
        info["reward"] = torch.tensor([float(torch.as_tensor(response["reward"]).flatten()[0])])
    for key, value in response.get("extra_logs", {}).items():
        if isinstance(value, torch.Tensor):
            value = value.flatten()[0].item()
        info[key] = torch.tensor([value])
    sequences = torch.tensor([response["observation_tokens"]])
    return Experience(sequences=sequences, attention_mask=torch.ones_like(sequences),
                      action_mask=torch.ones_like(sequences[:, 1:]), info=info)


def test_reward_func_file_through_the_executor_and_the_experience_split(tokenizer, tmp_path):
    path = tmp_path / "reward_func.py"
    path.write_text(REWARD_FILE)
    executor = SingleTurnAgentExecutor(remote_rm_url=str(path))  # --reward.remote_url /path/reward_func.py
    outs = rollouts(executor, tokenizer)
    assert [float(torch.as_tensor(o["reward"]).flatten()[0]) for o in outs] == [-1.0, 1.0, 2.5]
    assert [set(o["extra_logs"]) for o in outs] == [{"failed", "fmt", "len", "len.n_tokens", "ref"}] * 3
    batch = Experience.concat_experiences([experience(o) for o in outs], tokenizer.pad_token_id)
    items = split_experience_batch(batch)  # raises "Size of info[x] does not match batch_size" on uneven keys
    assert [float(i.info["failed"]) for i in items] == [1.0, 0.0, 0.0]
    assert [float(i.info["len.n_tokens"]) for i in items] == [2.0, 0.0, 2.0]
    assert [float(i.info["ref"]) for i in items] == [0.0, 1.0, 1.0]


def test_uneven_extra_logs_break_openrlhf(tokenizer, tmp_path):
    # the failure the adapter avoids, on OpenRLHF's own code: the failed sample lacks a key
    path = tmp_path / "uneven.py"
    path.write_text(textwrap.dedent('''
        import torch

        def reward_func(queries, prompts, labels):
            logs = {} if labels[0] == "BAD" else {"fmt": torch.tensor([1.0])}
            return {"rewards": torch.tensor([0.0]), "scores": torch.tensor([0.0]), "extra_logs": logs}
    '''))
    outs = rollouts(SingleTurnAgentExecutor(remote_rm_url=str(path)), tokenizer)
    batch = Experience.concat_experiences([experience(o) for o in outs], tokenizer.pad_token_id)
    with pytest.raises(ValueError, match=r"Size of info\[fmt\] \(2\) does not match batch_size \(3\)"):
        split_experience_batch(batch)


SERVED = """
openrlhf_reward = "caption"
[rewards.caption.components.fmt]
scorer = "timestamp_format"
[rewards.caption.components.len]
scorer = "length"
weight = 0.5
options = { tokenizer = "whitespace", l1 = 2, l2 = 4 }
gate = { component = "fmt", threshold = 1.0 }
"""


def test_server_route_through_openrlhfs_http_client(tokenizer, tmp_path):
    from rl_rewards.server.process import ServerProcess

    (tmp_path / "server.toml").write_text(SERVED)
    with ServerProcess(["--config", str(tmp_path / "server.toml")], log_path=tmp_path / "server.log") as server:
        executor = SingleTurnAgentExecutor(remote_rm_url=f"{server.url}/openrlhf/get_reward")
        outs = rollouts(executor, tokenizer)
    assert [o["reward"] for o in outs] == [[1.5], [0.0], [1.5]]  # no ref component on the server
    batch = Experience.concat_experiences([experience(o) for o in outs], tokenizer.pad_token_id)
    items = split_experience_batch(batch)
    assert [i.info["len.n_tokens"].flatten().tolist() for i in items] == [[2.0], [0.0], [2.0]]
    assert [i.info["failed"].flatten().tolist() for i in items] == [[0.0], [0.0], [0.0]]
