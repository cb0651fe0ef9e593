# ruff: noqa: E402  (imports follow the importorskip of the optional framework)
"""Our policy losses against TRL 1.16's own loss code, run inside a real `trl.GRPOTrainer` built on
the CPU around the tiny qwen3 (`rl_models.tiny`), one trainer per configuration.

Losses: TRL's `_compute_loss(model, inputs)` runs with the trainer's log-prob forward replaced by
one that returns a fixed `logp` tensor (requires_grad) and zero entropies, so TRL's loss and ours
see the same log-probs; the loss values and the gradients w.r.t. `logp` must agree. Pairs:
`dapo` (clip-higher) = `ppo_clip` + `token-mean`, `cispo` (`epsilon_high=E`) = `cispo` with
`clip_high=E - 1, clip_low=1` + `token-mean`, `sapo` = `sapo` + `seq-mean-token-mean`, `dr_grpo`
= `ppo_clip` + `seq-mean-token-sum-norm` with `norm_length=max_completion_length`, and TRL's
`off_policy_mask_threshold` (with `sampling_per_token_logps`) = our `off_policy_mask`.

Rollout correction: TRL computes `importance_sampling_ratio` inline in
`_generate_and_score_completions`, only when vLLM generates. The trainer is built without vLLM,
then told it uses it (`use_vllm` and the `vllm_importance_sampling_*` attributes that method
reads), its `_generate` returns fixed completions with the engine log-probs, and its log-prob
forward returns the trainer's `old_logp`: TRL's own code then computes the ratio, which must equal
`rollout_correction`; fed back into TRL's `_compute_loss`, the loss must equal ours with
`is_weights`.
"""

from __future__ import annotations

import math
from types import MethodType

import pytest

torch = pytest.importorskip("torch")
trl = pytest.importorskip("trl")
from datasets import Dataset

from rl_core.losses import compute_policy_loss, rollout_correction

pytestmark = [pytest.mark.third_party, pytest.mark.filterwarnings("ignore::DeprecationWarning"),
              pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.filterwarnings("ignore::FutureWarning")]

B, T, P, MAX_LEN = 4, 5, 3, 8  # rollouts (2 prompts x 2), completion width, prompt length, max_completion_length
LENGTHS = [5, 3, 4, 2]  # valid completion tokens per row (no empty row: TRL's "grpo" mean counts those too)
ADV = [1.0, -0.5, 0.8, -1.2]  # one advantage per sequence


def reward_len(completions, **kwargs):
    return [float(len(c)) for c in completions]


def make_trainer(tmp_path_factory, **options) -> trl.GRPOTrainer:
    from rl_models.tiny import build

    config = trl.GRPOConfig(
        output_dir=str(tmp_path_factory.mktemp("trl")), per_device_train_batch_size=B, num_generations=2,
        max_completion_length=MAX_LEN, beta=0.0, report_to=[], save_strategy="no", use_cpu=True, seed=0, **options,
    )
    dataset = Dataset.from_dict({"prompt": ["Describe a cat.", "Describe a dog."]})
    trainer = trl.GRPOTrainer(model=str(build("qwen3")), reward_funcs=[reward_len], args=config,
                              train_dataset=dataset)
    trainer.model.train()  # "train" mode: TRL divides by the accumulation steps, 1 here
    trainer.current_gradient_accumulation_steps = 1
    assert trainer.args.steps_per_generation == 1 and trainer.accelerator.num_processes == 1
    return trainer


def tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    """logp, old_logp (ratios from about e^-.6 to e^.6, so both clips bite), mask, advantages [B, T]."""
    gen = torch.Generator().manual_seed(seed)
    logp = -3 * torch.rand(B, T, generator=gen, dtype=torch.float64) - 0.05  # [B, T]
    old = logp + 1.2 * (torch.rand(B, T, generator=gen, dtype=torch.float64) - 0.5)  # [B, T]
    mask = (torch.arange(T)[None, :] < torch.tensor(LENGTHS)[:, None]).long()  # [B, T]
    return {"logp": logp, "old": old, "mask": mask, "adv": torch.tensor(ADV, dtype=torch.float64)}


def trl_loss(trainer: trl.GRPOTrainer, data: dict[str, torch.Tensor], **extra) -> tuple[float, torch.Tensor]:
    """TRL's `_compute_loss` on `data["logp"]`: its value and gradient w.r.t. logp."""
    logp = data["logp"].clone().requires_grad_(True)

    def fixed_logps(self, model, input_ids, attention_mask, logits_to_keep, **kwargs):
        assert logits_to_keep == T
        return logp, torch.zeros_like(logp), None

    trainer._get_per_token_logps_and_entropies = MethodType(fixed_logps, trainer)
    inputs = {
        "prompt_ids": torch.ones(B, P, dtype=torch.long), "prompt_mask": torch.ones(B, P, dtype=torch.long),
        "completion_ids": torch.ones(B, T, dtype=torch.long), "completion_mask": data["mask"],
        "advantages": data["adv"], "old_per_token_logps": data["old"],
        "num_items_in_batch": data["mask"].sum(), **extra,
    }
    loss = trainer._compute_loss(trainer.model, inputs)
    loss.backward()
    return float(loss.detach()), logp.grad


def our_loss(name: str, data: dict[str, torch.Tensor], **kwargs) -> tuple[float, torch.Tensor]:
    logp = data["logp"].clone().requires_grad_(True)
    loss, _ = compute_policy_loss(name, logp=logp, old_logp=data["old"], advantages=data["adv"][:, None].expand(B, T),
                                  mask=data["mask"], **kwargs)
    loss.backward()
    return float(loss.detach()), logp.grad


def assert_same(trl_result: tuple[float, torch.Tensor], ours: tuple[float, torch.Tensor]) -> None:
    # float64 inputs, but TRL's SAPO temperatures are float32 (`torch.where` of Python floats: 1.05
    # is off by 5e-8), so agreement is to about 1e-7 of terms of order 1
    rel, tol = (1e-6, 1e-7) if ours[1].dtype == torch.float64 else (1e-5, 1e-6)
    assert ours[0] == pytest.approx(trl_result[0], rel=rel, abs=tol)
    torch.testing.assert_close(ours[1], trl_result[1], rtol=rel, atol=tol)
    assert ours[1].abs().sum() > 0


@pytest.fixture(scope="module")
def trainers(tmp_path_factory):
    """One real GRPOTrainer per configuration, built on first use."""
    made: dict[str, trl.GRPOTrainer] = {}
    configs = {
        "dapo": {"loss_type": "dapo", "epsilon": 0.2, "epsilon_high": 0.28},
        "cispo": {"loss_type": "cispo", "epsilon_high": 1.3},
        "sapo": {"loss_type": "sapo", "sapo_temperature_pos": 1.0, "sapo_temperature_neg": 1.05},
        "dr_grpo": {"loss_type": "dr_grpo", "epsilon": 0.2},
        "dapo_opsm": {"loss_type": "dapo", "epsilon": 0.2, "epsilon_high": 0.28, "off_policy_mask_threshold": 0.5},
    }

    def get(key: str) -> trl.GRPOTrainer:
        if key not in made:
            made[key] = make_trainer(tmp_path_factory, **configs[key])
        return made[key]

    return get


def test_dapo_equals_ppo_clip_token_mean(trainers) -> None:
    data = tensors()
    ratio = torch.exp(data["logp"] - data["old"])[data["mask"].bool()]
    assert (ratio > 1.28).any() and (ratio < 0.8).any()  # both bounds are exercised
    ours = our_loss("ppo_clip", data, agg="token-mean", clip_low=0.2, clip_high=0.28, num_valid=data["mask"].sum())
    assert_same(trl_loss(trainers("dapo"), data), ours)


def test_cispo_equals_trl_cispo(trainers) -> None:
    # TRL clamps the ratio to epsilon_high = 1.3 from above only: clip_high = .3, clip_low = 1
    data = tensors(1)
    assert (torch.exp(data["logp"] - data["old"])[data["mask"].bool()] > 1.3).any()
    ours = our_loss("cispo", data, agg="token-mean", clip_low=1.0, clip_high=0.3, num_valid=data["mask"].sum())
    assert_same(trl_loss(trainers("cispo"), data), ours)


def test_sapo_equals_trl_sapo(trainers) -> None:
    data = tensors(2)
    ours = our_loss("sapo", data, agg="seq-mean-token-mean", tau_pos=1.0, tau_neg=1.05)
    assert_same(trl_loss(trainers("sapo"), data), ours)


def test_dr_grpo_equals_ppo_clip_seq_mean_token_sum_norm(trainers) -> None:
    data = tensors(3)
    ours = our_loss("ppo_clip", data, agg="seq-mean-token-sum-norm", norm_length=MAX_LEN)
    assert_same(trl_loss(trainers("dr_grpo"), data), ours)


def test_off_policy_mask_equals_trl_off_policy_mask_threshold(trainers) -> None:
    # engine log-probs above the trainer's by .9 (rows 0, 1), .2 (row 2), .3 (row 3); a NaN on one of
    # row 1's 3 valid tokens counts 0: mean .6 > .5 with A < 0, so row 1 (only) is dropped
    data = tensors(4)
    sampling = data["logp"] + torch.tensor([0.9, 0.9, 0.2, 0.3], dtype=torch.float64)[:, None]  # [B, T]
    sampling[1, 1] = math.nan
    trl_result = trl_loss(trainers("dapo_opsm"), data, sampling_per_token_logps=sampling)
    n = data["mask"].sum()
    ours = our_loss("ppo_clip", data, agg="token-mean", clip_low=0.2, clip_high=0.28, num_valid=n,
                    off_policy_mask=0.5, sampling_logp=sampling)
    assert_same(trl_result, ours)
    assert (ours[1][1] == 0).all() and (ours[1][0] != 0).any()  # row 1 dropped, row 0 (A > 0) kept
    unmasked = our_loss("ppo_clip", data, agg="token-mean", clip_low=0.2, clip_high=0.28, num_valid=n)
    assert unmasked[0] != pytest.approx(ours[0])


IS_CASES = [
    ("token_truncate", None, 3.0),
    ("token_truncate", 0.5, 1.5),
    ("token_mask", None, 3.0),
    ("token_mask", 0.5, 2.0),  # IcePop-style two-sided token mask
    ("sequence_truncate", None, 3.0),
    ("sequence_truncate", 0.8, 1.2),
    ("sequence_mask", None, 3.0),
    ("sequence_mask", 0.5, 1.5),
    ("sequence_mask", 1.1, None),
]


@pytest.mark.parametrize(("mode", "clip_min", "clip_max"), IS_CASES)
def test_rollout_correction_equals_trl_importance_sampling_ratio(trainers, mode, clip_min, clip_max) -> None:
    trainer = trainers("dapo")
    gen = torch.Generator().manual_seed(5)
    old = -3 * torch.rand(B, T, generator=gen) - 0.05  # [B, T] the trainer's log-probs (float32 as TRL's)
    sampling = old + torch.tensor([0.9, -0.05, 0.3, -1.5])[:, None] * torch.rand(B, T, generator=gen)  # [B, T]
    sampling[0, 1] = math.nan  # a token the engine could not score
    rows = [sampling[i, :n].tolist() for i, n in enumerate(LENGTHS)]

    def generate(self, prompts):
        completion_ids = [[5 + j for j in range(n)] for n in LENGTHS]
        return ([[1, 2, 3]] * B, completion_ids, None, ["x" * n for n in LENGTHS], rows, {}, None, [])

    def trainer_logps(self, model, input_ids, attention_mask, logits_to_keep, **kwargs):
        return old[:, :logits_to_keep].clone(), None, None

    trainer._generate = MethodType(generate, trainer)
    trainer._get_per_token_logps_and_entropies = MethodType(trainer_logps, trainer)
    trainer.use_vllm = trainer.vllm_importance_sampling_correction = True
    trainer.vllm_importance_sampling_mode = mode
    trainer.vllm_importance_sampling_clip_min, trainer.vllm_importance_sampling_clip_max = clip_min, clip_max
    try:
        out = trainer._generate_and_score_completions([{"prompt": "Describe a cat."}, {"prompt": "Describe a cat."},
                                                       {"prompt": "Describe a dog."}, {"prompt": "Describe a dog."}])
    finally:
        trainer.use_vllm = False
    mask = out["completion_mask"]
    ours = rollout_correction(mode, old_logp=out["old_per_token_logps"], sampling_logp=out["sampling_per_token_logps"],
                              mask=mask, clip_min=clip_min, clip_max=clip_max)  # [B, T]
    theirs = out["importance_sampling_ratio"].expand(B, T)  # [B, 1] for the sequence modes
    assert ours.shape == theirs.shape == (B, T)
    torch.testing.assert_close(ours, theirs)
    raw = rollout_correction(mode.replace("mask", "truncate"), old_logp=out["old_per_token_logps"],
                             sampling_logp=out["sampling_per_token_logps"], mask=mask, clip_max=None)
    assert not torch.equal(ours, raw)  # the bounds bite in every case
    # TRL's loss with its own ratio equals ours with is_weights (the ratio weights a fixed logp)
    data = {"logp": out["old_per_token_logps"] + 0.1, "old": out["old_per_token_logps"], "mask": mask,
            "adv": out["advantages"]}
    trainer.use_vllm = True
    try:
        trl_result = trl_loss(trainer, data, importance_sampling_ratio=out["importance_sampling_ratio"])
    finally:
        trainer.use_vllm = False
    assert_same(trl_result, our_loss("ppo_clip", data, agg="token-mean", clip_low=0.2, clip_high=0.28,
                                     num_valid=mask.sum(), is_weights=ours))
