"""`rl-rewards score --config reward.toml IN.jsonl -o OUT.jsonl`, run as a real subprocess."""

import json
import subprocess
import sys

import msgspec
import pytest

from rl_rewards.offline import summary_table
from rl_rewards.samples import ScoreResult

pytestmark = pytest.mark.no_torch

CONFIG = """
[components.fmt]
scorer = "timestamp_format"
weight = 0.2

[components.len]
scorer = "length"
options = { tokenizer = "whitespace", l1 = 3, l2 = 5 }
"""


def _run(*args):
    return subprocess.run([sys.executable, "-m", "rl_rewards.cli", "score", *args], capture_output=True, text=True)


def test_score_file_writes_one_result_per_line_and_a_summary(tmp_path):
    config = tmp_path / "reward.toml"
    config.write_text(CONFIG)
    samples = [{"completion": "[00:01] a b"}, {"completion": "one two three four", "prompt": "p"}, {"completion": "a b c d e f"}]
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(json.dumps(s) for s in samples) + "\n")
    out = tmp_path / "out.jsonl"
    proc = _run("--config", str(config), str(src), "-o", str(out), "--batch-size", "2")
    assert proc.returncode == 0, proc.stderr
    results = [msgspec.json.decode(line, type=ScoreResult) for line in out.read_bytes().splitlines()]
    # fmt: 1, 0, 0; len (l1=3, l2=5): 3 words -> 1, 4 words -> 0.5, 6 words -> 0
    assert [r.score for r in results] == pytest.approx([0.2 + 1.0, 0.5, 0.0])
    assert "3 samples, 0 errors" in proc.stderr
    assert "len.n_tokens" in proc.stderr and "wrote 3 results" in proc.stderr


def test_bad_input_line_names_file_and_line(tmp_path):
    config = tmp_path / "reward.toml"
    config.write_text(CONFIG)
    src = tmp_path / "in.jsonl"
    src.write_text('{"completion": "ok"}\n{"prompt": "no completion"}\n')
    proc = _run("--config", str(config), str(src), "-o", str(tmp_path / "out.jsonl"))
    assert proc.returncode == 2
    assert "in.jsonl:2" in proc.stderr and "completion" in proc.stderr


def test_unknown_scorer_in_config_is_reported(tmp_path):
    config = tmp_path / "reward.toml"
    config.write_text('[components.a]\nscorer = "nope"\n')
    src = tmp_path / "in.jsonl"
    src.write_text('{"completion": "ok"}\n')
    proc = _run("--config", str(config), str(src), "-o", str(tmp_path / "out.jsonl"))
    assert proc.returncode == 2 and "unknown scorer 'nope'" in proc.stderr


def test_an_error_message_keeps_its_bracketed_words(tmp_path):
    """The error is printed as text: rich would take `[bad]` for markup and drop it."""
    config = tmp_path / "reward.toml"
    config.write_text('[components.a]\nscorer = "nope[bad]"\n')
    src = tmp_path / "in.jsonl"
    src.write_text('{"completion": "ok"}\n')
    proc = _run("--config", str(config), str(src), "-o", str(tmp_path / "out.jsonl"))
    assert proc.returncode == 2 and "unknown scorer 'nope[bad]'" in proc.stderr


def test_summary_statistics_hand_worked():
    from rich.console import Console

    results = [ScoreResult(score=1.0, components={"a": 1.0}), ScoreResult(score=3.0, components={"a": 0.0}),
               ScoreResult.failed("boom")]
    console = Console(record=True, width=120)
    console.print(summary_table(results))
    text = console.export_text()
    assert "3 samples, 1 errors" in text
    assert "2.0000" in text and "1.0000" in text  # score mean 2, std 1
    assert "0.5000" in text  # a: mean 0.5, std 0.5
