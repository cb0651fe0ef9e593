"""Tensors shared between processes on one machine by CUDA IPC handles, not by copies.

A process that must hand a set of GPU tensors to another (a vLLM engine core, a Ray rollout
actor) could serialize every tensor, copying gigabytes through host memory. Instead the sender
shares each tensor's GPU memory (PyTorch's CUDA IPC, `torch.multiprocessing.reductions`) and
sends only its handle, a few hundred bytes a tensor; the receiver opens the handles on the same
physical GPU, numbered as it sees it (a process given one GPU by `CUDA_VISIBLE_DEVICES` calls
it 0), copies what it needs, and synchronizes before it answers. The pattern of verl's and
OpenRLHF's weight updates and of vLLM's own `ipc` weight-transfer engine.

The tensors must live on the receiver's GPU (copy them there first) and stay alive in the
sender until the receiver has answered.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterable

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

__all__ = ["ipc_payload", "open_ipc_payload"]

_DEVICE_ARG = 6  # in reduce_tensor's rebuild arguments: the sender's device index


def ipc_payload(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> bytes:
    """The CUDA IPC handles of `(name, tensor)` pairs, pickled: what `open_ipc_payload` opens."""
    entries = []
    for name, tensor in named_tensors:
        if not tensor.is_cuda:
            raise ValueError(f"weight {name!r}: a push to an engine in another process shares GPU memory, "
                             f"this tensor is on {tensor.device}")
        _, args = reduce_tensor(tensor.detach())
        entries.append((name, args))
    return pickle.dumps(entries)


def open_ipc_payload(payload: bytes, device_index: int) -> list[tuple[str, torch.Tensor]]:
    """The tensors behind `ipc_payload`'s handles, opened on this process's GPU `device_index`
    (the sender's GPU as this process numbers it). They alias the sender's memory: copy them,
    synchronize, and drop them before answering."""
    tensors = []
    for name, args in pickle.loads(payload):  # from the trainer that built this receiver
        rebuild_args = list(args)
        rebuild_args[_DEVICE_ARG] = device_index
        tensors.append((name, rebuild_cuda_tensor(*rebuild_args)))
    return tensors
