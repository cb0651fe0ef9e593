"""Partial rollouts streamed by group: a step takes the groups that finish first, and the samples
still running go on in the next step with the newer weights (verl's and AReaL's partial
rollouts).

Without them a step's rollout lasts as long as its longest sample: where response lengths have
a long tail, most of the batch waits for a few samples and the engine decodes a shrinking batch.
With `PartialRollouts(chunk_tokens=C, steps=K)` each process keeps `(K + 1) x take` groups in
flight. A step

1. draws new groups (`draw(count)`: the recipe's next prompts) until `(K + 1) x take` are in flight,
2. decodes every unfinished sample `C` tokens at a time, each round with the weights the engine
   holds now, resuming a sample after its tokens so far (`rl_rollout.protocol.Continuation`),
3. stops once `take` groups have finished and every group drawn `K` steps ago has finished,
4. returns `take` finished groups: those drawn `K` steps ago first, then in the order they
   finished (ties by the order they were drawn). The others stay in flight.

So a group is trained at most `K` steps after it was drawn, and each token carries the weight
version that sampled it (`Generation.token_versions`): with `train.max_staleness = N` a token is
at most `N + K` optimizer steps older than the weights it trains. The log-probs the engine
recorded are each token's own sampling distribution, so the ratio's correction
(`algo.rollout_correction`) and the mismatch metrics work per token unchanged.

What it costs: each round re-reads the prompt and the tokens so far (a prefill; vLLM's prefix
cache makes it cheap, the `hf` engine pays it) and the rounds synchronise every `C` tokens. Choose
`C` of a few tens to a few hundred tokens: small enough that a round ends soon after `take` groups
finish, large enough that the prefills stay a small part. Choose K = 1 for response lengths with
a long tail; K = 0 turns it off (a step samples exactly its own groups, to the end).

Every choice depends only on the groups in flight, their seeds and the weights, so two runs of a
config sample the same rollouts, and the groups in flight go into checkpoints (a
`ProcessState`: each process its own), so a resumed run is the uninterrupted one. The groups in
flight are each process's own: a run with partial rollouts depends on its process count.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import torch

from rl_rollout.prompts import _has_media
from rl_rollout.protocol import (
    Continuation,
    Generation,
    Prompt,
    SamplingParams,
    generate_seeded,
    is_chat_messages,
)

__all__ = ["Drawn", "Generate", "PartialRollouts", "round_generator"]

# draw(count) -> the next `count` groups: their keys (the recipe's prompt ids), prompts, seeds
Drawn = tuple[Sequence[Any], Sequence[Prompt], Sequence[int]]
# a round: requests (n = 1 each), the call's params, each request's budget and seed (None: unseeded)
# -> one generation each
Generate = Callable[[list[Prompt | Continuation], SamplingParams, list[int], list[int] | None], list[Generation]]


def round_generator(engine: Any) -> Generate:
    """An engine's `generate` for partial rollouts' rounds: `vllm` takes each request's budget
    and seed in one call (`row_budgets = "seeded"`), `hf` each budget in one call, its batch
    drawn from `params.seed` (`"batch"`); any other engine samples each budget's requests with
    their seeds (`generate_seeded`: one call per request unless the engine spreads them, as Ray
    actors do)."""
    kind = getattr(engine, "row_budgets", None)
    if kind == "seeded":
        return lambda requests, params, lengths, seeds: engine.generate(requests, params, max_new_tokens=lengths,
                                                                         seeds=seeds)
    if kind == "batch":
        return lambda requests, params, lengths, seeds: engine.generate(requests, params, max_new_tokens=lengths)

    def by_length(requests: list[Prompt | Continuation], params: SamplingParams, lengths: list[int],
                  seeds: list[int] | None) -> list[Generation]:
        out: dict[int, Generation] = {}  # request index -> its generation
        for length in sorted(set(lengths)):
            rows = [i for i, n in enumerate(lengths) if n == length]
            some, budget = [requests[i] for i in rows], msgspec.structs.replace(params, max_new_tokens=length)
            gens = (engine.generate(some, budget) if seeds is None
                    else generate_seeded(engine, some, budget, [seeds[i] for i in rows]))  # type: ignore[arg-type]
            out.update(zip(rows, gens, strict=True))
        return [out[i] for i in range(len(requests))]

    return by_length


@dataclass
class _Sample:
    """One sample in flight: what it sampled so far and which weights sampled each token."""

    budget: int  # its max_new_tokens
    prompt_ids: list[int] = field(default_factory=list)  # the first round's encoding
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish: str | None = None  # "stop" | "length" once finished


@dataclass
class _Group:
    key: Any
    prompt: Prompt
    seed: int
    drawn: int  # the call that drew it
    samples: list[_Sample]
    finished: tuple[int, int] | None = None  # (call, round) it finished in

    @property
    def done(self) -> bool:
        return all(s.finish is not None for s in self.samples)


def _round_seed(seed: int, call: int, round_: int) -> int:
    digest = hashlib.blake2b(f"{seed}/{call}/{round_}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2


class PartialRollouts:
    """The groups in flight of one process (see the module doc): `chunk_tokens` per round,
    `steps` (K) the most steps a group waits, `decode(ids) -> str` the engine's tokenizer.
    `seeded=False` samples from the engine's own random state (faster on vLLM, whose seeded
    requests draw one by one; not reproducible)."""

    def __init__(self, chunk_tokens: int, steps: int, decode: Callable[[list[int]], str], *,
                 rank: int = 0, world_size: int = 1, seeded: bool = True) -> None:
        if chunk_tokens < 1 or steps < 0:
            raise ValueError(f"chunk_tokens must be >= 1 and steps >= 0, got {chunk_tokens} and {steps}")
        self.chunk_tokens, self.steps, self.decode, self.seeded = chunk_tokens, steps, decode, seeded
        self.rank, self.world_size = rank, world_size
        self.groups: list[_Group] = []
        self.calls = 0

    def run(self, generate: Generate, draw: Callable[[int], Drawn], take: int, params: SamplingParams,
            version: int, *, budgets: Callable[[Any, int], int] | None = None) -> tuple[list[Any], list[Generation]]:
        """One step's `take` finished groups: their keys, and their `params.n` generations each
        (request-major, `request_index` into the keys). `generate` is the engine's
        (`round_generator(engine)`), holding the weights of `version`; `budgets(key, j)`, if
        given, is sample j's own `max_new_tokens` (at most `params.max_new_tokens`)."""
        if params.stop:
            raise ValueError("partial rollouts cannot continue a sample across a stop string: use stop tokens")
        self.calls += 1
        wanted = (self.steps + 1) * take - len(self.groups)
        if wanted > 0:
            keys, prompts, seeds = draw(wanted)
            for key, prompt, seed in zip(keys, prompts, seeds, strict=True):
                caps = [params.max_new_tokens if budgets is None else min(params.max_new_tokens, budgets(key, j))
                        for j in range(params.n)]
                self.groups.append(_Group(key, prompt, seed, self.calls, [_Sample(max(1, c)) for c in caps]))
        take = min(take, len(self.groups))  # `draw` may give fewer (records it could not use)
        overdue = [g for g in self.groups if self.calls - g.drawn >= self.steps]
        round_ = 0
        while sum(g.done for g in self.groups) < take or not all(g.done for g in overdue):
            self._round(generate, params, version, round_)
            round_ += 1
        finished = sorted((g for g in self.groups if g.done), key=lambda g: (self.calls - g.drawn < self.steps,
                                                                              g.finished, g.drawn))
        chosen = finished[:take]
        taken = {id(g) for g in chosen}
        self.groups = [g for g in self.groups if id(g) not in taken]
        return [g.key for g in chosen], [self._generation(i, s) for i, g in enumerate(chosen) for s in g.samples]

    def _round(self, generate: Generate, params: SamplingParams, version: int, round_: int) -> None:
        """Every unfinished sample `chunk_tokens` further (fewer where its budget ends sooner),
        in one round: each sample from a seed of its own, its group's, the call's and the round's."""
        todo = [(g, j, s) for g in self.groups for j, s in enumerate(g.samples) if s.finish is None]
        lengths = [min(self.chunk_tokens, s.budget - len(s.ids)) for _, _, s in todo]
        seeds = [_round_seed(g.seed * 1_000 + j, self.calls, round_) for g, j, _ in todo] if self.seeded else None
        seed = _round_seed(todo[0][0].seed, self.calls, round_) if self.seeded else None
        chunk = msgspec.structs.replace(params, n=1, seed=seed)
        gens = generate([self._request(g, s) for g, _, s in todo], chunk, lengths, seeds)
        for (_, _, s), gen, length in zip(todo, gens, lengths, strict=True):
            if not s.ids and not s.prompt_ids:
                s.prompt_ids = list(gen.prompt_ids)
            s.ids += gen.completion_ids
            s.logprobs += gen.logprobs
            s.versions += [version] * len(gen.completion_ids)
            if gen.finish_reason == "stop":
                s.finish = "stop"
            elif len(s.ids) >= s.budget or len(gen.completion_ids) < length:  # its budget, or the context
                s.finish = "length"
        for g in self.groups:
            if g.finished is None and g.done:
                g.finished = (self.calls, round_)

    @staticmethod
    def _request(g: _Group, s: _Sample) -> Prompt | Continuation:
        if not s.ids:
            return g.prompt
        media = is_chat_messages(g.prompt) and _has_media(g.prompt)
        return Continuation(g.prompt if media else list(s.prompt_ids), list(s.ids))  # token ids where exact

    def _generation(self, index: int, s: _Sample) -> Generation:
        return Generation(request_index=index, prompt_ids=s.prompt_ids, completion_ids=s.ids,
                          text=self.decode(s.ids), logprobs=s.logprobs,
                          finish_reason="stop" if s.finish == "stop" else "length", token_versions=s.versions)

    # a ProcessState (rl_core.train): each process saves and loads its own groups in flight
    def save(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        torch.save({"world_size": self.world_size, "calls": self.calls, "groups": self.groups},
                   folder / f"rank{self.rank}.pt")

    def load(self, folder: Path) -> None:
        path = folder / f"rank{self.rank}.pt"
        if not path.is_file():
            raise FileNotFoundError(f"{folder} holds no partial rollouts of process {self.rank}: resume with as many "
                                    "processes as the run had")
        saved = torch.load(path, map_location="cpu", weights_only=False)  # our own file, written by save()
        if saved["world_size"] != self.world_size:
            raise ValueError(f"{folder}: the run had {saved['world_size']} processes, this one has {self.world_size}")
        self.calls, self.groups = int(saved["calls"]), list(saved["groups"])

    @property
    def in_flight(self) -> int:
        """Groups drawn and not yet returned."""
        return len(self.groups)
