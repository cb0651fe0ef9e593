"""`HFEngine.score_next_tokens_batch`: packed shared-prefix scoring equals scoring every full
sequence alone (fp32, CPU, the sdpa path the GPU takes, and eager)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from rl_rollout.hf import (
    HFEngine,
    PackedRow,
    compute_packing_plan,
    pack_rows_flat,
    shared_prefix_len,
)
from rl_rollout.protocol import BatchScoringEngine, Engine

CANDIDATES = [200, 201, 202, 7, 639]


def random_ids(n: int, seed: int) -> list[int]:
    return torch.randint(10, 640, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# prefixes of different lengths, different suffix counts, empty suffixes (also right after a
# non-empty one), an item with no suffixes, suffixes of one token
ITEMS: list[tuple[list[int], list[list[int]]]] = [
    (random_ids(30, 0), [random_ids(3, 1), [], random_ids(7, 2), random_ids(1, 3)]),
    (random_ids(5, 4), [random_ids(12, 5)]),
    (random_ids(17, 6), []),
    (random_ids(1, 7), [[], random_ids(4, 8), random_ids(4, 9), random_ids(9, 10), random_ids(2, 11)]),
    (random_ids(23, 12), [random_ids(6, 13), random_ids(6, 14)]),
]


def reference(model: torch.nn.Module, items: Sequence[tuple[list[int], Sequence[list[int]]]], temperature: float) -> list[torch.Tensor]:
    """Each full sequence prefix + suffix in its own unpadded forward, last-position log-probs."""
    out = []
    for prefix, suffixes in items:
        rows = []
        for suffix in suffixes:
            with torch.no_grad():
                logits = model(torch.tensor([prefix + suffix])).logits[0, -1].float()  # [V]
            rows.append(torch.log_softmax(logits / temperature, -1)[CANDIDATES])  # [C]
        out.append(torch.stack(rows) if rows else torch.empty(0, len(CANDIDATES)))
    return out


def assert_close(got: list[torch.Tensor], ref: list[torch.Tensor]) -> None:
    assert len(got) == len(ref)
    for i, (a, b) in enumerate(zip(got, ref, strict=True)):
        assert a.shape == b.shape and a.dtype == torch.float32, i
        assert torch.allclose(a, b, atol=1e-4), (i, (a - b).abs().max())


# a system prompt every item starts with (the flex path runs it once per forward), one item
# whose prefix is only that plus one token, and one empty suffix right after it
SYSTEM = random_ids(21, 20)
SHARED_ITEMS: list[tuple[list[int], list[list[int]]]] = [
    (SYSTEM + random_ids(9, 21), [random_ids(4, 22), random_ids(2, 23)]),
    (SYSTEM + random_ids(1, 24), [[], random_ids(5, 25)]),
    (SYSTEM + random_ids(14, 26), [random_ids(1, 27), random_ids(8, 28), random_ids(3, 29)]),
    (SYSTEM[:12] + random_ids(6, 30), [random_ids(3, 31)]),  # shares only 12 tokens with the rest
]


@pytest.mark.parametrize("attention", ["mask", "flex"])
@pytest.mark.parametrize("budget", [16384, 40, 1])
@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_batch_equals_full_sequence_scoring(qwen3_engine: HFEngine, budget: int, temperature: float, attention: str) -> None:
    """Budget 40 splits item 0 and 3 over several rows and forwards; budget 1 gives every
    suffix its own row and forward. flex runs uncompiled on the CPU (same masks and packing)."""
    engine = HFEngine(qwen3_engine.model, qwen3_engine.tokenizer, score_token_budget=budget, score_attention=attention)
    for items in (ITEMS, SHARED_ITEMS):
        got = engine.score_next_tokens_batch(items, CANDIDATES, temperature=temperature)
        assert_close(got, reference(engine.model, items, temperature))


def test_flex_runs_the_shared_prefix_once_per_forward(qwen3_engine: HFEngine) -> None:
    """The 12 tokens all four SHARED_ITEMS start with lead the packed sequence once; each item
    then adds only its own prefix and suffixes, laid end to end (no padding between rows)."""
    engine = HFEngine(qwen3_engine.model, qwen3_engine.tokenizer, score_attention="flex")
    inputs: list[list[int]] = []
    hook = engine.model.get_decoder().register_forward_pre_hook(
        lambda _m, _a, kw: inputs.append(kw["input_ids"][0].tolist()), with_kwargs=True)
    try:
        engine.score_next_tokens_batch(SHARED_ITEMS, CANDIDATES)
    finally:
        hook.remove()
    assert len(inputs) == 1 and len(inputs[0]) == 128  # one forward, padded to the smallest length
    own = sum(len(p) - 12 + sum(map(len, ss)) for p, ss in SHARED_ITEMS)
    assert inputs[0][:12] == SYSTEM[:12]
    assert inputs[0][12 + own:] == [engine.pad_id] * (128 - 12 - own)
    assert inputs[0].count(SYSTEM[0]) == SYSTEM[:12].count(SYSTEM[0])  # the shared part is not repeated


def test_mask_runs_the_shared_prefix_once_per_call(qwen3_engine: HFEngine) -> None:
    """The 12 tokens all four SHARED_ITEMS start with run once, into a KV cache; each row then
    holds only its item's own prefix and suffixes, so a batch of N judge prompts pays for
    their system prompt once, not N times."""
    engine = HFEngine(qwen3_engine.model, qwen3_engine.tokenizer, score_attention="mask")
    inputs: list[list[list[int]]] = []
    hook = engine.model.get_decoder().register_forward_pre_hook(
        lambda _m, _a, kw: inputs.append(kw["input_ids"].tolist()), with_kwargs=True)
    try:
        engine.score_next_tokens_batch(SHARED_ITEMS, CANDIDATES)
    finally:
        hook.remove()
    assert inputs[0] == [SYSTEM[:12]] and len(inputs) == 2  # the shared tokens, then one forward of rows
    rows = inputs[1]
    assert len(rows) == 4 and len(rows[0]) == max(len(p) - 12 + sum(map(len, ss)) for p, ss in SHARED_ITEMS)
    assert sorted(row[0] for row in rows) == sorted(p[12] for p, _ in SHARED_ITEMS)  # each row starts after them


def test_pack_rows_flat_and_the_shared_prefix() -> None:
    rows = [PackedRow(0, (0,), 7), PackedRow(1, (0,), 5), PackedRow(2, (0, 1), 4), PackedRow(3, (0,), 12)]
    assert pack_rows_flat(rows, 12) == [[rows[3]], [rows[0], rows[1]], [rows[2]]]  # 12 | 7+5 | 4
    assert shared_prefix_len([[1, 2, 3, 4], [1, 2, 3, 5, 6], [1, 2, 3, 4, 7]]) == 3
    assert shared_prefix_len([[1, 2, 3], [1, 2, 3, 4]]) == 2  # each prefix keeps one token of its own
    assert shared_prefix_len([[5], [5]]) == 0 and shared_prefix_len([]) == 0


def test_eager_attention_takes_the_additive_mask(qwen3_path: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(qwen3_path, dtype=torch.float32, attn_implementation="eager")
    engine = HFEngine(model, HFEngine.from_pretrained(qwen3_path).tokenizer, score_token_budget=64)
    assert_close(engine.score_next_tokens_batch(ITEMS, CANDIDATES), reference(model, ITEMS, 1.0))


def test_single_item_call_is_the_batch_call(qwen3_engine: HFEngine) -> None:
    """Scored alone, an item gets its batch row's log-probs. Not bitwise: alone, it is packed into
    a forward of another shape, and CPU matmul kernels (AVX-512 ones, seen) round differently
    per shape; 1e-5 is float32 rounding, far below any real packing or masking error."""
    batch = qwen3_engine.score_next_tokens_batch(ITEMS, CANDIDATES)
    for (prefix, suffixes), expected in zip(ITEMS, batch, strict=True):
        torch.testing.assert_close(qwen3_engine.score_next_tokens(prefix, suffixes, CANDIDATES), expected,
                                   rtol=0, atol=1e-5)
    one = qwen3_engine.score_next_tokens_batch(ITEMS[:1], CANDIDATES)
    assert_close(one, reference(qwen3_engine.model, ITEMS[:1], 1.0))


def test_forwards_stay_within_the_token_budget(qwen3_engine: HFEngine) -> None:
    engine = HFEngine(qwen3_engine.model, qwen3_engine.tokenizer, score_token_budget=48)
    shapes: list[torch.Size] = []
    hook = engine.model.get_decoder().register_forward_pre_hook(lambda _m, _a, kw: shapes.append(kw["input_ids"].shape), with_kwargs=True)
    try:
        engine.score_next_tokens_batch(ITEMS, CANDIDATES)
    finally:
        hook.remove()
    plan = compute_packing_plan([len(p) for p, _ in ITEMS], [[len(s) for s in ss] for _, ss in ITEMS], 48)
    assert len(shapes) == len(plan) > 1
    assert all(b * t <= 48 for b, t in shapes)  # no single row is longer than 48 here


def test_compute_packing_plan_hand_worked() -> None:
    # item 0: prefix 10, suffixes 3, 4, 5 -> rows [0, 1] (17 tokens) and [2] (15); item 1: no
    # suffixes -> no row; item 2: prefix 2, suffixes 30 (alone over budget), 0, 1 -> [0] (32), [1, 2] (3)
    plan = compute_packing_plan([10, 7, 2], [[3, 4, 5], [], [30, 0, 1]], token_budget=18)
    assert plan == [
        [PackedRow(2, (0,), 32)],
        [PackedRow(0, (0, 1), 17)],
        [PackedRow(0, (2,), 15)],
        [PackedRow(2, (1, 2), 3)],
    ]
    # a larger budget batches rows: widest 17 x 3 rows = 51 <= 60
    assert compute_packing_plan([10, 4], [[3, 4], [1]], token_budget=60) == [
        [PackedRow(0, (0, 1), 17), PackedRow(1, (0,), 5)]
    ]
    assert compute_packing_plan([], [], token_budget=8) == []


def test_bad_input_names_the_item(qwen3_engine: HFEngine) -> None:
    assert qwen3_engine.score_next_tokens_batch([], CANDIDATES) == []
    empty = qwen3_engine.score_next_tokens_batch([([1, 2], [])], CANDIDATES)
    assert len(empty) == 1 and empty[0].shape == (0, len(CANDIDATES))
    with pytest.raises(ValueError, match="item 1: shared prefix is empty"):
        qwen3_engine.score_next_tokens_batch([([1], [[2]]), ([], [[3]])], CANDIDATES)
    too_long = [3] * qwen3_engine.max_context
    with pytest.raises(ValueError, match=rf"item 2, suffix 1: prefix \(2\) \+ suffix \({len(too_long)}\)"):
        qwen3_engine.score_next_tokens_batch([([1], [[2]]), ([1], []), ([1, 2], [[3], too_long])], CANDIDATES)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        qwen3_engine.score_next_tokens_batch([([1], [[2]])], CANDIDATES, temperature=0.0)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        qwen3_engine.score_next_tokens_batch([([1], [[2]])], [-1])


def test_attention_without_custom_masks_is_refused(qwen3_path: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(qwen3_path, dtype=torch.float32)
    model.config._attn_implementation = "flash_attention_2"  # CUDA-only kernel; only the name is checked here
    engine = HFEngine(model, HFEngine.from_pretrained(qwen3_path).tokenizer)
    with pytest.raises(ValueError, match=r"attn_implementation 'flash_attention_2'.*\['eager', 'sdpa'\]"):
        engine.score_next_tokens([1], [[2]], CANDIDATES)


def test_hf_engine_is_a_batch_scoring_engine(qwen3_engine: HFEngine) -> None:
    assert isinstance(qwen3_engine, BatchScoringEngine) and isinstance(qwen3_engine, Engine)
