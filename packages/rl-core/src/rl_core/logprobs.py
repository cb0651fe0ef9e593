"""Token log-probabilities and entropy, with float32 math whatever the model dtype.

- `token_logprobs(logits, labels, temperature=1.0)`: `log_softmax(logits / temperature)` at the
  labels, `[...]` from `[..., V]` logits. Rows are processed in chunks, so without autograd it
  never holds a float32 copy of all logits (with autograd, the chunks' float32 values are
  saved for backward: use `token_logprobs_from_hidden` for training).
- `entropy(logits)`: entropy of `softmax(logits)` per position, chunked the same way.
- `token_logprobs_from_hidden(hidden, weight, labels, temperature=1.0, chunk_size=4096)`: the
  same log-probs computed from the last hidden states and the LM-head weight, through a custom
  autograd function that never materialises the `[B*T, V]` logits: forward keeps one
  `[chunk, V]` block at a time and only the `[B*T]` results; backward recomputes each chunk's
  logits and accumulates the gradients of `hidden` and (when it requires grad) `weight`.
  Memory is O(chunk_size * V + V * H) instead of O(B * T * V); the cost is one extra matmul
  (the recomputation). See `benchmarks/logprobs.py` for figures.
- `token_logprobs_and_entropy_from_hidden(...)`: the same, plus the entropy of each position's
  distribution (no gradient), taken from the chunk already in memory: when the entropy is only
  logged, this saves the separate no-grad pass over the LM head.

Temperature: sampling engines (vLLM, HF `generate`) divide logits by the temperature before the
softmax, so pass the rollout temperature here to score the distribution that was sampled.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

__all__ = ["entropy", "token_logprobs", "token_logprobs_and_entropy_from_hidden", "token_logprobs_from_hidden"]

_ROWS_PER_CHUNK = 4096


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for half/bfloat16/float32 inputs, float64 for float64 (used by gradcheck)."""
    return torch.promote_types(dtype, torch.float32)


def _check_labels(labels: Tensor, vocab: int, expected_shape: tuple[int, ...]) -> None:
    if tuple(labels.shape) != expected_shape:
        raise ValueError(f"labels must have shape {expected_shape}, got {tuple(labels.shape)}")
    if labels.is_floating_point() or labels.dtype == torch.bool:
        raise ValueError(f"labels must be integer token ids, got dtype {labels.dtype}")
    if labels.numel() and bool(((labels < 0) | (labels >= vocab)).any()):
        bad = labels[(labels < 0) | (labels >= vocab)][:5].tolist()
        raise ValueError(
            f"labels must lie in [0, vocab={vocab}); found {bad} (replace padding ids such as "
            "-100 by a real token id and mask those positions instead)"
        )


def token_logprobs(logits: Tensor, labels: Tensor, temperature: float = 1.0) -> Tensor:
    """`log_softmax(logits / temperature)[..., label]`: `[...]` float32 from `[..., V]` logits."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    vocab = logits.shape[-1]
    _check_labels(labels, vocab, tuple(logits.shape[:-1]))
    dtype = _compute_dtype(logits.dtype)
    flat = logits.reshape(-1, vocab)  # [N, V]
    flat_labels = labels.reshape(-1, 1)  # [N, 1]
    pieces = []
    for start in range(0, flat.shape[0], _ROWS_PER_CHUNK):
        z = flat[start : start + _ROWS_PER_CHUNK].to(dtype) / temperature  # [c, V]
        picked = z.gather(1, flat_labels[start : start + _ROWS_PER_CHUNK]).squeeze(1)  # [c]
        pieces.append(picked - torch.logsumexp(z, dim=-1))  # [c]
    if not pieces:
        return flat.new_zeros(labels.shape, dtype=dtype)
    return torch.cat(pieces).reshape(labels.shape)


def entropy(logits: Tensor) -> Tensor:
    """Entropy `-sum p log p` of `softmax(logits)` over the last dim: `[...]` float32."""
    vocab = logits.shape[-1]
    dtype = _compute_dtype(logits.dtype)
    flat = logits.reshape(-1, vocab)  # [N, V]
    pieces = []
    for start in range(0, flat.shape[0], _ROWS_PER_CHUNK):
        z = flat[start : start + _ROWS_PER_CHUNK].to(dtype)  # [c, V]
        p = torch.softmax(z, dim=-1)  # [c, V]
        pieces.append(torch.logsumexp(z, dim=-1) - (p * z).sum(dim=-1))  # [c]
    if not pieces:
        return flat.new_zeros(logits.shape[:-1], dtype=dtype)
    return torch.cat(pieces).reshape(logits.shape[:-1])


def _chunk_logits(hidden: Tensor, weight: Tensor, temperature: float, dtype: torch.dtype) -> Tensor:
    """`hidden @ weight.T / temperature` `[c, V]`; in the model dtype when temperature is 1."""
    logits = hidden @ weight.t()  # [c, V] model dtype, float32 accumulation in the matmul
    if temperature == 1.0:
        return logits
    return logits.to(dtype).div_(temperature)  # [c, V] compute dtype


class _LogprobsFromHidden(torch.autograd.Function):
    """Chunked `log_softmax(hidden @ weight.T / temperature)` at the labels; see module docs.

    `ctx` is `Any`: it is the autograd node, which carries `saved_tensors`, `needs_input_grad`
    and the attributes `forward` sets on it, none of which torch's `FunctionCtx` type declares.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: Tensor,  # [N, H]
        weight: Tensor,  # [V, H]
        labels: Tensor,  # [N]
        temperature: float,
        chunk_size: int,
        with_entropy: bool,
    ) -> tuple[Tensor, Tensor]:
        dtype = _compute_dtype(hidden.dtype)
        out = torch.empty(hidden.shape[0], dtype=dtype, device=hidden.device)  # [N]
        ent = torch.empty(hidden.shape[0] if with_entropy else 0, dtype=dtype, device=hidden.device)  # [N] or [0]
        for start in range(0, hidden.shape[0], chunk_size):
            stop = start + chunk_size
            logits = _chunk_logits(hidden[start:stop], weight, temperature, dtype)  # [c, V]
            logp = torch.log_softmax(logits, dim=-1, dtype=dtype)  # [c, V] one chunk only
            out[start:stop] = logp.gather(1, labels[start:stop, None]).squeeze(1)
            del logits
            if with_entropy:
                ent[start:stop] = logp.exp().mul_(logp).sum(-1).neg_()  # [c]: -sum p log p
            del logp
        ctx.save_for_backward(hidden, weight, labels, out)
        ctx.temperature = temperature
        ctx.chunk_size = chunk_size
        ctx.mark_non_differentiable(ent)
        return out, ent

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: Tensor, _grad_ent: Tensor | None) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        hidden, weight, labels, logp = ctx.saved_tensors
        temperature, chunk_size = ctx.temperature, ctx.chunk_size
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dtype = _compute_dtype(hidden.dtype)
        grad_hidden = torch.empty_like(hidden) if need_hidden else None  # [N, H]
        # float32 accumulator across chunks for low-precision weights (one rounding at the end)
        grad_weight = torch.zeros_like(weight, dtype=dtype) if need_weight else None  # [V, H]
        # d logp_y / d z_j = (1[j == y] - p_j) / temperature, so with s = grad_out / temperature
        # and Q = p - onehot(y): grad_logits = -s Q, grad_hidden = -s (Q @ W) and
        # grad_weight = Q.T @ (-s h). The row scale -s is applied to the small [c, H] tensors,
        # so the [c, V] block sees only the softmax and one scatter.
        neg_scale = -grad_out.to(dtype) / temperature  # [N]
        for start in range(0, hidden.shape[0], chunk_size):
            stop = start + chunk_size
            h = hidden[start:stop]  # [c, H]
            logits = _chunk_logits(h, weight, temperature, dtype)  # [c, V]
            q = torch.softmax(logits, dim=-1).to(weight.dtype)  # [c, V] float32 math inside
            del logits
            # label entry p_y - 1 = expm1(logp_y), formed in float32 from the forward's log-prob:
            # exact even when p_y rounds to 1.0 in bf16
            q.scatter_(1, labels[start:stop, None], torch.expm1(logp[start:stop, None]).to(q.dtype))
            row = neg_scale[start:stop, None]  # [c, 1]
            if grad_hidden is not None:  # need_hidden
                grad_hidden[start:stop] = (q @ weight).to(dtype) * row  # [c, H]
            if grad_weight is not None:  # need_weight
                grad_weight.add_(q.t() @ (h.to(dtype) * row).to(weight.dtype))  # [V, H]
            del q
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None


def token_logprobs_from_hidden(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    temperature: float = 1.0,
    chunk_size: int = 4096,
) -> Tensor:
    """Log-probs `[B, T]` (float32) of `labels` under `softmax(hidden @ weight.T / temperature)`.

    `hidden` `[B, T, H]` are the final hidden states (after the last norm), `weight` `[V, H]` the
    LM head (tied embeddings work the same). Gradients flow to `hidden` and, when it requires
    grad, to `weight`. Equal to `token_logprobs(hidden @ weight.T, labels, temperature)`
    within float32 rounding, without ever holding the `[B*T, V]` logits. `chunk_size` is the
    number of tokens per block: peak extra memory is about `chunk_size * V * 6` bytes in bf16.
    """
    return _apply(hidden, weight, labels, temperature, chunk_size, with_entropy=False)[0]


def token_logprobs_and_entropy_from_hidden(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    temperature: float = 1.0,
    chunk_size: int = 4096,
) -> tuple[Tensor, Tensor]:
    """`(logprobs [B, T], entropy [B, T])`, both float32: `token_logprobs_from_hidden` plus the
    entropy of `softmax(hidden @ weight.T / temperature)` at every position, computed from each
    chunk while it is in memory. The entropy carries no gradient (it is for logging); a chunk
    costs one more elementwise pass, about `chunk_size * V * 4` bytes more memory."""
    return _apply(hidden, weight, labels, temperature, chunk_size, with_entropy=True)


def _apply(hidden: Tensor, weight: Tensor, labels: Tensor, temperature: float, chunk_size: int,
           *, with_entropy: bool) -> tuple[Tensor, Tensor]:
    if hidden.dim() != 3:
        raise ValueError(f"hidden must be [B, T, H], got shape {tuple(hidden.shape)}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[2]:
        raise ValueError(
            f"weight must be [V, H={hidden.shape[2]}], got shape {tuple(weight.shape)}"
        )
    if weight.dtype != hidden.dtype or weight.device != hidden.device:
        raise ValueError(
            f"hidden and weight must share dtype and device, got {hidden.dtype}/{hidden.device} "
            f"and {weight.dtype}/{weight.device}"
        )
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    batch, length, size = hidden.shape
    _check_labels(labels, weight.shape[0], (batch, length))
    flat, ent = _LogprobsFromHidden.apply(
        hidden.reshape(-1, size), weight, labels.reshape(-1), float(temperature), int(chunk_size), with_entropy
    )  # [B*T], [B*T] or [0]
    return flat.reshape(batch, length), ent.reshape(batch, length) if with_entropy else ent
