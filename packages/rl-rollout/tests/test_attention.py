"""The engine's attention replacements equal the model's own attention."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.nn.functional import scaled_dot_product_attention

from rl_rollout import SamplingParams
from rl_rollout.attention import PackedBlockMasks, grouped_decode_attention
from rl_rollout.hf import HFEngine, swapped_forwards

PROMPTS = [[11, 12, 13, 14, 15], "the cat sat on", [{"role": "user", "content": "Describe a red square."}]]


@pytest.mark.parametrize("steps", [1, 3])
def test_grouped_decode_attention_equals_sdpa_with_repeated_heads(steps: int) -> None:
    gen = torch.Generator().manual_seed(0)
    bsz, heads, kv_heads, length, dim = 3, 8, 2, 11, 16
    query = torch.randn(bsz, heads, steps, dim, generator=gen)
    key, value = (torch.randn(bsz, kv_heads, length, dim, generator=gen) for _ in range(2))
    mask = torch.rand(bsz, 1, steps, length, generator=gen) > 0.4
    mask[..., 0] = True  # every query sees at least one key
    got, _ = grouped_decode_attention(torch.nn.Module(), query, key, value, mask, scaling=0.3)
    repeat = heads // kv_heads  # query head h reads KV head h // repeat, as transformers' repeat_kv
    ref = scaled_dot_product_attention(query, key.repeat_interleave(repeat, 1), value.repeat_interleave(repeat, 1),
                                       attn_mask=mask, scale=0.3)  # [B, H, T, D]
    torch.testing.assert_close(got, ref.transpose(1, 2), rtol=0, atol=1e-5)


def test_grouped_decode_attention_reads_only_the_slots_its_mask_covers() -> None:
    """A 2-slot mask over a 4-slot cache whose last two slots hold NaN: only the first two are
    read. Query heads 1 and 2 share the one KV head; scores q * k = [0, ln 3] and [0, 2 ln 3],
    softmax [1/4, 3/4] and [1/10, 9/10] over values [10, 20]: 17.5 and 19."""
    nan, ln3 = float("nan"), float(torch.log(torch.tensor(3.0)))
    query = torch.tensor([1.0, 2.0]).view(1, 2, 1, 1)  # [B=1, Hq=2, T=1, D=1]
    key = torch.tensor([0.0, ln3, nan, nan]).view(1, 1, 4, 1)  # [B, Hkv=1, L=4, D]
    value = torch.tensor([10.0, 20.0, nan, nan]).view(1, 1, 4, 1)
    bounded, _ = grouped_decode_attention(torch.nn.Module(), query, key, value,
                                          torch.ones(1, 1, 1, 2, dtype=torch.bool), scaling=1.0)
    torch.testing.assert_close(bounded.flatten(), torch.tensor([17.5, 19.0]))
    whole = torch.tensor([True, True, False, False]).view(1, 1, 1, 4)  # masked, yet read: 0 * NaN
    assert torch.isnan(grouped_decode_attention(torch.nn.Module(), query, key, value, whole, scaling=1.0)[0]).all()


def test_engine_decodes_the_same_with_the_models_own_attention(qwen3_path: Path) -> None:
    """Left-padded rows, sampled at T=1: tokens equal, log-probs to float32 rounding."""
    params = SamplingParams(n=2, max_new_tokens=12, seed=5)
    grouped = HFEngine.from_pretrained(qwen3_path, dtype=torch.float32, device="cpu")
    plain = HFEngine.from_pretrained(qwen3_path, dtype=torch.float32, device="cpu")
    assert grouped._grouped_decode
    plain._grouped_decode = False  # the model's sdpa with a 2-D mask, as before grouped decode
    a, b = grouped.generate(PROMPTS, params), plain.generate(PROMPTS, params)
    assert [g.completion_ids for g in a] == [g.completion_ids for g in b]
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(torch.tensor(x.logprobs), torch.tensor(y.logprobs), rtol=0, atol=1e-5)
    assert grouped.model.config._attn_implementation == "sdpa"  # restored after the loop


def test_packed_block_mask_keeps_every_visible_pair_and_drops_the_rest() -> None:
    """A 640-token sequence: 150 shared tokens, three rows (prefix + suffixes), end padding.
    Every visible token pair lies in a kept block; the kept blocks are exactly those that hold
    one (here the shared tokens and the row ranges decide it at block level)."""
    shared = 150
    doc = [-1] * shared
    seg = [0] * shared
    for d, (prefix, suffixes) in enumerate([(90, [40, 30]), (200, [10]), (20, [50, 25, 5])]):
        doc += [d] * (prefix + sum(suffixes))
        seg += [0] * prefix + [k for k, n in enumerate(suffixes, start=1) for _ in range(n)]
    pad = 640 - len(doc)
    doc_t, seg_t = torch.tensor(doc + [3] * pad), torch.tensor(seg + [-1] * pad)
    masks = PackedBlockMasks(640, "cpu")
    mask = masks.build(doc_t, seg_t, shared)
    q, k = torch.arange(640)[:, None], torch.arange(640)[None, :]
    own = (doc_t[q] == doc_t[k]) & ((seg_t[k] == 0) | (seg_t[k] == seg_t[q]))
    dense = (k <= q) & ((k < shared) | own)  # [640, 640] the token rule
    assert dense.any(dim=1).all()  # no query without a key (no NaN rows)
    blocks = dense.view(5, 128, 5, 128).any(dim=3).any(dim=1)  # [5, 5] blocks holding a visible pair
    assert torch.equal(mask.to_dense()[0, 0].bool(), blocks)
    full = torch.zeros(5, 5, dtype=torch.bool)  # blocks listed as wholly visible
    for qb in range(5):
        full[qb, mask.full_kv_indices[0, 0, qb, : mask.full_kv_num_blocks[0, 0, qb]].long()] = True
    every = dense.view(5, 128, 5, 128).all(dim=3).all(dim=1)  # [5, 5] blocks whose pairs are all visible
    assert full.any() and not (full & ~every).any()  # some, and only wholly visible ones
    assert not blocks.all()  # some blocks are skipped
    again = masks.build(torch.zeros(640, dtype=torch.long), torch.zeros(640, dtype=torch.long), 0)  # one causal row
    assert again.mask_mod is mask.mask_mod  # one mask function per length: the compiled kernel is reused
    assert torch.equal(again.to_dense()[0, 0].bool(), torch.ones(5, 5, dtype=torch.bool).tril())
    with pytest.raises(ValueError, match="multiple of 128"):
        PackedBlockMasks(600, "cpu")


def test_swapped_forwards_restore_class_and_instance_forwards() -> None:
    """How the engine runs compiled layers for scoring: inside, the given forwards; after (also
    on error), a module's own instance forward (a trainer's compiled layer) or its class's."""
    plain, own = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    own.forward = lambda x: x + 1  # as rl_models.compile_decoder_layers sets one per layer
    before = own.forward
    with pytest.raises(RuntimeError, match="boom"), swapped_forwards([plain, own], [lambda x: "a", lambda x: "b"]):
        assert plain(torch.ones(2)) == "a" and own(torch.ones(2)) == "b"
        raise RuntimeError("boom")
    assert "forward" not in plain.__dict__ and own.forward is before
    assert plain(torch.zeros(1, 2)).shape == (1, 2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.filterwarnings("ignore:TensorFloat32 tensor cores:UserWarning")  # inductor's hint, raised as an error otherwise
@pytest.mark.filterwarnings("ignore:The CUDA Graph is empty:UserWarning")  # torch's graph-tree pool set-up, first use per process
def test_compiled_paths_on_a_gpu_equal_the_references(qwen3_path: Path) -> None:
    """On CUDA (bf16, the tiny model with head_dim 16, the fused flex kernel's minimum): compiled
    flex scoring equals the dense-mask scoring and is not recompiled for new items of the same
    padded length; the compiled decode step with grouped attention gives log-probs that teacher
    forcing reproduces."""
    from test_hf_scoring_batched import CANDIDATES, ITEMS, SHARED_ITEMS
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(qwen3_path)
    config.head_dim = 16
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    engine = HFEngine(model, AutoTokenizer.from_pretrained(qwen3_path), device="cuda")
    assert engine.score_attention == "flex" and engine.compile and engine._grouped_decode
    system = torch.randint(10, 600, (300,), generator=torch.Generator().manual_seed(40)).tolist()
    ids = lambda n, seed: torch.randint(10, 600, (n,), generator=torch.Generator().manual_seed(seed)).tolist()  # noqa: E731
    # rows over several 128-token blocks: full blocks (shared, own prefix) and partial ones
    long_items = [(system + ids(260 + 40 * i, i), [ids(30 + 7 * j, 100 * i + j) for j in range(4)]) for i in range(5)]
    for i, items in enumerate((ITEMS, SHARED_ITEMS, long_items)):
        with torch._dynamo.config.patch(error_on_recompile=i == 1):  # as ITEMS, 128 tokens: the same kernel
            flex = engine.score_next_tokens_batch(items, CANDIDATES)
        engine.score_attention = "mask"
        mask = engine.score_next_tokens_batch(items, CANDIDATES)
        engine.score_attention = "flex"
        for a, b in zip(flex, mask, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=5e-2)  # bf16 logits, different kernels
    gens = engine.generate(PROMPTS, SamplingParams(n=2, max_new_tokens=16, seed=0))
    for g in gens:
        ids = torch.tensor([g.prompt_ids + g.completion_ids], device="cuda")
        with torch.no_grad():
            logits = engine.model(ids).logits[0].float()  # [T, V]
        ref = torch.log_softmax(logits, -1)[len(g.prompt_ids) - 1 : -1].gather(
            -1, torch.tensor(g.completion_ids, device="cuda")[:, None])[:, 0].cpu()  # [N]
        torch.testing.assert_close(torch.tensor(g.logprobs), ref, rtol=0, atol=5e-2)
