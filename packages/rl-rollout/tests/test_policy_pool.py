"""The policy's engine as Ray actors (`build_policy_engine(workers=N)`, `rl_rollout.policy_pool`)
on a real local Ray instance started by the builder, hf engines on CPU: the actors sample what
the in-process engine samples from the same weights, before and after a push, synchronous
(`sync`) and by version (`weight_channel`), whatever the number of actors."""

from __future__ import annotations

import pytest
import torch

from rl_core.errors import UserError
from rl_models import tiny
from rl_models.text import load_causal_lm
from rl_rollout import SamplingParams, generate_seeded
from rl_rollout.policy import build_policy_engine

PROMPTS = ["Hi", "The sky is", "One two", "A cat"]
SEEDS = [11, 12, 13, 14]
PARAMS = SamplingParams(n=2, temperature=1.0, max_new_tokens=6)


def _samples(engine) -> list[tuple[int, list[int], list[float]]]:
    with engine.session() as sampler:
        gens = generate_seeded(sampler, PROMPTS, PARAMS, SEEDS)
    return [(g.request_index, g.completion_ids, [round(x, 4) for x in g.logprobs]) for g in gens]


def _build(model, tokenizer, path: str, workers: int):
    return build_policy_engine("hf", model=model, processor=tokenizer, path=path, dtype="float32",
                               device=torch.device("cpu"), seed=0, compile=False, workers=workers)


@pytest.mark.parametrize("workers", [1, 2])
def test_ray_actors_sample_what_the_in_process_engine_samples(workers: int) -> None:
    path = str(tiny.build("qwen3"))
    model, tokenizer = load_causal_lm(path, dtype="float32")
    local = _build(model, tokenizer, path, workers=0)
    remote = _build(model, tokenizer, path, workers=workers)
    try:
        assert remote.kind == "hf" and remote.remote and not remote.shares_weights
        assert remote.engine.pool.num_workers == workers
        before = _samples(local)
        assert _samples(remote) == before  # the actors loaded the same checkpoint
        scored = remote.engine.score_next_tokens([5, 6, 7], [[8], [9, 10]], [11, 12], temperature=0.7)
        assert torch.equal(scored, local.engine.score_next_tokens([5, 6, 7], [[8], [9, 10]], [11, 12], temperature=0.7))
        with torch.no_grad():  # an "optimizer step": the actors see it only after the push
            model.get_output_embeddings().weight.mul_(-1)
        assert _samples(remote) == before
        remote.sync()
        after = _samples(local)
        assert after != before and _samples(remote) == after
        assert remote.weight_version == 1 and remote.engine.pool.version == 1
        # asynchronous runs: versions published by the trainer, loaded by the rollout thread
        channel = remote.weight_channel()
        channel.publish(1)
        with torch.no_grad():
            model.get_output_embeddings().weight.mul_(-1)  # back to the first weights
        remote.sync()  # only counts optimizer steps now
        channel.publish(2)
        channel.load(1)
        assert _samples(remote) == after
        channel.load(2)
        assert _samples(remote) == before and remote.engine.pool.version == 3  # the pool's own count: 3 pushes
    finally:
        remote.close()
        local.close()


def test_ray_actors_serve_one_training_process() -> None:
    path = str(tiny.build("qwen3"))
    model, tokenizer = load_causal_lm(path, dtype="float32")
    with pytest.raises(UserError, match="Ray actors serve one training process, this run has 2"):
        build_policy_engine("hf", model=model, processor=tokenizer, path=path, dtype="float32",
                            device=torch.device("cpu"), seed=0, world_size=2, workers=1)
