"""The recipe end to end on tiny SD3 and tiny Janus (model.family, one parametrised suite):
training changes every LoRA weight, writes VRL's outputs under the metric names of the table,
resumes exactly, guards against NaN gradients and rollout/replay mismatches; bad input stops in
one line before any model loads."""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import re
from pathlib import Path

import pytest
import torch
from conftest import (
    APP,
    CONFIGS,
    advantages,
    checked,
    flat,
    setup_state,
    tiny_config,
    tiny_overrides,
    train,
)
from grpo_config import RewardConfig, compiles_blocks, first_replay_tolerance, read_prompts
from PIL import Image

from rl_core.train import (
    ConfigError,
    GroupAdvantages,
    UserError,
    load_config,
    run_app,
    trainable_parameters,
    unknown_metric_names,
)
from rl_core.train.testing import run_cli

REPO = APP.parents[1]


def _config(app, out: Path, *extra: str):
    return load_config(app.Config, app.DEFAULT_CONFIG, tiny_overrides(out, *extra))


def _rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def _lora(ckpt: Path) -> dict[str, torch.Tensor]:
    return torch.load(ckpt / "lora.pt", weights_only=True)


@pytest.fixture(scope="module", params=["sd3", "janus"])
def family(request) -> str:
    """model.family: each test below that takes `full_run` or `run` runs once per family."""
    return request.param


@pytest.fixture(scope="module")
def full_run(app, family: str, tmp_path_factory) -> Path:
    """2 epochs, a checkpoint after each, eval at epochs 0 and 2 (2 prompts; sd3: 4 ODE steps)."""
    out = tmp_path_factory.mktemp(f"full-{family}")
    cfg = tiny_config(app, family, out, "train.epochs=2", "train.save_freq=1", "train.keep_last=3",
                      "train.eval_freq=100", "eval.max_prompts=2", "eval.num_steps=4")
    return train(app, cfg)


# sd3: the last MMDiT block is `context_pre_only`: its text-token queries (add_q_proj) reach no
# output, so that adapter's B gets no gradient and stays 0 (its A still moves by weight decay).
# janus: every adapter of the language model reaches the image-token head.
DEAD = {"sd3": ["transformer_blocks.1.attn.add_q_proj.lora_B"], "janus": []}


def test_every_lora_parameter_changes(app, family: str, full_run: Path) -> None:
    first, last = _lora(full_run / "checkpoints" / "checkpoint-1"), _lora(full_run / "checkpoints" / "checkpoint-2")
    assert len(last) > 0 and all(".lora_" in name for name in last)
    unchanged = [name for name in last if torch.equal(first[name], last[name])]
    assert [[d for d in DEAD[family] if d in name] for name in unchanged] == [[d] for d in DEAD[family]], \
        f"unchanged between epochs 1 and 2: {unchanged[:5]}"
    ema = torch.load(full_run / "checkpoints" / "checkpoint-2" / "ema.pt", weights_only=True)
    assert ema["updates"] > 0 and any(not torch.equal(ema["shadow"][k], last[k]) for k in last)


def test_outputs_match_vrl(full_run: Path) -> None:
    rows = _rows(full_run / "metrics.csv")
    assert unknown_metric_names(rows[0].keys()) == []  # every column is a name of the shared table
    train = [r for r in rows if r.get("reward/mean")]
    assert [int(r["step"]) for r in train] == [1, 2]
    for key in ("reward/std", "reward/brightness", "reward/zero_std_group_fraction", "adv/std",
                "loss/total", "loss/policy", "loss/kl", "policy/clip_fraction", "policy/approx_kl", "grad_norm",
                "time/rollout", "time/reward", "time/update", "throughput/samples_per_s", "image/brightness",
                "optimizer_steps", "rollout/weight_version"):
        assert train[0].get(key) not in (None, ""), key
    # micro-batches are the sampled batches (nothing dropped): the first replay is bit-exact
    assert all(float(r["replay/engine_diff_max"]) == 0.0 for r in train if float(r["adv/kept_fraction"]) == 1)
    evals = [r for r in rows if r.get("eval/reward/mean")]  # before the first epoch and after the last
    assert [int(r["step"]) for r in evals] == [0, 2]
    assert all(0 <= float(r["eval/image/brightness"]) <= 1 and float(r["eval/image/colour_entropy"]) > 0 for r in evals)
    with Image.open(full_run / "eval_epoch_2" / "contact_sheet.png") as sheet:
        assert sheet.size[0] >= 256 and sheet.size[1] > 256  # images with their prompt under them
    assert (full_run / "reward_curve.png").stat().st_size > 0
    samples = [json.loads(line) for line in (full_run / "samples" / "train.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [1] * 8 + [2] * 8 and all(0 <= s["reward"] <= 1 for s in samples)
    for folder in ("checkpoint-final/lora", "checkpoint-final/lora_ema", "checkpoints/checkpoint-2/lora"):
        config = json.loads((full_run / folder / "adapter_config.json").read_text())
        assert config["r"] == 8 and (full_run / folder / "adapter_model.safetensors").is_file()


def test_resume_equals_uninterrupted_run(app, family: str, full_run: Path, tmp_path: Path) -> None:
    first = train(app, tiny_config(app, family, tmp_path, "train.epochs=1", "train.save_freq=1"))
    resumed = train(app, tiny_config(app, family, tmp_path, "train.epochs=2", "train.save_freq=1"), resume="latest")
    assert resumed == first
    a, b = full_run / "checkpoints" / "checkpoint-2", resumed / "checkpoints" / "checkpoint-2"
    for name in ("lora.pt", "ema.pt", "optimizer.pt"):
        sa, sb = torch.load(a / name, weights_only=True), torch.load(b / name, weights_only=True)
        assert json.dumps(flat(sa)) == json.dumps(flat(sb)), name
    steps = [int(r["step"]) for r in _rows(resumed / "metrics.csv") if r.get("reward/mean")]
    assert steps == [1, 2]  # one row per epoch, as if uninterrupted
    again = train(app, tiny_config(app, family, tmp_path, "train.epochs=2", "train.save_freq=1"), resume="latest")
    assert again == first and [int(r["step"]) for r in _rows(again / "metrics.csv")] == [1, 2]  # finished: stops at once


@pytest.fixture(scope="module")
def state(app, family: str, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"run-{family}")
    return setup_state(app, tiny_config(app, family, out, "algo.kl_coef=0.04"))


def test_nan_loss_skips_the_step_and_three_in_a_row_stop(app, state) -> None:
    """A non-finite loss skips the optimizer step: LoRA, optimizer and EMA untouched, counted;
    `train.max_nonfinite_steps` (3) in a row stop the run."""
    from rl_core.train import NonFiniteError

    recipe, batch = app.RECIPE, app.RECIPE.rollout(state, 1)
    nan = torch.full((8,), math.nan)  # NaN advantages -> NaN loss and gradients
    adv = GroupAdvantages(nan, torch.ones(8, dtype=torch.bool), {})
    params = list(trainable_parameters(state.family.peft).values())
    before = [p.detach().clone() for p in params]
    ema, steps = {k: v.clone() for k, v in state.ema.shadow.items()}, state.ema.steps
    state.run.guard.consecutive = 0
    stats = recipe.update(state, 1, batch, adv)  # 2 optimizer steps, both skipped
    assert stats["nonfinite/skipped_steps"] == 2.0 and stats["optimizer_steps"] == 0.0
    assert state.ema.steps == steps and all(torch.equal(b, p) for b, p in zip(before, params, strict=True))
    assert all(torch.equal(ema[k], state.ema.shadow[k]) for k in ema)
    assert all(p.grad is None for p in params)
    with pytest.raises(NonFiniteError, match="3 optimizer steps in a row"):
        recipe.update(state, 1, batch, adv)
    state.run.guard.consecutive = 0


def test_first_replay_mismatch_stops_the_run(app, state) -> None:
    recipe, batch = app.RECIPE, app.RECIPE.rollout(state, 1)
    adv = advantages(app, state, batch, torch.arange(8, dtype=torch.float32))  # every group has spread: all kept
    stats = recipe.update(state, 1, batch, adv)  # on-policy: passes, with a KL term
    assert stats["replay/engine_diff_max"] == 0.0 and stats["loss/kl"] >= 0 and state.ema.steps == 2
    tampered = dataclasses.replace(batch, samples=[dataclasses.replace(batch.samples[0], log_probs=batch.samples[0].log_probs + 1e-3)],
                                   records=batch.records[:4], group_ids=batch.group_ids[:4], images=batch.images[:4])
    fresh = recipe.rollout(state, 2)  # new weights, new rollout: on-policy again
    assert recipe.update(state, 2, fresh, adv)["replay/engine_diff_max"] == 0.0
    with pytest.raises(RuntimeError, match=r"step 3: first replay.*algo\.replay_tolerance"):
        recipe.update(state, 3, tampered, GroupAdvantages(adv.advantages[:4], adv.valid[:4], {}))


def test_compile_and_the_first_replay_tolerance_follow_the_device_and_the_batches(app, tmp_path: Path) -> None:
    """model.compile unset compiles SD3's blocks on CUDA only (not sharded, not Janus); the unset
    algo.replay_tolerance is 1e-5 only where the replay repeats the rollout's kernels on its
    batches, else 1e-4 in float32 and 5e-2 in bf16; set values are used as given."""
    cfg = _config(app, tmp_path)  # float32, micro-batch = sampled batch = 4, zero_adv 'drop'
    assert (cfg.model.compile, cfg.algo.replay_tolerance) == (None, None)
    assert (compiles_blocks(cfg, "cpu"), compiles_blocks(cfg, "cuda")) == (False, True)
    assert (first_replay_tolerance(cfg, compiled=False), first_replay_tolerance(cfg, compiled=True)) == (1e-5, 1e-4)
    bf16 = _config(app, tmp_path, 'model.dtype="bfloat16"')
    assert (first_replay_tolerance(bf16, compiled=False), first_replay_tolerance(bf16, compiled=True)) == (1e-5, 5e-2)
    for other_batches in ("train.micro_batch_size=2", 'train.zero_adv="flow_grpo"'):
        assert first_replay_tolerance(_config(app, tmp_path, other_batches), compiled=False) == 1e-4, other_batches
    assert not compiles_blocks(_config(app, tmp_path, 'train.sharding="fsdp2"'), "cuda")
    assert not compiles_blocks(_config(app, tmp_path, "model.compile=false"), "cuda")
    assert compiles_blocks(_config(app, tmp_path, "model.compile=true"), "cpu")
    assert first_replay_tolerance(_config(app, tmp_path, "algo.replay_tolerance=0.3"), compiled=True) == 0.3
    janus = tiny_config(app, "janus", tmp_path)
    assert not compiles_blocks(janus, "cuda")
    assert first_replay_tolerance(janus, compiled=False) == 1e-5  # log-probs rescored teacher-forced
    decode = tiny_config(app, "janus", tmp_path, 'janus.logprobs="decode"')
    assert first_replay_tolerance(decode, compiled=False) == 1e-4  # the KV-cached decode's own log-probs


def test_config_errors_name_the_key(app, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"train\.lrr"):
        _config(app, tmp_path, "train.lrr=1")
    with pytest.raises(ConfigError, match=r"sampling\.kind"):
        _config(app, tmp_path, "sampling.kind=ddim")
    with pytest.raises(ConfigError, match=r"sampling\.attention_backend"):
        _config(app, tmp_path, "sampling.attention_backend=sage")
    with pytest.raises(UserError, match="no non-zero weight"):
        checked(app, "reward.components={ocr=0.0}")


def test_help_lists_every_vrl_knob(app, capsys) -> None:
    assert app.main(["--help"]) is None
    text = capsys.readouterr().out
    for key in ("rollout.n", "sampling.guidance_scale", "train.clip_range", "algo.kl_coef",
                "train.gradient_accumulation_steps", "eval.num_steps", "eval.use_ema", "reward.url"):
        assert key in text


@pytest.mark.parametrize(("argv", "line"), [
    (["--help"], None),
    (["train.nope=1"], r"diffusion-grpo: error: unknown config key 'train\.nope' \(override train\.nope=1\): no field"),
    (["algo.kl=k4"], r"diffusion-grpo: error: algo\.kl: unknown KL estimator 'k4'; valid names: k1, k2, k3, "),
    (["train.kl_beta=0"], r"diffusion-grpo: error: train\.kl_beta was renamed: use algo\.kl_coef$"),
    (["janus.temperature=0.7"], r"diffusion-grpo: error: janus\.temperature was renamed: use rollout\.temperature$"),
    (["train.lr=fast"], r"diffusion-grpo: error: train\.lr: expected float, got 'fast' \(from override train\.lr=fast\)$"),
    (["model.dtype=float8", "model.path=/nope"], r"diffusion-grpo: error: model\.dtype: unknown value 'float8'; "
     r"valid choices: auto, float32, fp32, bfloat16, bf16, float16, fp16 \(from override model\.dtype=float8\)$"),
    (["model.text_encoder_dtype=fp8", "model.path=/nope"], r"diffusion-grpo: error: model\.text_encoder_dtype: unknown "
     r"value 'fp8'; valid choices: auto, float32, "),
])
def test_help_and_config_errors_answer_before_torch_is_imported(argv: list[str], line: str | None) -> None:
    """The command line and the config are read before the recipe (and torch) loads."""
    done = run_cli(APP, *argv, cwd=REPO)
    assert not done.imported_torch
    if line is None:
        assert done.returncode == 0 and "algo.kl_coef" in done.stdout and "VRL_OUTPUT_DIR" in done.stdout
        assert max(map(len, done.stdout.splitlines())) < 100  # wrapped: off a terminal, to 100 columns
    else:
        assert done.returncode == 2 and len(done.stderr.splitlines()) == 1 and re.match(line, done.stderr), done.stderr


def test_aesthetic_and_clip_score_rewards_from_the_command_line(app, tmp_path: Path) -> None:
    """VRL's reward override, as typed on the command line: OCR off, aesthetic + CLIPScore on
    (the tiny CLIP stands in for ViT-L/14 when the model is tiny)."""
    overrides = [o for o in tiny_overrides(tmp_path) if not o.startswith("reward.")]
    argv = [*overrides, "reward.components.ocr=0.0", "reward.components.aesthetic=1.0",
            "reward.components.clip_score=0.5", "reward.components.brightness=0", "train.eval_freq=1", "eval.max_prompts=2", "eval.num_steps=2",
            "train.epochs=1"]
    run = app.main(argv)
    assert run == (tmp_path / "latest").resolve()
    rows = _rows(run / "metrics.csv")
    row = next(r for r in rows if r.get("reward/mean"))
    assert not row.get("reward/ocr") and not row.get("reward/brightness") and float(row["reward/failed"]) == 0
    aesthetic, clip = float(row["reward/aesthetic"]), float(row["reward/clip_score"])
    assert float(row["reward/mean"]) == pytest.approx(aesthetic + 0.5 * clip, abs=1e-6)
    assert float(row["reward/std"]) > 0  # the random tiny heads still tell the images apart
    evals = [r for r in rows if r.get("eval/reward/mean")]
    assert [r["step"] for r in evals] == ["0", "1"] and all(r["eval/reward/clip_score"] != "" for r in evals)


def test_trains_from_a_save_to_disk_directory(app, tmp_path: Path) -> None:
    """data.manifest / data.eval_manifest name a `datasets` save_to_disk directory whose
    `prompt` column holds manifest lines; one epoch trains on exactly those prompts."""
    import datasets

    lines = (Path(__file__).resolve().parents[3] / "examples/data/ocr/train.txt").read_text().splitlines()[:4]
    folder = tmp_path / "ocr_ds"
    datasets.Dataset.from_dict({"prompt": lines}).save_to_disk(str(folder))
    assert [p.prompt for p in read_prompts(str(folder), "data.manifest")] == lines
    assert read_prompts(str(folder), "data.manifest")[0].target == lines[0].split('"')[1]
    out = train(app, _config(app, tmp_path / "out", f"data.manifest={folder}", f"data.eval_manifest={folder}",
                             "train.epochs=1"))
    assert [r["step"] for r in _rows(out / "metrics.csv") if r.get("reward/mean")] == ["1"]
    with pytest.raises(UserError, match=r"data\.manifest: .*no-such-manifest\.txt"):
        read_prompts(str(tmp_path / "no-such-manifest.txt"), "data.manifest")


@pytest.mark.parametrize("key", ["data.manifest", "data.eval_manifest"])
def test_empty_or_undecodable_manifest_is_one_line_and_exit_2(app, tmp_path: Path, capsys, key: str) -> None:
    """The data is read before any model loads: `model.path` names no model at all, and the
    error is still the data's."""
    empty, latin = tmp_path / "empty.txt", tmp_path / "latin.txt"
    empty.write_text("\n  \n")
    latin.write_bytes('A sign that says "OPEN"\nA caf\xe9 sign that says "CAF\xc9"\n'.encode("latin-1"))
    for path, message in ((empty, f"{key}='{empty}' holds no prompt"), (latin, f"{key}: {latin}: line 2: not valid UTF-8")):
        argv = [*tiny_overrides(tmp_path / "out"), f"{key}={path}", f"model.path={tmp_path / 'no-model'}"]
        assert run_app(app.RECIPE.name, app.main, argv) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"diffusion-grpo: error: {message}") and len(err.splitlines()) == 1, err


def test_reward_spec_inline_or_from_a_file(app, tmp_path: Path) -> None:
    """`reward.spec` gives a whole RewardSpec, from a TOML file or inline; it trains as the
    shorthand `reward.components` it replaces."""
    spec = tmp_path / "reward.toml"
    spec.write_text('[components.b]\nscorer = "brightness"\nweight = 2.0\n')
    from_file = app.reward_spec(RewardConfig(spec=str(spec)), tiny=True)
    inline = load_config(app.Config, app.DEFAULT_CONFIG, ["reward.spec.components.b.scorer=brightness",
                                                         "reward.spec.components.b.weight=2.0"]).reward
    shorthand = load_config(app.Config, app.DEFAULT_CONFIG, ["reward.components={brightness=2.0}"]).reward
    assert from_file == app.reward_spec(inline, tiny=True)
    assert app.reward_spec(shorthand, tiny=True).components["brightness"].weight == from_file.components["b"].weight
    with pytest.raises(UserError, match=r"reward\.spec='nope\.toml'"):
        checked(app, "reward.spec=nope.toml")
    out = train(app, _config(app, tmp_path / "out", f"reward.spec={spec}", "train.epochs=1"))
    [row] = [r for r in _rows(out / "metrics.csv") if r.get("reward/mean")]
    assert float(row["reward/mean"]) == pytest.approx(2 * float(row["reward/b"]), rel=1e-6)


def test_compile_is_refused_where_it_does_not_apply(app) -> None:
    with pytest.raises(ConfigError, match=r"model\.compile=true compiles an unsharded sd3, wan or cosmos .* "
                                          r"model\.family='janus'"):
        checked(app, "--config", str(CONFIGS["janus"]), "model.compile=true")
    with pytest.raises(ConfigError, match=r"train\.sharding='fsdp2'"):
        checked(app, "model.compile=true", "train.sharding=fsdp2")
    checked(app, "--config", str(APP / "configs" / "wan_tiny.toml"), "model.compile=true")  # video: when asked


def test_janus_window_settings_are_token_positions_checked_before_and_at_load(app, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"set sampling\.sde_window_range=\[start, limit\) in tokens"):
        checked(app, "--config", str(CONFIGS["janus"]), "sampling.sde_window_mode=random")
    with pytest.raises(ConfigError, match=r"sampling\.sde_window=\[5, 5\] must be \[start, stop\)"):
        checked(app, "--config", str(CONFIGS["janus"]), "sampling.sde_window=[5,5]")
    with pytest.raises(ConfigError, match=r"sampling\.sde_window_size=8 does not fit"):
        checked(app, "--config", str(CONFIGS["janus"]), "sampling.sde_window_mode=random",
                "sampling.sde_window_size=8", "sampling.sde_window_range=[10,16]")
    with pytest.raises(UserError, match=r"sampling\.sde_window=\[4, 20\]: this Janus checkpoint draws 16 image tokens"):
        train(app, tiny_config(app, "janus", tmp_path, "sampling.sde_window=[4,20]", "train.epochs=1"))


def test_janus_trains_a_window_of_its_image_tokens(app, tmp_path: Path) -> None:
    """A fixed window [4, 12) of the tiny checkpoint's 16 tokens: the replay runs the first 12
    tokens only, and its log-probs still equal the rollout's to the default algo.replay_tolerance (1e-5):
    the run would stop at the first replay otherwise. MixGRPO's sliding window moves by epoch."""
    out = train(app, tiny_config(app, "janus", tmp_path / "fixed", "sampling.sde_window=[4,12]", "train.epochs=1"))
    [row] = [r for r in _rows(out / "metrics.csv") if r.get("replay/steps_per_batch")]
    assert (float(row["replay/steps_per_batch"]), float(row["replay/first_step"]), float(row["replay/last_step"])) == (8, 4, 11)
    out = train(app, tiny_config(app, "janus", tmp_path / "sliding", "sampling.sde_window_mode=sliding",
                                 "sampling.sde_window_size=4", "sampling.sde_window_range=[0,16]",
                                 "sampling.shift_interval=1", "sampling.window_stride=4", "train.epochs=2"))
    rows = [r for r in _rows(out / "metrics.csv") if r.get("replay/first_step")]
    assert [(float(r["replay/first_step"]), float(r["replay/last_step"])) for r in rows] == [(0, 3), (4, 7)]


# torch's dynamo reads `.grad` of non-leaf fake tensors while tracing the replay (a UserWarning of
# its own, an error under this suite's filterwarnings)
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf:UserWarning")
@pytest.mark.slow  # ~45 s of compiling on 2 cores; rl-rollout's default suite checks compiled sampling = eager
def test_compiled_blocks_sample_and_replay_within_the_replay_tolerance(app, tmp_path: Path) -> None:
    """model.compile=true: the blocks compiled for sampling (no grad) and for the replay (grad) are
    different graphs; in float32 on the CPU the first replay still passes the default
    algo.replay_tolerance (1e-5), and the LoRA trains."""
    cfg = _config(app, tmp_path, "model.compile=true", "train.epochs=1", "train.save_freq=1")
    run_dir = train(app, cfg)
    [row] = [r for r in _rows(run_dir / "metrics.csv") if r.get("replay/engine_diff_max")]
    assert float(row["replay/engine_diff_max"]) < 1e-5
    assert any(v.abs().sum() > 0 for k, v in _lora(run_dir / "checkpoints" / "checkpoint-1").items() if "lora_B" in k)
