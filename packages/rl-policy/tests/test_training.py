"""The token update (`rl_policy.training`) on the tiny Qwen3, on rollouts the hf engine really
sampled through the policy engine layer: accumulation over micro-batches equals one batch, the
on-policy path (old log-probs from the update's own forward) equals the replayed one, the
first-replay check stops a mismatched engine before any weight changes, a failed sample
trains nothing, and 2 processes equal 1 process with twice the rollouts (pinned)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator

from rl_core.train import NonFiniteGuard
from rl_models import tiny
from rl_models.text import load_causal_lm
from rl_policy.engine import build_policy_engine
from rl_policy.training import (
    LossOptions,
    Policy,
    Rollout,
    by_length,
    rollout_logprobs,
    token_update,
)
from rl_rollout import SamplingParams
from rl_rollout.prompts import EncodedPrompt

PROMPTS = [[{"role": "user", "content": "Name a colour."}], [{"role": "user", "content": "Count to three."}]]
ADVANTAGES = [1.0, -1.0, 0.5, 0.25]  # one per rollout (2 prompts x 2 samples)
SCRIPT = Path(__file__).with_name("mp_token_update_script.py")


def sample(seed: int = 0) -> list[Rollout]:
    """4 rollouts of the tiny Qwen3 (float32), sampled by its hf engine through the policy layer."""
    model, tokenizer = load_causal_lm(str(tiny.build("qwen3")), dtype="float32")
    engine = build_policy_engine("hf", model=model, processor=tokenizer, path="", dtype="float32",
                                 device=torch.device("cpu"), seed=0, compile=False)
    with engine.session() as sampler:
        gens = sampler.generate(PROMPTS, SamplingParams(n=2, max_new_tokens=6, seed=seed))
    return [Rollout(EncodedPrompt(g.prompt_ids), g.completion_ids, g.logprobs, valid=True) for g in gens]


def update(rollouts: list[Rollout], *, micro: int, replay: bool = False, tolerance: float | None = 1e-4,
           valid: list[bool] | None = None, advantages: list[float] = ADVANTAGES,
           options: LossOptions = LossOptions()) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    """One token_update (one optimizer step) on a fresh tiny Qwen3; returns its metrics and weights."""
    torch.manual_seed(0)
    acc = Accelerator(cpu=True)
    model, _ = load_causal_lm(str(tiny.build("qwen3")), dtype="float32")
    policy = Policy(model)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    policy, optimizer = acc.prepare(policy, optimizer)
    if valid is not None:
        rollouts = [Rollout(r.prompt, r.completion_ids, r.engine_logprobs, ok) for r, ok in zip(rollouts, valid, strict=True)]
    old = rollout_logprobs(acc.unwrap_model(policy), rollouts, micro_batch_size=micro, temperature=1.0, pad_id=0,
                           device=acc.device) if replay else None
    metrics = token_update(acc, policy, optimizer, rollouts, [torch.full((len(r.completion_ids),), a)
                                                              for r, a in zip(rollouts, advantages, strict=True)],
                           options=options, old=old, ref=None, num_minibatches=1, micro_batch_size=micro,
                           ppo_epochs=1, grad_clip=1.0, guard=NonFiniteGuard(), pad_id=0, check_tolerance=tolerance)
    weights = {k: v.detach().clone() for k, v in acc.unwrap_model(policy).model.state_dict().items()}
    return metrics, weights


def moved(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.fixture(scope="module")
def rollouts() -> list[Rollout]:
    return sample()


@pytest.fixture(scope="module")
def one_batch(rollouts: list[Rollout]) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    return update(rollouts, micro=4)


# one optimizer step on the 4 rollouts of 6 tokens, one process (pinned on the 2-core CPU). By hand:
# on-policy, every ratio is 1, so the token-mean loss is -(1 - 1 + 0.5 + 0.25) x 6 / 24 = -0.1875
PINNED = {"loss/policy": -0.1875, "grad_norm": 1.381696, "policy/entropy": 6.454838}


def test_one_step_is_pinned_and_moves_the_weights(rollouts, one_batch) -> None:
    metrics, weights = one_batch
    assert [len(r.completion_ids) for r in rollouts] == [6, 6, 6, 6]
    start = {k: v for k, v in load_causal_lm(str(tiny.build("qwen3")), dtype="float32")[0].state_dict().items()}
    assert moved(weights, start) > 5e-4  # AdamW's first step moves elements by ~lr
    for key, value in PINNED.items():
        assert metrics[key] == pytest.approx(value, abs=1e-4), (key, metrics[key])
    assert metrics["replay/engine_diff_mean"] < 1e-4 and metrics["optimizer_steps"] == 1.0


def test_accumulated_micro_batches_equal_one_batch(rollouts, one_batch) -> None:
    metrics, weights = update(rollouts, micro=1)
    # AdamW's first step is lr x g / (|g| + eps) for each element: where a gradient is ~1e-8, the
    # last-bit difference between 4 micro-batch sums and one batch's moves it by up to ~1% of
    # lr = 1e-3 (3.0e-6 on one 2-core CI machine, < 2e-6 on another). A micro-batch missed or
    # counted twice turns elements' steps around: differences of order lr (one of the 4 rollouts
    # left out: 2.0e-3).
    assert moved(weights, one_batch[1]) < 1e-5
    assert metrics["loss/policy"] == pytest.approx(one_batch[0]["loss/policy"], abs=1e-6)


def cut(rollouts: list[Rollout], lengths: list[int]) -> list[Rollout]:
    """The rollouts with their completions cut to `lengths` (a spread of lengths, as a long tail gives)."""
    return [Rollout(r.prompt, r.completion_ids[:n], r.engine_logprobs[:n], valid=True)
            for r, n in zip(rollouts, lengths, strict=True)]


def test_micro_batches_of_alike_lengths_keep_the_order_and_the_update(rollouts) -> None:
    """Micro-batches take the rollouts by length (the 1- and 2-token ones together, then 5 and 6),
    so none pads a short completion to a long one; the log-probs come back in the rollouts' order,
    and the update equals one batch of all four."""
    spread = cut(rollouts, [6, 2, 5, 1])
    assert by_length(spread, range(4)) == [3, 1, 2, 0]
    model, _ = load_causal_lm(str(tiny.build("qwen3")), dtype="float32")
    alone = [rollout_logprobs(model, [r], micro_batch_size=1, temperature=1.0, pad_id=0,
                              device=torch.device("cpu"))[0] for r in spread]
    paired = rollout_logprobs(model, spread, micro_batch_size=2, temperature=1.0, pad_id=0, device=torch.device("cpu"))
    assert [len(x) for x in paired] == [6, 2, 5, 1]
    for a, b in zip(alone, paired, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    metrics, weights = update(spread, micro=2)
    whole_metrics, whole = update(spread, micro=4)
    assert moved(weights, whole) < 1e-5
    assert metrics["loss/policy"] == pytest.approx(whole_metrics["loss/policy"], abs=1e-6)


def test_on_policy_equals_the_replayed_old_logprobs(rollouts, one_batch) -> None:
    metrics, weights = update(rollouts, micro=4, replay=True)
    assert moved(weights, one_batch[1]) < 2.5e-4  # Adam's sign-like first step: float noise near eps
    assert metrics["grad_norm"] == pytest.approx(one_batch[0]["grad_norm"], rel=1e-4)


def test_a_mismatched_engine_stops_before_the_first_step(rollouts) -> None:
    bad = [Rollout(r.prompt, r.completion_ids, [lp - 0.1 for lp in r.engine_logprobs], True) for r in rollouts]
    with pytest.raises(RuntimeError, match=r"first replay: mean \|engine logp - trainer logp\| = 0.1"):
        update(bad, micro=4)


def test_a_failed_sample_trains_nothing(rollouts, one_batch) -> None:
    """An invalid rollout (failed reward) stays in the batch with weight 0: the same update as
    without it, the count of valid tokens excluding it."""
    _, with_invalid = update(rollouts, micro=2, valid=[True, True, True, False])
    _, without = update(rollouts[:3], micro=2, advantages=ADVANTAGES[:3])
    assert moved(with_invalid, without) < 2e-6


def shifted(rollouts: list[Rollout], row: int, shift: float) -> list[Rollout]:
    """The rollouts with row `row`'s engine log-probs moved by `shift` (an engine that disagrees)."""
    return [Rollout(r.prompt, r.completion_ids, [lp + shift for lp in r.engine_logprobs], r.valid) if i == row else r
            for i, r in enumerate(rollouts)]


def test_rollout_correction_token_mask_gives_mismatched_tokens_no_update(rollouts, one_batch) -> None:
    """Rollout 3's engine log-probs 5 below the trainer's: ratio trainer / engine = e^5 > 3, so
    token_mask zeroes its 6 tokens. The update equals one where rollout 3 has advantage 0 (its
    tokens still count in the token-mean divisor); the others keep weight ~1 (engine = trainer)."""
    bad = shifted(rollouts, 3, -5.0)
    masked, weights = update(bad, micro=2, tolerance=None, options=LossOptions(rollout_correction="token_mask"))
    zero_metrics, zero_adv = update(rollouts, micro=2, advantages=[*ADVANTAGES[:3], 0.0])
    assert moved(weights, zero_adv) < 2.5e-4  # Adam's sign-like first step: float noise near eps
    assert masked["grad_norm"] == pytest.approx(zero_metrics["grad_norm"], rel=1e-3)
    assert masked["grad_norm"] != pytest.approx(one_batch[0]["grad_norm"], rel=1e-2)  # rollout 3 did count before
    assert masked["policy/is_masked"] == pytest.approx(0.25)  # 6 of 24 tokens
    assert masked["policy/is_ratio_mean"] == pytest.approx(0.75, abs=1e-3)  # 18 tokens of weight ~1
    assert "policy/is_masked" not in one_batch[0] and "policy/off_policy_masked" not in one_batch[0]
    # without the correction the mismatched rollout trains at full weight
    _, uncorrected = update(bad, micro=2, tolerance=None)
    assert moved(uncorrected, weights) > 5e-4


def test_off_policy_mask_drops_a_negative_sequence_the_engine_rated_higher(rollouts) -> None:
    """Rollout 1 (advantage -1) with engine log-probs 2 above the trainer's: mean gap 2 > 0.5, dropped."""
    options = LossOptions(off_policy_mask=0.5)
    dropped, weights = update(shifted(rollouts, 1, 2.0), micro=4, tolerance=None, options=options)
    zero_metrics, zero_adv = update(rollouts, micro=4, advantages=[1.0, 0.0, 0.5, 0.25])
    assert moved(weights, zero_adv) < 2.5e-4
    assert dropped["grad_norm"] == pytest.approx(zero_metrics["grad_norm"], rel=1e-5)
    assert dropped["policy/off_policy_masked"] == pytest.approx(0.25)
    # a positive advantage is never dropped: rollout 0 shifted the same way trains as usual
    kept, _ = update(shifted(rollouts, 0, 2.0), micro=4, tolerance=None, options=options)
    assert kept["policy/off_policy_masked"] == 0.0


def test_loss_options_reach_the_loss(rollouts, one_batch) -> None:
    # on-policy (ratio 1) sapo's gradient is -A per token, as ppo_clip's: the same update
    _, weights = update(rollouts, micro=4, options=LossOptions("sapo", loss_options={"tau_pos": 2.0}))
    assert moved(weights, one_batch[1]) < 2.5e-4
    with pytest.raises(ValueError, match="tau_neg must be > 0"):
        update(rollouts, micro=4, options=LossOptions("sapo", loss_options={"tau_neg": 0.0}))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_equal_one_process_with_twice_the_rollouts(rollouts, one_batch, tmp_path: Path) -> None:
    torch.save(rollouts, tmp_path / "rollouts.pt")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(SCRIPT.parent),
           "RL_MODELS_CACHE": str(tmp_path / "empty-cache")}  # the ranks build the checkpoint, as a first run does
    done = subprocess.run(
        [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", "--num_machines",
         "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(_free_port()),
         str(SCRIPT), str(tmp_path)], capture_output=True, text=True, env=env, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    two = torch.load(tmp_path / "result.pt", weights_only=False)
    assert moved(two["weights"], one_batch[1]) < 5e-6
    for key in ("grad_norm", "policy/entropy", "loss/policy", "replay/engine_diff_mean"):
        assert two["metrics"][key] == pytest.approx(one_batch[0][key], abs=1e-5), key
