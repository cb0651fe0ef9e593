"""Group sampler for group-relative RL (GRPO, RLOO, REINFORCE++-baseline): every prompt is
repeated ``n`` times consecutively, so a rollout batch is made of whole groups.

Sharding is by **whole groups, strided** (rank r takes prompts ``r, r + W, r + 2W, …`` of the
epoch's order, like torch's DistributedSampler): every group lives on exactly one rank, so a
rank can compute group statistics locally, and apps that gather rewards before advantages
reassemble each group contiguously. When the prompt count does not divide by the world size,
``drop_last=False`` (default) pads the epoch by wrapping around to its first prompts so every rank
runs the same number of steps (collectives need that); ``drop_last=True`` drops the remainder.

Resume: ``state_dict()`` holds the epoch and the number of indices this rank has yielded in it
(equal on all ranks, so one rank's state restores all of them); after ``load_state_dict`` the
next index is exactly the one that would have come next.

:class:`GroupStream` is the same idea for data that cannot be indexed — an ``IterableDataset``
streamed from the Hub or larger than memory: it repeats each record of a reader ``n`` times,
epoch after epoch, and resumes from a saved position. Pick :class:`GroupSampler` whenever the
records fit in a list (it shuffles exactly and pads ranks to equal length).
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Generic, TypeVar

if TYPE_CHECKING:
    from rl_data.readers import Reader

__all__ = ["GroupSampler", "GroupStream"]

T = TypeVar("T")


class GroupSampler:
    """Prompt indices, each repeated ``n`` times in a row, shuffled per epoch, sharded by rank.

    Args:
        num_prompts: dataset size.
        n: rollouts per prompt (group size).
        seed: with the epoch number, fixes each epoch's order on every rank.
        shuffle: False keeps the dataset order every epoch (eval, debugging).
        rank / world_size: data-parallel position.
        drop_last: drop the last ``num_prompts % world_size`` prompts of each epoch instead of
            padding with wrapped-around prompts.

    Iterating (``for i in sampler`` or ``for batch in sampler.batches(k)``) yields the rest of
    the current epoch and then moves to the next epoch.
    """

    def __init__(
        self,
        num_prompts: int,
        n: int,
        *,
        seed: int = 0,
        shuffle: bool = True,
        rank: int = 0,
        world_size: int = 1,
        drop_last: bool = False,
    ) -> None:
        if num_prompts < 1 or n < 1:
            raise ValueError(f"num_prompts and n must be >= 1, got {num_prompts} and {n}")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"need 0 <= rank < world_size, got rank={rank} world_size={world_size}")
        if drop_last and num_prompts < world_size:
            raise ValueError(f"drop_last with {num_prompts} prompts < {world_size} ranks leaves none")
        self.num_prompts, self.n, self.seed, self.shuffle = num_prompts, n, seed, shuffle
        self.rank, self.world_size, self.drop_last = rank, world_size, drop_last
        self.epoch = 0
        self.position = 0  # indices yielded in this epoch on this rank

    @property
    def prompts_per_rank(self) -> int:
        if self.drop_last:
            return self.num_prompts // self.world_size
        return math.ceil(self.num_prompts / self.world_size)

    def __len__(self) -> int:
        """Indices per rank per epoch (``prompts_per_rank * n``)."""
        return self.prompts_per_rank * self.n

    def epoch_prompts(self, epoch: int) -> list[int]:
        """This rank's prompt indices (one per group) for ``epoch``."""
        order = list(range(self.num_prompts))
        if self.shuffle:
            random.Random(f"rl_data.GroupSampler:{self.seed}:{epoch}").shuffle(order)
        total = self.prompts_per_rank * self.world_size
        order = (order * math.ceil(total / self.num_prompts))[:total]  # pad by wrapping / drop
        return order[self.rank :: self.world_size]

    def set_epoch(self, epoch: int) -> None:
        """Jump to the start of ``epoch``."""
        self.epoch, self.position = epoch, 0

    def __iter__(self) -> Iterator[int]:
        if self.position >= len(self):
            self.set_epoch(self.epoch + 1)
        prompts = self.epoch_prompts(self.epoch)
        while self.position < len(self):
            index = prompts[self.position // self.n]
            self.position += 1  # count before yielding: state_dict() after a yield is resumable
            yield index
        self.set_epoch(self.epoch + 1)

    def next_prompts(self, count: int) -> list[int]:
        """The next `count` prompts of this rank, one index per group (the engine samples `n` of
        each), crossing into the next epoch when this one runs out: a step's prompts."""
        out: list[int] = []
        while len(out) < count * self.n:
            for index in self:
                out.append(index)
                if len(out) == count * self.n:
                    break
        return out[:: self.n]

    def batches(self, prompts_per_batch: int) -> Iterator[list[int]]:
        """The rest of the epoch in batches of ``prompts_per_batch * n`` indices (whole groups
        when the epoch was started with batches; the last batch may be shorter)."""
        if prompts_per_batch < 1:
            raise ValueError(f"prompts_per_batch must be >= 1, got {prompts_per_batch}")
        size = prompts_per_batch * self.n
        batch: list[int] = []
        for index in self:
            batch.append(index)
            if len(batch) == size:
                yield batch
                batch = []
        if batch:
            yield batch

    def state_dict(self) -> dict[str, Any]:
        """Resumable position (an exhausted epoch is reported as the start of the next one)."""
        epoch, position = self.epoch, self.position
        if position >= len(self):
            epoch, position = epoch + 1, 0
        return {
            "epoch": epoch,
            "position": position,
            "seed": self.seed,
            "num_prompts": self.num_prompts,
            "n": self.n,
            "world_size": self.world_size,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a position. The ordering settings must match the sampler that saved it —
        otherwise "the next prompt" would be a different prompt — and a mismatch raises."""
        for key in ("seed", "num_prompts", "n", "world_size", "shuffle", "drop_last"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"sampler state has {key}={state[key]!r} but this sampler has "
                    f"{key}={getattr(self, key)!r}; resume with the same settings"
                )
        if not 0 <= state["position"] <= len(self):
            raise ValueError(f"sampler state position {state['position']} outside [0, {len(self)}]")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])


class GroupStream(Generic[T]):
    """The records of one rank's reader, each repeated ``n`` times in a row, epoch after epoch.

    Give it this rank's shard, e.g. ``read_caption_qa(ids, rank=r, world_size=w,
    on_error="skip")`` over an ``IterableDataset``: shards of different ranks are disjoint, so two
    processes never see the same record. The stream never ends — after the last record the reader
    is moved to the next epoch (``set_epoch``, which reshuffles an ``IterableDataset`` shuffled
    with a seed) — so ranks whose shards differ in length still take the same number of batches.

    Resume: ``state_dict()`` holds the epoch, the row to continue from and how many copies of the
    current record were already given; ``load_state_dict`` continues exactly there. The rows
    before that point are read again but not converted (no media is decoded), and the order must
    be the same as before — a fixed ``seed`` for a shuffled dataset. Each rank's position is its
    own (shard lengths and bad rows differ): save every rank's state.
    """

    def __init__(self, reader: Reader[T], n: int) -> None:
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        self.reader, self.n = reader, n
        self.epoch = 0
        self.position = 0  # ordinal of the row whose group is under way (or next)
        self.repeat = 0  # copies of that row's record given so far

    def __iter__(self) -> Iterator[T]:
        while True:
            self.reader.set_epoch(self.epoch)
            found = self.position > 0 or self.repeat > 0
            for ordinal, record in self.reader.records(self.position):
                found = True
                self.position = ordinal
                while self.repeat < self.n:
                    self.repeat += 1
                    if self.repeat == self.n:  # count before yielding: state_dict() is resumable
                        self.position, self.repeat = ordinal + 1, 0
                        yield record
                        break
                    yield record
            if not found:
                raise ValueError(f"{self.reader.rows.source}: no usable record in epoch "
                                 f"{self.epoch} ({self.reader.skipped} skipped)")
            self.epoch, self.position, self.repeat = self.epoch + 1, 0, 0

    def batches(self, prompts_per_batch: int) -> Iterator[list[T]]:
        """Batches of ``prompts_per_batch * n`` records (whole groups when the stream was
        started with batches), without end."""
        if prompts_per_batch < 1:
            raise ValueError(f"prompts_per_batch must be >= 1, got {prompts_per_batch}")
        size = prompts_per_batch * self.n
        records = iter(self)
        while True:
            yield [next(records) for _ in range(size)]

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position, "repeat": self.repeat,
                "n": self.n, "shard": list(self.reader.rows.shard)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a position saved by a stream of the same ``n`` over the same shard."""
        for key, mine in (("n", self.n), ("shard", list(self.reader.rows.shard))):
            saved = list(state[key]) if key == "shard" else state[key]
            if saved != mine:
                raise ValueError(f"stream state has {key}={state[key]!r} but this stream has "
                                 f"{key}={mine!r}; resume with the same settings")
        if not 0 <= state["repeat"] < self.n or state["position"] < 0:
            raise ValueError(f"stream state position {state['position']}, repeat {state['repeat']} "
                             f"is not a position of a stream with n={self.n}")
        self.epoch, self.position, self.repeat = (int(state["epoch"]), int(state["position"]),
                                                  int(state["repeat"]))
