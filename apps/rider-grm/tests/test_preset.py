"""The verl-with-rms preset (examples/rider-grm/verl-with-rms.toml) reproduces VeRL-with-RMs'
reward formula (verl/trainer/ppo/ray_trainer.py, cdffe05):

    total = rule + 0.5 * bge * [rule == 1], then per judge: add: total += w * s * [rule == 1]
                                                             mul: total *= w * s * [rule == 1]

with judges and BGE reading the JSON "Response" field (0.0 when malformed). The golden table
runs the preset's reward through `compose_reward` with tiny real models: a rule that reads the
answer's "Rule" field, judge "rider" (add, 0.3) and judge "consistency" switched to mul (0.5),
both `tests/judges/echo_judge.py` (a judge's score is the judged Response read as a number),
and the tiny embedding model (identical Response texts: cosine 1, mapped 1, BGE term
0.7 * 1 + 0.3 = 1.0; a malformed answer: 0.0).
"""

from __future__ import annotations

import json

import msgspec
import pytest
import torch
from conftest import REPO, TESTS
from judging import build_judge
from rewarding import compose_reward, score
from rider_config import DEFAULT_CONFIG, Config, check_config, judge_configs

from rl_core.train import ConfigError, PhaseTimer, load_config
from rl_rewards.samples import Sample

PRESET = REPO / "examples" / "rider-grm" / "verl-with-rms.toml"

# (answer, reference Response) -> total under the preset, and under rider-grm's defaults for the
# same judges (gated_out = "skip", similarity last and ungated)
GOLDEN = [
    # rule 1, Response "0.8" = reference: (1 + 0.5 * 1.0 + 0.3 * 0.8) * 0.5 * 0.8 = 0.696;
    # ours: (1 + 0.3 * 0.8) * 0.5 * 0.8 + 0.5 * 1.0 = 0.996
    ({"Rule": 1, "Response": "0.8"}, "0.8", 0.696, 0.996),
    # rule 0.1 (partial credit) gates everything out: the masked mul judge zeroes the total;
    # ours skips both judges and keeps 0.1, then adds the ungated similarity: 0.1 + 0.5 = 0.6
    ({"Rule": 0.1, "Response": "0.8"}, "0.8", 0.0, 0.6),
    # rule 1 but Response is no string: BGE and both judges score 0.0 (malformed), the mul zeroes
    ({"Rule": 1, "Response": 5}, "0.8", 0.0, 0.0),
    # rule 1, Response "0.5": (1 + 0.5 + 0.3 * 0.5) * 0.5 * 0.5 = 0.4125; ours 1.15 * 0.25 + 0.5 = 0.7875
    ({"Rule": 1, "Response": "0.5"}, "0.5", 0.4125, 0.7875),
    # not JSON: rule 0, everything gated out (and the similarity malformed): 0 either way
    ("no JSON here", "0.8", 0.0, 0.0),
]


def _samples() -> list[Sample]:
    return [Sample(completion=answer if isinstance(answer, str) else json.dumps(answer), prompt="When am I paid?",
                   reference=json.dumps({"Response": ref, "Thought": ""}),
                   metadata={"uid": i, "data_source": "rider", "extra_info": {},
                             "rm_prompts": ["Rate: {response}", "Contradiction? {response}"]})
            for i, (answer, ref, _, _) in enumerate(GOLDEN)]


def _tiny_preset(ours: bool) -> Config:
    """The preset with tiny models, the test rule and judges, judge 2 combined with mul; `ours`
    switches the three VeRL-with-RMs choices back to rider-grm's defaults."""
    cfg = load_config(Config, PRESET)
    judges = [msgspec.structs.replace(j, module=str(TESTS / "judges" / "echo_judge.py"), model=f"tiny:qwen3:{i + 1}",
                                      max_new_tokens=2, combine="mul" if i else j.combine,
                                      gated_out="skip" if ours else j.gated_out)
              for i, j in enumerate(cfg.reward.judges)]
    emb = msgspec.structs.replace(cfg.reward.embedding, model="tiny:embedding")
    if ours:
        emb = msgspec.structs.replace(emb, position="last", gate=None)
    reward = msgspec.structs.replace(cfg.reward, rule=str(TESTS / "rules" / "json_rule.py"), judges=judges, embedding=emb)
    return msgspec.structs.replace(cfg, reward=reward)


@pytest.mark.parametrize("ours", [False, True], ids=["verl-with-rms", "ours"])
def test_golden_totals(ours: bool) -> None:
    cfg = _tiny_preset(ours)
    device, timer = torch.device("cpu"), PhaseTimer()
    judges = [build_judge(i, judge, device, timer, sleep=False) for i, judge in enumerate(cfg.reward.judges)]
    reward = compose_reward(cfg, judges, list(cfg.reward.judges), timer, device)
    assert list(reward.spec.components) == (["rule", "rider", "consistency", "similarity"] if ours
                                            else ["rule", "similarity", "rider", "consistency"])
    results, logs = score(reward, judges, _samples())
    totals = [r.score for r in results]
    assert totals == pytest.approx([row[3 if ours else 2] for row in GOLDEN], abs=1e-6)
    # the gate is checked first: only rule >= 1 answers reach the judges, malformed ones not the model
    assert logs["rider"].judged == logs["consistency"].judged == {0, 2, 3}
    assert [r.components["rider.malformed"] for r in results][:4] == [0.0, 0.0, 1.0, 0.0]
    assert [r.components["similarity"] for r in results] == pytest.approx(
        [1.0, 1.0 if ours else 0.0, 0.0, 1.0, 0.0], abs=1e-6)
    for judge in judges:
        judge.close()


def test_preset_file_holds_the_formula() -> None:
    cfg = load_config(Config, PRESET)
    judges = judge_configs(cfg.reward)
    assert [(j.gate, j.gated_out, j.completion_field, j.on_malformed, j.fallback) for j in judges] == [
        (1.0, "zero", "Response", 0.0, 0.0)] * 2
    emb = cfg.reward.embedding
    assert (emb.weight, emb.position, emb.gate, emb.completion_field, emb.reference_field, emb.on_malformed) == (
        0.5, "after_rule", 1.0, "Response", "Response", 0.0)


def test_gated_out_needs_a_gate_and_served_judges_take_no_field() -> None:
    def check(judge: str) -> None:
        check_config(load_config(Config, DEFAULT_CONFIG, [f"reward.judges=[{judge}]"]), 1)

    with pytest.raises(ConfigError, match=r"reward\.judges\[0\].*gated_out = 'zero' but no gate"):
        check('{module = "m.py", model = "x", gated_out = "zero"}')
    with pytest.raises(ConfigError, match=r"completion_field is applied by the server"):
        check('{engine = "server", url = "http://h", spec = "s", completion_field = "Response"}')
