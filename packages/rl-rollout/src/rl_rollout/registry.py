"""Engines by name: `build_engine("hf", model=..., tokenizer_or_processor=...)`.

Builders take flat keyword arguments (configs stop at the app edge). Engines whose extra is not
installed are still listed; building them raises ImportError with the install command.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rl_core.errors import UserError
from rl_rollout.protocol import Engine

EngineBuilder = Callable[..., Engine]
_ENGINES: dict[str, EngineBuilder] = {}


def register_engine(name: str, builder: EngineBuilder) -> None:
    """Register an engine builder; registering a name twice raises."""
    if name in _ENGINES:
        raise ValueError(f"engine {name!r} is already registered")
    _ENGINES[name] = builder


def engine_names() -> list[str]:
    return sorted(_ENGINES)


def resolve_engine(kind: str, *, key: str = "engine") -> tuple[str, str]:
    """`(engine, why)` for a configured engine kind: `auto` picks `vllm` when a CUDA GPU is
    visible and vLLM imports, else `hf`; any other kind is returned as given. Apps log `why`, so
    a run says which engine it rolls out with. `vllm` asked for where it cannot run (no CUDA
    device, vLLM not installed) raises `rl_core.errors.UserError` naming the setting `key`
    (e.g. `rollout.engine`), before anything is loaded."""
    import importlib.util

    import torch

    if kind not in ("auto", "vllm"):
        return kind, f"{kind} (as configured)"
    if not torch.cuda.is_available():
        if kind == "vllm":
            raise UserError(f'{key} = "vllm" needs a CUDA GPU, and torch sees none on this machine: '
                            f'use {key} = "hf" (or "auto", which picks hf here)')
        return "hf", "hf (auto: no CUDA device, vLLM needs one)"
    if importlib.util.find_spec("vllm") is None:
        if kind == "vllm":
            raise UserError(f'{key} = "vllm" needs vLLM, which is not installed: pip install "rl-rollout[vllm]" '
                            f'(in a clone: uv sync --all-packages --extra vllm), or use {key} = "hf"')
        return "hf", 'hf (auto: vLLM is not installed; pip install "rl-rollout[vllm]" for it)'
    return "vllm", "vllm (as configured)" if kind == "vllm" else "vllm (auto: CUDA device and vLLM found)"


def resolve_judge_engine(kind: str, *, key: str, world_size: int = 1) -> tuple[str, str]:
    """`(engine, why)` for a judge's engine (`resolve_engine`), in a run of `world_size`
    training processes: a vLLM judge serves one process (its engine core, a process of its own,
    would start on GPU 0 for every rank), so with several on a CUDA machine `auto` is `hf` and `vllm`
    is refused (without CUDA the reason given is that one)."""
    import torch

    if world_size > 1 and torch.cuda.is_available():
        if kind == "vllm":
            raise UserError(f'{key} = "vllm" serves one training process and this run has {world_size}: each would '
                            f'start its judge on GPU 0; use {key} = "hf" (or "auto"), or a reward server')
        if kind == "auto":
            return "hf", f"hf (auto: {world_size} training processes, a vLLM judge serves one)"
    return resolve_engine(kind, key=key)


def load_engine(kind: str, model: str, *, key: str = "engine", in_process: bool = True,
                report: Callable[[str], None] | None = None, **options: Any) -> Engine:
    """The one builder of a text engine from a checkpoint, every kind: `auto` resolved
    (`resolve_engine`; a `vllm` that cannot run here is a `UserError` naming `key`) and the
    pick passed to `report` (e.g. a logger's `info`); `hf` loads `model` in this process;
    `vllm` with its engine core in this process (`in_process`: weight pushes pass tensors by
    reference) or in its own (judges: several vLLM engines in one trainer; build those before
    any in-process one, `rl_rollout.colocated.vllm_engine_core`); `openai`: `model` is the
    served model name, `base_url` goes in `options`. A checkpoint is a local folder, a hub id or
    `tiny:<family>` (`rl_models.tiny.resolve`: a missing folder is an error naming it, not a hub
    lookup). `options` go to the engine's constructor (`device=`, `gpu_memory_utilization=`, ...)."""
    given = kind
    kind, why = resolve_engine(kind, key=key)
    if report is not None and given in ("auto", "vllm"):
        report(why)
    if kind in ("hf", "vllm"):
        from rl_models.tiny import resolve

        model = resolve(model, key="model")
    if kind == "hf":
        return build_engine("hf", path=model, **options)
    if kind == "vllm":
        from rl_rollout.colocated import vllm_engine_core

        with vllm_engine_core(in_process=in_process):
            return build_engine("vllm", model=model, **options)
    return build_engine(kind, model=model, **options)


def build_engine(name: str, **kwargs: Any) -> Engine:
    """Build the engine registered as `name` with keyword arguments.

    `hf`: `path=` (checkpoint, via `HFEngine.from_pretrained`) or `model=` + `tokenizer_or_processor=`.
    `openai`: `base_url=`, `model=`, ... (`OpenAIEngine`). `vllm`: `model=` path, ... (`VLLMEngine`).
    Image engines (`sd3`, `janus`) have their own protocol and builder: `rl_rollout.images`.
    """
    if name not in _ENGINES:
        raise KeyError(f"unknown engine {name!r}; valid: {', '.join(engine_names())}")
    return _ENGINES[name](**kwargs)


def _build_hf(**kwargs: Any) -> Engine:
    from rl_rollout.hf import HFEngine

    if "path" in kwargs:
        return HFEngine.from_pretrained(kwargs.pop("path"), **kwargs)
    return HFEngine(kwargs.pop("model"), kwargs.pop("tokenizer_or_processor"), **kwargs)


def _build_openai(**kwargs: Any) -> Engine:
    from rl_rollout.openai import OpenAIEngine

    return OpenAIEngine(**kwargs)


def _build_vllm(**kwargs: Any) -> Engine:
    from rl_rollout.vllm import VLLMEngine

    return VLLMEngine(**kwargs)


register_engine("hf", _build_hf)
register_engine("openai", _build_openai)
register_engine("vllm", _build_vllm)
