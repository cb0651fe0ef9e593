# ruff: noqa: E402  (imports follow the importorskip of the optional framework)
"""GDPO's `normalize_then_sum` against TRL 1.16's own `multi_objective_aggregation="normalize_then_sum"`,
in a real `trl.GRPOTrainer` step on the CPU around the tiny qwen3 (`rl_models.tiny`).

Two reward functions return fixed values of different scales (one of them None for one
completion: a missing component); TRL's `_generate_and_score_completions` is wrapped to record
the advantages it returns, the reward functions to record what they returned. Fed the same
per-function rewards, with TRL's rows grouped as it groups them (`row // num_generations`),
our `normalize_then_sum` must return TRL's advantages.
"""

from __future__ import annotations

import math
from types import MethodType

import pytest

torch = pytest.importorskip("torch")
trl = pytest.importorskip("trl")
from datasets import Dataset

from rl_core.advantages import normalize_then_sum

pytestmark = [pytest.mark.third_party, pytest.mark.filterwarnings("ignore::DeprecationWarning"),
              pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.filterwarnings("ignore::FutureWarning")]

NUM_GENERATIONS = 4
WEIGHTS = [1.0, 0.5]


def test_normalize_then_sum_equals_trl(tmp_path):
    from rl_models.tiny import build

    calls: dict[str, list[list[float | None]]] = {"accuracy": [], "formatting": []}

    def accuracy(completions, idx, **kwargs):  # 0/1 by prompt and position in the batch
        out = [float((i + 2 * p) % 3 == 0) for i, p in enumerate(idx)]
        calls["accuracy"].append(out)
        return out

    def formatting(completions, idx, **kwargs):  # a wider scale; None (missing) for the batch's third row
        out: list[float | None] = [10.0 * p + 3.0 * (i % 4) - 0.5 * i for i, p in enumerate(idx)]
        out[2] = None
        calls["formatting"].append(out)
        return out

    dataset = Dataset.from_dict({"prompt": ["Describe a cat.", "Describe a dog."], "idx": [0, 1]})
    config = trl.GRPOConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=2 * NUM_GENERATIONS, num_generations=NUM_GENERATIONS,
        max_completion_length=4, max_steps=1, report_to=[], save_strategy="no", use_cpu=True, seed=0,
        reward_weights=WEIGHTS, multi_objective_aggregation="normalize_then_sum",
    )
    trainer = trl.GRPOTrainer(model=str(build("qwen3")), reward_funcs=[accuracy, formatting], args=config,
                              train_dataset=dataset)
    advantages: list[torch.Tensor] = []
    original = trainer._generate_and_score_completions

    def recording(self, inputs):
        output = original(inputs)
        advantages.append(output["advantages"].detach().clone())
        return output

    trainer._generate_and_score_completions = MethodType(recording, trainer)
    trainer.train()

    assert len(advantages) == len(calls["accuracy"]) == len(calls["formatting"]) == 1
    theirs = advantages[0].double()  # [8]
    objectives = torch.tensor([[math.nan if v is None else v for v in row]
                               for row in zip(calls["accuracy"][0], calls["formatting"][0], strict=True)],
                              dtype=torch.float32)  # [8, 2], TRL's row order
    assert torch.isnan(objectives).sum() == 1 and objectives.shape == (2 * NUM_GENERATIONS, 2)
    group_ids = torch.arange(objectives.shape[0]) // NUM_GENERATIONS  # TRL's contiguous groups
    ours = normalize_then_sum(objectives, WEIGHTS, group_ids)
    torch.testing.assert_close(ours.double(), theirs, atol=1e-5, rtol=0)
    assert theirs.abs().min() > 0.01  # a real signal on every row, the one with a missing component included
