"""One environment per reward: rewards with `[rewards.NAME] python = ...` are scored by worker
processes of that interpreter, the others as they would be without them.

flow_grpo serves each reward whose dependencies clash from a reward server of its own, in its own
environment. Here one server does it: a reward that names an interpreter gets a `Router` of its
own over `ProcessWorker`s started with that interpreter (as many as `--workers`, at least one,
with the same GPU groups), whose settings hold that reward alone; `EnvironmentPool` sends each
reward's batches to its pool. The server process never builds, nor imports, such a reward's
scorer (`build_served` skips it), so its module may import only in its own environment.
"""

from __future__ import annotations

import asyncio

import msgspec

from rl_rewards.samples import Sample, ScoreResult
from rl_rewards.server.metrics import Metrics
from rl_rewards.server.rewards import reward_names
from rl_rewards.server.settings import ServerSettings
from rl_rewards.server.workers import Pool, process_router


def own_settings(settings: ServerSettings, name: str) -> ServerSettings:
    """The settings of reward `name`'s own workers: that reward alone (its `python` dropped, so
    they build it), no judge, and at least one worker."""
    table = {k: v for k, v in settings.rewards[name].items() if k != "python"}
    return msgspec.structs.replace(settings, rewards={name: table}, model=None, default_reward="",
                                   openrlhf_reward="", workers=max(settings.workers, 1))


class EnvironmentPool:
    """The server's pool (`default`: in-process or `--workers`, for every reward without a
    `python`; None when there is none) and one process pool per reward with a `python`.

    `size` is the workers each reward has (the same for all: `--workers`, or 1); `alive()` the
    fewest of them alive in any one pool, so `/health`'s `workers_alive` drops when a reward's
    own workers are down."""

    def __init__(self, settings: ServerSettings, default: Pool | None, metrics: Metrics) -> None:
        interpreters = settings.interpreters()
        self._order = reward_names(settings)
        self._default = default
        self._own: dict[str, Pool] = {
            name: process_router(own_settings(settings, name), metrics, python) for name, python in interpreters.items()
        }
        self._pools: list[Pool] = [*([default] if default is not None else []), *self._own.values()]
        self.size = max(settings.workers, 1)
        self.rewards: list[str] = []
        self.inline: frozenset[str] = frozenset()
        self._by_reward: dict[str, Pool] = {}

    async def start(self) -> None:
        await asyncio.gather(*(pool.start() for pool in self._pools))
        for pool in self._pools:
            self._by_reward.update(dict.fromkeys(pool.rewards, pool))
        self.rewards = [name for name in self._order if name in self._by_reward]
        self.inline = self._default.inline if self._default is not None else frozenset()

    async def score(self, reward: str, samples: list[Sample]) -> list[ScoreResult]:
        return await self._by_reward[reward].score(reward, samples)

    def score_inline(self, reward: str, samples: list[Sample]) -> list[ScoreResult]:
        return self._by_reward[reward].score_inline(reward, samples)

    async def close(self) -> None:
        await asyncio.gather(*(pool.close() for pool in self._pools))

    def alive(self) -> int:
        return min(pool.alive() for pool in self._pools)

    def ready(self) -> bool:
        return all(pool.ready() for pool in self._pools)


def serves_others(settings: ServerSettings) -> bool:
    """Whether any reward is left for the server's own pool once those with a `python` are out."""
    return bool(set(reward_names(settings)) - set(settings.interpreters()))
