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

TAIL_KEY = (24, 8)  # a sample's key: its tokens [-24:-8] (clear of async scheduling's placeholders)
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


def _key(tokens: list[int]) -> tuple[int, ...] | None:
    first, last = TAIL_KEY
    return tuple(tokens[-first:-last]) if len(tokens) >= first else None


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
        key = _key([*sample.tokens, *sample.output])
        if key is not None:
            self.carried[key] = (sample.generated, sample.length)
            while len(self.carried) > CARRIED_MAX:
                self.carried.popitem(last=False)

    def _join(self, prompt: list[int], output: list[int]) -> _Sample:
        key = _key([*prompt, *output])
        if key is not None and key in self.carried:  # a continuation, or a preempted request back
            generated, stop = self.carried.pop(key)
            return _Sample(prompt, output, generated - len(output), stop)
        return _Sample(prompt, output, 0, length(self.rng.getrandbits(32)))

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for index, _params, prompt, output in batch_update.added:
            self._leave(self.rows.get(index))
            self.rows[index] = self._join(list(prompt or []), output)
        for index in batch_update.removed:
            self._leave(self.rows.pop(index, None))
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
