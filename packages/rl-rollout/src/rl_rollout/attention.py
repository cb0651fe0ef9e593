"""Attention kernels the `hf` engine swaps into a transformers model for its own calls.

transformers' `sdpa` path repeats every key/value head to the query heads (`repeat_kv`) as soon
as a mask is given, and a mask is always given when rows are padded. For decode that copy is
most of the step's memory traffic: at Qwen3-4B shape (32 query heads over 8 KV heads) it writes
and reads 4x the KV cache per layer. Two replacements, each registered with transformers'
`AttentionInterface` and switched on only while the engine runs (`attention_implementation`),
so a model shared with a trainer keeps its own attention everywhere else:

- `grouped_decode`: one new token per row against the static cache. The query heads of a
  KV head are folded into that head's rows of one batched matmul, so each key and value is read
  once; softmax in float32 over a boolean key mask `[B, 1, 1, Lk]`. The mask's length bounds
  the read: a mask shorter than the cache (`Lk < L`, e.g. the filled length rounded up to a
  block) reads only the first Lk slots, so decode traffic follows the context, not the
  preallocated length (`rl_rollout.janus` passes the bound; `hf` passes the whole cache).
- `packed_flex`: `torch.nn.attention.flex_attention` with a `BlockMask`, for shared-prefix
  scoring. Blocks the mask leaves empty are skipped, so packing many prompts and their suffixes
  into one long row costs the attention each prompt needs, not the square of the row.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from transformers import AttentionInterface, PretrainedConfig

GROUPED_DECODE = "rl_rollout_grouped_decode"
PACKED_FLEX = "rl_rollout_packed_flex"


def grouped_decode_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention of T new tokens per row over the cache, without repeating KV heads.

    query: [B, Hq, T, D]; key, value: [B, Hkv, L, D]; attention_mask: boolean [B, 1, T, Lk]
    (True = attend; T = 1 in decode; Lk <= L: only the first Lk cache slots are read) or None.
    Returns ([B, T, Hq, D], None) as transformers' attention functions do.
    """
    if attention_mask is not None:  # unconditional slice (a no-op at Lk = L): no guard on Lk under compile
        key, value = key[:, :, : attention_mask.shape[-1]], value[:, :, : attention_mask.shape[-1]]  # [B, Hkv, Lk, D]
    bsz, heads, steps, dim = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    scale = scaling if scaling is not None else dim**-0.5
    q = query.reshape(bsz, kv_heads, groups * steps, dim)  # [B, Hkv, G*T, D]; head h = kv * G + g
    scores = torch.matmul(q, key.transpose(-1, -2)).float() * scale  # [B, Hkv, G*T, Lk]
    if attention_mask is not None:
        if attention_mask.dtype != torch.bool:
            raise TypeError("grouped_decode_attention takes a boolean mask (True = attend)")
        # [B, 1, T, Lk] -> [B, 1, G*T, Lk]: every group of a KV head sees the same keys
        mask = attention_mask.expand(bsz, 1, steps, -1).repeat(1, 1, groups, 1)
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(value.dtype)  # [B, Hkv, G*T, Lk]
    out = torch.matmul(probs, value)  # [B, Hkv, G*T, D]
    return out.reshape(bsz, heads, steps, dim).transpose(1, 2), None  # [B, T, Hq, D]


_compiled_flex: Any = None


def _flex_attention() -> Any:
    """flex_attention, compiled on first use on CUDA (uncompiled it materialises the scores)."""
    global _compiled_flex
    from torch.nn.attention.flex_attention import flex_attention

    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex


def packed_flex_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """flex_attention over a `BlockMask` (passed as the model's `attention_mask`), grouped
    query heads read their KV head directly. query: [B, Hq, T, D]; key, value: [B, Hkv, T, D].
    Returns ([B, T, Hq, D], None)."""
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    if not isinstance(attention_mask, BlockMask):
        raise TypeError("packed_flex_attention needs a flex_attention BlockMask as the attention mask")
    gqa = query.shape[1] != key.shape[1]
    if query.device.type == "cuda" and query.shape[-1] >= 16:  # the fused kernel needs head_dim >= 16
        out = _flex_attention()(query, key, value, block_mask=attention_mask, scale=scaling, enable_gqa=gqa)
    else:  # the unfused reference: right, and fast enough for the CPU's small models
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
            out = flex_attention(query, key, value, block_mask=attention_mask, scale=scaling, enable_gqa=gqa)
    return out.transpose(1, 2).contiguous(), None  # [B, T, Hq, D]


FLEX_BLOCK = 128  # flex_attention's block size; packed sequences are padded to a multiple of it


class PackedBlockMasks:
    """`BlockMask`s for packed scoring sequences of one length, built from their structure in
    O(blocks^2) (`create_block_mask` would evaluate the token rule on all N^2 pairs: 4 GB at 64k).

    Token roles, as given to `build`: `doc` non-decreasing per token, -1 for the `shared`
    leading tokens every row reads, d for row d, a number past the last row for the end padding;
    `seg` 0 for a row's prefix, k for its k-th suffix, -1 for padding. A key is visible to a
    query when causal and either shared or in the query's row and in the prefix or the query's
    segment. A block pair is kept when it can hold a visible key (causal, and the key block
    holds shared tokens or the two blocks' row ranges overlap); the token rule applies inside,
    except in blocks known to be wholly visible (listed as full blocks, where flex skips it).

    The rule reads this object's fixed buffers, so every mask of this length carries the same
    mask function: the compiled flex kernel is reused. A new closure per call would recompile
    it each forward, and past dynamo's recompile limit flex silently falls back to its unfused
    kernel, which materialises every score (tens of GiB at 16k tokens).
    """

    def __init__(self, length: int, device: torch.device | str) -> None:
        if length % FLEX_BLOCK:
            raise ValueError(f"packed sequence length {length} is not a multiple of {FLEX_BLOCK}")
        self.length = length
        self.doc = torch.zeros(length, dtype=torch.long, device=device)  # [N]
        self.seg = torch.zeros(length, dtype=torch.long, device=device)  # [N]
        self.shared = torch.zeros((), dtype=torch.long, device=device)
        doc, seg, shared = self.doc, self.seg, self.shared

        def visible(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
            own = (doc[q] == doc[k]) & ((seg[k] == 0) | (seg[k] == seg[q]))
            return (k <= q) & ((k < shared) | own)

        self.visible = visible

    def build(self, doc: torch.Tensor, seg: torch.Tensor, shared: int) -> Any:
        """The mask for one sequence (doc, seg: [N] as described above)."""
        from torch.nn.attention.flex_attention import BlockMask

        if doc.shape != (self.length,) or seg.shape != (self.length,):
            raise ValueError(f"doc and seg must have shape ({self.length},), got {tuple(doc.shape)} and {tuple(seg.shape)}")
        self.doc.copy_(doc)
        self.seg.copy_(seg)
        self.shared.fill_(shared)
        blocks = self.doc.view(-1, FLEX_BLOCK)  # [nb, 128]
        low, high = blocks.min(dim=1).values, blocks.max(dim=1).values  # [nb] row range of each block
        index = torch.arange(blocks.shape[0], device=self.doc.device)  # [nb]
        overlap = (low[:, None] <= high[None, :]) & (low[None, :] <= high[:, None])  # [nb q, nb k]
        holds_shared = index[None, :] * FLEX_BLOCK < shared  # [1, nb k]
        live = (index[None, :] <= index[:, None]) & (overlap | holds_shared)  # [nb q, nb k]
        # full blocks (every pair visible: the kernel skips the rule there): a key block before
        # the query block that is all shared tokens, or all prefix of the one row the query block is in
        segs = self.seg.view(-1, FLEX_BLOCK)  # [nb, 128]
        prefix_only = (segs.min(dim=1).values == 0) & (segs.max(dim=1).values == 0)  # [nb]
        one_row = low == high  # [nb]
        same_row = one_row[:, None] & one_row[None, :] & (low[:, None] == low[None, :])  # [nb q, nb k]
        shared_only = (index + 1) * FLEX_BLOCK <= shared  # [nb]
        full = (index[None, :] < index[:, None]) & (shared_only[None, :] | (same_row & prefix_only[None, :]))
        partial = live & ~full  # [nb q, nb k]

        def listed(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            order = torch.argsort((~blocks).to(torch.int8), dim=1, stable=True)  # listed blocks first, ascending
            return blocks.sum(dim=1, dtype=torch.int32)[None, None], order.to(torch.int32)[None, None]

        return BlockMask.from_kv_blocks(
            *listed(partial), *listed(full), BLOCK_SIZE=FLEX_BLOCK, mask_mod=self.visible,
            seq_lengths=(self.length, self.length),
        )


AttentionInterface.register(GROUPED_DECODE, grouped_decode_attention)
AttentionInterface.register(PACKED_FLEX, packed_flex_attention)


@contextmanager
def attention_implementation(config: PretrainedConfig, name: str) -> Iterator[None]:
    """Run the layers that read `config` with attention function `name`, then restore the
    previous one (also on error). Only this config object changes, not its sub-configs."""
    previous = config._attn_implementation_internal
    config._attn_implementation_internal = name
    try:
        yield
    finally:
        config._attn_implementation_internal = previous
