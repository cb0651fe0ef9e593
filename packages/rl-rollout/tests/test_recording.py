"""`RecordingEngine` around a real tiny `hf` engine: the texts it keeps, and that it is the engine."""

from __future__ import annotations

import torch

from rl_rollout import Engine, RecordingEngine, SamplingParams
from rl_rollout.hf import HFEngine

PROMPTS = ["the cat sat on", [{"role": "user", "content": "Rate this reply from 0 to 10."}]]


def test_keeps_every_generated_text_in_order_across_calls(fresh_engine: HFEngine) -> None:
    engine = RecordingEngine(fresh_engine)
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=6, seed=3)
    first = engine.generate(PROMPTS, params)
    second = engine.generate(PROMPTS[:1], SamplingParams(max_new_tokens=4, seed=4))
    assert engine.texts == [g.text for g in first + second] and len(engine.texts) == 5
    assert first == fresh_engine.generate(PROMPTS, params)  # the inner engine's own samples, unchanged
    engine.texts.clear()  # its user clears it between calls
    engine.generate(PROMPTS[1:], SamplingParams(max_new_tokens=3, seed=5))
    assert len(engine.texts) == 1


def test_forwards_state_scoring_weights_and_sleep(fresh_engine: HFEngine) -> None:
    engine = RecordingEngine(fresh_engine)
    assert isinstance(engine, Engine)
    scores = engine.score_next_tokens([11, 12, 13], [[14], [15, 16]], [17, 18], temperature=0.7)
    assert scores.shape == (2, 2)
    torch.testing.assert_close(scores, fresh_engine.score_next_tokens([11, 12, 13], [[14], [15, 16]], [17, 18],
                                                                     temperature=0.7), rtol=0, atol=0)
    weights = {name: torch.zeros_like(p) for name, p in fresh_engine.model.named_parameters() if name.endswith("norm.weight")}
    engine.load_weights(weights.items(), version=7)
    assert fresh_engine.weight_version == 7
    assert all(p.abs().sum() == 0 for name, p in fresh_engine.model.named_parameters() if name in weights)
    engine.sleep()
    assert engine.state == fresh_engine.state == "asleep"
    engine.wake()
    assert engine.state == fresh_engine.state == "awake"
    engine.close()
    assert engine.state == fresh_engine.state == "closed"
    assert engine.texts == []  # scoring, weights and sleep generate nothing
