"""`LongTailStop`: the long-tail lengths (benchmarks/long_tail.py) imposed inside a vLLM engine.

- a new sample draws its length L (`long_tail.length`); until then the tokenizer's special
  tokens are masked (a random policy would otherwise stop or emit an image placeholder now and
  then);
- at token L its only choice is the EOS token, so the engine stops it there, as a policy that
  learned to stop would;
- a sample that leaves the batch before its length (a partial rollout's round, a preemption)
  keeps it: when it comes back as a continuation (its prompt: the prompt it started from, then
  the tokens it had), it goes on to the same L.

vLLM keeps a request's generated tokens only as a count for a plugin like this one: the lists it
hands over hold placeholders (-1), the real ids being filled in only for processors given as
`logits_processors` or for penalties. So a continuation is matched by the prompt it starts with
and how many tokens it had, not by the tokens themselves. Samples of one prompt that left with
the same count are interchangeable (their lengths are independent draws, each above that
count), so which of them a continuation goes on as leaves the distribution of lengths unchanged.
"""

from __future__ import annotations

import os
import random
from collections import defaultdict, deque
from dataclasses import dataclass

import torch
from long_tail import length
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

LAG = 4  # a continuation also matches a sample counted up to 3 tokens short (async scheduling's lag)
CARRIED_MAX = 100_000  # samples that left the batch before their length, kept for their continuation


@dataclass
class _Sample:
    start: tuple[int, ...]  # the prompt this sample started from
    output: list[int]  # vLLM's live list of this request's generated tokens (placeholders count too)
    before: int  # tokens the sample had generated before this request
    length: int  # where it stops

    @property
    def generated(self) -> int:
        return self.before + len(self.output)


class LongTailStop(LogitsProcessor):
    """Stops each sample at its drawn `length` (module docstring)."""

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(vllm_config.model_config.tokenizer)
        self.eos = int(tokenizer.eos_token_id)
        self.masked = torch.tensor(sorted({*tokenizer.all_special_ids, self.eos}), device=device)
        self.device = device
        self.rows: dict[int, _Sample] = {}  # batch index -> sample
        # (prompt length, prompt, tokens generated) -> the lengths of samples that left there
        self.carried: dict[tuple[int, int, int], deque[int]] = defaultdict(deque)
        self.carried_count = 0
        self.rng = random.Random(os.getpid())

    def is_argmax_invariant(self) -> bool:
        return False

    def _leave(self, sample: _Sample | None) -> None:
        """A sample out of the batch before its length keeps it for its continuation."""
        if sample is None or sample.generated >= sample.length:
            return
        if self.carried_count >= CARRIED_MAX:  # continuations that never came: start afresh
            self.carried.clear()
            self.carried_count = 0
        self.carried[(len(sample.start), hash(sample.start), sample.generated)].append(sample.length)
        self.carried_count += 1

    def _join(self, prompt: list[int], output: list[int]) -> _Sample:
        """A continuation (or a preempted request back) goes on to its kept length; a new
        sample draws one."""
        starts = sorted({key[0] for key in self.carried if key[0] <= len(prompt)}, reverse=True)
        for start in starts:
            had = len(prompt) - start + len(output)  # tokens the sample has now
            key = hash(tuple(prompt[:start]))
            for lag in range(LAG):
                kept = self.carried.get((start, key, had - lag))
                if kept:
                    self.carried_count -= 1
                    stop = kept.popleft()
                    if not kept:
                        del self.carried[(start, key, had - lag)]
                    return _Sample(tuple(prompt[:start]), output, len(prompt) - start, stop)
        return _Sample(tuple(prompt), output, 0, length(self.rng.getrandbits(32)))

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
