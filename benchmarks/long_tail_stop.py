"""`LongTailStop`: the long-tail lengths (benchmarks/long_tail.py) imposed inside a vLLM engine.

- a new sample draws its length L (`long_tail.length`); until then the tokenizer's special
  tokens are masked (a random policy would otherwise stop or emit an image placeholder now and
  then);
- at token L its only choice is the EOS token, so the engine stops it there, as a policy that
  learned to stop would;
- a sample that leaves the batch before its length (a partial rollout's round, a preemption)
  keeps it: when it comes back as a continuation (its prompt ending in the tokens it had), it
  goes on to the same L.
"""

from __future__ import annotations

import os
import random
from collections import OrderedDict
from dataclasses import dataclass

import torch
from long_tail import length
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

TAIL = 16  # a sample's key: its last 16 tokens
SHIFTS = 4  # a continuation also matches a key that lacks up to 3 of its last tokens (async scheduling's lag)
CARRIED_MAX = 100_000  # samples that left the batch before their length, kept for their continuation


@dataclass
class _Sample:
    tokens: list[int]  # the request's prompt (a continuation's ends with the sample's tokens so far)
    output: list[int]  # vLLM's live list of the tokens this request generated
    before: int  # tokens the sample had generated before this request
    length: int  # where it stops

    @property
    def generated(self) -> int:
        return self.before + len(self.output)


def _known(output: list[int]) -> list[int]:
    """The output's tokens without async scheduling's trailing placeholders (-1)."""
    end = len(output)
    while end and output[end - 1] < 0:
        end -= 1
    return output[:end]


class LongTailStop(LogitsProcessor):
    """Stops each sample at its drawn `length` (module docstring)."""

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(vllm_config.model_config.tokenizer)
        self.eos = int(tokenizer.eos_token_id)
        self.masked = torch.tensor(sorted({*tokenizer.all_special_ids, self.eos}), device=device)
        self.device = device
        self.rows: dict[int, _Sample] = {}  # batch index -> sample
        self.carried: OrderedDict[tuple[int, ...], tuple[int, int]] = OrderedDict()  # key -> (generated, length)
        self.rng = random.Random(os.getpid())

    def is_argmax_invariant(self) -> bool:
        return False

    def _leave(self, sample: _Sample | None) -> None:
        """A sample out of the batch before its length keeps it for its continuation."""
        if sample is None or sample.generated >= sample.length:
            return
        known = _known(sample.output)
        tokens = [*sample.tokens, *known]
        if len(tokens) >= TAIL:
            self.carried[tuple(tokens[-TAIL:])] = (sample.before + len(known), sample.length)
            while len(self.carried) > CARRIED_MAX:
                self.carried.popitem(last=False)

    def _join(self, prompt: list[int], output: list[int]) -> _Sample:
        tokens = [*prompt, *_known(output)]
        for shift in range(SHIFTS):  # a continuation, or a preempted request back
            end = len(tokens) - shift
            kept = self.carried.pop(tuple(tokens[end - TAIL:end]), None) if end >= TAIL else None
            if kept is not None:
                generated, stop = kept  # generated: the sample's tokens at `end`
                return _Sample(prompt, output, generated + shift - len(tokens) + len(prompt), stop)
        return _Sample(prompt, output, 0, length(self.rng.getrandbits(32)))

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        # every sample that leaves is kept before any joins: a round's continuations join in the
        # update that removes the round's requests
        for index in batch_update.removed:
            self._leave(self.rows.pop(index, None))
        for index, *_ in batch_update.added:
            self._leave(self.rows.pop(index, None))
        for index, _params, prompt, output in batch_update.added:
            self.rows[index] = self._join(list(prompt or []), output)
        for a, b, direction in batch_update.moved:
            first, second = self.rows.pop(a, None), self.rows.pop(b, None)
            if first is not None:
                self.rows[b] = first
            if second is not None:
                if direction == MoveDirectionality.SWAP:
                    self.rows[a] = second
                else:
                    self._leave(second)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """logits: [batch, vocab]; special tokens masked, EOS forced where a sample's next token is its last."""
        logits[:, self.masked] = float("-inf")
        last = [i for i, s in self.rows.items() if s.generated + 1 >= s.length and i < logits.shape[0]]
        if last:
            rows = torch.tensor(last, device=self.device)
            logits[rows] = float("-inf")
            logits[rows, self.eos] = 0.0
        return logits
