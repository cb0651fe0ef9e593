"""One table of metric names for every app: the same quantity has the same name in metrics.csv,
the trackers and the console, whichever app logged it.

`METRIC_NAMES` maps a name (or a family: `<component>`, `<phase>` stand for one path segment) to
what it means; docs/metrics.md shows it. `unknown_metric_names(columns)` returns the columns no
entry covers: each app's tests call it on a real run's metrics.csv, so a new metric is added
here before an app logs it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

__all__ = ["METRIC_NAMES", "unknown_metric_names"]

METRIC_NAMES: dict[str, str] = {
    # the loop
    "step": "the optimizer-step cycle the row belongs to (rollout, reward, update); eval-only rows before training are step 0",
    "skipped": "1 when the step made no update (the reward service failed after its retries, no rollout anywhere), else 0",
    "error": "why the step was skipped",
    "time/<phase>": "seconds in a phase: rollout, reward, advantages, update, eval, checkpoint, step, and a recipe's own (logprob, weight_gather, ...); the rollout engine's: rollout_wake and rollout_sleep (inside rollout), weight_sync (a weight push into the engine), weight_publish (an asynchronous run's copy of each version); asynchronous runs: rollout (on the rollout thread, overlapped), rollout_wait (the trainer waiting for it), prepare; several processes: rank_wait (waiting for the other processes' samples before the reward)",
    "time/<phase>/<phase>": "seconds in a phase inside an eval (time/eval/rollout)",
    "time_max/<phase>": "several processes: the most seconds any process spent in a phase (rollout, rollout_wait, prepare, rank_wait, reward, advantages, logprob, update, weight_sync, weight_gather); time/<phase> is rank 0's",
    "compile/graphs": "graphs torch.compile built during the step, most on any process (a compile or a recompile: with a slow step, see TORCH_LOGS=recompiles); time/compile: the seconds spent building them, inside the phase that triggered it",
    "memory/<phase>_peak_gib": "peak CUDA memory allocated during a phase (GiB)",
    "memory/<phase>/<phase>_peak_gib": "the same for a phase inside an eval",
    "throughput/samples_per_s": "samples of all processes per second of step time",
    "throughput/tokens_per_s": "prompt + completion tokens per second per process (text apps)",
    "world_size": "number of training processes",
    "eval/<metric>": "a metric of the held-out evaluation (eval/reward/mean, eval/reward/<component>, ...)",
    "eval/<metric>/<component>": "a component of a held-out metric (eval/reward/qa)",
    "eval/judge/<name>/<metric>": "a judge's counter on the held-out evaluation (eval/judge/<name>/scored)",
    # rewards and advantages (rl_core.train.group_advantages, every process)
    "reward/mean": "mean reward of the samples that scored",
    "reward/std": "standard deviation (n - 1) of those rewards",
    "reward/failed": "samples whose reward failed (left out of the statistics, advantage 0)",
    "reward/<component>": "mean unweighted value of one reward component",
    "reward/zero_std_group_fraction": "fraction of groups whose samples all scored the same (no signal)",
    "dynamic_sampling/rounds": "rollout rounds the step ran (dynamic sampling; 1 = no extra round)",
    "dynamic_sampling/kept_groups": "informative groups trained on (their samples did not all score the same)",
    "dynamic_sampling/dropped_groups": "groups generated but not trained on (uniform, or beyond the batch)",
    "dynamic_sampling/filled_groups": "uniform groups trained on to fill a batch still short after max_rounds",
    "dynamic_sampling/metric_mean": "mean of the filter's metric over every sample generated in the step",
    "adv/mean": "mean advantage of the samples that entered the statistics",
    "adv/std": "their standard deviation",
    "adv/min": "their smallest advantage",
    "adv/max": "their largest advantage",
    "adv/small_groups": "groups left with fewer than 2 valid samples (no baseline: advantage 0)",
    "adv/kept_fraction": "fraction of samples that entered the statistics",
    "adv/trained_samples": "samples trained on (image apps: zero-advantage samples may be dropped)",
    # the update
    "loss/policy": "policy-gradient loss per optimizer step",
    "loss/kl": "KL-to-reference loss per optimizer step (before its coefficient)",
    "loss/total": "the loss that was back-propagated",
    "policy/clip_fraction": "fraction of trained units whose ratio was clipped",
    "policy/approx_kl": "mean (ratio - 1) - log ratio, the KL between the sampling and the updated policy",
    "policy/ratio_mean": "mean importance ratio",
    "policy/ratio_max": "largest importance ratio",
    "policy/ratio_min": "smallest importance ratio (image apps: rl_core.train.replay_update)",
    "policy/entropy": "mean token entropy of the policy on its samples",
    "policy/off_policy_masked": "fraction of trained tokens dropped by the off-policy sequence mask (DeepSeek-V3.2)",
    "policy/is_ratio_mean": "mean rollout-correction weight (trainer / engine probability, bounded)",
    "policy/is_ratio_min": "the smallest rollout-correction weight",
    "policy/is_ratio_max": "the largest rollout-correction weight",
    "policy/is_masked": "fraction of trained tokens whose rollout-correction weight is 0",
    "grad_norm": "gradient norm before clipping, mean over the step's optimizer steps",
    "optimizer_steps": "optimizer steps taken in the step",
    "nonfinite/skipped_steps": "optimizer steps skipped for a non-finite loss or gradient",
    "lr": "learning rate after the step",
    "replay/engine_diff_mean": "mean |rollout engine log-prob - trainer log-prob| on the first replay; a rescored update (FP8 rollouts): over every trained unit, against the trainer's rescore before the first optimizer step",
    "replay/engine_diff_max": "the largest such difference",
    "replay/engine_kl": "KL(engine || trainer) on the first replay, the k3 estimate mean(r - 1 - log r), r = trainer / engine probability",
    "replay/steps_per_batch": "denoising steps replayed per sampled batch (diffusion: its SDE window; Janus with a window: image tokens trained)",
    "replay/first_step": "the earliest denoising step replayed (Janus with a window: token position trained)",
    "replay/last_step": "the latest denoising step replayed (Janus with a window: token position trained)",
    "nft/positive_loss": "DiffusionNFT: mean adaptive-weighted x0 error of the implicit positive policy (rl_core.flow.compute_nft_loss)",
    "nft/negative_loss": "DiffusionNFT: the same for the implicit negative policy",
    "nft/old_deviation": "DiffusionNFT: mean squared difference between the trained and the old policy's velocity",
    "nft/old_decay": "DiffusionNFT: the share of the old policy kept when it moved towards the trained one after the step",
    "dpo/margin": "Diffusion-DPO: mean over pairs of (policy - reference velocity error) on the chosen minus the same on the rejected (rl_core.flow.compute_flow_dpo_loss); below 0 prefers the chosen",
    "dpo/accuracy": "Diffusion-DPO: the share of pairs whose margin is below 0",
    "dpo/chosen_error": "Diffusion-DPO: the policy's mean velocity error on the chosen images or videos",
    "dpo/rejected_error": "Diffusion-DPO: the same on the rejected ones",
    # rollouts
    "rollout/weight_version": "optimizer steps in the weights the step's rollouts were sampled with",
    "rollout/staleness": "asynchronous runs: steps between the weights that sampled the step's rollouts and the trainer's (at most train.max_staleness; with dynamic sampling the oldest kept round's, further rounds being 0)",
    "rollout/token_staleness_max": "partial rollouts: optimizer steps between the weights that sampled the step's oldest token and the trained weights (train.partial_rollouts)",
    "rollout/token_staleness_mean": "partial rollouts: the same, averaged over the step's tokens",
    "rollout/dropped_long": "prompts dropped for exceeding the prompt length limit",
    "response/length_mean": "mean completion length (tokens)",
    "response/length_max": "longest completion (tokens)",
    "response/truncation_rate": "fraction of completions cut at the length limit",
    "response/placeholder_rows": "completions that sampled a vision placeholder token (left out of the update)",
    "data/skipped_records": "records skipped as malformed or unusable so far (file and line in the log)",
    "image/brightness": "mean grey level of the step's images in [0, 1] (reward-hacking watch)",
    "image/colour_entropy": "mean colour entropy of the step's images in bits (reward-hacking watch)",
    # rider-grm's judges and memory plan
    "judge/<name>/scored": "samples sent to a judge",
    "judge/<name>/parse_failures": "judge outputs that did not parse (scored by the judge's fallback)",
    "judge/<name>/request_failures": "samples of requests to a served judge that failed as a whole",
    "check/policy_awake_during_<name>": "times the policy engine was awake while a judge scored (0 when swapping)",
    "check/judges_awake_during_rollout": "judge engines awake while the policy generated (0 when swapping)",
    "swap/offload_policy": "1 when the policy leaves the GPU while the judges score",
    "swap/sleep_judges": "1 when each judge sleeps after scoring",
}


def _pattern(name: str) -> re.Pattern[str]:
    parts = re.split(r"(<[a-z]+>)", name)
    return re.compile("".join("[^/]+" if p.startswith("<") else re.escape(p) for p in parts) + r"\Z")


_PATTERNS = [_pattern(name) for name in METRIC_NAMES]


def unknown_metric_names(columns: Iterable[str]) -> list[str]:
    """The columns (metric names) that no entry of `METRIC_NAMES` covers."""
    return [c for c in columns if not any(p.match(c) for p in _PATTERNS)]
