"""diffusion-grpo's configuration: one msgspec Struct per TOML table (VRL's knobs, see the
README's table), VRL's environment variables, the checks between keys (run before any model
loads) and the prompt sources (a manifest file, a save_to_disk directory or a cached Hub id). No
torch: `__main__.py` reads the command line and the config with it, before the recipe
(`grpo_recipe.py`) loads."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal

import msgspec

from rl_core.train import (
    AppConfig,
    ConfigError,
    DType,
    KLName,
    NonNegative,
    NonNegativeFloat,
    Positive,
    PositiveFloat,
    RewardAggregationName,
    RolloutCorrectionName,
    RunFields,
    UnitInterval,
    UserError,
    resolve_path,
)
from rl_core.train.entry import AppEntry
from rl_rewards import Component, RewardSpec, load_spec

if TYPE_CHECKING:
    from rl_data import OCRPrompt, PreferenceRecord

NAME = "diffusion-grpo"
APP = Path(__file__).resolve().parent
REPO = APP.parents[1]
DEFAULT_CONFIG = APP / "configs" / "default.toml"
VIDEO = ("wan", "cosmos")  # the families whose samples are videos (4k + 1 frames through Wan's VAE)


class ModelConfig(msgspec.Struct, kw_only=True, frozen=True):
    family: Literal["sd3", "wan", "cosmos", "janus"] = "sd3"
    """`sd3`: Flow-GRPO on an SD3/SD3.5 pipeline (SDE sampling, per-step log-probs). `wan`/`cosmos`: the
    same on Wan 2.1 text-to-video / Cosmos-Predict2.5 text-to-world, its guardrail not run (`sampling.num_frames`
    frames a sample; each reward component scores every frame, folded by `reward.frame_aggregate`). `janus`:
    token-level GRPO on Janus / Janus-Pro image tokens (CFG sampling, per-token log-probs; VRL's
    autoregressive trainer); its own knobs are the [janus] table, and rollout.temperature,
    rollout.compile, model.gradient_checkpointing and algo.kl apply to it only."""
    path: str = "stabilityai/stable-diffusion-3.5-medium"
    """diffusers SD3/SD3.5 folder or hub id (`tiny:sd3` builds a tiny random pipeline); with
    family `wan` a diffusers Wan 2.1 folder (Wan-AI/Wan2.1-T2V-1.3B-Diffusers, `tiny:wan`; `cosmos`: `tiny:cosmos`); with
    family `janus` a transformers Janus checkpoint (deepseek-community/Janus-Pro-7B, `tiny:janus`)."""
    dtype: DType = "bfloat16"  # transformer + VAE weights (Janus: all weights); step maths is always float32
    text_encoder_dtype: DType | None = None  # None = dtype
    lora_rank: NonNegative = 32  # 0: full fine-tuning of the sd3/wan/cosmos transformer (README: full fine-tuning)
    lora_alpha: float = 64
    lora_targets: list[str] | None = None  # None: rl_models' default (sd3: attention; janus: LM projections)
    compile: bool | None = None
    """sd3: compile the transformer's blocks (torch.compile, one graph a block) for the rollout and
    the replay, in the trainer and the Ray workers: faster rollouts on a GPU after a compile of
    the first epoch (benchmarks/RESULTS.md). None (the default): on where that pays, model.family='sd3' on CUDA with train.sharding='none'; off on
    the CPU, where compiling costs more than a short run gains. Set false for a quick GPU check.
    The first replay's |log ratio| then stays inside the automatic algo.replay_tolerance. Not with train.sharding='fsdp2'."""
    gradient_checkpointing: bool = False  # janus: recompute the language model's activations in the update


class DataConfig(msgspec.Struct, kw_only=True, frozen=True):
    manifest: str = "examples/data/ocr/train.txt"
    """OCR prompts, one per line (Flow-GRPO format), or rows (.jsonl, .parquet, a save_to_disk directory, a
    cached Hub id) with `prompt` (or `text`) and, for cosmos, the `image` or `video` each sample starts from."""
    eval_manifest: str = "examples/data/ocr/test.txt"
    preferences: str = ""
    """train.method = "dpo": the preference pairs (prompt, chosen, rejected: two images, or two videos for
    wan and cosmos), a .jsonl or .parquet file (media paths relative to it) or a dataset, as
    `rl_data.read_preferences` reads them (Pick-a-Pic's columns too); data.manifest is then unused."""


class SamplingConfig(msgspec.Struct, kw_only=True, frozen=True):
    resolution: Positive = 512  # square images (wan: square frames)
    num_frames: Positive = 33  # wan: frames of each video, 4k + 1 (Wan 2.1: 81 at 480x832)
    num_steps: Positive = 10  # training rollout steps
    guidance_scale: NonNegativeFloat = 4.5
    noise_level: PositiveFloat = 0.7  # SDE `a` (0.7 Flow-GRPO sde; 0.8 for cps)
    kind: Literal["sde", "cps", "ode"] = "sde"
    """The sampler: `sde` (Flow-GRPO) or `cps` (coefficients-preserving) steps carry the
    log-probabilities GRPO trains on; `ode` (the deterministic Euler ODE) has none and is for
    train.method = "nft", which trains on the clean images of any sampler."""
    sde_window: list[int] | None = None
    """[start, stop): stochastic steps with sde_window_mode "fixed"; other steps use the ODE. None = all."""
    sde_window_mode: Literal["fixed", "random", "sliding"] = "fixed"
    """Which steps are stochastic, hence trained (`rl_core.flow.compute_sde_window`): `fixed` =
    sde_window; `random` (Flow-GRPO-Fast) = sde_window_size steps at a random place in
    sde_window_range, drawn per sampled batch; `sliding` (MixGRPO) = sde_window_size steps whose
    first moves by window_stride every shift_interval epochs, back to the start after the last."""
    sde_window_size: Positive = 2  # random/sliding: stochastic steps per trajectory (Fast: 2; MixGRPO: 4)
    sde_window_range: list[int] | None = None
    """random/sliding: [start, limit) the window stays in; None = [0, int(num_steps x train.timestep_fraction))."""
    shift_interval: Positive = 25  # sliding: epochs between window moves (MixGRPO iters_per_group)
    window_stride: Positive = 1  # sliding: steps the window moves by (MixGRPO prog_overlap_step)
    max_sequence_length: Positive = 128  # T5 tokens (wan: UMT5 tokens, every prompt padded to it; Wan uses 226)
    # sd3 rollout options (rl_rollout.diffusion; benchmarks/diffusion_grpo.py measures each): None/"auto"
    # = the engine's measured CUDA choice (AUTO_ON_CUDA), off on CPU; CUDA-only choices fail on CPU
    cuda_graphs: bool | None = None  # replay each sampling step's CFG forward as a captured CUDA graph
    attention_backend: Literal["auto", "default", "flash", "cudnn", "efficient", "math"] = "auto"
    """SDPA kernel of the joint attention, for the rollout and the replay alike (ratio 1 kept)."""
    overlap_decode: bool | None = None  # VAE-decode a batch on a side stream while the next denoises


class RolloutConfig(msgspec.Struct, kw_only=True, frozen=True):
    n: Positive = 8  # images per prompt (group size)
    groups_per_epoch: Positive = 8  # prompts per epoch, all processes together
    sample_batch_size: Positive = 8  # images per sampling forward
    workers: NonNegative = 0
    """0 = sample in the trainer's engine; N = N Ray actors per trainer process (families.py)."""
    placement: Literal["split", "colocated"] = "split"
    """VRL presets: `split` = actors on their own GPUs; `colocated` = on the trainer's, asleep during training."""
    gpus_per_worker: float | None = None  # None: split 1, colocated 1/workers, 0 without CUDA
    ray_address: str | None = None  # join this Ray cluster (env RAY_ADDRESS); None starts a local one
    temperature: PositiveFloat = 1.0  # janus: image-token sampling temperature (Janus-Pro: 1); sd3 has none
    compile: bool | None = None  # janus: compile the decode step (None: on CUDA); sd3 compiles with model.compile
    precision: Literal["bf16", "fp8"] = "bf16"
    """`fp8`: sample with FP8 matmuls (an H100/H200, emulated on the CPU), the update in model.dtype
    on old log-probs rescored by the trainer, the gap corrected by algo.rollout_correction."""


class RewardConfig(msgspec.Struct, kw_only=True, frozen=True):
    spec: str | RewardSpec | None = None
    """A whole `rl_rewards` RewardSpec (gates, fold, fallbacks): a TOML file, or an inline table
    `[reward.spec.components.NAME]`. Given, it takes the place of `components` and `kwargs`."""
    components: dict[str, float] = msgspec.field(default_factory=lambda: {"ocr": 1.0})
    """scorer name -> weight (weighted sum); 0 disables one: `reward.components.aesthetic=1.0`."""
    kwargs: dict[str, dict[str, Any]] = {}  # scorer name -> its build options
    url: str | None = None  # a running `rl-rewards serve`; images go as PNG paths
    frame_aggregate: Literal["mean", "min", "max"] = "mean"
    """wan: how a component's per-frame scores make the video's (`rl_rewards` `per_frame`): `min`
    when one bad frame spoils the video (text that must stay legible); video scorers
    (`temporal_consistency`) score the whole video instead."""
    frames: Positive | None = None  # wan: score this many evenly spaced frames (first and last kept); None: all
    server_reward: str = ""  # reward name on the server ("" = its default)


class TrainConfig(RunFields, kw_only=True, frozen=True):
    method: Literal["grpo", "nft", "dpo"] = "grpo"
    """`grpo`: Flow-GRPO (with the SDE windows of Flow-GRPO-Fast and MixGRPO): a PPO ratio on the
    SDE sampler's per-step log-probabilities. `nft`: DiffusionNFT (Zheng et al. 2025), negative-aware fine-tuning on the
    forward process: the clean images of any sampler (sampling.kind = "ode" is its choice, CFG-free)
    are noised again and trained with a velocity loss between an implicit positive and negative
    policy, weighted by the reward; an old policy, moved towards the trained one after each epoch
    ([nft] table), samples. Choose `nft` for a deterministic or few-step sampler, no CFG and no
    log-probabilities, in one or two optimizer steps an epoch as upstream (steps over few images fit noise); it needs a flow family
    (sd3, wan, cosmos) and no Ray workers, FSDP2 or asynchronous rollouts (README: DiffusionNFT). `dpo`:
    Diffusion-DPO, offline: each step trains rollout.groups_per_epoch pairs of data.preferences ([dpo] table;
    the reward only scores the evals); no janus, Ray workers, FSDP2 or asynchronous rollouts, as nft."""
    epochs: Positive = 100_000  # one epoch is one step of the trainer loop
    lr: PositiveFloat = 3e-4
    weight_decay: NonNegativeFloat = 1e-4
    grad_clip: PositiveFloat = 1.0  # max gradient norm (Flow-GRPO max_grad_norm)
    ratio_norm: bool = False
    """GRPO-Guard's RatioNorm (Wang et al. 2025, arXiv 2510.22319; upstream `config.rationorm`):
    each replayed SDE step's log ratio gets its mean-shift bias |mean - old_mean|^2 / (2 s^2) added
    back and is multiplied by the step's std s, and the step's policy loss is divided by |dt|
    (`rl_core.flow.compute_ratio_guard`). Plain Flow-GRPO's ratios sit below 1 on the low-noise
    steps, so the clip lets those steps over-optimise the reward; choose it to train every step
    under one ratio scale (its presets clip at 2e-6: examples/diffusion-grpo/grpo_guard.toml).
    The rollout then keeps each step's mean (one more latent per step). sd3, train.method =
    "grpo", sampling.kind = "sde" only."""
    clip_range: UnitInterval = 1e-4  # PPO ratio clip (SD3: 1e-4; log-probs are per-element means; janus: per token, 0.2)
    adv_scale: Literal["batch", "group"] = "batch"  # std over the whole batch (Flow-GRPO global std)
    adv_clip: PositiveFloat = 5.0
    adv_eps: PositiveFloat = 1e-4
    adv_std: Literal["unbiased", "population"] = "unbiased"
    """Std of the advantage denominator: divides by n - 1 (`torch.std`, ours) or by n (`np.std`:
    Flow-GRPO and VRL; smaller by sqrt((n - 1) / n) for n samples)."""
    adv_eps_mode: Literal["add", "clamp"] = "add"
    """Denominator std + adv_eps (ours, Flow-GRPO: 1e-4) or max(std, adv_eps) (VRL: 1e-8)."""
    adv_group_by: Literal["group", "prompt"] = "group"
    """A sample's baseline: the mean of its group (the n images of one draw of a prompt; ours,
    VRL) or of every image of the same prompt text in the epoch (Flow-GRPO's per-prompt stat
    tracker: two groups of one prompt share a mean)."""
    zero_adv: Literal["drop", "flow_grpo"] = "drop"
    """Zero-advantage images (train.method = "grpo"): `drop` (ours, VRL) trains the rest of each sampled batch in chunks
    of micro_batch_size; `flow_grpo` (Flow-GRPO) puts randomly chosen ones back until the kept
    count divides into the epoch's batches, shuffles, and trains equal batches. See README."""
    micro_batch_size: Positive = 8  # images per replay forward (= sample_batch_size keeps ratio bit-exact)
    gradient_accumulation_steps: Positive = 4  # micro-batches per optimizer step
    timestep_fraction: Annotated[float, msgspec.Meta(gt=0, le=1)] = 0.99  # train the stochastic steps k < int(S * fraction): 9 of 10
    ema_decay: Annotated[float, msgspec.Meta(ge=0, lt=1)] = 0.9
    ema_interval: Positive = 8  # optimizer steps between EMA updates
    seed: NonNegative = 42
    save_freq: Positive = 60  # epochs between checkpoints (and at the end)
    eval_freq: NonNegative = 60  # epochs between evals (0 = never); also before the first and after the last
    output_dir: str = "runs/diffusion-grpo"


class AlgoConfig(msgspec.Struct, kw_only=True, frozen=True):
    """`algo.*`: the algorithm keys this app shares with the text apps' `algo` tables, under their
    names; Flow-GRPO's own (train.clip_range, train.adv_*, train.zero_adv) stay in [train]."""

    kl_coef: NonNegativeFloat = 0.04
    """Weight of the KL to the LoRA-disabled model (Flow-GRPO `train.beta`): sd3 the flow KL of each
    SDE step, janus the per-token `algo.kl`, nft the velocity MSE; 0 skips the reference forward."""
    kl: KLName = "k3"  # janus: the per-token KL estimator (sd3's flow KL is closed form)
    reward_aggregation: RewardAggregationName = "sum_then_normalize"
    """Several reward components (ocr + brightness, say): `sum_then_normalize` (their weighted sum is
    the reward, normalised by train.adv_*) or `normalize_then_sum` (GDPO; TRL's
    multi_objective_aggregation): each component normalised within its group before the weighted
    sum, then over the batch (train.adv_* do not apply), so a large-scale reward cannot drown a
    small one. Needs the reward in process (a weighted sum, not reward.url)."""
    replay_tolerance: NonNegativeFloat | None = None
    """Max |log ratio| on the first replay of an epoch; above it the run stops (rollout and replay
    disagree: wrong weights, a sampler bug). None (the default) chooses it from what can make the
    replay's numbers differ from the rollout's (`first_replay_tolerance`): 1e-5 where the replay
    repeats the rollout's kernels on the same batches (eager blocks, micro_batch_size =
    rollout.sample_batch_size, zero_adv='drop', Janus log-probs rescored); otherwise (compiled blocks,
    other micro-batches, zero_adv='flow_grpo' shuffling, Janus decode log-probs) 1e-4 in float32 and
    5e-2 in bf16, where a kernel's rounding shows. A number is used as given. With train.max_staleness >= 1 only the first epoch is
    checked (later ones are sampled by older weights)."""
    rollout_correction: RolloutCorrectionName = "none"  # rollout.precision='fp8': token_truncate (TIS), token_mask (MIS)
    rollout_clip_min: NonNegativeFloat | None = None  # its weight's bounds: a step's log-prob is a mean, keep them near 1
    rollout_clip_max: PositiveFloat | None = 3.0


class EvalConfig(msgspec.Struct, kw_only=True, frozen=True):
    max_prompts: Positive = 16
    num_steps: Positive = 40  # deterministic ODE steps (sd3; janus samples its tokens at the fixed seed)
    guidance_scale: float = 4.5
    seed: int = 20260504
    use_ema: bool = True
    batch_size: Positive = 8


class NFTConfig(msgspec.Struct, kw_only=True, frozen=True):
    """Knobs of train.method = "nft" only (DiffusionNFT; the advantages are train.adv_*'s,
    train.adv_clip also scales the loss, algo.kl_coef weighs the velocity MSE to the LoRA-disabled
    model, train.timestep_fraction x sampling.num_steps is how many noise levels each image is
    trained at)."""

    beta: PositiveFloat = 1.0
    """Step of the implicit policies v+- = v_old +- beta (v - v_old) (upstream `config.beta`: 1
    by default, 0.1 for OCR and multi-reward)."""
    old_decay_start: NonNegative = 0  # optimizer steps before the old policy lags (upstream decay_type 1: 0; 2: 75)
    old_decay_rate: NonNegativeFloat = 0.001  # its lag per optimizer step after that (1: 0.001; 2: 0.0075)
    old_decay_max: Annotated[float, msgspec.Meta(ge=0, lt=1)] = 0.5
    """After each epoch old <- decay old + (1 - decay) trained, decay = min((steps - start) x rate,
    max) (`rl_core.flow.compute_nft_decay`; upstream decay_type 1: 0.5; 2: 0.999)."""


class DPOConfig(msgspec.Struct, kw_only=True, frozen=True):
    """Knobs of train.method = "dpo" only (train.timestep_fraction x sampling.num_steps is how many of
    the sampler's noise levels each pair is trained at, a level and a noise shared by its two members)."""

    beta: PositiveFloat = 500.0
    """The loss's whole factor on the margin of velocity errors (`rl_core.flow.compute_flow_dpo_loss`):
    larger trusts the pairs more and drifts further from the reference; tune it per model."""


class JanusConfig(msgspec.Struct, kw_only=True, frozen=True):
    """Knobs of the `janus` family only (sampling.guidance_scale is the CFG weight, 5 in Janus-Pro;
    sampling.resolution must be the checkpoint's image size, 384 for Janus-Pro)."""

    loss_logits: Literal["cfg", "cond"] = "cfg"
    """Log-probs in the loss: `cfg` scores each token under the guided distribution it was drawn
    from (importance ratio 1 on the first replay; gradients reach both CFG rows); `cond` under the
    conditional logits alone (one forward of B rows, half the update cost; old log-probs are then
    recomputed with the conditional logits before the update, and the first-replay check is off)."""
    logprobs: Literal["rescore", "decode"] = "rescore"
    """Rollout log-probs: `rescore` recomputes them teacher-forced (first replay bit-exact with
    micro_batch_size = sample_batch_size); `decode` keeps the KV-cached decode loop's (no extra
    forward; the automatic algo.replay_tolerance is then 1e-4 in float32, 5e-2 in bf16)."""


class Config(AppConfig, kw_only=True, frozen=True):
    # Keys renamed to the other apps' names for the same idea (old -> new; the old is refused).
    RENAMED: ClassVar[dict[str, str]] = {
        "train.kl_beta": "algo.kl_coef", "janus.kl": "algo.kl", "train.ratio_tolerance": "algo.replay_tolerance",
        "train.reward_aggregation": "algo.reward_aggregation", "train.max_grad_norm": "train.grad_clip",
        "eval.every": "train.eval_freq", "janus.temperature": "rollout.temperature", "janus.compile": "rollout.compile",
        "janus.gradient_checkpointing": "model.gradient_checkpointing"}
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    sampling: SamplingConfig = SamplingConfig()
    rollout: RolloutConfig = RolloutConfig()
    reward: RewardConfig = RewardConfig()
    train: TrainConfig = TrainConfig()
    algo: AlgoConfig = AlgoConfig()
    eval: EvalConfig = EvalConfig()
    nft: NFTConfig = NFTConfig()
    dpo: DPOConfig = DPOConfig()
    janus: JanusConfig = JanusConfig()


# VRL's deployment inputs stay environment variables (its README's table).
ENV = {"VRL_OUTPUT_DIR": "train.output_dir", "REWARD_URL": "reward.url", "RAY_ADDRESS": "rollout.ray_address"}


def check_config(cfg: Config, world_size: int) -> None:
    """The rules between keys and against the process count; `ConfigError` names the keys."""
    m, r, t = cfg.model, cfg.rollout, cfg.train
    images = r.groups_per_epoch // world_size * r.n  # per process
    refused = [
        (r.n < 2 and t.method != "dpo", f"rollout.n={r.n}: GRPO compares the images of one prompt with each other and needs rollout.n >= 2"),
        (m.lora_rank == 0 and (m.family == "janus" or cfg.rollout.precision == "fp8"), "model.lora_rank=0 fully fine-tunes "
         "an sd3, wan or cosmos transformer sampled in model.dtype: set a LoRA rank for janus or rollout.precision='fp8'"),
        (m.family == "janus" and t.sharding != "none", f"train.sharding={t.sharding!r} shards a diffusion transformer; "
         "model.family='janus' trains with DDP (FSDP2 for it is not done): set train.sharding='none'"),
        (m.family in VIDEO and (cfg.sampling.num_frames - 1) % 4 != 0, f"sampling.num_frames="
         f"{cfg.sampling.num_frames}: Wan's VAE takes 4k + 1 frames (1, 5, 9, ..., 33, ..., 81)"),
        (t.max_staleness > 0 and t.sharding != "none" and r.workers > 0, f"train.max_staleness={t.max_staleness} "
         f"with rollout.workers={r.workers} and train.sharding={t.sharding!r}: a sharded LoRA is not published to Ray "
         "workers yet; set train.sharding='none' or rollout.workers=0"),
        (m.family == "janus" and cfg.sampling.sde_window_mode != "fixed" and cfg.sampling.sde_window_range is None,
         f"sampling.sde_window_mode={cfg.sampling.sde_window_mode!r} with model.family='janus' trains a window of "
         "image-token positions: set sampling.sde_window_range=[start, limit) in tokens (Janus-Pro draws 576 a "
         "384x384 image)"),
        (m.compile and (m.family == "janus" or t.sharding != "none"), "model.compile=true compiles an unsharded sd3, "
         f"wan or cosmos transformer's blocks (got model.family={m.family!r}, train.sharding={t.sharding!r})"),
        (m.family != "janus" and int(cfg.sampling.num_steps * t.timestep_fraction) == 0,
         f"train.timestep_fraction={t.timestep_fraction} x sampling.num_steps={cfg.sampling.num_steps} trains no "
         "step (Flow-GRPO trains int(steps x fraction)); raise it"),
        (cfg.sampling.sde_window_mode != "fixed" and cfg.sampling.sde_window is not None,
         f"sampling.sde_window={cfg.sampling.sde_window} is the fixed window: with sampling.sde_window_mode="
         f"{cfg.sampling.sde_window_mode!r} set sampling.sde_window_range (and sde_window_size) instead"),
        *window_problems(cfg),
        *nft_problems(cfg),
        *guard_problems(cfg),
        (r.workers > 0 and world_size > 1 and not r.ray_address, f"rollout.workers={r.workers} with {world_size} "
         "trainer processes needs a running Ray cluster: `ray start --head`, then set RAY_ADDRESS or rollout.ray_address"),
        (cfg.algo.reward_aggregation == "normalize_then_sum" and cfg.reward.url is not None,
         "algo.reward_aggregation=normalize_then_sum weighs the reward's components itself: it needs the reward in "
         "process (reward.url unset)"),
        (r.groups_per_epoch % world_size != 0,
         f"rollout.groups_per_epoch={r.groups_per_epoch} must divide by the {world_size} processes"),
        (t.zero_adv == "flow_grpo" and (images % t.micro_batch_size or images // t.micro_batch_size % t.gradient_accumulation_steps),
         f"train.zero_adv='flow_grpo' trains equal batches: the {images} images per process must divide into batches "
         f"of train.micro_batch_size={t.micro_batch_size}, and their number into optimizer steps of "
         f"train.gradient_accumulation_steps={t.gradient_accumulation_steps}"),
    ]
    for bad, message in refused:
        if bad:
            raise ConfigError(message)
    reward_spec(cfg.reward, tiny=m.path.startswith("tiny:"), video=m.family in VIDEO)  # a bad spec or weights stop here too


def compiles_blocks(cfg: Config, device_type: str) -> bool:
    """model.compile resolved for a trainer on a `device_type` ("cuda", "cpu") device: a set value as
    given (sd3, wan, cosmos); None compiles the SD3 blocks on CUDA when nothing refuses it (unsharded)."""
    m = cfg.model
    if m.compile is not None:
        return m.compile
    return m.family == "sd3" and cfg.train.sharding == "none" and device_type == "cuda"


def first_replay_tolerance(cfg: Config, compiled: bool) -> float:
    """algo.replay_tolerance resolved (its docstring gives the rule); `compiled`: the SD3 blocks
    are compiled (`compiles_blocks`)."""
    t = cfg.train
    if cfg.algo.replay_tolerance is not None:
        return cfg.algo.replay_tolerance
    janus_decode = cfg.model.family == "janus" and cfg.janus.logprobs == "decode"
    same_kernels = not compiled and not janus_decode and (cfg.rollout.precision == "fp8" or (  # fp8: rescored alike
        t.zero_adv == "drop" and t.micro_batch_size == cfg.rollout.sample_batch_size))
    if same_kernels:
        return 1e-5
    return 1e-4 if cfg.model.dtype == "float32" else 5e-2


def nft_problems(cfg: Config) -> list[tuple[bool, str]]:
    """train.method against the rest (a `check_config` rule list): GRPO needs log-probabilities;
    DiffusionNFT's old policy lives in the trainer's engine (SD3, Wan, Cosmos)."""
    t, r, s = cfg.train, cfg.rollout, cfg.sampling
    if t.method == "grpo":
        return [(s.kind == "ode", "sampling.kind='ode' samples no log-probability: train.method='grpo' needs 'sde' or "
                 "'cps' (or choose train.method='nft', which trains on the clean images of any sampler)")]
    why = "train.method='nft' (DiffusionNFT)" if t.method == "nft" else "train.method='dpo' (Diffusion-DPO)"
    return [
        (t.method == "dpo" and not cfg.data.preferences, f"{why} trains on preference pairs: set data.preferences"),
        (cfg.model.family == "janus", f"{why} trains a flow model's velocity: model.family='janus' samples tokens; "
         "set train.method='grpo'"),
        (t.max_staleness > 0, f"train.max_staleness={t.max_staleness}: {why} samples with its old policy, which "
         "asynchronous rollouts do not publish; set train.max_staleness=0 or train.method='grpo'"),
        (r.workers > 0, f"rollout.workers={r.workers}: {why} samples with its old policy in the trainer's engine; "
         "set rollout.workers=0"),
        (t.sharding != "none", f"train.sharding={t.sharding!r}: {why} keeps an unsharded old policy; set "
         "train.sharding='none'"),
        (s.guidance_scale > 1 and t.method == "nft", f"sampling.guidance_scale={s.guidance_scale}: {why} is CFG-free (it trains the "
         "conditional velocity its samples came from); set sampling.guidance_scale=1"),
        (t.zero_adv != "drop", f"train.zero_adv={t.zero_adv!r} picks GRPO's images: {why} trains every scored image "
         "(advantage 0 is r = 0.5); leave train.zero_adv='drop'"),
    ]


def guard_problems(cfg: Config) -> list[tuple[bool, str]]:
    """train.ratio_norm against the rest (a `check_config` rule list): RatioNorm re-scales the
    ratio of one Flow-GRPO SDE step, so it needs SD3, GRPO and the `sde` sampler."""
    if not cfg.train.ratio_norm:
        return []
    why = "train.ratio_norm=true (GRPO-Guard) re-scales the ratio of an SD3 SDE step"
    return [
        (cfg.model.family != "sd3", f"{why}: model.family={cfg.model.family!r} trains per-token ratios; set "
         "train.ratio_norm=false"),
        (cfg.train.method != "grpo", f"{why}: train.method={cfg.train.method!r} has no ratio; set "
         "train.ratio_norm=false"),
        (cfg.rollout.precision == "fp8", f"{why}: rollout.precision='fp8' rescores the old log-probs, not the means"),
        (cfg.model.family == "sd3" and cfg.train.method == "grpo" and cfg.sampling.kind != "sde",
         f"{why}: sampling.kind={cfg.sampling.kind!r} is not done (upstream's form is the sde step's); set "
         "sampling.kind='sde'"),
    ]


def window_range(cfg: Config) -> tuple[int, int]:
    """[start, limit) of a random or sliding SDE window: sampling.sde_window_range, else the trained steps."""
    s = cfg.sampling
    if s.sde_window_range is not None:
        start, limit = s.sde_window_range
        return start, limit
    return 0, max(1, int(s.num_steps * cfg.train.timestep_fraction))


def janus_window(s: SamplingConfig) -> tuple[str, list[int] | None]:
    """Janus's window key and value: `sde_window` (fixed mode) or `sde_window_range`, in image-token positions."""
    return ("sde_window", s.sde_window) if s.sde_window_mode == "fixed" else ("sde_window_range", s.sde_window_range)


def window_problems(cfg: Config) -> list[tuple[bool, str]]:
    """The random/sliding window's range against the steps (a `check_config` rule list)."""
    s = cfg.sampling
    if cfg.model.family == "janus":  # token positions: checked against the checkpoint's count when it loads
        name, window = janus_window(s)
        if window is None:
            return []
        return [(len(window) != 2 or not 0 <= window[0] < window[1],
                 f"sampling.{name}={window} must be [start, stop) image-token positions, start < stop"),
                (s.sde_window_mode == "random" and len(window) == 2 and window[0] + s.sde_window_size > window[1],
                 f"sampling.sde_window_size={s.sde_window_size} does not fit in sampling.sde_window_range={window}")]
    if s.sde_window_mode == "fixed":
        return []
    if s.sde_window_range is not None and len(s.sde_window_range) != 2:
        return [(True, f"sampling.sde_window_range={s.sde_window_range} must be [start, limit)")]
    start, limit = window_range(cfg)
    trained = max(1, int(s.num_steps * cfg.train.timestep_fraction))
    return [
        (not 0 <= start < limit <= trained, f"sampling.sde_window_range=[{start}, {limit}) must lie in the "
         f"{trained} trained steps [0, int(sampling.num_steps x train.timestep_fraction)), non-empty"),
        (s.sde_window_mode == "random" and start + s.sde_window_size > limit,
         f"sampling.sde_window_size={s.sde_window_size} does not fit in sampling.sde_window_range=[{start}, {limit})"),
    ]


def read_prompts(source: str, key: str, family: str = "sd3") -> list[OCRPrompt]:
    """The OCR prompts of a manifest, rows (`image`/`video`: what a cosmos sample starts from), a save_to_disk
    directory or a cached Hub id; a missing or empty source, a bad line or picture is a `UserError` naming `key`."""
    from rl_data import open_source  # imported here: it loads pyarrow, which `--help` does not need

    try:
        prompts = list(open_source(resolve_path(source, REPO), kind="ocr"))
    except (FileNotFoundError, ValueError) as e:  # missing; not a dataset dir; several splits; a bad line
        raise UserError(f"{key}: {e}") from None
    if not prompts:
        raise UserError(f"{key}={source!r} holds no prompt: give a manifest with one prompt per line")
    given = [p.media is not None for p in prompts]
    if any(given) and (family != "cosmos" or not all(given)):  # cosmos, and on every row
        raise UserError(f"{key}, row {given.index(family != 'cosmos') + 1}: an image or video to start from "
                        f"needs model.family = 'cosmos' (not {family!r}) and one on every row")
    return prompts


def read_pairs(source: str, *, video: bool) -> list[PreferenceRecord]:
    """The preference pairs of `data.preferences`, all images (video: all videos); a missing or
    empty source, a bad row or a pair of the other kind is a `UserError` naming the row."""
    from rl_data import read_preferences

    try:
        pairs = list(read_preferences(resolve_path(source, REPO)))
    except (FileNotFoundError, ValueError) as e:
        raise UserError(f"data.preferences: {e}") from None
    if not pairs:
        raise UserError(f"data.preferences={source!r} holds no pair")
    for i, pair in enumerate(pairs):
        if pair.media != ("video" if video else "image"):
            raise UserError(f"data.preferences={source!r}, row {i + 1}: a pair of {pair.media}s, but this family "
                            f"trains on {'videos' if video else 'images'}")
    return pairs


def reward_spec(cfg: RewardConfig, *, tiny: bool, video: bool = False) -> RewardSpec:
    """`reward.spec` (inline, or a TOML file), else the weighted sum of `reward.components` with
    `reward.kwargs` as options. `clip_score`/`aesthetic` without a `model` option get CLIP
    ViT-L/14 (the LAION aesthetic head's backbone), or the tiny CLIP when the model is tiny.
    `video`: each image scorer scores every frame (`per_frame`, folded by `reward.frame_aggregate`
    over `reward.frames`); a video scorer scores the video."""
    spec = _reward_spec(cfg, tiny=tiny)
    if not video:
        return spec
    from rl_rewards.scorers.video import (
        lift_to_video,  # pillow and numpy, which `--help` does not need
    )

    return lift_to_video(spec, aggregate=cfg.frame_aggregate, frames=cfg.frames)


def _reward_spec(cfg: RewardConfig, *, tiny: bool) -> RewardSpec:
    if isinstance(cfg.spec, str):
        try:
            return load_spec(resolve_path(cfg.spec, REPO))
        except (OSError, ValueError) as e:
            raise UserError(f"reward.spec={cfg.spec!r}: {e}") from None
    if cfg.spec is not None:
        return cfg.spec
    clip = "tiny:clip" if tiny else "openai/clip-vit-large-patch14"
    components = {name: Component(scorer=name, weight=w, options=(
        {"model": clip} if name in ("clip_score", "aesthetic") else {}) | cfg.kwargs.get(name, {}))
        for name, w in cfg.components.items() if w != 0}
    if not components:
        raise UserError(f"reward.components {cfg.components} has no non-zero weight")
    return RewardSpec(components=components)


ENTRY = AppEntry(NAME, Config, DEFAULT_CONFIG, ENV, recipe="grpo_recipe")
"""The app: `__main__.py` attaches it (the command line and the config are read before the recipe
and torch load)."""
