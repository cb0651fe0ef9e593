"""The pinned-buffer offloaders: values survive, host buffers are reused, tied weights count once,
frozen models are not copied back, optimizer moments move and step counters stay."""

from __future__ import annotations

import pytest
import torch

from rl_core.train.offload import OptimizerOffload, PinnedOffload, park_frozen, visiting


def tied_model() -> torch.nn.Module:
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=False))
    model[1].weight = model[0].weight  # tied, as in Qwen3 small models
    model.register_buffer("scale", torch.arange(3.0))
    return model


def test_pinned_offload_reuses_its_host_buffers_and_counts_tied_weights_once() -> None:
    """CPU stand-in for the accelerator (pin=False): the values survive, `.data` *is* the host
    buffer after `to_host`, and the second offload writes into the same buffers."""
    model = tied_model()
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    offload = PinnedOffload(model, torch.device("cpu"), pin=False)
    assert offload.nbytes == (10 * 4 + 3) * 4  # embedding (= tied head) + buffer, float32
    offload.to_host()
    first = [t.data_ptr() for t in offload.tensors]
    assert first == [h.data_ptr() for h in offload.host]
    with torch.no_grad():
        model[0].weight.add_(1.0)  # an update between offloads is what the next offload copies
    offload.to_device()
    offload.to_host()
    assert [h.data_ptr() for h in offload.host] == first
    assert torch.equal(model.state_dict()["0.weight"], expected["0.weight"] + 1)
    assert torch.equal(model.scale, expected["scale"])


def test_frozen_offload_does_not_copy_back() -> None:
    """A frozen (reference) model's host buffers are current after the first offload: later
    offloads drop the device copies without copying (a change made meanwhile is not kept)."""
    model = tied_model()
    original = model[0].weight.detach().clone()
    offload = PinnedOffload(model, torch.device("cpu"), pin=False, frozen=True)
    offload.to_host()
    model[0].weight.data = model[0].weight.data + 1  # as if moved to the device and changed there
    offload.to_host()
    assert model[0].weight.data_ptr() == offload.host[0].data_ptr()
    assert torch.equal(model[0].weight, original)


def test_optimizer_offload_moves_moments_not_step_counters() -> None:
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    offload = OptimizerOffload(optimizer, torch.device("cpu"))
    before = {(id(p), k): v.clone() for p, s in optimizer.state.items() for k, v in s.items()}
    assert offload.nbytes == 2 * (6 + 2) * 4  # exp_avg and exp_avg_sq of weight and bias
    offload.to_host()
    assert len(offload.host) == 4  # two moments x two parameters; `step` stays where it is
    offload.to_device()
    after = {(id(p), k): v for p, s in optimizer.state.items() for k, v in s.items()}
    assert all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned host memory and freed device memory need "
                    "CUDA (opt-in gpu session; passed on the H100)")
def test_optimizer_offload_frees_the_gpu_and_restores_exactly() -> None:
    model = torch.nn.Linear(1024, 1024, device="cuda")
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(1, 1024, device="cuda")).sum().backward()
    optimizer.step()
    offload = OptimizerOffload(optimizer, torch.device("cuda"))
    expected = {(id(p), k): v.clone() for p, s in optimizer.state.items() for k, v in s.items()}
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    offload.to_host()
    assert before - torch.cuda.memory_allocated() >= offload.nbytes > 0
    assert all(h.is_pinned() for h in offload.host.values())
    offload.to_device()
    assert all(torch.equal(v, expected[(id(p), k)]) for p, s in optimizer.state.items() for k, v in s.items())


def test_visiting_returns_the_module_to_its_host_buffers_after_the_block_and_after_an_error() -> None:
    """`visiting(offload)`: the weights are back in the host buffers when the block ends, also
    when it raises; None moves nothing."""
    model = tied_model()
    offload = PinnedOffload(model, torch.device("cpu"), pin=False)
    offload.to_host()
    host = [h.data_ptr() for h in offload.host]
    with visiting(offload):
        assert torch.equal(model[0](torch.tensor([1]))[0], model[0].weight[1])
    assert [t.data_ptr() for t in offload.tensors] == host
    with pytest.raises(RuntimeError, match="in the block"), visiting(offload):
        raise RuntimeError("in the block")
    assert [t.data_ptr() for t in offload.tensors] == host
    with visiting(None):
        pass


def test_a_frozen_module_parked_on_a_cpu_stays_on_the_device_and_stops_requiring_grad() -> None:
    model = tied_model()
    assert park_frozen(model, torch.device("cpu")) is None
    assert not any(p.requires_grad for p in model.parameters())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="moves weights between a GPU and host buffers")
def test_a_parked_module_visits_the_gpu_only_inside_the_block() -> None:
    model = tied_model()
    parked = park_frozen(model, torch.device("cuda"))
    assert parked is not None and model[0].weight.device.type == "cpu" and model[0].weight.is_pinned()
    with visiting(parked):
        assert model[0].weight.device.type == "cuda"
    assert model[0].weight.device.type == "cpu"
