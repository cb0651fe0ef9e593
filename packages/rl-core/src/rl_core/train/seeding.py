"""Seeding and RNG state capture for exact resume: Python `random`, NumPy's global generator
(when NumPy is installed), torch CPU and every CUDA device.
"""

from __future__ import annotations

import hashlib
import os
import random
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, cast

import torch

try:  # NumPy is optional for rl-core; its global RNG is seeded/saved when it is installed
    import numpy as np
except ImportError:  # pragma: no cover - numpy comes with accelerate in rl-core[train]
    np = None  # type: ignore[assignment]  # every use checks `np is not None`

__all__ = ["get_rng_state", "isolated_rng", "sample_seed", "seed_everything", "set_rng_state"]


def seed_everything(seed: int, *, rank: int = 0, deterministic: bool = False) -> int:
    """Seed python, numpy, torch and CUDA with `seed + rank`; return that seed.

    Pass the data-parallel rank so ranks draw different noise (identical sampling noise on
    every rank would duplicate rollouts, e.g. the SDE noise of Flow-GRPO). `deterministic=True`
    also turns on `torch.use_deterministic_algorithms` and disables cuDNN autotuning: pick it to
    debug a divergence, not for speed.
    """
    seed = seed + rank
    random.seed(seed)
    if np is not None:
        np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # seeds every CUDA device too
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False
        torch.backends.cudnn.deterministic = True
    return seed


def get_rng_state() -> dict[str, Any]:
    """Every global RNG state, in types `torch.load(weights_only=True)` accepts."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if np is not None:
        # legacy=True gives the MT19937 tuple; numpy's stub returns `dict | tuple` for any flag
        kind, key, pos, has_gauss, gauss = cast(
            "tuple[str, np.ndarray, int, int, float]", np.random.get_state(legacy=True))
        state["numpy"] = (kind, torch.from_numpy(key.astype(np.int64)), pos, has_gauss, gauss)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what `get_rng_state` captured."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(state["torch"])
    if np is not None and "numpy" in state:
        kind, key, pos, has_gauss, gauss = state["numpy"]
        np.random.set_state((kind, key.numpy().astype(np.uint32), pos, has_gauss, gauss))
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])


def sample_seed(*parts: int) -> int:
    """A 56-bit seed from integers such as `(seed, step, sample index)`: randomness that depends
    only on a sample's place in the run, not on the process count, the batch split or what ran
    before it, so a resumed or re-sharded run draws the same samples."""
    digest = hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=7).digest()
    return int.from_bytes(digest, "little")


@contextmanager
def isolated_rng() -> Iterator[None]:
    """Run a block (validation, a start-up dry run) without moving the training RNG streams, so
    doing it or not never changes the training run (and a resumed run repeats an uninterrupted
    one exactly)."""
    state = get_rng_state()
    try:
        yield
    finally:
        set_rng_state(state)
