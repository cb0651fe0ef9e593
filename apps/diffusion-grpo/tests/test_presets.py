"""The presets that reproduce Flow-GRPO and VRL (examples/diffusion-grpo/flow_grpo.toml,
vrl.toml) against ours (the defaults): their files load, and on one hand-worked batch they give
the advantages and train the images their systems would.

The batch: 4 groups of 2 images, groups 0 and 2 drawn from the same prompt "p":

    group   0      1      2          3
    prompt  p      q      p          s
    reward  0, 0   1, 1   0.75, 0.25 0, 1

Over the batch, mean 0.5 and sum of squared deviations 1.625, so the unbiased std is
sqrt(1.625 / 7) = 0.48181 and the population std sqrt(1.625 / 8) = 0.45069.

- ours: baseline = group mean, (r - mean) / (unbiased std + 1e-4): groups 0 and 1 are 0,
  group 2 +-0.25 / 0.48191 = +-0.51877, group 3 +-0.5 / 0.48191 = +-1.03753. Zero-advantage
  images are dropped: images 4-7 are trained, one micro-batch of trajectory 1.
- vrl: same baseline, (r - mean) / max(population std, 1e-8): +-0.25 / 0.45069 = +-0.55470,
  +-1.10940; the same 4 images trained.
- flow_grpo: baseline = mean over the prompt text: "p" pools groups 0 and 2 (0, 0, 0.75, 0.25:
  mean 0.25), so group 0 gets -0.25 / (0.45069 + 1e-4) = -0.55458 and group 2 +0.5 -> +1.10915
  and 0.25 -> 0; group 3 +-1.10915. Five images are non-zero (0, 1, 4, 6, 7); with 8 images in
  batches of 4 there are 2 batches per epoch, so one zero-advantage image (of 2, 3, 5) is put
  back, drawn with the (seed, epoch) generator: image 2. The 6 are shuffled and trained as two
  equal batches of 3 (one optimizer step each, gradient_accumulation_steps = 1).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import msgspec
import pytest
import torch
from conftest import advantages, checked, setup_state, tiny_overrides
from grpo_config import first_replay_tolerance

from rl_core.train import ConfigError, UserError, group_advantages, load_config

EXAMPLES = Path(__file__).resolve().parents[3] / "examples" / "diffusion-grpo"
REWARDS = torch.tensor([0, 0, 1, 1, 0.75, 0.25, 0, 1])
GROUPS = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
PROMPTS = ["p", "p", "q", "q", "p", "p", "s", "s"]
UNBIASED, POPULATION = (1.625 / 7) ** 0.5, (1.625 / 8) ** 0.5


def _preset(app, name: str, *overrides: str):
    path = app.DEFAULT_CONFIG if name == "ours" else EXAMPLES / f"{name}.toml"
    return load_config(app.Config, path, list(overrides))


@pytest.fixture(scope="module")
def state(app, tmp_path_factory):
    out = tmp_path_factory.mktemp("presets")
    return setup_state(app, load_config(app.Config, app.DEFAULT_CONFIG, tiny_overrides(out)))


def test_preset_files_fix_their_systems_knobs(app) -> None:
    knobs = ("adv_std", "adv_eps", "adv_eps_mode", "adv_scale", "adv_group_by", "zero_adv", "adv_clip")
    got = {name: tuple(getattr(_preset(app, name).train, k) for k in knobs) for name in ("ours", "flow_grpo", "vrl")}
    assert got == {
        "ours": ("unbiased", 1e-4, "add", "batch", "group", "drop", 5.0),
        "flow_grpo": ("population", 1e-4, "add", "batch", "prompt", "flow_grpo", 5.0),
        "vrl": ("population", 1e-8, "clamp", "batch", "group", "drop", 5.0),
    }
    for name in ("flow_grpo", "vrl"):  # the full-size files pass the app's own checks, shared numbers
        cfg = checked(app, "--config", str(EXAMPLES / f"{name}.toml"))
        assert (cfg.rollout.n, cfg.rollout.groups_per_epoch, cfg.train.micro_batch_size,
                cfg.train.gradient_accumulation_steps) == (8, 8, 8, 4)
        assert (cfg.train.lr, cfg.train.clip_range, cfg.algo.kl_coef, cfg.train.timestep_fraction) == (3e-4, 1e-4, 0.04, 0.99)
        assert (cfg.sampling.num_steps, cfg.sampling.guidance_scale, cfg.eval.num_steps) == (10, 4.5, 40)
    flow, vrl = _preset(app, "flow_grpo"), _preset(app, "vrl")
    assert (flow.eval.max_prompts, flow.eval.batch_size, flow.train.keep_last) == (1018, 16, 5)
    assert (vrl.eval.max_prompts, vrl.eval.batch_size, vrl.train.output_dir) == (16, 8, "outputs/sd3_5_ocr_grpo")


@pytest.mark.parametrize(("name", "expected", "steps"), [
    ("ours", [0, 0, 0, 0, 0.25 / (UNBIASED + 1e-4), -0.25 / (UNBIASED + 1e-4), -0.5 / (UNBIASED + 1e-4),
              0.5 / (UNBIASED + 1e-4)],
     [[(1, [0, 1, 2, 3])]]),
    ("vrl", [0, 0, 0, 0, 0.25 / POPULATION, -0.25 / POPULATION, -0.5 / POPULATION, 0.5 / POPULATION],
     [[(1, [0, 1, 2, 3])]]),
    ("flow_grpo", [-0.25 / (POPULATION + 1e-4), -0.25 / (POPULATION + 1e-4), 0, 0, 0.5 / (POPULATION + 1e-4), 0,
                   -0.5 / (POPULATION + 1e-4), 0.5 / (POPULATION + 1e-4)],
     # images (0, 2, 6) then (1, 4, 7): trajectory 0 holds images 0-3, trajectory 1 images 4-7
     [[(0, [0, 2]), (1, [2])], [(0, [1]), (1, [0, 3])]]),
])
def test_advantages_and_trained_images_per_preset(app, state, name: str, expected: list[float], steps: list) -> None:
    cfg, acc = _preset(app, name, "train.micro_batch_size=4", "train.gradient_accumulation_steps=1"), state.run.accelerator
    scores = app.grpo_scores(cfg, acc, REWARDS, GROUPS, PROMPTS, {})
    adv = group_advantages(scores.estimator, scores.rewards, scores.group_ids, accelerator=acc,
                           options=scores.options).advantages
    torch.testing.assert_close(adv, torch.tensor(expected), atol=1e-6, rtol=0)
    assert [round(a, 5) for a in adv.tolist()[4:6]] == {"ours": [0.51877, -0.51877], "vrl": [0.5547, -0.5547],
                                                      "flow_grpo": [1.10915, 0.0]}[name]
    plan = app.plan_micro_batches(cfg.train, acc, [4, 4], adv, epoch=0)
    assert [[(k, rows.tolist()) for k, rows, weight in step if weight] for step in plan] == steps
    if name == "flow_grpo":  # every step trains the same number of images
        assert [sum(len(rows) for _, rows, _ in step) for step in plan] == [3, 3]


def test_flow_grpo_refill_trains_equal_steps_end_to_end(app, state) -> None:
    """One epoch of the tiny model under the flow_grpo rule (2 prompts x 4 images): only images 0
    and 3 have a non-zero advantage; 8 images in micro-batches of 2 make 4 batches, so 2 zero
    ones are put back and two optimizer steps train 2 images each (the first replay on-policy).
    Under `drop` the same rewards train the 2 images in one step."""
    rewards = torch.tensor([0, 0.5, 0.5, 1, 1, 1, 1, 1])
    for zero_adv, optimizer_steps, trained in (("flow_grpo", 2, 4), ("drop", 1, 2)):
        cfg = msgspec.structs.replace(state.cfg, train=msgspec.structs.replace(
            state.cfg.train, zero_adv=zero_adv, micro_batch_size=2, gradient_accumulation_steps=2))
        preset = dataclasses.replace(state, cfg=cfg)
        batch = app.RECIPE.rollout(preset, 1)
        adv = advantages(app, preset, batch, rewards)
        assert (adv.advantages != 0).nonzero().flatten().tolist() == [0, 3]
        stats = app.RECIPE.update(preset, 1, batch, adv)
        assert (stats["optimizer_steps"], stats["adv/trained_samples"]) == (optimizer_steps, trained)
        assert stats["replay/engine_diff_max"] <= first_replay_tolerance(cfg, compiled=False)


def test_flow_grpo_needs_batches_that_divide(app) -> None:
    with pytest.raises(ConfigError, match=r"train\.micro_batch_size=3"):
        checked(app, "train.zero_adv=flow_grpo", "train.micro_batch_size=3")


def test_batches_are_checked_against_the_process_count(app) -> None:
    """Before any model loads (`Recipe.check` with the launch's process count)."""
    cfg = load_config(app.Config, app.DEFAULT_CONFIG, ["rollout.groups_per_epoch=3"])
    app.RECIPE.check(cfg, 1)
    with pytest.raises(ConfigError, match=r"rollout\.groups_per_epoch=3 must divide by the 2 processes"):
        app.RECIPE.check(cfg, 2)
    flow = load_config(app.Config, app.DEFAULT_CONFIG, ["train.zero_adv=flow_grpo", "rollout.groups_per_epoch=4",
                                                        "rollout.n=4", "rollout.sample_batch_size=4",
                                                        "train.micro_batch_size=4", "train.gradient_accumulation_steps=2"])
    app.RECIPE.check(flow, 2)  # 8 images per process: 2 batches of 4, one optimizer step
    with pytest.raises(ConfigError, match=r"the 4 images per process must divide"):
        app.RECIPE.check(flow, 4)  # 1 batch per process cannot fill steps of 2
    ray = load_config(app.Config, app.DEFAULT_CONFIG, ["rollout.workers=2"])
    with pytest.raises(ConfigError, match=r"rollout\.workers=2 with 2 trainer processes needs a running Ray cluster"):
        app.RECIPE.check(ray, 2)


def test_timestep_fraction_that_trains_no_step_is_refused(app) -> None:
    """Flow-GRPO trains range(int(steps x fraction)) steps: none for 4 x 0.2; refused, not run."""
    with pytest.raises(ConfigError, match=r"train\.timestep_fraction=0\.2 x sampling\.num_steps=4 trains no step"):
        checked(app, "sampling.num_steps=4", "train.timestep_fraction=0.2")
    cfg = checked(app, "sampling.num_steps=4", "train.timestep_fraction=0.25")
    assert cfg.train.timestep_fraction == 0.25


@pytest.mark.parametrize(("name", "hub_id"), [("janus_pro_1b", "deepseek-community/Janus-Pro-1B"),
                                               ("janus_pro_7b", "deepseek-community/Janus-Pro-7B")])
def test_janus_pro_presets_use_the_paper_sampling(app, name: str, hub_id: str) -> None:
    """Janus-Pro's generation script: CFG weight 5, temperature 1, 384x384, parallel_size 16."""
    cfg = checked(app, "--config", str(EXAMPLES / f"{name}.toml"))
    assert (cfg.model.family, cfg.model.path) == ("janus", hub_id)
    assert (cfg.sampling.guidance_scale, cfg.rollout.temperature, cfg.sampling.resolution, cfg.rollout.n) == (5.0, 1.0, 384, 16)
    # Janus samples on Ray workers too (tests/test_ray_rollout.py)
    assert checked(app, "--config", str(EXAMPLES / f"{name}.toml"), "rollout.workers=2").rollout.workers == 2


def test_janus_resolution_must_be_the_checkpoints(app, tmp_path: Path) -> None:
    from conftest import tiny_config

    with pytest.raises(UserError, match=r"sampling\.resolution=64: .* 32x32 .* sampling\.resolution=32"):
        setup_state(app, tiny_config(app, "janus", tmp_path, "sampling.resolution=64"))


def test_normalize_then_sum_normalises_each_component_in_its_group(app, state) -> None:
    """algo.reward_aggregation=normalize_then_sum: the images' components reach the loop's group
    advantages with the reward's weights (GDPO), in place of train.adv_* on the weighted sum."""
    from rl_core.advantages import normalize_then_sum

    cfg = _preset(app, "ours", "algo.reward_aggregation=normalize_then_sum")
    components = [{"ocr": float(i % 2), "brightness": 0.1 * i} for i in range(8)]
    weights = {"ocr": 1.0, "brightness": 0.1}
    scores = app.grpo_scores(cfg, state.run.accelerator, REWARDS, GROUPS, PROMPTS, {}, components=components,
                             weights=weights)
    assert scores.aggregation == "normalize_then_sum" and scores.weights == weights
    objectives = torch.tensor([[c["brightness"], c["ocr"]] for c in components])  # [8, 2], sorted names
    expected = normalize_then_sum(objectives, torch.tensor([0.1, 1.0]), GROUPS)
    from rl_core.train.loop import _objectives

    adv = group_advantages(scores.estimator, scores.rewards, scores.group_ids, accelerator=state.run.accelerator,
                           options=scores.options, **_objectives(scores)).advantages
    torch.testing.assert_close(adv, expected, atol=1e-6, rtol=0)
    with pytest.raises(ConfigError, match="needs the reward in process"):
        app.check_config(_preset(app, "ours", "algo.reward_aggregation=normalize_then_sum",
                                 "reward.url=http://127.0.0.1:1"), 1)


@pytest.mark.parametrize(("mode", "step", "replayed"), [("random", 1, 2), ("sliding", 3, 1)])
def test_sde_window_epoch_trains_only_its_steps(app, state, mode: str, step: int, replayed: int) -> None:
    """One epoch of the tiny run (4 sampling steps, trained k < 3) with a 2-step window: each
    sampled batch is stochastic (non-zero log-probs) inside its window and sampled with the ODE
    (log-prob 0, nothing to replay) outside it, and the update replays the window's steps only.
    `random` (Flow-GRPO-Fast): 2 steps at a drawn place. `sliding` (MixGRPO), moved every epoch:
    the third epoch (step 3) is the last place, [2, 3), cut to 1 step."""
    sampling = msgspec.structs.replace(state.cfg.sampling, sde_window_mode=mode, sde_window_size=2, shift_interval=1)
    algo = msgspec.structs.replace(state.cfg.algo, kl_coef=0.0)  # no reference forward: a shorter test
    preset = dataclasses.replace(state, cfg=msgspec.structs.replace(state.cfg, sampling=sampling, algo=algo))
    batch = app.RECIPE.rollout(preset, step)
    windows = [app.sde_window(preset.cfg, step - 1, first) for first in (0, 4)]  # one per sampled batch of 4
    assert all(stop - start == replayed for start, stop in windows)
    for traj, (start, stop) in zip(batch.samples, windows, strict=True):
        assert traj.sde_steps.nonzero().flatten().tolist() == list(range(start, stop))
        assert bool((traj.log_probs[:, start:stop] != 0).all())
        assert traj.log_probs[:, :start].abs().sum() == 0 and traj.log_probs[:, stop:].abs().sum() == 0
    stats = app.RECIPE.update(preset, step, batch, advantages(app, preset, batch, torch.tensor([0, 0.25, 0.5, 1] * 2)))
    assert stats["replay/steps_per_batch"] == replayed
    assert (stats["replay/first_step"], stats["replay/last_step"]) == (min(w[0] for w in windows), max(w[1] - 1 for w in windows))
    assert stats["replay/engine_diff_max"] <= first_replay_tolerance(preset.cfg, compiled=False)


def test_window_presets_load_and_train_their_upstream_windows(app) -> None:
    """flow_grpo_fast.toml: flow_grpo.toml's recipe with a random 2-step window in [0, 5) (first
    step 0..3); mixgrpo.toml: a 4-step window sliding by 1 every 25 epochs in [0, 23), so epoch
    50 trains [2, 6), epoch 500 (place 20) [20, 23), epoch 575 (place 23 = back to 0) [0, 4)."""
    fast = checked(app, "--config", str(EXAMPLES / "flow_grpo_fast.toml"))
    flow = _preset(app, "flow_grpo")
    assert msgspec.structs.replace(fast.sampling, sde_window_mode="fixed", sde_window_size=2, sde_window_range=None) \
        == flow.sampling and fast.train.lr == flow.train.lr and fast.rollout == flow.rollout
    assert {app.sde_window(fast, 0, first)[0] for first in range(0, 400, 8)} == {0, 1, 2, 3}
    assert all(stop - start == 2 for start, stop in (app.sde_window(fast, e, 0) for e in range(20)))
    mix = checked(app, "--config", str(EXAMPLES / "mixgrpo.toml"))
    assert (mix.sampling.num_steps, mix.rollout.n, mix.train.lr, mix.algo.kl_coef, mix.train.clip_range) == (25, 12, 1e-5, 0, 1e-4)
    assert [app.sde_window(mix, e, 0) for e in (0, 24, 25, 50, 500, 574, 575)] == [
        (0, 4), (0, 4), (1, 5), (2, 6), (20, 23), (22, 23), (0, 4)]


def test_diffusion_nft_preset_carries_upstreams_numbers(app) -> None:
    """diffusion_nft.toml: DiffusionNFT's sd3_ocr (config/nft.py on config/base.py). Upstream sizes
    the epoch for 8 GPUs: 48 prompts x 24 images, 144 per GPU in 16 batches of 9, two optimizer
    steps of 8 batches each; on 8 processes the preset gives the same."""
    cfg = checked(app, "--config", str(EXAMPLES / "diffusion_nft.toml"))
    app.RECIPE.check(cfg, 8)
    s, r, t, n, e = cfg.sampling, cfg.rollout, cfg.train, cfg.nft, cfg.eval
    assert (t.method, s.kind, s.guidance_scale, s.num_steps, s.resolution) == ("nft", "ode", 1.0, 10, 512)
    assert (r.n, r.groups_per_epoch, r.sample_batch_size, t.micro_batch_size) == (24, 48, 9, 9)
    per_process = r.groups_per_epoch // 8 * r.n
    assert (per_process, per_process // t.micro_batch_size // t.gradient_accumulation_steps) == (144, 2)
    assert (n.beta, n.old_decay_start, n.old_decay_rate, n.old_decay_max) == (0.1, 75, 0.0075, 0.999)
    assert (t.lr, t.weight_decay, t.grad_clip, cfg.algo.kl_coef, t.adv_clip, t.timestep_fraction) == (
        3e-4, 1e-4, 1.0, 1e-4, 5.0, 0.99)
    assert (t.adv_scale, t.adv_std, t.adv_eps, t.adv_eps_mode, t.adv_group_by) == (
        "batch", "population", 1e-4, "add", "prompt")
    assert (t.ema_decay, t.ema_interval, t.save_freq, t.seed) == (0.9, 1, 30, 42)
    assert (t.eval_freq, e.num_steps, e.guidance_scale, e.batch_size) == (10, 40, 1.0, 16)
    assert (cfg.model.lora_rank, cfg.model.lora_alpha, cfg.reward.components) == (32, 64, {"ocr": 1.0})


def test_grpo_guard_preset_carries_upstreams_numbers(app) -> None:
    """grpo_guard.toml: GRPO-Guard's general_ocr_sd3_rationorm. Upstream sizes the epoch for 16
    GPUs: 48 prompts x 24 images, 72 per GPU in 8 batches of 9, two optimizer steps of 4 batches;
    on 16 processes the preset gives the same, and RatioNorm is on."""
    cfg = checked(app, "--config", str(EXAMPLES / "grpo_guard.toml"))
    app.RECIPE.check(cfg, 16)
    s, r, t = cfg.sampling, cfg.rollout, cfg.train
    assert (t.method, t.ratio_norm, s.kind, s.guidance_scale, s.num_steps, s.noise_level) == ("grpo", True, "sde", 4.5, 10, 0.7)
    assert (r.n, r.groups_per_epoch, r.sample_batch_size, t.micro_batch_size) == (24, 48, 9, 9)
    per_process = r.groups_per_epoch // 16 * r.n
    assert (per_process, per_process // t.micro_batch_size // t.gradient_accumulation_steps) == (72, 2)
    assert (t.lr, t.clip_range, cfg.algo.kl_coef, t.timestep_fraction) == (1e-4, 2e-6, 0.0, 0.99)
    assert (t.adv_scale, t.adv_std, t.adv_eps, t.adv_group_by, t.zero_adv) == ("group", "population", 1e-4, "prompt",
                                                                               "flow_grpo")
    assert (t.eval_freq, cfg.eval.num_steps, t.save_freq, cfg.reward.components) == (30, 40, 30, {"ocr": 1.0})


# dynamo reads `.grad` of non-leaf fake tensors while tracing the replay (its own UserWarning)
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf:UserWarning")
def test_flow_grpo_replay_compiles_no_new_block_graph_after_the_first_epoch(app, state) -> None:
    """Flow-GRPO's shuffled batches mix sampled batches; the update replays each optimizer step's
    rows in forwards of train.micro_batch_size rows, so the compiled blocks see the same shapes in
    every epoch and the second compiles nothing. (A forward per sampled batch ran 2 + 2 rows here in
    epoch 1 and 1 + 3 in epoch 2, a new graph per new size in every epoch: at SD3.5-M shape the
    update took ~6x the replay benchmark's.) The blocks are compiled as `DiffusionEngine(compile=
    True)` compiles them (`fullgraph=True, dynamic=False`) with dynamo's `eager` backend: the same
    guards and recompiles without inductor's code generation, minutes on a CPU (that compile:
    test_recipe.py's `test_compiled_blocks_sample_and_replay_within_the_replay_tolerance`, slow)."""
    from torch._dynamo.utils import counters

    train = msgspec.structs.replace(state.cfg.train, zero_adv="flow_grpo", micro_batch_size=2,
                                    gradient_accumulation_steps=2)
    preset = dataclasses.replace(state, cfg=msgspec.structs.replace(state.cfg, train=train))
    blocks = state.family.engine.transformer.transformer_blocks
    torch._dynamo.reset()
    for block in blocks:
        block.forward = torch.compile(block.forward, fullgraph=True, dynamic=False, backend="eager")
    graphs = []
    try:
        for step in (1, 2):
            before = counters["stats"]["unique_graphs"]
            with torch.compiler.set_stance("fail_on_recompile" if step == 2 else "default"):
                batch = app.RECIPE.rollout(preset, step)
                adv = advantages(app, preset, batch, torch.tensor([0, 0.25, 0.5, 1, 1, 0.5, 0, 0.75]))
                stats = app.RECIPE.update(preset, step, batch, adv)
            graphs.append(counters["stats"]["unique_graphs"] - before)
            assert stats["optimizer_steps"] == 2
    finally:
        for block in blocks:
            del block.forward  # back to the eager forward for the module's other tests
        torch._dynamo.reset()
    assert graphs == [6, 0]  # sampling (no grad), replay (grad), LoRA-off reference x the 2 tiny block kinds
