"""Compile the text decoder's layers one by one (`torch.compile` per layer, in place).

Training a 2-4B policy on short rows is not bound by its matmuls but by the many small unfused
elementwise kernels around them (RMSNorm in float32, rotary embeddings, SwiGLU, and their
backward). Compiling each decoder layer fuses them: forward + backward get faster at the same
activation memory (benchmarks/RESULTS.md, "caption-rl vs TRL GRPOTrainer: RL step throughput at
Qwen3-VL-2B shape"). Choose it on a GPU; on a CPU the compile costs more than it saves.

Why per layer and not the whole model: the layers are identical, so one compiled graph serves
all of them (`torch.compile` treats the module as an input), the compile takes seconds instead
of minutes, and the parts that break graphs (the multimodal wrapper, media merging, gradient
checkpointing's bookkeeping) stay eager around them. The vision tower's blocks are left eager:
compiling them did not pay at Qwen3-VL-2B shape.

The rollout engine (`rl_rollout.hf`) decodes with the same modules: forwards that carry a KV
cache run the layers eagerly (see `compile_decoder_layers`), and the engine's own compiled decode
step traces through them as before.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from rl_models.logprobs import unwrap_peft


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The text decoder's layer list of a causal LM or Qwen-VL model (peft-wrapped or not)."""
    decoder = unwrap_peft(model).get_decoder()
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or len(layers) == 0:
        raise ValueError(f"{type(unwrap_peft(model)).__name__}: its decoder ({type(decoder).__name__}) has no "
                         f"`layers` list to compile")
    return layers


def compile_decoder_layers(model: torch.nn.Module, **compile_kwargs: Any) -> torch.nn.Module:
    """`torch.compile` every text decoder layer of `model` for forwards without a KV cache (the
    training and log-prob forwards); forwards with one (generation) stay eager. `compile_kwargs`
    go to `torch.compile` (`mode`, `dynamic`, `backend`). Parameter names, state dicts,
    checkpoints and LoRA adapters are unchanged. Choose it for training on a GPU; on a CPU the
    first forward spends tens of seconds compiling for a small gain. Returns `model`.

    Why generation stays eager: a cache object carries per-layer state (`is_initialized`, the
    layer index) that dynamo guards on, so each layer would become a graph of its own, hit
    dynamo's recompile limit (8) and leave every later forward, training included, uncompiled.
    An engine that compiles its own decode step (`rl_rollout.hf`) traces through the eager
    layers as before.

    Why `dynamic=True` (the default here; pass `dynamic=None` for torch's): training rows vary
    in length, and a micro-batch without padding reaches the layers with no attention mask
    (transformers drops an all-ones one) while a padded one brings a mask. Left to dynamo's
    automatic dynamic shapes, each of the two variants compiled first for its first length and
    again, dynamic, at its first other length, a recompile in the middle of a run (a slow
    update step; benchmarks/RESULTS.md, "Follow-up (CPU): caption-rl's step-3 update outlier is a
    recompile"). Dynamic from the start, both graphs come with their first micro-batch; the
    steady state ran the dynamic graphs anyway."""
    compile_kwargs.setdefault("dynamic", True)
    for layer in decoder_layers(model):
        layer.forward = _CompiledWithoutCache(layer.forward, torch.compile(layer.forward, **compile_kwargs))
    return model


class _CompiledWithoutCache:
    """A layer's `forward`: the compiled one, or the eager one when a KV cache is passed
    (`past_key_values=`; transformers >= 5.24 names it `cache=`)."""

    def __init__(self, eager: Callable[..., Any], compiled: Callable[..., Any]) -> None:
        self.eager, self.compiled = eager, compiled

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("past_key_values") is not None or kwargs.get("cache") is not None:
            return self.eager(*args, **kwargs)
        return self.compiled(*args, **kwargs)
