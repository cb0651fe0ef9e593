"""FP8 matmuls for a rollout's forward (an engine's `precision="fp8"`): `Fp8Linears` keeps an
FP8 copy of a module's linear weights and, inside `active()`, runs those layers as FP8 GEMMs.
Outside it the layers are untouched, so the replay and the update stay in the weights' dtype.

Numerics, in float8 e4m3 (largest value 448):
- a weight `[N, K]` is quantized per output row: `w ~ q_w * s_w`, with `s_w = max|w_n| / 448`;
- an activation `[M, K]` is quantized per row (token) as the layer runs: `x ~ q_x * s_x`;
- `y = (q_x @ q_w^T) * s_x * s_w^T + b`, accumulated in float32 and returned in x's dtype.

On CUDA (compute capability 9.0 and up: H100, H200) the product is `torch._scaled_mm` with
row-wise scales, and the weights must be bf16. Inside a compiled block, inductor fuses the
activation's max and cast into the kernel that produces it (a norm, a modulation, a GELU).
Elsewhere (the CPU) the same quantization is emulated: the FP8 values are dequantized and
multiplied in float32. A CPU run then shows the rollout/trainer gap that FP8 sampling makes,
without an FP8 kernel.

A weight's FP8 copy is rebuilt when the weight changes: `refresh()` compares each weight's
storage and version counter (an optimizer step, a weight push or a gather into the weights
bumps it). A frozen LoRA base is quantized once; the LoRA adapters (peft's `lora_A`/`lora_B`)
stay in the weights' dtype, added to the FP8 base layer's output.

    fp8 = Fp8Linears(transformer.transformer_blocks)
    fp8.refresh()                # after the weights changed (cheap when they did not)
    with fp8.active():
        images = sample(...)     # every selected linear runs in FP8
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["FP8", "Fp8Linears", "Fp8Sampling", "Precision", "check_precision", "fp8_linear", "quantize_rows"]

Precision = Literal["bf16", "fp8"]
FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
_ALIGN = 16  # torch._scaled_mm needs both dimensions of the weight divisible by 16


def quantize_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """`x` `[M, K]` as FP8 values `[M, K]` and float32 scales `[M, 1]`, one per row: `x ~ q * s`.
    A row of zeros stays zero; a NaN stays NaN."""
    amax = x.abs().amax(dim=-1, keepdim=True).float()  # [M, 1]
    scale = amax.clamp(min=1e-12) / FP8_MAX  # [M, 1]
    q = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)  # [M, K]
    return q, scale


def fp8_linear(x: Tensor, weight: Tensor, weight_scale: Tensor, bias: Tensor | None) -> Tensor:
    """`x` `[..., K]` times the FP8 weight `[N, K]` (scales `weight_scale` `[1, N]`) plus `bias`
    `[N]`, with x quantized per row; `[..., N]` in x's dtype (see the module docstring)."""
    rows = x.reshape(-1, x.shape[-1])  # [M, K]
    q, scale = quantize_rows(rows)  # [M, K], [M, 1]
    if x.is_cuda:
        out = torch._scaled_mm(q, weight.t(), scale_a=scale, scale_b=weight_scale, bias=bias,
                               out_dtype=x.dtype)  # [M, N]
    else:  # emulated: the same FP8 values, dequantized, in float32
        out = F.linear(q.float() * scale, weight.float() * weight_scale.t(),
                       None if bias is None else bias.float()).to(x.dtype)  # [M, N]
    return out.reshape(*x.shape[:-1], weight.shape[0])


def check_precision(precision: str, device: torch.device, dtype: torch.dtype) -> None:
    """Refuse a precision this device and weight dtype cannot run (a ValueError naming why)."""
    if precision not in ("bf16", "fp8"):
        raise ValueError(f"precision={precision!r}: choose 'bf16' (the weights' own dtype) or 'fp8'")
    if precision != "fp8" or device.type != "cuda":
        return
    capability = torch.cuda.get_device_capability(device)
    if capability < (9, 0):
        raise ValueError(f"precision='fp8' runs row-scaled FP8 GEMMs, which need compute capability 9.0 (H100, "
                         f"H200); this GPU has {capability[0]}.{capability[1]}: use precision='bf16'")
    if dtype != torch.bfloat16:
        raise ValueError(f"precision='fp8' on CUDA needs bfloat16 weights (got {dtype}): the FP8 GEMM returns bf16")


@dataclass
class _Layer:
    """One linear layer's FP8 copy and what it was made from (the weight's storage and version)."""

    module: torch.nn.Linear
    weight: Tensor  # [N, K] float8_e4m3fn
    scale: Tensor  # [1, N] float32
    made_from: tuple[int, int, torch.device]

    def forward(self, x: Tensor) -> Tensor:
        return fp8_linear(x, self.weight, self.scale, self.module.bias)


def _source(weight: Tensor) -> tuple[int, int, torch.device]:
    return weight.data_ptr(), weight._version, weight.device


class Fp8Linears:
    """The FP8 copies of the linear layers under `root` (every `torch.nn.Linear` whose dimensions
    divide by 16, except LoRA adapters), and the switch that routes their forwards through them."""

    def __init__(self, root: torch.nn.Module) -> None:
        self.modules = selected_linears(root)
        self._layers: list[_Layer] = []

    def covers(self, root: torch.nn.Module) -> bool:
        """Whether `root`'s layers are still the ones quantized (no LoRA added, no copy taken)."""
        current = selected_linears(root)
        return len(current) == len(self.modules) and all(a is b for a, b in zip(current, self.modules, strict=True))

    @torch.no_grad()
    def refresh(self) -> int:
        """Re-quantize the layers whose weight changed since they were quantized, in place where
        the shapes and device allow (a captured CUDA graph keeps reading the same buffers).
        Returns how many were re-quantized."""
        if not self._layers:
            self._layers = [self._quantized(m) for m in self.modules]
            return len(self._layers)
        changed = 0
        for k, layer in enumerate(self._layers):
            source = _source(layer.module.weight)
            if source == layer.made_from:
                continue
            fresh = self._quantized(layer.module)
            if fresh.weight.shape == layer.weight.shape and fresh.weight.device == layer.weight.device:
                layer.weight.copy_(fresh.weight)
                layer.scale.copy_(fresh.scale)
                layer.made_from = source
            else:
                self._layers[k] = fresh
            changed += 1
        return changed

    @staticmethod
    def _quantized(module: torch.nn.Linear) -> _Layer:
        q, scale = quantize_rows(module.weight.detach())  # [N, K], [N, 1]
        return _Layer(module, q, scale.t().contiguous(), _source(module.weight))  # scale [1, N]

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Inside, each selected layer's forward is its FP8 GEMM (call `refresh()` first)."""
        if len(self._layers) != len(self.modules):
            raise RuntimeError("Fp8Linears.active() before refresh(): the FP8 weights are not made yet")
        for layer in self._layers:
            layer.module.forward = layer.forward  # type: ignore[method-assign,assignment]
        try:
            yield
        finally:
            for layer in self._layers:
                layer.module.__dict__.pop("forward", None)

    def nbytes(self) -> int:
        """Bytes the FP8 copies hold (weights and scales)."""
        return sum(t.numel() * t.element_size() for layer in self._layers for t in (layer.weight, layer.scale))


def selected_linears(root: torch.nn.Module) -> list[torch.nn.Linear]:
    """The linear layers `Fp8Linears` quantizes: `torch.nn.Linear` modules under `root` with both
    dimensions divisible by 16, outside LoRA adapters (peft's `lora_A`, `lora_B`, ...)."""
    return [module for name, module in root.named_modules()
            if isinstance(module, torch.nn.Linear) and not any(part.startswith("lora_") for part in name.split("."))
            and module.in_features % _ALIGN == 0 and module.out_features % _ALIGN == 0]


class Fp8Sampling:
    """An engine's `precision` ("bf16" | "fp8", checked against its `device` and `dtype` when
    set) and the context its sampling runs in: `_sampling_precision(root)` runs `root`'s linear
    layers from an `Fp8Linears` with "fp8", made at the first sample and again when the layers
    change (a copy of the model), re-quantized where the weights changed; `_drop_fp8()` frees it
    (sleep). Mixed into the image engines, which provide `device` and `dtype`."""

    device: torch.device
    _fp8: Fp8Linears | None = None  # made at the first FP8 sample
    _precision: Precision = "bf16"

    if TYPE_CHECKING:
        @property
        def dtype(self) -> torch.dtype: ...

    @property
    def precision(self) -> Precision:
        return self._precision

    @precision.setter
    def precision(self, value: Precision) -> None:
        check_precision(value, self.device, self.dtype)
        self._precision = value

    def _sampling_precision(self, root: torch.nn.Module) -> contextlib.AbstractContextManager[None]:
        if self.precision != "fp8":
            return contextlib.nullcontext()
        if self._fp8 is None or not self._fp8.covers(root):
            self._fp8 = Fp8Linears(root)
        self._fp8.refresh()
        return self._fp8.active()

    def _drop_fp8(self) -> None:
        self._fp8 = None  # made again from the weights at the next sample
