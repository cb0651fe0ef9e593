"""caption-rl with train.partial_rollouts on the hf engine: image and video prompts continued chunk
by chunk (the prompt's media re-read with the tokens so far), trained with their versions."""

from __future__ import annotations

import csv
import json
from pathlib import Path

from conftest import tiny_overrides

from rl_core.train import unknown_metric_names


def rows(run: Path) -> list[dict[str, str]]:
    with (run / "metrics.csv").open() as f:
        return list(csv.DictReader(f))


def test_partial_rollouts_continue_image_and_video_prompts(app, tmp_path):
    """2 groups a step of 4 in flight, 3 tokens a round up to 8: step 1's continued captions
    carry the engine's log-probs of the chunks after the first, which the first-step check
    compares with the trainer's replay (a wrong position after the media would fail it); later
    steps train tokens sampled by older weights."""
    run = app.main(tiny_overrides(tmp_path, "train.max_steps=3", "train.partial_rollouts.steps=1",
                                  "train.partial_rollouts.chunk_tokens=3", "algo.rollout_correction=token_truncate"))
    table = rows(run)
    assert not unknown_metric_names(table[0])
    assert float(table[0]["replay/engine_diff_mean"]) < 1e-3 and float(table[0]["rollout/token_staleness_max"]) == 0
    assert max(float(r["rollout/token_staleness_max"]) for r in table) >= 1
    trained = [json.loads(line) for line in (run / "samples" / "prompts.jsonl").read_text().splitlines()]
    assert [len(t["prompts"]) for t in trained] == [2, 2, 2]
    lengths = [float(r["response/length_mean"]) for r in table]
    assert max(lengths) > 3  # captions longer than one round
