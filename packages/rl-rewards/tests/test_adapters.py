"""Adapters, each called exactly the way its framework calls it. The frameworks' own loops run in
`tests/third_party/` (nox session `third_party`); these pin the values by hand."""

import asyncio
import inspect

import pytest

from rl_rewards.adapters import as_openrlhf_reward_func, as_trl_reward, as_verl_compute_score
from rl_rewards.composition import build_reward
from rl_rewards.samples import ScoreResult

SPEC = {
    "components": {
        "fmt": {"scorer": "timestamp_format"},
        "ref": {"scorer": "x", "weight": 0.5},
    }
}


class ReferenceMatch:
    """1.0 when the completion contains the reference; fails when the reference is 'BAD'."""

    name = "reference_match"

    def score(self, samples):
        return [
            ScoreResult.failed("unusable reference") if s.reference == "BAD"
            else ScoreResult(score=float(str(s.reference) in s.completion)) for s in samples
        ]


def _reward():
    return build_reward(SPEC, scorers={"ref": ReferenceMatch()})


class TrainerState:  # TRL passes its TrainerState as a keyword; it is not a dataset column
    global_step = 3


@pytest.mark.no_torch
def test_trl_reward_function_standard_and_conversational():
    f = as_trl_reward(_reward(), name="caption_reward")
    assert f.__name__ == "caption_reward" and not inspect.iscoroutinefunction(f)
    # GRPOTrainer: reward_func(prompts=..., completions=..., completion_ids=..., **reward_kwargs)
    scores = f(
        prompts=["describe", "describe", "describe"],
        completions=["[00:01] cat", "no stamps cat", "[00:02] dog"],
        completion_ids=[[1, 2], [3], [4]],
        reference=["cat", "cat", "BAD"],
        data_source=["v", "v", "v"],
        trainer_state=TrainerState(),
    )
    assert scores == [1.5, 0.5, None]  # fmt + 0.5*ref; the failed row abstains
    conversational = f(
        prompts=[[{"role": "user", "content": "describe"}]],
        completions=[[{"role": "assistant", "content": "[00:01] a cat"}]],
        completion_ids=[[1]],
        reference=["dog"],
        trainer_state=TrainerState(),
    )
    assert conversational == [1.0]


@pytest.mark.no_torch
def test_trl_reward_is_async_for_a_server_url(tmp_path):
    from rl_rewards.server.process import ServerProcess

    with ServerProcess([], log_path=tmp_path / "server.log") as server:
        f = as_trl_reward(server.url, reward="timestamp_format")
        assert inspect.iscoroutinefunction(f)  # TRL awaits async reward functions
        scores = asyncio.run(f(prompts=["p", "p"], completions=["[00:01] a", "none"], completion_ids=None))
    assert scores == [1.0, 0.0]


@pytest.mark.no_torch
def test_verl_single_and_batch_forms():
    compute_score = as_verl_compute_score(_reward())
    # NaiveRewardManager: compute_score(data_source=..., solution_str=..., ground_truth=..., extra_info=...)
    out = compute_score(data_source="caprl_video", solution_str="[00:01] cat", ground_truth="cat", extra_info={"index": 0})
    assert out == {"score": 1.5, "failed": 0.0, "fmt": 1.0, "ref": 1.0}
    failed = compute_score(data_source="caprl_video", solution_str="[00:01] cat", ground_truth="BAD")
    assert failed == {"score": 0.0, "failed": 1.0, "fmt": 1.0, "ref": 0.0}  # same keys for every sample
    batch = as_verl_compute_score(_reward(), batch=True, error_score=-1.0)
    # BatchRewardManager: compute_score(data_sources=..., solution_strs=..., ground_truths=..., extra_infos=...)
    outs = batch(data_sources=["a", "b"], solution_strs=["[00:01] x", "y"], ground_truths=["x", "BAD"], extra_infos=[None, None])
    assert [o["score"] for o in outs] == [1.5, -1.0]
    assert [set(o) for o in outs] == [{"score", "failed", "fmt", "ref"}] * 2


def test_openrlhf_reward_func():
    import torch

    reward_func = as_openrlhf_reward_func(_reward(), error_score=-1.0)
    # OpenRLHF --reward.remote_url reward_func.py (was --remote_rm_url): reward_func(queries, prompts, labels)
    out = reward_func(
        ["<|user|>describe<|assistant|>[00:01] cat", "<|user|>describe<|assistant|>dog", "other [00:01]"],
        ["<|user|>describe<|assistant|>", "<|user|>describe<|assistant|>", "mismatched prompt"],
        ["cat", "BAD", "zzz"],
    )
    assert isinstance(out["rewards"], torch.Tensor)
    assert out["rewards"].tolist() == [1.5, -1.0, 1.0]
    assert out["scores"].tolist() == out["rewards"].tolist()
    logs = out["extra_logs"]
    assert set(logs) == {"failed", "fmt", "ref"}  # every key, one value per query
    assert logs["failed"].tolist() == [0.0, 1.0, 0.0]
    assert logs["fmt"].tolist() == [1.0, 0.0, 1.0]  # the failed sample's components: 0.0
    assert logs["ref"].tolist() == [1.0, 0.0, 0.0]  # "zzz" is not in the completion


GATED = {  # a sub-component (len.n_tokens) behind a gate: gated-out samples must still carry it
    "components": {
        "fmt": {"scorer": "timestamp_format"},
        "len": {"scorer": "length", "weight": 0.5, "options": {"tokenizer": "whitespace", "l1": 2, "l2": 4},
                "gate": {"component": "fmt", "threshold": 1.0}},
        "ref": {"scorer": "x"},
    }
}
KEYS = {"score", "failed", "fmt", "len", "len.n_tokens", "ref"}


@pytest.mark.no_torch
def test_verl_same_keys_for_gated_out_and_failed_samples():
    compute_score = as_verl_compute_score(build_reward(GATED, scorers={"ref": ReferenceMatch()}), error_score=-1.0)
    rows = [("[00:01] cat", "cat"), ("no stamp cat", "cat"), ("[00:01] cat", "BAD")]
    outs = [compute_score(data_source="d", solution_str=s, ground_truth=g, extra_info={}) for s, g in rows]
    assert [set(o) for o in outs] == [KEYS] * 3
    # hand-worked: 1.0 + 0.5 * 1.0 (2 words) + 1.0 | gated out: 0 + 0 + 1 | failed: error_score
    assert outs[0] == {"score": 2.5, "failed": 0.0, "fmt": 1.0, "len": 1.0, "len.n_tokens": 2.0, "ref": 1.0}
    assert outs[1] == {"score": 1.0, "failed": 0.0, "fmt": 0.0, "len": 0.0, "len.n_tokens": 0.0, "ref": 1.0}
    assert outs[2] == {"score": -1.0, "failed": 1.0, "fmt": 1.0, "len": 1.0, "len.n_tokens": 2.0, "ref": 0.0}


class NotANumber:
    name = "nan"

    def score(self, samples):
        return [ScoreResult(score=float("nan") if s.completion == "nan" else 1.0) for s in samples]


def test_a_non_finite_reward_is_a_failed_sample_on_every_adapter():
    trl = as_trl_reward(NotANumber())
    assert trl(prompts=["p", "p"], completions=["nan", "ok"]) == [None, 1.0]
    verl = as_verl_compute_score(NotANumber(), error_score=-1.0)
    assert verl(data_source="d", solution_str="nan", ground_truth=None) == {"score": -1.0, "failed": 1.0}
    openrlhf = as_openrlhf_reward_func(NotANumber(), error_score=-1.0)
    out = openrlhf(["nan", "ok"], ["", ""], [None, None])
    assert out["rewards"].tolist() == [-1.0, 1.0] and out["extra_logs"]["failed"].tolist() == [1.0, 0.0]


@pytest.mark.no_torch
def test_trl_logs_components_through_log_metric():
    logged: list[tuple[str, float]] = []
    f = as_trl_reward(build_reward(GATED, scorers={"ref": ReferenceMatch()}), name="cap")
    scores = f(prompts=["p"] * 3, completions=["[00:01] cat", "no stamp cat", "[00:01] cat"],
               reference=["cat", "cat", "BAD"], trainer_state=TrainerState(),
               log_extra=lambda column, values: None, log_metric=lambda key, value: logged.append((key, value)))
    assert scores == [2.5, 1.0, None]
    # means over the two samples that did not fail: fmt (1 + 0) / 2, len (1 + 0) / 2, n_tokens (2 + 0) / 2
    assert logged == [("cap/failed", pytest.approx(1 / 3)), ("cap/fmt", 0.5), ("cap/len", 0.5),
                      ("cap/len.n_tokens", 1.0), ("cap/ref", 1.0)]


SERVED = """
default_reward = "caption"
[rewards.caption.components.format]
scorer = "timestamp_format"
[rewards.caption.components.length]
scorer = "length"
weight = 0.5
options = { tokenizer = "whitespace", l1 = 2, l2 = 4 }
gate = { component = "format", threshold = 1.0 }

[rewards.overflow.components.format]
scorer = "timestamp_format"
weight = 1e308
[rewards.overflow.components.again]
scorer = "timestamp_format"
weight = 1e308
"""
SERVED_KEYS = {"score", "failed", "format", "length", "length.n_tokens"}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from rl_rewards.server.process import ServerProcess

    tmp = tmp_path_factory.mktemp("served")
    (tmp / "server.toml").write_text(SERVED)
    with ServerProcess(["--config", str(tmp / "server.toml")], log_path=tmp / "server.log") as server:
        yield server


@pytest.mark.no_torch
def test_verl_url_target_same_keys_and_picklable(served):
    import pickle

    compute_score = as_verl_compute_score(served.url, error_score=-1.0)
    rows = [
        ("[00:01] cat", {}),  # scored
        ("no stamp", {}),  # length gated out on the server
        ("[00:01] cat", {"image": "cat.png"}),  # the server has no media root: fails before scoring
    ]
    outs = [compute_score(data_source="d", solution_str=s, ground_truth=None, extra_info=e) for s, e in rows]
    assert [set(o) for o in outs] == [SERVED_KEYS] * 3
    assert outs[0] == {"score": 1.5, "failed": 0.0, "format": 1.0, "length": 1.0, "length.n_tokens": 2.0}
    assert outs[1] == {"score": 0.0, "failed": 0.0, "format": 0.0, "length": 0.0, "length.n_tokens": 0.0}
    assert outs[2] == {"score": -1.0, "failed": 1.0, "format": 0.0, "length": 0.0, "length.n_tokens": 0.0}
    # verl's remote reward manager pickles the function for its Ray workers
    clone = pickle.loads(pickle.dumps(compute_score))
    assert clone(data_source="d", solution_str="[00:01] cat", ground_truth=None) == outs[0]
    compute_score.scorer.close()
    clone.scorer.close()


@pytest.mark.no_torch
def test_openrlhf_route_sends_the_same_keys_for_every_request(served):
    import httpx

    def post(query):
        return httpx.post(f"{served.url}/openrlhf/get_reward", json={"query": [query]}, timeout=30).json()

    scored, gated = post("[00:01] cat"), post("no stamp")  # OpenRLHF: one query per request
    assert scored["extra_logs"] == {"failed": [0.0], "format": [1.0], "length": [1.0], "length.n_tokens": [2.0]}
    assert gated["extra_logs"] == {"failed": [0.0], "format": [0.0], "length": [0.0], "length.n_tokens": [0.0]}


@pytest.mark.no_torch
def test_a_non_finite_served_reward_is_a_failed_sample_not_a_null(served):
    from rl_rewards.client import RewardClient
    from rl_rewards.samples import Sample

    with RewardClient(served.url) as client:
        (result,) = client.score("overflow", [Sample(completion="[00:01] cat")])  # 1e308 + 1e308
    assert result.score is None and "the combined reward is inf" in result.error
    verl = as_verl_compute_score(served.url, reward="overflow", error_score=-1.0)
    out = verl(data_source="d", solution_str="[00:01] cat", ground_truth=None)
    assert out == {"score": -1.0, "failed": 1.0, "format": 1.0, "again": 1.0}
    verl.scorer.close()


OVERFLOW = {"components": {"format": {"scorer": "timestamp_format", "weight": 1e308},
                           "again": {"scorer": "timestamp_format", "weight": 1e308}}}


def test_openrlhf_route_and_reward_func_name_a_failed_sample_alike(tmp_path):
    """One name for a failed sample in OpenRLHF's `extra_logs`, `failed`, whichever way OpenRLHF
    reaches the reward: the server's `/openrlhf/get_reward` route (it sent `error`) and
    `as_openrlhf_reward_func`, in process or against that server. The stamped query overflows
    (1e308 + 1e308 = inf) and fails; the other scores 0."""
    import httpx

    from rl_rewards.client import RemoteScorer
    from rl_rewards.server.process import ServerProcess

    config = tmp_path / "server.toml"
    config.write_text('openrlhf_reward = "overflow"\n' + "".join(
        f'[rewards.overflow.components.{name}]\nscorer = "timestamp_format"\nweight = 1e308\n'
        for name in OVERFLOW["components"]
    ))
    queries, prompts, labels = ["[00:01] cat", "no stamp"], ["", ""], [None, None]
    want = {"failed": [1.0, 0.0], "format": [1.0, 0.0], "again": [1.0, 0.0]}
    with ServerProcess(["--config", str(config)], log_path=tmp_path / "server.log") as server:
        route = httpx.post(f"{server.url}/openrlhf/get_reward", json={"query": queries}, timeout=30).json()
        scorer = RemoteScorer(server.url, "overflow")  # the URL form's scorer, closed here
        remote = as_openrlhf_reward_func(scorer)(queries, prompts, labels)
        scorer.close()
    local = as_openrlhf_reward_func(OVERFLOW)(queries, prompts, labels)
    assert route["extra_logs"] == want
    assert {k: v.tolist() for k, v in remote["extra_logs"].items()} == want
    assert {k: v.tolist() for k, v in local["extra_logs"].items()} == want


PART_RULE = '''
def compute_score(data_source, solution_str, ground_truth, extra_info):
    """0.5, with a sub-component `part` that is the completion's own nan/inf, else 0.25."""
    return {"score": 0.5, "part": float(solution_str) if solution_str in ("nan", "inf", "-inf") else 0.25}
'''


def _part_spec(tmp_path) -> dict:
    (tmp_path / "part_rule.py").write_text(PART_RULE)
    options = {"function": f"{tmp_path / 'part_rule.py'}:compute_score", "components": ["part"]}
    return {"components": {"rule": {"scorer": "rule", "options": options}}}


class NonFinitePart:
    """A bare scorer (no spec): score 1.0, component `part` the completion's nan/inf, else 0.25."""

    name = "non_finite_part"

    def score(self, samples):
        return [ScoreResult(score=1.0, components={"part": float(s.completion) if s.completion in ("nan", "inf") else 0.25})
                for s in samples]


def test_a_non_finite_component_is_a_failed_sample_on_every_adapter(tmp_path):
    """As a non-finite score: the sample fails (None for TRL, `failed` 1 and every key 0.0 for
    verl and OpenRLHF), in a composed reward and from a bare scorer; TRL's metrics stay finite."""
    reward = build_reward(_part_spec(tmp_path))
    logged: list[tuple[str, float]] = []
    trl = as_trl_reward(reward, name="part")
    assert trl(prompts=["p"] * 3, completions=["nan", "ok", "inf"], log_metric=lambda k, v: logged.append((k, v))) == [
        None, 0.5, None]
    assert logged == [("part/failed", pytest.approx(2 / 3)), ("part/rule", 0.5), ("part/rule.part", 0.25)]
    assert as_trl_reward(NonFinitePart())(prompts=["p", "p"], completions=["nan", "ok"]) == [None, 1.0]
    verl = as_verl_compute_score(reward, error_score=-1.0)
    assert verl(data_source="d", solution_str="-inf", ground_truth=None) == {
        "score": -1.0, "failed": 1.0, "rule": 0.0, "rule.part": 0.0}
    assert verl(data_source="d", solution_str="ok", ground_truth=None) == {
        "score": 0.5, "failed": 0.0, "rule": 0.5, "rule.part": 0.25}
    [bare] = as_verl_compute_score(NonFinitePart(), batch=True, error_score=-1.0)(["d"], ["inf"], [None], [None])
    assert bare == {"score": -1.0, "failed": 1.0}
    out = as_openrlhf_reward_func(reward, error_score=-1.0)(["nan", "ok"], ["", ""], [None, None])
    assert out["rewards"].tolist() == [-1.0, 0.5]
    assert {k: v.tolist() for k, v in out["extra_logs"].items()} == {
        "failed": [1.0, 0.0], "rule": [0.0, 0.5], "rule.part": [0.0, 0.25]}


@pytest.mark.no_torch
def test_a_non_finite_component_is_a_failed_sample_on_every_route_not_a_null(tmp_path):
    """A served reward whose sub-component is NaN/inf for one sample: `/v1/score` (through our
    own client), `/openrlhf/get_reward` and CapRL's `/get_reward` (the reward served as the
    qa judge) fail that sample as they fail a NaN score, and score the others."""
    import httpx

    from rl_rewards.client import RewardClient
    from rl_rewards.samples import Sample
    from rl_rewards.server.process import ServerProcess

    spec = _part_spec(tmp_path)["components"]["rule"]
    config = tmp_path / "server.toml"
    config.write_text(  # served under the CapRL judge's name: /get_reward scores it (no model loads)
        '[rewards.caption_qa.components.rule]\nscorer = "rule"\n'
        f'options = {{ function = "{spec["options"]["function"]}", components = ["part"] }}\n'
    )
    env = {"REWARD_MODEL": "tiny:qwen3", "REWARD_SCORE_MODE": "qa", "REWARD_TASK": "image"}
    with ServerProcess(["--config", str(config)], env=env, log_path=tmp_path / "server.log") as server:
        with RewardClient(server.url) as client:
            results = client.score("caption_qa", [Sample(completion=t) for t in ("nan", "ok", "inf")])
        openrlhf = httpx.post(f"{server.url}/openrlhf/get_reward", json={"query": ["ok", "-inf"]}, timeout=30).json()
        caprl = httpx.post(f"{server.url}/get_reward", json={"prompts": [["nan", [["Q?\n   - A) x", "A"]]],
                                                                         ["ok", [["Q?\n   - A) x", "A"]]]]}, timeout=30)
    assert [r.score for r in results] == [None, 0.5, None]
    assert "non-finite component 'part' = nan" in (results[0].error or "")
    assert results[0].components == {"rule": 0.0, "rule.part": 0.0}
    assert results[1].components == {"rule": 0.5, "rule.part": 0.25}
    assert openrlhf["rewards"] == [0.5, 0.0]
    assert openrlhf["extra_logs"] == {"failed": [0.0, 1.0], "rule": [0.5, 0.0], "rule.part": [0.25, 0.0]}
    assert caprl.status_code == 200, caprl.text
    body = caprl.json()
    assert body["rewards"] == [0.0, 0.5] and "non-finite component" in body["errors"][0] and body["errors"][1] is None
