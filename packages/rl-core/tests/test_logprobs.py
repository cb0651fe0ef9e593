from __future__ import annotations

import math

import pytest
import torch

from rl_core.logprobs import (
    entropy,
    token_logprobs,
    token_logprobs_and_entropy_from_hidden,
    token_logprobs_from_hidden,
)


def test_token_logprobs_hand_worked() -> None:
    # logits 0, ln 3 -> p = 1/4, 3/4
    logits = torch.tensor([[0.0, math.log(3)], [0.0, math.log(3)]])
    out = token_logprobs(logits, torch.tensor([1, 0]))
    torch.testing.assert_close(out, torch.tensor([math.log(0.75), math.log(0.25)]))
    # temperature 2: logits 0, ln(3)/2 -> p_1 = sqrt3 / (1 + sqrt3) = .634
    hot = token_logprobs(logits[:1], torch.tensor([1]), temperature=2.0)
    torch.testing.assert_close(hot, torch.tensor([math.log(math.sqrt(3) / (1 + math.sqrt(3)))]))


def test_entropy_hand_worked() -> None:
    # p = 1/4, 3/4: H = -(1/4 ln 1/4 + 3/4 ln 3/4) = .5623; uniform over 8: ln 8
    logits = torch.tensor([[0.0, math.log(3)]])
    torch.testing.assert_close(
        entropy(logits), torch.tensor([-(0.25 * math.log(0.25) + 0.75 * math.log(0.75))])
    )
    torch.testing.assert_close(entropy(torch.zeros(2, 3, 8)), torch.full((2, 3), math.log(8)))


def test_bf16_logits_give_float32_results_computed_in_float32() -> None:
    logits = (torch.randn(3, 4, 50) * 4).to(torch.bfloat16)
    labels = torch.randint(0, 50, (3, 4))
    out = token_logprobs(logits, labels)
    assert out.dtype == torch.float32 and entropy(logits).dtype == torch.float32
    # identical to upcasting first: the math is float32 whatever the input dtype
    torch.testing.assert_close(out, token_logprobs(logits.float(), labels), rtol=0, atol=0)
    naive = torch.log_softmax(logits.float(), -1).gather(-1, labels[..., None]).squeeze(-1)
    torch.testing.assert_close(out, naive)


def test_token_logprobs_gradient_matches_log_softmax() -> None:
    logits = torch.randn(2, 3, 7, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 7, (2, 3))
    assert torch.autograd.gradcheck(lambda z: token_logprobs(z, labels, temperature=0.7), (logits,))
    assert torch.autograd.gradcheck(entropy, (logits,))


def test_label_errors_are_clear() -> None:
    with pytest.raises(ValueError, match="labels must lie in \\[0, vocab=5\\); found \\[-100\\]"):
        token_logprobs(torch.zeros(1, 2, 5), torch.tensor([[1, -100]]))
    with pytest.raises(ValueError, match="labels must have shape \\(1, 2\\)"):
        token_logprobs(torch.zeros(1, 2, 5), torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="temperature must be > 0"):
        token_logprobs(torch.zeros(1, 5), torch.tensor([0]), temperature=0.0)


# --------------------------------------------------------------------- chunked from hidden states


def naive(hidden, weight, labels, temperature=1.0):
    logits = hidden @ weight.t()  # [B, T, V]
    return (
        torch.log_softmax(logits.float() / temperature, dim=-1)
        .gather(-1, labels[..., None])
        .squeeze(-1)
    )


@pytest.mark.parametrize("chunk_size", [1, 7, 1024])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_chunked_equals_naive_values_and_gradients_fp32(
    chunk_size: int, temperature: float
) -> None:
    b, t, h, v = 3, 11, 16, 97  # 33 tokens: chunks of 7 leave a remainder of 5
    hidden = (torch.randn(b, t, h) * 2).requires_grad_(True)
    weight = torch.randn(v, h).requires_grad_(True)
    labels = torch.randint(0, v, (b, t))
    upstream = torch.randn(b, t)  # a non-uniform upstream gradient, as from a policy loss

    out = token_logprobs_from_hidden(
        hidden, weight, labels, temperature=temperature, chunk_size=chunk_size
    )
    gh, gw = torch.autograd.grad((out * upstream).sum(), (hidden, weight))
    ref = naive(hidden, weight, labels, temperature)
    rh, rw = torch.autograd.grad((ref * upstream).sum(), (hidden, weight))

    assert out.dtype == torch.float32 and out.shape == (b, t)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gh, rh, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gw, rw, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("chunk_size", [4, 64])
def test_entropy_from_hidden_equals_entropy_of_full_logits(chunk_size: int) -> None:
    b, t, h, v = 2, 9, 8, 31
    hidden = torch.randn(b, t, h, requires_grad=True)
    weight = torch.randn(v, h, requires_grad=True)
    labels = torch.randint(0, v, (b, t))
    logp, ent = token_logprobs_and_entropy_from_hidden(hidden, weight, labels, temperature=0.7, chunk_size=chunk_size)
    logits = (hidden @ weight.T / 0.7).detach()  # [b, t, v]
    torch.testing.assert_close(ent, entropy(logits), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logp, token_logprobs_from_hidden(hidden, weight, labels, 0.7, chunk_size))
    assert not ent.requires_grad and logp.requires_grad
    # the entropy output does not disturb the log-prob gradient
    g_both = torch.autograd.grad(logp.sum(), hidden)[0]
    g_plain = torch.autograd.grad(token_logprobs_from_hidden(hidden, weight, labels, 0.7, chunk_size).sum(), hidden)[0]
    torch.testing.assert_close(g_both, g_plain)


def test_chunked_gradcheck_float64() -> None:
    hidden = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 5, (2, 3))
    assert torch.autograd.gradcheck(
        lambda hh, ww: token_logprobs_from_hidden(hh, ww, labels, temperature=0.8, chunk_size=4),
        (hidden, weight),
    )


def test_frozen_weight_gets_no_gradient_and_hidden_still_does() -> None:
    hidden = torch.randn(2, 5, 8, requires_grad=True)
    weight = torch.randn(13, 8)  # frozen LM head (e.g. LoRA training)
    labels = torch.randint(0, 13, (2, 5))
    out = token_logprobs_from_hidden(hidden, weight, labels, chunk_size=3)
    out.sum().backward()
    assert weight.grad is None
    ref_hidden = hidden.detach().clone().requires_grad_(True)
    naive(ref_hidden, weight, labels).sum().backward()
    torch.testing.assert_close(hidden.grad, ref_hidden.grad, rtol=1e-5, atol=1e-5)


def test_weight_only_gradient() -> None:
    hidden = torch.randn(2, 5, 8)
    weight = torch.randn(13, 8, requires_grad=True)
    labels = torch.randint(0, 13, (2, 5))
    (gw,) = torch.autograd.grad(
        token_logprobs_from_hidden(hidden, weight, labels, chunk_size=4).sum(), (weight,)
    )
    (rw,) = torch.autograd.grad(naive(hidden, weight, labels).sum(), (weight,))
    torch.testing.assert_close(gw, rw, rtol=1e-5, atol=1e-5)


def test_confident_label_keeps_its_small_gradient_in_bf16() -> None:
    # p(label) = 1 - 1e-3: the label's logit gradient is 1 - p = 1e-3, which a bf16 softmax
    # (p rounds to 1.0) would lose; the chunked path forms it in float32
    weight = torch.zeros(4, 2, dtype=torch.bfloat16)
    weight[0, 0] = 1.0
    margin = math.log((1 - 1e-3) / 1e-3 * 3)  # logit of label 0 vs three zeros
    hidden = torch.tensor([[[margin, 0.0]]], dtype=torch.bfloat16, requires_grad=True)
    labels = torch.tensor([[0]])
    out = token_logprobs_from_hidden(hidden, weight, labels)
    (gh,) = torch.autograd.grad(out.sum(), (hidden,))
    ref_hidden = hidden.detach().float().requires_grad_(True)
    (rh,) = torch.autograd.grad(naive(ref_hidden, weight.float(), labels).sum(), (ref_hidden,))
    torch.testing.assert_close(gh.float(), rh, rtol=2e-2, atol=1e-5)
    assert float(gh[0, 0, 0]) > 5e-4


def test_bf16_inputs_close_to_naive_bf16() -> None:
    hidden = torch.randn(2, 9, 32).to(torch.bfloat16).requires_grad_(True)
    weight = (torch.randn(101, 32) / 4).to(torch.bfloat16).requires_grad_(True)
    labels = torch.randint(0, 101, (2, 9))
    out = token_logprobs_from_hidden(hidden, weight, labels, chunk_size=5)
    assert out.dtype == torch.float32
    gh, gw = torch.autograd.grad(out.sum(), (hidden, weight))
    assert gh.dtype == torch.bfloat16 and gw.dtype == torch.bfloat16
    ref = naive(hidden, weight, labels)
    rh, rw = torch.autograd.grad(ref.sum(), (hidden, weight))
    torch.testing.assert_close(out, ref, rtol=1e-2, atol=2e-2)
    torch.testing.assert_close(gh.float(), rh.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(gw.float(), rw.float(), rtol=2e-2, atol=2e-2)


def test_no_grad_call_returns_detached_values() -> None:
    hidden = torch.randn(1, 4, 8, requires_grad=True)
    weight = torch.randn(10, 8, requires_grad=True)
    labels = torch.randint(0, 10, (1, 4))
    with torch.no_grad():
        out = token_logprobs_from_hidden(hidden, weight, labels)
    assert not out.requires_grad
    torch.testing.assert_close(out, naive(hidden, weight, labels).detach(), rtol=1e-5, atol=1e-5)


def test_from_hidden_input_errors() -> None:
    hidden, weight, labels = torch.randn(1, 2, 4), torch.randn(6, 4), torch.tensor([[0, 1]])
    with pytest.raises(ValueError, match="hidden must be \\[B, T, H\\]"):
        token_logprobs_from_hidden(hidden[0], weight, labels)
    with pytest.raises(ValueError, match="weight must be \\[V, H=4\\]"):
        token_logprobs_from_hidden(hidden, weight.t(), labels)
    with pytest.raises(ValueError, match="share dtype"):
        token_logprobs_from_hidden(hidden, weight.double(), labels)
    with pytest.raises(ValueError, match="labels must lie in \\[0, vocab=6\\)"):
        token_logprobs_from_hidden(hidden, weight, torch.tensor([[0, 6]]))
    with pytest.raises(ValueError, match="chunk_size must be >= 1"):
        token_logprobs_from_hidden(hidden, weight, labels, chunk_size=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_chunked_peak_memory_is_a_fraction_of_naive_on_gpu() -> None:
    device = torch.device("cuda")
    b, t, h, v = 2, 2048, 1024, 32000
    hidden = torch.randn(b, t, h, device=device, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(v, h, device=device, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, v, (b, t), device=device)

    def peak(fn) -> int:
        hidden.grad = weight.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn(hidden, weight, labels).sum().backward()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base

    naive_peak = peak(naive)
    chunked_peak = peak(lambda hh, ww, ll: token_logprobs_from_hidden(hh, ww, ll, chunk_size=512))
    assert chunked_peak < 0.25 * naive_peak
