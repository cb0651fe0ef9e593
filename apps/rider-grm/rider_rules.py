"""Rule rewards for the rider example, in verl's `compute_score` form
(`compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float | dict`)."""

from __future__ import annotations

import re
from typing import Any


def compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None) -> dict[str, float]:
    """Format gate for rider replies: 1.0 when the reply is non-empty and at most three
    sentences (the system prompt's limit), else 0.0; `sentences` is reported as an extra."""
    sentences = [s for s in re.split(r"[.!?。！？]+", solution_str) if s.strip()]
    ok = 1 <= len(sentences) <= 3
    return {"score": 1.0 if ok else 0.0, "sentences": float(len(sentences))}


def letter_e_share(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None) -> float:
    """The share of the reply's characters that are the letter "e" (0 for an empty reply): a rule
    a tiny random policy learns within a few steps (~0.07 for random tokens), which is why the
    embedded default trains on it."""
    return sum(ch == "e" for ch in solution_str) / max(len(solution_str), 1)
