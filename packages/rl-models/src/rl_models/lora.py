"""LoRA through peft: default targets per family, the reference model as "the same model with
LoRA disabled" (no second copy of the weights), and merged or adapter-only export; full
fine-tuning's reference, a frozen copy (`full_finetune`, `reference_of`).
"""

from __future__ import annotations

import contextlib
import copy
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import cast

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.lora import LoraLayer
from torch import Tensor
from torch.distributed.tensor import DTensor
from transformers import PreTrainedModel
from transformers.utils import PushToHubMixin

from rl_models.logprobs import TokenBatch, completion_logprobs, unwrap_peft

_QWEN_PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Qwen-VL vision towers also have `*_proj` MLPs: restrict the match to the language model.
_QWEN_VL_TARGETS = r".*language_model.*\.(" + "|".join(_QWEN_PROJ) + r")"

# family -> peft `target_modules` (a list matches module-name suffixes, a string is a full regex).
DEFAULT_TARGET_MODULES: dict[str, list[str] | str] = {
    "qwen3": list(_QWEN_PROJ),
    "qwen2": list(_QWEN_PROJ),
    "qwen2_5_vl": _QWEN_VL_TARGETS,
    "qwen3_vl": _QWEN_VL_TARGETS,
    # Flow-GRPO's SD3 recipe (docs/reference.md §2): joint-attention projections of both streams.
    "sd3": ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"],
    # Janus: LoRA on the language model and the image-generation head's first layer (`proj_out`;
    # its last layer is read as a raw matrix by the chunked image-token log-probs, so it stays
    # out); the VQ and SigLIP towers stay frozen. The head matters when its weights are small:
    # the language model's output is RMS-normalised, so through a frozen head LoRA can move the
    # image-token logits only as far as the head's norm allows (~0.1 on the tiny random model).
    # Wan 2.1: the self- and cross-attention projections of every block (diffusers' Wan LoRA
    # training and DanceGRPO's targets).
    "wan": ["to_q", "to_k", "to_v", "to_out.0"],
    "cosmos": ["to_q", "to_k", "to_v", "to_out.0"],  # CosmosTransformer3DModel's self- and cross-attention
    "janus": r".*(language_model.*\.(" + "|".join(_QWEN_PROJ) + r")|generation_head\.proj_out)",
}


def default_target_modules(family: str) -> list[str] | str:
    """Default LoRA targets of `family` (a config `model_type` or "sd3")."""
    if family not in DEFAULT_TARGET_MODULES:
        raise KeyError(
            f"no default LoRA targets for family {family!r}; valid: "
            f"{', '.join(sorted(DEFAULT_TARGET_MODULES))} (or pass target_modules=...)"
        )
    return DEFAULT_TARGET_MODULES[family]


def add_lora(
    model: torch.nn.Module,
    *,
    family: str | None = None,
    r: int = 16,
    alpha: float = 32,
    dropout: float = 0.0,
    target_modules: list[str] | str | None = None,
    init_lora_weights: bool | str = True,
) -> PeftModel:
    """Wrap `model` with fresh LoRA adapters (`get_peft_model`); only they are trainable.

    `family` defaults to `model.config.model_type` for transformers models; pass "sd3" for an
    `SD3Transformer2DModel`, "wan" for a `WanTransformer3DModel`, "cosmos" for a `CosmosTransformer3DModel`. peft initialises B to zero, so
    the wrapped model starts equal to the base model (`init_lora_weights=False` gives random B,
    for tests).
    """
    if target_modules is None:
        if family is None:
            family = getattr(getattr(model, "config", None), "model_type", None)
            if not isinstance(family, str):
                raise ValueError(f"{type(model).__name__} has no config.model_type: pass family= "
                                 f"(e.g. family='sd3')")
        target_modules = default_target_modules(family)
    config = LoraConfig(
        r=r,
        lora_alpha=alpha,  # type: ignore[arg-type]  # peft annotates int; the scale alpha / r takes a float
        lora_dropout=dropout,
        target_modules=target_modules,
        init_lora_weights=init_lora_weights,  # type: ignore[arg-type]  # peft checks the name
    )
    return get_peft_model(model, config)


@contextlib.contextmanager
def disabled_adapter(model: PeftModel) -> Iterator[PeftModel]:
    """Run `model` as its reference (LoRA off) inside the block: the same weights, no copy."""
    with model.disable_adapter():
        yield model


_REFERENCES: weakref.WeakKeyDictionary[torch.nn.Module, torch.nn.Module] = weakref.WeakKeyDictionary()


def full_finetune(model: torch.nn.Module, *, reference: bool) -> torch.nn.Module:
    """`model` with every weight trainable: full fine-tuning, where `add_lora` trains an adapter.
    `reference`: keep a frozen copy of the starting weights for `reference_of` (a KL term or a
    DPO margin needs one; it costs the model's memory once more). Returns `model` itself."""
    model.requires_grad_(True)
    if reference:
        _REFERENCES[model] = copy.deepcopy(model).requires_grad_(False).eval()
    return model


@contextlib.contextmanager
def reference_of(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """The reference policy to run inside the block: a LoRA model with its adapters off (the same
    weights), else the frozen copy `full_finetune(model, reference=True)` kept."""
    if isinstance(model, PeftModel):
        with model.disable_adapter():
            yield model
        return
    ref = _REFERENCES.get(model)
    if ref is None:
        raise ValueError(f"{type(model).__name__} trains every weight and kept no reference: "
                         "build it with full_finetune(model, reference=True)")
    yield ref


@torch.no_grad()
def reference_completion_logprobs(
    model: PeftModel, batch: TokenBatch, *, temperature: float = 1.0, chunk_size: int = 1024
) -> Tensor:
    """`completion_logprobs` `[B, C]` of the reference policy: the LoRA model with adapters disabled."""
    with disabled_adapter(model):
        return completion_logprobs(model, batch, temperature=temperature, chunk_size=chunk_size)


def export_lora(model: PeftModel, out_dir: str | Path) -> Path:
    """Save the adapter only (`adapter_config.json` + `adapter_model.safetensors`)."""
    out = Path(out_dir)
    model.save_pretrained(str(out))  # peft annotates the directory as str
    return out


def merge_and_export(
    model: PeftModel, out_dir: str | Path, *, processor: PushToHubMixin | None = None
) -> Path:
    """Save the base model with the LoRA deltas merged in, loadable without peft.

    The merge is undone afterwards, so training can go on with the same adapters. The exported
    model is built on the meta device and takes the merged tensors by reference: no extra copy.
    `processor` (a tokenizer or processor) is saved alongside when given.
    """
    out = Path(out_dir)
    base = model.get_base_model()
    model.merge_adapter()
    try:
        merged = {
            name.replace(".base_layer", ""): tensor
            for name, tensor in base.state_dict().items()
            if ".lora_" not in name
        }
        with torch.device("meta"):
            if isinstance(base, PreTrainedModel):
                fresh = type(base)._from_config(base.config)
                fresh.generation_config = base.generation_config
            else:  # diffusers ModelMixin
                fresh = type(base).from_config(base.config)  # type: ignore[attr-defined]  # ModelMixin's
        fresh.load_state_dict(merged, strict=True, assign=True)
        fresh.save_pretrained(out)
    finally:
        model.unmerge_adapter()
    if processor is not None:
        processor.save_pretrained(out)
    return out


def export_model(model: torch.nn.Module, out_dir: str | Path, *, processor: PushToHubMixin | None = None) -> Path:
    """A trained model in Hugging Face format: a `PeftModel`'s adapter in `out_dir/adapter` and
    the merged model in `out_dir`, or a transformers model as it is; the processor beside."""
    out = Path(out_dir)
    if isinstance(model, PeftModel):
        export_lora(model, out / "adapter")
        return merge_and_export(model, out, processor=processor)
    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"export needs a transformers model (or its PeftModel), got {type(model).__name__}")
    model.save_pretrained(out)
    if processor is not None:
        processor.save_pretrained(out)
    return out


def merged_named_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The policy's current weights under its Hugging Face checkpoint names, which vLLM's
    `load_weights` takes (it maps them to its own layout): PEFT's `base_model.model.` prefix and
    `.base_layer` dropped, LoRA deltas merged (W + scale * B @ A, computed: the trained base
    weights are not touched), adapter tensors left out. Tied weights come once; FSDP2-sharded
    parameters are gathered whole."""
    base = unwrap_peft(model)
    lora = {name: module for name, module in base.named_modules() if isinstance(module, LoraLayer)}
    with torch.no_grad():
        for name, param in base.named_parameters():
            if ".lora_" in name:
                continue
            tensor = param.full_tensor() if isinstance(param, DTensor) else param
            owner_name, _, leaf = name.rpartition(".")
            owner = lora.get(owner_name.removesuffix(".base_layer"))
            if owner is not None and owner_name.endswith(".base_layer"):
                name = f"{owner_name.removesuffix('.base_layer')}.{leaf}"
                if leaf == "weight" and not owner.merged:
                    for adapter in owner.active_adapters:
                        # every concrete LoRA layer (Linear, Conv, Embedding) defines it; LoraLayer does not
                        delta = owner.get_delta_weight(adapter)  # type: ignore[attr-defined]
                        tensor = tensor + delta.to(tensor.dtype)  # [out, in]
            yield name, tensor.detach()


def adapter_tensors(model: torch.nn.Module) -> dict[str, Tensor]:
    """A LoRA policy's adapter, for an engine that merges it over base weights of its own
    (`merge_adapter`): for each adapted weight W (its Hugging Face checkpoint name, as in
    `merged_named_weights`), `W:lora_A` [r, in], `W:lora_B` [out, r] and `W:scaling` (0-d,
    float64). Megabytes where the merged weights are gigabytes. Linear LoRA layers with one
    active adapter only (no DoRA); a policy that trains weights outside its LoRA is refused."""
    from peft.tuners.lora import Linear as LoraLinear

    if not isinstance(model, PeftModel):
        raise ValueError("an adapter push needs a LoRA (peft) policy; one that trains every weight pushes them merged")
    base = unwrap_peft(model)
    others = [name for name, p in base.named_parameters() if p.requires_grad and ".lora_" not in name]
    if others:
        raise ValueError(f"an adapter push carries the LoRA alone, but the policy also trains {others[:3]} "
                         f"({len(others)} tensors): push the weights merged")
    found: dict[str, Tensor] = {}
    for name, module in base.named_modules():
        if not isinstance(module, LoraLayer) or module.merged:
            continue
        adapters = [a for a in module.active_adapters if a in module.lora_A]
        if len(adapters) != 1 or not isinstance(module, LoraLinear) or module.fan_in_fan_out \
                or module.use_dora.get(adapters[0], False):
            raise ValueError(f"{name}: an adapter push takes Linear LoRA layers with one active adapter, no DoRA")
        adapter = adapters[0]
        for part in ("lora_A", "lora_B"):  # [r, in], [out, r]
            weight = cast(Tensor, getattr(module, part)[adapter].weight)
            found[f"{name}.weight:{part}"] = (weight.full_tensor() if isinstance(weight, DTensor) else weight).detach()
        found[f"{name}.weight:scaling"] = torch.tensor(float(module.scaling[adapter]), dtype=torch.float64)
    return found


def merge_adapter(base: dict[str, Tensor], adapter: dict[str, Tensor],
                  device: torch.device | None = None) -> Iterator[tuple[str, Tensor]]:
    """`(name, W + scale * B @ A)` for each weight of `adapter` (`adapter_tensors`), W being
    `base[name]`: computed as `merged_named_weights` computes it (peft's delta, in float32 on a
    CPU for half-precision LoRA), on `device` (default: W's; one W moved there at a time): equal
    bit for bit where devices and dtypes match."""
    for key, lora_a in adapter.items():
        name, _, part = key.rpartition(":")
        if part != "lora_A":
            continue
        weight = base[name] if device is None else base[name].to(device, non_blocking=True)
        a, b = lora_a.to(weight.device), adapter[f"{name}:lora_B"].to(weight.device)  # [r, in], [out, r]
        scale = float(adapter[f"{name}:scaling"])
        upcast = weight.device.type == "cpu" and b.dtype in (torch.float16, torch.bfloat16)
        delta = ((b.float() @ a.float()) * scale).to(b.dtype) if upcast else (b @ a) * scale  # [out, in]
        yield name, weight + delta.to(weight.dtype)

