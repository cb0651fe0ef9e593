"""Weight pushes into a vLLM engine whose engine core runs in a process of its own, by CUDA IPC.

An engine core in this process takes pushed tensors by reference (`VLLMEngine.load_weights`
through `collective_rpc` with a function). One in a process of its own would get every tensor
serialized and copied; instead the sender shares each tensor's GPU memory (PyTorch's CUDA IPC,
`torch.multiprocessing.reductions.reduce_tensor`) and sends only the handles, a few hundred bytes
a tensor, to `IPCWeightReceiver`, the worker extension (`vllm.LLM(worker_extension_cls=...)`)
that opens them on its GPU and loads them. The pattern of verl's and OpenRLHF's IPC updates and
of vLLM's own `ipc` weight-transfer engine (which needs Ray or HTTP; this needs neither).

The tensors must live on the engine's GPU, and stay alive until the push returns (the
receiver synchronizes its GPU before it answers).
"""

from __future__ import annotations

import pickle
from collections.abc import Iterable
from typing import Any

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

EXTENSION = "rl_rollout.vllm_ipc.IPCWeightReceiver"
"""`vllm.LLM(worker_extension_cls=EXTENSION)`: gives every worker `rl_load_ipc_weights`."""
METHOD = "rl_load_ipc_weights"

_DEVICE_ARG = 6  # in reduce_tensor's rebuild arguments: the sender's device index


def ipc_payload(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> bytes:
    """The CUDA IPC handles of `(name, tensor)` pairs, pickled: what `rl_load_ipc_weights` opens."""
    entries = []
    for name, tensor in named_tensors:
        if not tensor.is_cuda:
            raise ValueError(f"weight {name!r}: a push to an engine in another process shares GPU memory, "
                             f"this tensor is on {tensor.device}")
        _, args = reduce_tensor(tensor.detach())
        entries.append((name, args))
    return pickle.dumps(entries)


class IPCWeightReceiver:
    """vLLM worker extension: loads weights shared by `ipc_payload` into the worker's model.

    Mixed into vLLM's GPU worker, which provides `device` and `model_runner`."""

    device: torch.device
    model_runner: Any

    def rl_load_ipc_weights(self, payload: bytes) -> int:
        """Open each handle on this worker's GPU, `model.load_weights` them (Hugging Face names),
        and wait for the copies to finish, so the sender may free its tensors once this returns.
        Returns how many tensors were loaded."""
        index = self.device.index
        weights = []
        for name, args in pickle.loads(payload):  # from the trainer that built this engine
            rebuild_args = list(args)
            rebuild_args[_DEVICE_ARG] = index  # the same GPU, numbered as this process sees it
            weights.append((name, rebuild_cuda_tensor(*rebuild_args)))
        self.model_runner.model.load_weights(weights=weights)
        torch.cuda.synchronize(index)
        return len(weights)
