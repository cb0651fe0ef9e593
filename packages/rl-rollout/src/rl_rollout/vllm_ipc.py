"""Weight pushes into a vLLM engine whose engine core runs in a process of its own, by CUDA IPC.

An engine core in this process takes pushed tensors by reference (`VLLMEngine.load_weights`
through `collective_rpc` with a function). One in a process of its own would get every tensor
serialized and copied; instead the sender sends only the tensors' CUDA IPC handles
(`rl_rollout.cuda_ipc`) to `IPCWeightReceiver`, the worker extension
(`vllm.LLM(worker_extension_cls=...)`) that opens them on its GPU and loads them. vLLM's own
`ipc` weight-transfer engine needs Ray or HTTP; this needs neither.

The tensors must live on the engine's GPU, and stay alive until the push returns (the
receiver synchronizes its GPU before it answers).
"""

from __future__ import annotations

from typing import Any

import torch

from rl_rollout.cuda_ipc import ipc_payload, open_ipc_payload

__all__ = ["EXTENSION", "METHOD", "IPCWeightReceiver", "ipc_payload"]

EXTENSION = "rl_rollout.vllm_ipc.IPCWeightReceiver"
"""`vllm.LLM(worker_extension_cls=EXTENSION)`: gives every worker `rl_load_ipc_weights`."""
METHOD = "rl_load_ipc_weights"


class IPCWeightReceiver:
    """vLLM worker extension: loads weights shared by `ipc_payload` into the worker's model.

    Mixed into vLLM's GPU worker, which provides `device` and `model_runner`."""

    device: torch.device
    model_runner: Any

    def rl_load_ipc_weights(self, payload: bytes, requantize: bool = False) -> int:
        """Open each handle on this worker's GPU, `model.load_weights` them (Hugging Face names),
        and wait for the copies to finish, so the sender may free its tensors once this returns.
        Returns how many tensors were loaded."""
        index = self.device.index
        weights = open_ipc_payload(payload, index)  # the same GPU, numbered as this process sees it
        load_into_model(self.model_runner, weights, requantize=requantize)
        torch.cuda.synchronize(index)
        return len(weights)


def load_into_model(runner: Any, weights: list[tuple[str, torch.Tensor]], *, requantize: bool) -> None:
    """`weights` (Hugging Face names, the model's dtype) into a worker's model; `requantize`: the
    model was quantized online (`quantization="fp8"`), so its layers are rebuilt from them."""
    model = runner.model
    if not requantize:
        model.load_weights(weights=weights)
        return
    from vllm.model_executor.model_loader.reload import (
        finalize_layerwise_reload,
        initialize_layerwise_reload,
    )

    initialize_layerwise_reload(model)
    model.load_weights(weights=weights)
    finalize_layerwise_reload(model, runner.model_config)
