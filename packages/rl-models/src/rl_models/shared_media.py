"""Encode each distinct image or video once per forward, however many rows repeat it.

GRPO-style training samples `n` completions per prompt, so a micro-batch of a Qwen-VL captioner
holds the same image `n` times, and the vision tower (a ~0.4B-parameter ViT at Qwen3-VL-2B,
run with one attention call per image) encodes every copy — in the rollout prefill, in the
log-prob replay and, with gradients, in every update. `share_identical_media(model)` makes the
vision tower encode the distinct images once and hand each copy the same features.

Same results: the tower attends within each image only, so an image's features do not depend
on the others in the batch (up to float rounding where matmul shapes change), and autograd sums
the gradients of all copies into the one computation (`index_select`'s backward), which is what
the copies' separate gradients add up to. Images are matched by grid and pixel values
(a fingerprint on the device, then `torch.equal`), so rows need not be ordered or labelled.
"""

from __future__ import annotations

import types
from typing import Any, cast

import torch
from torch import Tensor

_MARK = "_rl_models_shares_media"


def share_identical_media(model: torch.nn.Module) -> torch.nn.Module:
    """Make `model`'s vision tower encode identical images/videos in one forward only once.

    `model` is a Qwen2.5-VL / Qwen3-VL model (or a peft wrapper of one). The tower's `forward`
    is wrapped on the instance, so parameter names, checkpoints and `save_pretrained` are
    unchanged. Calling it twice is harmless. Returns `model`.
    """
    visual = _vision_tower(model)
    if not getattr(visual, _MARK, False):
        visual.forward = types.MethodType(_sharing_forward, visual)
        setattr(visual, _MARK, True)
    return model


def _vision_tower(model: torch.nn.Module) -> torch.nn.Module:
    for name, module in model.named_modules():
        if name.endswith("visual") and hasattr(module, "spatial_merge_size"):
            return module
    raise ValueError(f"{type(model).__name__} has no Qwen-VL vision tower (a `visual` module with spatial_merge_size)")


def _sharing_forward(self: torch.nn.Module, hidden_states: Tensor, grid_thw: Tensor, **kwargs: Any) -> Any:
    """The tower's own forward on the unique images only. It is looked up on the class, not
    captured, so a deep copy of the model (`rl_core.train.FullWeights`) runs its own tower."""
    original = type(self).forward.__get__(self)
    # hidden_states: [P, D] patches of every image, image after image; grid_thw: [N, 3]
    owners = _owners(hidden_states, grid_thw)
    if owners is None or kwargs.get("output_hidden_states") or kwargs.get("output_attentions"):
        return original(hidden_states, grid_thw, **kwargs)
    unique = sorted(set(owners))
    patches = grid_thw.prod(-1).tolist()  # patches per image
    starts = [sum(patches[:i]) for i in range(len(patches))]
    keep = torch.cat([torch.arange(starts[u], starts[u] + patches[u]) for u in unique]).to(hidden_states.device)
    out = original(hidden_states[keep], grid_thw[unique], **kwargs)
    merge_size = cast(int, self.spatial_merge_size)  # an int attribute of the vision tower
    merged = [p // merge_size**2 for p in patches]  # output tokens per image
    index = _expand_index(owners, unique, merged).to(hidden_states.device)  # [M] rows of the unique output
    out.pooler_output = out.pooler_output.index_select(0, index)  # [M, D_out]
    if out.get("deepstack_features") is not None:  # Qwen3-VL
        out.deepstack_features = [f.index_select(0, index) for f in out.deepstack_features]
    # patch-level states are not per-image contiguous in Qwen2.5-VL (window order) and no
    # caller reads them: drop them rather than hand back the unique images' states
    out.last_hidden_state = None
    return out


def _owners(hidden_states: Tensor, grid_thw: Tensor) -> list[int] | None:
    """For each image, the index of the first identical one (same grid, same pixels); None when
    all are distinct (nothing to share)."""
    count = grid_thw.shape[0]
    if count < 2:
        return None
    patches = grid_thw.prod(-1)  # [N]
    probe = torch.linspace(0.5, 1.5, hidden_states.shape[-1], device=hidden_states.device)  # [D]
    per_patch = hidden_states.float() @ probe  # [P] one number per patch
    image_of_patch = torch.repeat_interleave(torch.arange(count, device=hidden_states.device), patches)  # [P]
    prints = torch.zeros(count, device=hidden_states.device).index_add_(0, image_of_patch, per_patch)  # [N]
    keys = list(zip(grid_thw.tolist(), prints.tolist(), strict=True))
    slices = hidden_states.split(patches.tolist())
    owners: list[int] = []
    for i, key in enumerate(keys):
        match = next((j for j in range(i) if owners[j] == j and keys[j] == key and torch.equal(slices[j], slices[i])), i)
        owners.append(match)
    return None if len(set(owners)) == count else owners


def _expand_index(owners: list[int], unique: list[int], merged: list[int]) -> Tensor:
    """Row indices into the unique images' concatenated output that rebuild every image's rows."""
    offset, start_of = 0, {}
    for u in unique:
        start_of[u] = offset
        offset += merged[u]
    return torch.cat([torch.arange(start_of[o], start_of[o] + merged[i]) for i, o in enumerate(owners)])
