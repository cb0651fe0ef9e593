"""Composition: sum/fold combine, gates evaluated before the gated scorer, per-sample errors."""

import asyncio
import copy
from collections.abc import Sequence

import pytest

from rl_rewards.composition import build_reward
from rl_rewards.samples import Sample, ScoreResult

pytestmark = pytest.mark.no_torch


class LookupScorer:
    """Scores `metadata[key]`; records every sample it is asked to score."""

    def __init__(self, key: str) -> None:
        self.name = f"lookup_{key}"
        self.key = key
        self.seen: list[str] = []
        self.calls = 0

    def score(self, samples: Sequence[Sample]) -> list[ScoreResult]:
        self.calls += 1
        self.seen += [s.completion for s in samples]
        return [ScoreResult(score=s.metadata[self.key]) for s in samples]


class ExplodingScorer:
    """Raises for the whole batch whenever it contains a completion marked 'bad'."""

    name = "exploding"

    def __init__(self) -> None:
        self.calls = 0

    def score(self, samples: Sequence[Sample]) -> list[ScoreResult]:
        self.calls += 1
        if any(s.completion == "bad" for s in samples):
            raise RuntimeError("cannot score 'bad'")
        return [ScoreResult(score=1.0, components={"len": float(len(s.completion))}) for s in samples]


def _samples(rows):
    return [Sample(completion=f"s{i}", metadata=row) for i, row in enumerate(rows)]


def test_sum_is_weighted_and_components_unweighted():
    spec = {
        "components": {
            "fmt": {"scorer": "timestamp_format", "weight": 0.2},
            "len": {"scorer": "length", "weight": 0.5, "options": {"tokenizer": "whitespace", "l1": 2, "l2": 4}},
        }
    }
    reward = build_reward(spec)
    # fmt: "[00:10] a [00:05] b" -> 0.5 (out of order); len: 4 words -> 0.0
    # "[00:01] x" -> fmt 1.0; 2 words -> len 1.0
    results = reward.score([Sample(completion="[00:10] a [00:05] b"), Sample(completion="[00:01] x")])
    assert results[0].components == {"fmt": 0.5, "len": 0.0, "len.n_tokens": 4.0}
    assert results[0].score == pytest.approx(0.2 * 0.5)
    assert results[1].score == pytest.approx(0.2 * 1.0 + 0.5 * 1.0)


def test_fold_add_mul_hand_worked():
    spec = {
        "combine": "fold",
        "components": {
            "rule": {"scorer": "x"},
            "judge_a": {"scorer": "x", "op": "add", "weight": 0.5},
            "judge_b": {"scorer": "x", "op": "mul", "weight": 2.0},
        },
    }
    scorers = {"rule": LookupScorer("r"), "judge_a": LookupScorer("a"), "judge_b": LookupScorer("b")}
    reward = build_reward(spec, scorers=scorers)
    [result] = reward.score(_samples([{"r": 1.0, "a": 0.4, "b": 0.25}]))
    # ((1.0 + 0.5*0.4) * (2.0*0.25)) = 1.2 * 0.5 = 0.6
    assert result.score == pytest.approx(0.6)
    assert result.components == {"rule": 1.0, "judge_a": 0.4, "judge_b": 0.25}


def test_gate_skips_gated_out_samples_before_calling_the_judge():
    spec = {
        "combine": "fold",
        "components": {
            "rule": {"scorer": "x"},
            "judge": {"scorer": "x", "weight": 0.5, "gate": {"component": "rule", "threshold": 1.0}},
        },
    }
    rule, judge = LookupScorer("r"), LookupScorer("j")
    reward = build_reward(spec, scorers={"rule": rule, "judge": judge})
    rows = [{"r": 1.0, "j": 0.8}, {"r": 0.0, "j": 0.9}, {"r": 1.0, "j": 0.2}, {"r": 0.5, "j": 1.0}]
    results = reward.score(_samples(rows))
    assert judge.seen == ["s0", "s2"]  # gated-out samples never reached the judge
    assert judge.calls == 1
    assert [r.score for r in results] == pytest.approx([1.4, 0.0, 1.1, 0.5])
    assert results[1].components == {"rule": 0.0, "judge": 0.0}  # gated-out reported as 0.0


def test_gate_in_sum_mode_adds_nothing_for_gated_out():
    spec = {
        "components": {
            "rule": {"scorer": "x"},
            "judge": {"scorer": "x", "gate": {"component": "rule", "threshold": 0.5}},
        }
    }
    judge = LookupScorer("j")
    reward = build_reward(spec, scorers={"rule": LookupScorer("r"), "judge": judge})
    results = reward.score(_samples([{"r": 0.4, "j": 1.0}, {"r": 0.5, "j": 1.0}]))
    assert [r.score for r in results] == pytest.approx([0.4, 1.5])
    assert judge.seen == ["s1"]


def test_one_bad_sample_in_64_leaves_63_good():
    exploding = ExplodingScorer()
    reward = build_reward({"components": {"x": {"scorer": "x"}}}, scorers={"x": exploding})
    samples = [Sample(completion="bad" if i == 17 else f"ok{i}") for i in range(64)]
    results = reward.score(samples)
    assert [i for i, r in enumerate(results) if r.error is not None] == [17]
    assert "cannot score 'bad'" in results[17].error and "component 'x'" in results[17].error
    assert results[17].score is None
    good = [r for i, r in enumerate(results) if i != 17]
    assert len(good) == 63 and all(r.score == 1.0 for r in good)
    assert good[0].components == {"x": 1.0, "x.len": 3.0}
    assert exploding.calls == 1 + 64  # the batch, then one call per sample


def test_component_error_skips_later_components_and_fallback_replaces_it():
    class HalfFailing:
        name = "half"

        def score(self, samples):
            return [ScoreResult.failed("no media") if s.metadata["fail"] else ScoreResult(score=0.5) for s in samples]

    later = LookupScorer("v")
    spec = {"components": {"a": {"scorer": "x"}, "b": {"scorer": "x"}}}
    reward = build_reward(spec, scorers={"a": HalfFailing(), "b": later})
    results = reward.score(_samples([{"fail": True, "v": 1.0}, {"fail": False, "v": 1.0}]))
    assert results[0].score is None and "no media" in results[0].error
    assert later.seen == ["s1"]  # a failed sample is not scored further
    assert results[1].score == 1.5

    spec = {"components": {"a": {"scorer": "x", "fallback": -1.0}, "b": {"scorer": "x"}}}
    reward = build_reward(spec, scorers={"a": HalfFailing(), "b": LookupScorer("v")})
    results = reward.score(_samples([{"fail": True, "v": 1.0}]))
    assert results[0].error is None and results[0].score == 0.0  # -1 + 1
    assert results[0].components == {"a": -1.0, "b": 1.0}


def test_abstaining_component_makes_the_sample_abstain():
    class Abstain:
        name = "abstain"

        def score(self, samples):
            return [ScoreResult(score=None) for _ in samples]

    reward = build_reward({"components": {"a": {"scorer": "x"}}}, scorers={"a": Abstain()})
    [result] = reward.score([Sample(completion="x")])
    assert result.score is None and result.error is None


def test_async_path_matches_sync_and_awaits_async_scorers():
    class AsyncLookup:
        name = "async_lookup"

        async def ascore(self, samples):
            await asyncio.sleep(0)
            return [ScoreResult(score=2.0 * s.metadata["r"]) for s in samples]

    spec = {"components": {"a": {"scorer": "x"}, "b": {"scorer": "timestamp_format"}}}
    rows = [{"r": 0.25}, {"r": 1.0}]
    samples = [Sample(completion="[00:01]", metadata=rows[0]), Sample(completion="none", metadata=rows[1])]
    reward = build_reward(spec, scorers={"a": AsyncLookup()})
    async_results = asyncio.run(reward.ascore(samples))
    assert [r.score for r in async_results] == [1.5, 2.0]
    assert [r.score for r in reward.score(samples)] == [1.5, 2.0]  # sync path runs the async scorer too


def test_scorer_returning_wrong_count_fails_each_sample_clearly():
    class Short:
        name = "short"

        def score(self, samples):
            return [ScoreResult(score=1.0)] if len(samples) > 1 else []

    reward = build_reward({"components": {"a": {"scorer": "x"}}}, scorers={"a": Short()})
    results = reward.score([Sample(completion="1"), Sample(completion="2")])
    assert all("returned 0 results for 1 samples" in r.error for r in results)


def test_build_reward_rejects_scorers_for_unknown_components():
    with pytest.raises(KeyError, match="unknown components"):
        build_reward({"components": {"a": {"scorer": "timestamp_format"}}}, scorers={"zzz": LookupScorer("r")})


def test_rule_only_rewards_run_inline_and_others_do_not():
    from rl_rewards.samples import runs_inline

    rules = build_reward({"components": {"fmt": {"scorer": "timestamp_format"},
                                         "len": {"scorer": "length", "options": {"tokenizer": "whitespace"}}}})
    assert rules.inline and runs_inline(rules)

    class Remote:  # no `inline`: anything unknown is queued, never run on the event loop
        name = "remote"

        def score(self, samples):
            return [ScoreResult(score=0.0) for _ in samples]

    mixed = build_reward({"components": {"fmt": {"scorer": "timestamp_format"}, "other": {"scorer": "remote"}}},
                         scorers={"other": Remote()})
    assert not mixed.inline and not runs_inline(Remote())


# ------------------------------------------------------------------ VeRL-with-RMs, exactly

VERL_WITH_RMS = {  # its trainer: rule, then BGE (weight 0.5) and judges, all masked by rule == 1
    "combine": "fold",
    "components": {
        "rule": {"scorer": "x"},
        "bge": {"scorer": "x", "op": "add", "weight": 0.5,
                "gate": {"component": "rule", "threshold": 1.0, "gated_out": "zero"}},
        "helpful": {"scorer": "x", "op": "add", "weight": 0.3,
                    "gate": {"component": "rule", "threshold": 1.0, "gated_out": "zero"}},
        "safe": {"scorer": "x", "op": "mul", "weight": 2.0,
                 "gate": {"component": "rule", "threshold": 1.0, "gated_out": "zero"}},
    },
}
ROWS = [  # rule, bge, helpful, safe
    {"r": 1.0, "b": 0.8, "a": 0.5, "s": 0.25},
    {"r": 0.5, "b": 0.9, "a": 1.0, "s": 1.0},  # rule not passed: every other term masked
    {"r": -1.0, "b": 0.9, "a": 1.0, "s": 1.0},
    {"r": 1.0, "b": 0.1, "a": 1.0, "s": 0.5},
]


def verl_with_rms_total(r: float, b: float, a: float, s: float) -> float:
    """VeRL-with-RMs ray_trainer.py's reward step restated for one sample: final = rule; each
    later term is zeroed where rule != 1, then added (BGE, add judges) or multiplied (mul)."""
    mask = 1.0 if r == 1 else 0.0
    final = r + 0.5 * (b * mask)
    final = final + 0.3 * (a * mask)
    return final * 2.0 * (s * mask)


def _lookups():
    return {"rule": LookupScorer("r"), "bge": LookupScorer("b"), "helpful": LookupScorer("a"), "safe": LookupScorer("s")}


def test_verl_with_rms_golden_table():
    # hand-worked:  1: (1 + 0.5*0.8 + 0.3*0.5) * 2*0.25 = 1.55 * 0.5 = 0.775
    #               2: rule 0.5 != 1 -> the mul judge counts as 0 -> 0.0     (skip would leave 0.5)
    #               3: rule -1 -> 0.0                                         (skip would leave -1)
    #               4: (1 + 0.05 + 0.3) * 2*0.5 = 1.35
    golden = [0.775, 0.0, 0.0, 1.35]
    scorers = _lookups()
    results = build_reward(VERL_WITH_RMS, scorers=scorers).score(_samples(ROWS))
    assert [r.score for r in results] == pytest.approx(golden)
    assert golden == pytest.approx([verl_with_rms_total(**row) for row in ROWS])
    # every judge and the BGE term masked by the rule: never called for samples 1 and 2
    for name in ("bge", "helpful", "safe"):
        assert scorers[name].seen == ["s0", "s3"]
    assert results[1].components == {"rule": 0.5, "bge": 0.0, "helpful": 0.0, "safe": 0.0}


def test_gated_out_skip_is_our_default_and_differs_only_for_mul():
    spec = copy.deepcopy(VERL_WITH_RMS)
    for name in ("bge", "helpful", "safe"):
        del spec["components"][name]["gate"]["gated_out"]
    results = build_reward(spec, scorers=_lookups()).score(_samples(ROWS))
    assert [r.score for r in results] == pytest.approx([0.775, 0.5, -1.0, 1.35])


def test_order_is_part_of_the_fold_bge_after_the_judges_is_another_formula():
    # our old rider-grm layout: judges first, BGE added at the end and ungated
    spec = {"combine": "fold", "components": {
        "rule": {"scorer": "x"},
        "helpful": {"scorer": "x", "op": "add", "weight": 0.3, "gate": {"component": "rule"}},
        "safe": {"scorer": "x", "op": "mul", "weight": 2.0, "gate": {"component": "rule"}},
        "bge": {"scorer": "x", "op": "add", "weight": 0.5},
    }}
    results = build_reward(spec, scorers=_lookups()).score(_samples(ROWS))
    # 1: (1 + 0.15) * 0.5 + 0.4 = 0.975 (VeRL-with-RMs: 0.775); 2: 0.5 + 0.45 = 0.95
    assert [r.score for r in results] == pytest.approx([0.975, 0.95, -1.0 + 0.45, 1.3 * 1.0 + 0.05])


def test_every_result_carries_every_key_gated_out_and_failed_included():
    spec = {"components": {
        "fmt": {"scorer": "timestamp_format"},
        "len": {"scorer": "length", "options": {"tokenizer": "whitespace", "l1": 2, "l2": 4},
                "gate": {"component": "fmt", "threshold": 1.0}},
    }}
    reward = build_reward(spec)
    assert reward.keys == ("fmt", "len", "len.n_tokens")
    passed, gated = reward.score([Sample(completion="[00:01] x"), Sample(completion="no stamp here")])
    assert passed.components == {"fmt": 1.0, "len": 1.0, "len.n_tokens": 2.0}
    assert gated.components == {"fmt": 0.0, "len": 0.0, "len.n_tokens": 0.0}
    failing = build_reward({"components": {"a": {"scorer": "x"}, "len": {"scorer": "length", "options": {"tokenizer": "whitespace"}}}},
                           scorers={"a": ExplodingScorer()})
    (bad,) = failing.score([Sample(completion="bad")])
    assert bad.score is None and bad.components == {"a": 0.0, "len": 0.0, "len.n_tokens": 0.0}


class ConstantScorer:
    name = "constant"

    def __init__(self, value: float) -> None:
        self.value = value

    def score(self, samples):
        return [ScoreResult(score=self.value) for _ in samples]


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_a_non_finite_score_is_that_samples_error(value):
    reward = build_reward({"components": {"a": {"scorer": "x"}}}, scorers={"a": ConstantScorer(value)})
    (result,) = reward.score([Sample(completion="c")])
    assert result.score is None and "non-finite score" in result.error and "'constant'" in result.error


def test_a_non_finite_total_is_that_samples_error():
    spec = {"combine": "fold", "components": {"a": {"scorer": "x", "weight": 1e300},
                                                "b": {"scorer": "x", "op": "mul", "weight": 1e300}}}
    reward = build_reward(spec, scorers={"a": ConstantScorer(1e10), "b": ConstantScorer(1e10)})
    (result,) = reward.score([Sample(completion="c")])
    assert result.score is None and "the combined reward is inf" in result.error


def test_a_timed_scorer_scores_inside_its_phase_and_inside_a_composed_reward() -> None:
    """`TimedScorer`: each call runs inside `timer(phase)` (here a recording context manager),
    the inner scorer's results unchanged; in a reward its component is named by the spec."""
    import contextlib

    from rl_rewards.samples import TimedScorer

    phases: list[str] = []

    @contextlib.contextmanager
    def timer(phase: str):
        phases.append(f"enter {phase}")
        yield
        phases.append(f"exit {phase}")

    inner = LookupScorer("a")
    timed = TimedScorer(inner, timer, "rule")
    samples = [Sample(completion="x", metadata={"a": 0.25}), Sample(completion="y", metadata={"a": 1.0})]
    assert [r.score for r in timed.score(samples)] == [0.25, 1.0] and timed.name == "rule"
    assert phases == ["enter rule", "exit rule"] and inner.seen == ["x", "y"]
    reward = build_reward({"components": {"r": {"scorer": "rule", "weight": 2.0}}}, scorers={"r": timed})
    assert [r.score for r in reward.score(samples)] == [0.5, 2.0] and len(phases) == 4
