"""The stochastic flow-matching step of Flow-GRPO, with its log-probability, and the step KL.

Flow matching interpolates `x_t = (1 - t) x_0 + t eps`; sampling runs from `t = sigma = 1`
(noise) towards 0 with `dt = sigma_next - sigma < 0` and a predicted velocity `v`. GRPO needs a
stochastic policy, so the ODE step is replaced by an SDE step with the same marginals, whose
transition is Gaussian, `x' ~ N(mean, std_step^2)`, with a log-probability:

- `kind="sde"` (Flow-GRPO, Liu et al. 2025, `sde_step_with_logprob`): with noise level `a`
  (0.7 in Flow-GRPO), `sigma_t = a * sqrt(sigma / (1 - sigma))` (at `sigma = 1`, `1 - sigma`
  is replaced by `1 - sigma_next`, the scheduler's first step),
  `mean = x (1 + sigma_t^2 dt / (2 sigma)) + v (1 + sigma_t^2 (1 - sigma) / (2 sigma)) dt`,
  `std_step = sigma_t sqrt(-dt)`.
- `kind="cps"` (coefficients-preserving sampling, Wang & Yu 2025, "Flow-CPS"): with
  `sigma_t = sigma_next sin(a pi / 2)` (the paper recommends `a = 0.8`: pass
  `noise_level=0.8`), `mean = (1 - sigma_next)(x - sigma v) + sqrt(sigma_next^2 - sigma_t^2)
  (x + (1 - sigma) v)`, `std_step = sigma_t`. It keeps the noise level of `x'` equal to the
  scheduler's, so late steps stay sharp.

`log_prob` is the Gaussian log density of `x'` under `(mean, std_step)`, averaged (not summed)
over all non-batch dimensions, computed in float32. For `cps` Flow-GRPO's code keeps only
`-(x' - mean)^2` (no `1 / (2 std^2)`, no constants); we keep the true density for both kinds, so
the importance ratio is the real likelihood ratio (clip ranges tuned on Flow-GRPO's cps
surrogate do not carry over 1:1). A step with zero noise (`noise_level=0`, or the last `cps`
step where `sigma_next = 0`) is deterministic: `next_latents = mean` and `log_prob = 0`.

Replay: pass the stored `next_latents` and the step scores that sample instead of drawing one.
The same float32 function is used for rollout and replay, so the first on-policy replay gives
ratio exactly 1 (store `next_latents` as returned, in float32).

DiffusionNFT (Zheng et al. 2025, arXiv 2509.16117) needs no step log-probability: it trains on
the *forward* process of the clean samples (`flow_noise`), with `compute_nft_loss`,
`compute_nft_optimality` and the old policy's schedule `compute_nft_decay`. Diffusion-DPO
(Wallace et al. 2023) trains on preference pairs the same way, offline (`compute_flow_dpo_loss`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "SDEStep",
    "compute_flow_dpo_loss",
    "compute_nft_decay",
    "compute_nft_loss",
    "compute_nft_optimality",
    "compute_ratio_guard",
    "compute_sde_window",
    "flow_kl",
    "flow_noise",
    "host_randn",
    "sde_step",
    "velocity_errors",
]

_LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


@dataclass(frozen=True)
class SDEStep:
    """One stochastic sampling step; all float32.

    - `next_latents` `[B, ...]`: the drawn (or replayed) sample `x'`.
    - `log_prob` `[B]`: Gaussian log density of `x'`, mean over non-batch dims.
    - `mean` `[B, ...]`: the transition mean (carries the gradient of `velocity`).
    - `std` `[B]`: Flow-GRPO's `std_dev_t` (`sigma_t` above). The per-element std of `x'` is
      `std * sqrt(-dt)` for `sde` and `std` for `cps`; `flow_kl` takes it with `dt` accordingly.
    """

    next_latents: Tensor
    log_prob: Tensor
    mean: Tensor
    std: Tensor


def _per_sample(value: float | Tensor, batch: int, device: torch.device, name: str) -> Tensor:
    """A python number, 0-dim or `[B]` tensor as a float32 `[B]` tensor."""
    if isinstance(value, (int, float)):
        # a fill on the device, not a host-to-device copy (which waits for the device)
        return torch.full((batch,), value, dtype=torch.float32, device=device)
    out = torch.as_tensor(value, dtype=torch.float32, device=device)
    if out.dim() == 0:
        return out.expand(batch)
    if out.shape != (batch,):
        raise ValueError(
            f"{name} must be a scalar or a [B]={batch} tensor, got shape {tuple(out.shape)}"
        )
    return out


def _noise(
    shape: torch.Size,
    device: torch.device,
    generator: torch.Generator | list[torch.Generator] | None,
) -> Tensor:
    """Standard normal noise `shape` in float32; one generator per sample when given a list.

    Noise from CPU generators goes through `host_randn`: the CPU draws it while the GPU still runs
    the step's forward, and the copy does not wait for the GPU."""
    if generator is None:
        return torch.randn(shape, device=device, dtype=torch.float32)
    if isinstance(generator, list):
        if len(generator) != shape[0]:
            raise ValueError(f"got {len(generator)} generators for a batch of {shape[0]}")
        if all(g.device.type == "cpu" for g in generator):
            return host_randn(shape, generator, device)
        rows = [torch.randn(shape[1:], generator=g, device=g.device, dtype=torch.float32) for g in generator]
        return torch.stack(rows).to(device)
    if generator.device.type == "cpu":
        return host_randn(shape, generator, device)
    return torch.randn(shape, generator=generator, device=generator.device, dtype=torch.float32).to(device)


def host_randn(
    shape: torch.Size | tuple[int, ...],
    generator: torch.Generator | list[torch.Generator],
    device: torch.device,
) -> Tensor:
    """Float32 normal noise `shape` from CPU generator(s) (a list: one per row, `shape[0]` of
    them) on `device`, equal to `torch.randn(shape, generator=g)` (per row with a list). For CUDA
    it is drawn into pinned memory and copied asynchronously (the caching host allocator keeps the
    buffer until the copy is done): a pageable copy would wait for the GPU's queued work."""
    out = torch.empty(shape, dtype=torch.float32, pin_memory=device.type == "cuda")
    if isinstance(generator, list):
        for row, g in zip(out, generator, strict=True):  # row: a view of out
            torch.randn(row.shape, generator=g, out=row)
    else:
        torch.randn(shape, generator=generator, out=out)
    return out.to(device, non_blocking=device.type == "cuda")


def _sde_mean_std(
    x: Tensor, v: Tensor, sigma: Tensor, sigma_next: Tensor, a: float
) -> tuple[Tensor, Tensor, Tensor]:
    """Flow-GRPO's SDE: mean `[B, ...]`, sigma_t `[B, 1...]`, per-element step std `[B, 1...]`."""
    dt = sigma_next - sigma  # [B, 1...] negative
    one_minus = 1 - torch.where(sigma == 1, sigma_next, sigma)  # [B, 1...]
    sigma_t = torch.sqrt(sigma / one_minus) * a  # [B, 1...]
    mean = (
        x * (1 + sigma_t**2 / (2 * sigma) * dt)
        + v * (1 + sigma_t**2 * (1 - sigma) / (2 * sigma)) * dt
    )
    return mean, sigma_t, sigma_t * torch.sqrt(-dt)


def _cps_mean_std(
    x: Tensor, v: Tensor, sigma: Tensor, sigma_next: Tensor, a: float
) -> tuple[Tensor, Tensor, Tensor]:
    """Flow-CPS: mean `[B, ...]`, sigma_t `[B, 1...]` (also the per-element step std)."""
    sigma_t = sigma_next * math.sin(a * math.pi / 2)  # [B, 1...]
    x0 = x - sigma * v  # [B, ...] predicted clean sample
    x1 = x + (1 - sigma) * v  # [B, ...] predicted noise
    mean = x0 * (1 - sigma_next) + x1 * torch.sqrt((sigma_next**2 - sigma_t**2).clamp(min=0))
    return mean, sigma_t, sigma_t


def sde_step(
    *,
    velocity: Tensor,
    latents: Tensor,
    sigma: float | Tensor,
    sigma_next: float | Tensor,
    noise_level: float = 0.7,
    kind: str = "sde",
    next_latents: Tensor | None = None,
    generator: torch.Generator | list[torch.Generator] | None = None,
    mask: Tensor | None = None,
) -> SDEStep:
    """One stochastic step from `latents` (`x` at `sigma`) to `sigma_next`, with its log-prob.

    `velocity` and `latents` are `[B, ...]` in any float dtype (math is float32); `sigma` and
    `sigma_next` are scalars or `[B]` tensors with `0 <= sigma_next < sigma <= 1`. With
    `next_latents` the step scores that sample (replay) and draws nothing; otherwise it draws
    noise from `generator` (one `torch.Generator`, or a list with one per sample). `mask`
    (broadcastable to `[B, ...]`, 1 where an element counts): the log-prob is the mean over those
    elements only (video frames given to the sampler, which it holds, are left out).
    """
    if velocity.shape != latents.shape:
        raise ValueError(
            f"velocity {tuple(velocity.shape)} and latents {tuple(latents.shape)} differ in shape"
        )
    if next_latents is not None and next_latents.shape != latents.shape:
        raise ValueError(
            f"next_latents {tuple(next_latents.shape)} must match latents {tuple(latents.shape)}"
        )
    if noise_level < 0:
        raise ValueError(f"noise_level must be >= 0, got {noise_level}")
    batch, device = latents.shape[0], latents.device
    sig = _per_sample(sigma, batch, device, "sigma")  # [B]
    sig_next = _per_sample(sigma_next, batch, device, "sigma_next")  # [B]
    # python numbers are checked on the host (as the float32 the maths uses); tensors where they
    # are, which for accelerator tensors waits for the device
    host = isinstance(sigma, (int, float)) and isinstance(sigma_next, (int, float))
    checked = torch.tensor([[sigma], [sigma_next]], dtype=torch.float32) if host else torch.stack([sig, sig_next])
    s, s_next = checked[0], checked[1]  # [1] or [B]
    if bool(((s <= 0) | (s > 1) | (s_next < 0) | (s_next >= s)).any()):
        raise ValueError(
            f"need 0 <= sigma_next < sigma <= 1 (sampling runs from 1 to 0), got sigma={s.tolist()} "
            f"sigma_next={s_next.tolist()}"
        )
    view = (batch,) + (1,) * (latents.dim() - 1)
    x, v = latents.float(), velocity.float()  # [B, ...]
    if kind == "sde":
        mean, sigma_t, step_std = _sde_mean_std(
            x, v, sig.view(view), sig_next.view(view), noise_level
        )
    elif kind == "cps":
        mean, sigma_t, step_std = _cps_mean_std(
            x, v, sig.view(view), sig_next.view(view), noise_level
        )
    else:
        raise ValueError(f"kind must be 'sde' or 'cps', got {kind!r}")
    if next_latents is None:
        next_latents = mean.detach() + step_std * _noise(
            latents.shape, device, generator
        )  # [B, ...]
    sample = next_latents.detach().float()  # [B, ...]
    noisy = step_std > 0  # [B, 1...]
    safe_std = torch.where(noisy, step_std, torch.ones_like(step_std))  # [B, 1...]
    log_density = -((sample - mean) ** 2) / (2 * safe_std**2) - torch.log(safe_std) - _LOG_SQRT_2PI
    dims = tuple(range(1, latents.dim()))
    if mask is None:
        log_prob = log_density.mean(dim=dims)  # [B]
    else:
        weight = mask.to(log_density).expand_as(log_density)  # [B, ...]
        log_prob = (log_density * weight).sum(dim=dims) / weight.sum(dim=dims).clamp(min=1)  # [B]
    log_prob = torch.where(noisy.reshape(batch), log_prob, torch.zeros_like(log_prob))  # [B]
    return SDEStep(next_latents=sample, log_prob=log_prob, mean=mean, std=sigma_t.reshape(batch))


def flow_kl(
    mean: Tensor, ref_mean: Tensor, std: Tensor | float, dt: Tensor | float | None = None
) -> Tensor:
    """KL between the policy's and the reference's step Gaussians, `[B]`, as in Flow-GRPO.

    Both transitions share the std, so KL = `mean over non-batch dims of (mean - ref_mean)^2 /
    (2 s^2)` with `s` the per-element step std. Without `dt`, `s = std`: Flow-GRPO's
    `train_sd3.py` form (`/ (2 * std_dev_t**2)`), exact for `cps` steps and a `|dt|`-scaled
    approximation for `sde` steps. With `dt` (`sigma_next - sigma`, scalar or `[B]`),
    `s = std * sqrt(|dt|)`: the exact KL of `sde` steps, Flow-GRPO's `train_wan2_1.py` form.
    `std` is `SDEStep.std` (scalar, `[B]` or `[B, 1, ...]`). Flow-GRPO weights it by 0.04 (OCR).
    """
    if mean.shape != ref_mean.shape:
        raise ValueError(
            f"mean {tuple(mean.shape)} and ref_mean {tuple(ref_mean.shape)} differ in shape"
        )
    batch, device = mean.shape[0], mean.device
    sq = ((mean.float() - ref_mean.float()) ** 2).mean(dim=tuple(range(1, mean.dim())))  # [B]
    s = torch.as_tensor(std, dtype=torch.float32, device=device)
    s = s.reshape(batch) if s.dim() > 0 else s.expand(batch)  # [B]
    var = s**2  # [B]
    if dt is not None:
        var = var * _per_sample(dt, batch, device, "dt").abs()  # [B]
    return sq / (2 * var)


def compute_sde_window(
    mode: str,
    *,
    epoch: int,
    limit: int,
    size: int,
    start: int = 0,
    shift_interval: int = 1,
    stride: int = 1,
    generator: torch.Generator | None = None,
) -> tuple[int, int]:
    """The stochastic (trained) steps `[first, stop)` of one trajectory, inside `[start, limit)`.

    Steps outside the window are sampled with the deterministic ODE, so only the window's steps
    have a log-probability and are replayed: the update costs `size` forwards per sample instead
    of `limit`.

    - `fixed`: `[start, start + size)`, every epoch.
    - `random` (Flow-GRPO-Fast, `sde_window_size` / `sde_window_range`): the first step drawn
      uniformly from `start .. limit - size` with `generator`; pick it for the cheapest update
      that still sees every step over many trajectories.
    - `sliding` (MixGRPO's `progressive` strategy with `prog_overlap` and `roll_back`): the first
      step is `start + stride x j` with `j = (epoch // shift_interval) mod P`, `P` the number of
      first steps below `limit`, so the window moves from high noise to low every `shift_interval`
      epochs and rolls back to `start`; the last windows are cut at `limit`. Pick it to train the
      early (high-noise) steps first, as MixGRPO does.

    Example: `limit=8, size=4, stride=1, shift_interval=25`: epochs 0-24 train [0, 4), 25-49
    [1, 5), ..., epochs 175-199 train [7, 8), epoch 200 [0, 4) again.
    """
    if not 0 <= start < limit:
        raise ValueError(f"need 0 <= start < limit, got start={start} limit={limit}")
    if size < 1 or shift_interval < 1 or stride < 1:
        raise ValueError(f"size, shift_interval and stride must be >= 1, got {size}, {shift_interval}, {stride}")
    if mode == "fixed":
        return start, min(start + size, limit)
    if mode == "random":
        if start + size > limit:
            raise ValueError(f"a window of {size} steps does not fit in [{start}, {limit})")
        first = int(torch.randint(start, limit - size + 1, (1,), generator=generator))
        return first, first + size
    if mode == "sliding":
        positions = (limit - 1 - start) // stride + 1
        first = start + (epoch // shift_interval) % positions * stride
        return first, min(first + size, limit)
    raise ValueError(f"mode must be 'fixed', 'random' or 'sliding', got {mode!r}")


def compute_ratio_guard(
    *,
    logp: Tensor,
    old_logp: Tensor,
    mean: Tensor,
    old_mean: Tensor,
    step_std: Tensor | float,
    dt: Tensor | float,
) -> tuple[Tensor, Tensor]:
    """GRPO-Guard's RatioNorm (Wang et al. 2025, arXiv 2510.22319; `config.rationorm` of its
    `train_sd3_GRPO_Guard.py`): the log importance ratio of one SDE step re-centred and
    re-scaled, and the step's loss weight. Returns `(log_ratio [B], weight [B])`.

    With `x' = old_mean + s eps` (`s` = `step_std`, the per-element std `sigma_t sqrt(|dt|)` of an
    `sde` step), the per-element-mean log ratio is `-|mean - old_mean|^2 / (2 s^2) + eps .
    (mean - old_mean) / s`: its mean is negative and grows as `s` shrinks, so late (low-noise)
    steps sit below 1 and the clip lets them push the policy harder. RatioNorm adds the bias back
    and multiplies by `s`: `log_ratio = (logp - old_logp + |mean - old_mean|^2 / (2 s^2)) s`,
    which is `mean over elements of eps (mean - old_mean)` (zero mean, one scale for every step).
    The gradient re-weighting divides the step's policy loss by `|dt|` (`weight = 1 / |dt|`).

    Pick it to stop the implicit over-optimisation of Flow-GRPO on late steps. Inputs: `logp`,
    `old_logp` `[B]`; `mean`, `old_mean` `[B, ...]` (the rollout's transition mean); `step_std`
    and `dt` scalars or `[B]`. Upstream averages `sigma_t` and `sqrt(dt)` over the batch, which
    is the same when the batch's rows share the step (as here: a micro-batch replays one step).
    """
    if mean.shape != old_mean.shape:
        raise ValueError(f"mean {tuple(mean.shape)} and old_mean {tuple(old_mean.shape)} differ in shape")
    batch, device = mean.shape[0], mean.device
    s = _per_sample(step_std, batch, device, "step_std")  # [B]
    step = _per_sample(dt, batch, device, "dt").abs()  # [B]
    if bool((s <= 0).any() | (step <= 0).any()):
        raise ValueError("GRPO-Guard needs a stochastic step: step_std > 0 and dt != 0")
    bias = ((mean.float() - old_mean.float()) ** 2).mean(dim=tuple(range(1, mean.dim()))) / (2 * s**2)  # [B]
    log_ratio = (logp.float() - old_logp.float() + bias) * s  # [B]
    return log_ratio, 1 / step


# DiffusionNFT's floor on the adaptive weight (`.clip(min=0.00001)` upstream): an exact x0
# prediction would otherwise divide zero by zero
_NFT_WEIGHT_MIN = 1e-5


def flow_noise(clean: Tensor, noise: Tensor, sigma: float | Tensor) -> Tensor:
    """The forward process of flow matching, `x_t = (1 - sigma) x_0 + sigma eps`, float32
    `[B, ...]` from `clean` `x_0` and `noise` `eps` `[B, ...]` and `sigma` (scalar or `[B]`, in
    [0, 1]; 1 = pure noise, the sampler's start). DiffusionNFT trains on it."""
    if clean.shape != noise.shape:
        raise ValueError(f"clean {tuple(clean.shape)} and noise {tuple(noise.shape)} differ in shape")
    batch = clean.shape[0]
    s = _per_sample(sigma, batch, clean.device, "sigma").view((batch,) + (1,) * (clean.dim() - 1))  # [B, 1...]
    return (1 - s) * clean.float() + s * noise.float()  # [B, ...]


def compute_nft_optimality(advantages: Tensor, clip: float) -> Tensor:
    """DiffusionNFT's optimality probability `r` `[B]` in [0, 1] of each sample from its
    advantage `[B]`: clipped to `[-clip, clip]`, then `r = adv / (2 clip) + 1/2` (upstream:
    `(clamp(adv, -5, 5) / 5) / 2 + 0.5`). Example, `clip = 5`: advantages -7, -2.5, 0, 2.5, 5
    give r = 0, 0.25, 0.5, 0.75, 1. `r` weighs the positive (1) against the negative (0) policy."""
    if clip <= 0:
        raise ValueError(f"clip must be > 0, got {clip}")
    return (advantages.float().clamp(-clip, clip) / clip / 2 + 0.5).clamp(0, 1)  # [B]


def compute_nft_decay(step: int, *, start: int, rate: float, limit: float) -> float:
    """How much of the old (sampling) policy DiffusionNFT keeps when it moves it towards the
    trained one after an epoch: `old <- decay old + (1 - decay) trained`, with `step` the
    optimizer steps taken so far and `decay = 0` before `start`, then `min((step - start) rate,
    limit)` (upstream's `return_decay`). `decay = 0` samples with the trained policy itself.

    Upstream's `decay_type` 1 (its default) is `start=0, rate=0.001, limit=0.5`: after 100 steps
    0.1, from 500 on 0.5. `decay_type` 2 (its OCR config) is `start=75, rate=0.0075, limit=0.999`:
    0 up to step 75, 0.1875 at 100, 0.999 from about 208 on: an old policy that nearly stops
    moving, pick it for a reward that is easy to over-optimise."""
    if start < 0 or rate < 0 or not 0 <= limit < 1:
        raise ValueError(f"need start >= 0, rate >= 0 and 0 <= limit < 1, got {start}, {rate}, {limit}")
    return 0.0 if step < start else min((step - start) * rate, limit)


def compute_nft_loss(
    *,
    velocity: Tensor,
    old_velocity: Tensor,
    clean: Tensor,
    noisy: Tensor,
    sigma: float | Tensor,
    advantages: Tensor,
    beta: float,
    adv_clip: float,
    ref_velocity: Tensor | None = None,
    kl_beta: float = 0.0,
) -> tuple[Tensor, dict[str, float]]:
    """DiffusionNFT's loss (Zheng et al. 2025, "Online Diffusion Reinforcement with Forward
    Process"; `scripts/train_nft_sd3.py` of NVlabs/DiffusionNFT), per sample: returns
    `(loss [B], metrics)`; sum it over samples and divide by the global sample count.

    Inputs: the trained policy's `velocity` `[B, ...]` (with gradients) and the old (sampling)
    policy's `old_velocity` (no gradient) at the forward-noised `noisy` = `flow_noise(clean,
    eps, sigma)`; `clean` `x_0` `[B, ...]`; `sigma` scalar or `[B]`; `advantages` `[B]`. The
    implicit policies are `v+ = (1 - beta) v_old + beta v` and `v- = (1 + beta) v_old - beta v`;
    each is scored by its x0 prediction `x_t - sigma v`:

        L+- = mean over elements of |x0(v+-) - x_0|^2 / w+-,   w+- = mean |x0(v+-) - x_0| (no gradient, >= 1e-5)
        loss = adv_clip / beta x (r L+ + (1 - r) L-) + kl_beta x mean |v - ref_velocity|^2

    with `r = compute_nft_optimality(advantages, adv_clip)`: a good sample (r near 1) pulls the
    positive policy to it, a bad one (r near 0) pushes the negative one, i.e. the trained policy
    away from it. The adaptive weight `w` (upstream computes it in float64, as here; the loss is
    then float64) makes every sample's term scale-free. The KL term is upstream's `train.beta` x
    the velocity MSE to the reference (the LoRA-disabled model), skipped when `ref_velocity` is
    None. Pick NFT over GRPO (`sde_step` + `ppo_clip`) when the sampler should be any solver (ODE,
    few steps, no CFG) and no per-step log-probability is wanted: only the clean samples are kept.
    """
    shape = clean.shape
    for name, other in (("velocity", velocity), ("old_velocity", old_velocity), ("noisy", noisy)):
        if other.shape != shape:
            raise ValueError(f"{name} {tuple(other.shape)} must match clean {tuple(shape)}")
    if beta <= 0:
        raise ValueError(f"beta must be > 0 (the implicit policies' step), got {beta}")
    batch, dims = shape[0], tuple(range(1, clean.dim()))
    s = _per_sample(sigma, batch, clean.device, "sigma").view((batch,) + (1,) * (clean.dim() - 1))  # [B, 1...]
    v, v_old = velocity.float(), old_velocity.detach().float()  # [B, ...]
    x0, xt = clean.float(), noisy.float()  # [B, ...]
    r = compute_nft_optimality(advantages.to(clean.device), adv_clip)  # [B]

    def scored(v_implicit: Tensor) -> Tensor:
        prediction = xt - s * v_implicit  # [B, ...] the implicit policy's x0 prediction
        with torch.no_grad():
            error = prediction.detach().double() - x0.double()  # [B, ...]
            weight = error.abs().mean(dim=dims, keepdim=True).clamp(min=_NFT_WEIGHT_MIN)  # [B, 1...]
        return ((prediction - x0) ** 2 / weight).mean(dim=dims)  # [B] float64

    positive = scored(beta * v + (1 - beta) * v_old)  # [B]
    negative = scored((1 + beta) * v_old - beta * v)  # [B]
    policy = (r * positive / beta + (1 - r) * negative / beta) * adv_clip  # [B], upstream's order of operations
    kl = torch.zeros_like(policy)  # [B]
    if ref_velocity is not None and kl_beta > 0:
        kl = ((v - ref_velocity.detach().float()) ** 2).mean(dim=dims)  # [B]
    loss = policy + kl_beta * kl  # [B]
    metrics = {"policy": float(policy.detach().mean()), "kl": float(kl.detach().mean()),
               "positive": float(positive.detach().mean()), "negative": float(negative.detach().mean()),
               "old_deviation": float(((v.detach() - v_old) ** 2).mean())}
    return loss, metrics


def velocity_errors(velocity: Tensor, clean: Tensor, noise: Tensor) -> Tensor:
    """Each sample's flow-matching error `[B]`: the mean over its elements of
    `(velocity - (noise - clean))^2`, float32. `velocity` `[B, ...]` is a model's prediction at
    `flow_noise(clean, noise, sigma)`; `noise - clean` is the velocity that path has."""
    if not velocity.shape == clean.shape == noise.shape:
        raise ValueError(f"velocity {tuple(velocity.shape)}, clean {tuple(clean.shape)} and noise "
                         f"{tuple(noise.shape)} must have one shape")
    target = noise.float() - clean.float()  # [B, ...]
    return ((velocity.float() - target) ** 2).mean(dim=tuple(range(1, clean.dim())))  # [B]


def compute_flow_dpo_loss(
    *, chosen: Tensor, rejected: Tensor, ref_chosen: Tensor, ref_rejected: Tensor, beta: float,
) -> tuple[Tensor, dict[str, float]]:
    """Diffusion-DPO (Wallace et al. 2023) in its flow-matching form, per pair: returns
    `(loss [B], metrics)`. Inputs are `velocity_errors` `[B]` of the trained policy (`chosen`,
    `rejected`, with gradients) and of the frozen reference (`ref_*`) on the preferred and the
    rejected sample of each pair, both noised at the same `sigma` with the same noise:

        margin = (chosen - ref_chosen) - (rejected - ref_rejected)
        loss = -log sigmoid(-beta x margin)

    A policy that lowers its error on the preferred sample more than on the rejected one (both
    against the reference) has a negative margin and a lower loss. The paper writes beta as
    `beta_paper x T x w(t)`; here `beta` is the whole factor (its SD1.5 runs: 5000 x 1000 steps
    in noise units; velocity errors are of another scale, so tune it per model). Metrics: the
    mean margin, `accuracy` (the share of pairs with margin < 0: the implicit reward prefers the
    chosen sample), and the policy's own errors."""
    if beta <= 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    shapes = {tuple(t.shape) for t in (chosen, rejected, ref_chosen, ref_rejected)}
    if len(shapes) != 1 or len(next(iter(shapes))) != 1:
        raise ValueError(f"the four error vectors must each be [B] of one length, got {sorted(shapes)}")
    margin = (chosen.float() - ref_chosen.detach().float()) - (rejected.float() - ref_rejected.detach().float())  # [B]
    loss = -torch.nn.functional.logsigmoid(-beta * margin)  # [B]
    metrics = {"margin": float(margin.detach().mean()), "accuracy": float((margin.detach() < 0).float().mean()),
               "chosen_error": float(chosen.detach().mean()), "rejected_error": float(rejected.detach().mean())}
    return loss, metrics
