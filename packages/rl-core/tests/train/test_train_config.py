"""rl_core.train.config: precedence, value parsing, errors naming the field and source, help
text, TOML round trip, CLI splitting."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Annotated, ClassVar, Literal, get_args

import msgspec
import pytest

from rl_core.train import RewardAggregationName  # exported from the package, as the apps import it
from rl_core.train.config import (
    AdvantageName,
    AppConfig,
    CliArgs,
    ConfigError,
    config_help,
    dump_config,
    load_config,
    parse_cli,
)
from rl_core.train.fields import CompileMode, DType, RunFields, TrackerName


class OptimConfig(msgspec.Struct, kw_only=True, frozen=True):
    lr: Annotated[float, msgspec.Meta(gt=0, description="AdamW learning rate")] = 1e-5
    betas: list[float] = msgspec.field(default_factory=lambda: [0.9, 0.999])
    warmup: int = 0  # linear warmup steps


class EvalConfig(msgspec.Struct, kw_only=True, frozen=True):
    every: int = 10
    """Evaluate every N steps."""
    seeds: list[int] = msgspec.field(default_factory=list)


class JudgeConfig(msgspec.Struct, kw_only=True, frozen=True):
    module: str
    weight: float = 1.0  # scales this judge's score


class Config(msgspec.Struct, kw_only=True, frozen=True):
    name: str = "run"
    steps: int = 100
    estimator: Literal["grpo", "rloo"] = "grpo"
    bf16: bool = True
    seed: int | None = 0
    tags: list[str] = msgspec.field(default_factory=list)
    weights: dict[str, float] = msgspec.field(default_factory=lambda: {"qa": 1.0})
    optim: OptimConfig = msgspec.field(default_factory=OptimConfig)
    eval: EvalConfig | None = None
    judges: list[JudgeConfig] = msgspec.field(default_factory=list)


ENV = {"TEST_RL_LR": "optim.lr", "TEST_RL_STEPS": "steps", "TEST_RL_WARMUP": "optim.warmup"}


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ENV:
        monkeypatch.delenv(var, raising=False)


def _write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def test_defaults_when_nothing_given() -> None:
    assert load_config(Config) == Config()


@pytest.mark.parametrize("suffix", [".toml", ".yaml"])
def test_precedence_defaults_file_env_cli(tmp_path: Path, suffix: str,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    text = {
        ".toml": 'steps = 7\nname = "from-file"\n[optim]\nlr = 0.5\nwarmup = 3\n',
        # YAML 1.1 reads 5e-1 as a string; the lax conversion still yields a float
        ".yaml": "steps: 7\nname: from-file\noptim:\n  lr: 5e-1\n  warmup: 3\n",
    }[suffix]
    path = _write(tmp_path / f"c{suffix}", text)
    monkeypatch.setenv("TEST_RL_STEPS", "8")  # env beats file
    monkeypatch.setenv("TEST_RL_LR", "0.25")  # env beats file, CLI beats env
    cfg = load_config(Config, path, ["optim.lr=0.125"], env=ENV)
    assert cfg.name == "from-file"  # file beats default
    assert cfg.steps == 8
    assert cfg.optim.lr == 0.125
    assert cfg.optim.warmup == 3  # file only
    assert cfg.optim.betas == [0.9, 0.999]  # default only
    assert cfg.estimator == "grpo"


def test_override_value_syntax() -> None:
    cfg = load_config(Config, overrides=[
        "name=123",  # a str field takes the raw text
        "tags=a,b",  # comma list
        "optim.betas=[0.5, 0.6]",  # TOML array
        "bf16=false",
        "seed=null",
        "estimator=rloo",
        "eval.every=5",  # fills an optional nested Struct that defaults to None
        'eval.seeds=[1, 2]',
    ])
    assert cfg.name == "123"
    assert cfg.tags == ["a", "b"]
    assert cfg.optim.betas == [0.5, 0.6]
    assert cfg.bf16 is False
    assert cfg.seed is None
    assert cfg.estimator == "rloo"
    assert cfg.eval == EvalConfig(every=5, seeds=[1, 2])


def test_dict_field_keys_merge_across_sources(tmp_path: Path) -> None:
    path = _write(tmp_path / "c.toml", "[weights]\nqa = 0.5\nfmt = 0.2\n")
    cfg = load_config(Config, path, ["weights.len=0.1", "weights.fmt=0.3"])
    assert cfg.weights == {"qa": 0.5, "fmt": 0.3, "len": 0.1}
    with pytest.raises(ConfigError, match=r"weights\.len: expected float, got 'x'"):
        load_config(Config, overrides=["weights.len=x"])


def test_missing_required_field_is_named() -> None:
    class Needs(msgspec.Struct, kw_only=True):
        model: str

    class Outer(msgspec.Struct, kw_only=True):
        policy: Needs = msgspec.field(default_factory=lambda: Needs(model="m"))

    with pytest.raises(ConfigError, match=r"^config: object missing required field model$"):
        load_config(Needs)
    assert load_config(Needs, overrides=["model=tiny"]) == Needs(model="tiny")


def test_later_override_wins_and_quoted_strings() -> None:
    cfg = load_config(Config, overrides=["steps=1", "steps=2", 'name="a b"'])
    assert (cfg.steps, cfg.name) == (2, "a b")


@pytest.mark.parametrize(("override", "pattern"), [
    ("optim.lr=abc", r"optim\.lr: expected float, got 'abc' \(from override optim\.lr=abc\)"),
    ("optim.lr=-1", r"optim\.lr: expected float > 0\.0, got -1 \(from override"),
    ("steps=1.5", r"steps: expected int, got 1\.5"),
    ("estimator=ppo", r"^estimator: unknown value 'ppo'; valid choices: grpo, rloo \(from override estimator=ppo\)$"),
    ("optim.betas=[1, \"x\"]", r"optim\.betas\[1\]: expected float, got str"),
])
def test_type_errors_name_field_and_source(override: str, pattern: str) -> None:
    with pytest.raises(ConfigError, match=pattern):
        load_config(Config, overrides=[override])


def test_type_error_from_file_names_file(tmp_path: Path) -> None:
    path = _write(tmp_path / "bad.toml", '[optim]\nwarmup = "soon"\n')
    with pytest.raises(ConfigError, match=rf"optim\.warmup: expected int, got 'soon' \(from {path}\)"):
        load_config(Config, path)


def test_type_error_from_env_names_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TEST_RL_WARMUP", "lots")
    with pytest.raises(ConfigError, match=r"optim\.warmup: .*\(from env TEST_RL_WARMUP=lots\)"):
        load_config(Config, env=ENV)


def test_unknown_override_key_lists_close_matches() -> None:
    with pytest.raises(ConfigError, match=r"unknown config key 'optim\.lrr'.*did you mean: optim\.lr\b"):
        load_config(Config, overrides=["optim.lrr=1"])
    with pytest.raises(ConfigError, match=r"'stpes'.*did you mean: steps"):
        load_config(Config, overrides=["stpes=1"])


def test_unknown_file_key_names_file(tmp_path: Path) -> None:
    path = _write(tmp_path / "c.yaml", "optim:\n  warmpu: 3\n")
    with pytest.raises(ConfigError, match=rf"'optim\.warmpu' \({path}\).*did you mean: optim\.warmup"):
        load_config(Config, path)


def test_unknown_env_mapping_key_is_an_error() -> None:
    with pytest.raises(ConfigError, match=r"env mapping X_LR.*did you mean: optim\.lr"):
        load_config(Config, env={"X_LR": "optim.lrate"})


@pytest.mark.parametrize(("name", "text", "pattern"), [
    ("c.json", "{}", "must end in .toml, .yaml or .yml"),
    ("c.toml", "steps = = 1", r"c\.toml: "),
    ("c.yaml", "- 1\n- 2\n", "top level must be a table"),
])
def test_bad_files(tmp_path: Path, name: str, text: str, pattern: str) -> None:
    with pytest.raises(ConfigError, match=pattern):
        load_config(Config, _write(tmp_path / name, text))


def test_malformed_override() -> None:
    with pytest.raises(ConfigError, match=r"must look like dotted\.key=value"):
        load_config(Config, overrides=["steps"])


def test_dump_config_round_trips(tmp_path: Path) -> None:
    cfg = Config(name='quote " and ünïcode', tags=["x", "y"], seed=3,
                 optim=OptimConfig(lr=3e-4, betas=[0.5, 0.75]), eval=EvalConfig(every=2))
    text = dump_config(cfg)
    assert "[optim]\nlr = 0.0003\n" in text
    path = _write(tmp_path / "config.toml", text)
    assert load_config(Config, path) == cfg


def test_dump_config_writes_none_as_comment() -> None:
    text = dump_config(Config())
    assert "# eval = null" in text
    assert "[eval]" not in text


def test_config_help_lists_every_key_with_type_default_doc_env() -> None:
    text = config_help(Config, env=ENV, prog="my-app", width=100)
    assert text.startswith("usage: my-app [--config FILE] [--resume [PATH]] [key=value ...]")
    keys = text.split("keys:\n", 1)[1]
    lines = {line.split()[0]: line for line in keys.splitlines() if line.startswith("  ") and line[2] != " "}
    assert set(lines) == {"name", "steps", "estimator", "bf16", "seed", "tags", "optim.lr",
                          "weights", "optim.betas", "optim.warmup", "eval", "eval.every", "eval.seeds",
                          "judges", "judges[i].module", "judges[i].weight"}
    assert lines["judges[i].module"] == "  judges[i].module  str = (required)"  # the keys of each [[judges]] table
    assert lines["judges[i].weight"] == "  judges[i].weight  float = 1.0"
    assert lines["optim.lr"] == "  optim.lr  float > 0 = 1e-05  [env TEST_RL_LR]"
    assert lines["estimator"] == "  estimator  'grpo' | 'rloo' = \"grpo\""
    assert lines["seed"] == "  seed  int | None = 0" and lines["optim.betas"] == "  optim.betas  list[float] = [0.9, 0.999]"
    # grouped by table, each key's doc on the lines below it; an optional table says so, and its
    # keys are required only when it is given
    assert "\n[optim]\n  optim.lr  float > 0 = 1e-05  [env TEST_RL_LR]\n      AdamW learning rate\n" in keys
    assert "  optim.warmup  int = 0  [env TEST_RL_WARMUP]\n      linear warmup steps\n" in keys  # trailing comment
    assert "\n[eval]  (optional)\n  eval.every  int = 10\n      Evaluate every N steps.\n" in keys  # docstring
    assert "  eval  EvalConfig | None = null\n" in keys  # the optional table's own key, with the top-level keys
    assert "\n[[judges]]  (each entry of the list)\n  judges[i].module  str = (required)\n" in keys
    assert "  judges[i].weight  float = 1.0\n      scales this judge's score\n" in keys
    assert keys.index("  judges  ") < keys.index("[optim]")  # top-level keys first, then the tables


class Optional_(msgspec.Struct, kw_only=True, frozen=True):
    spec: str | JudgeConfig | None = None
    """A registered spec's name, or the table."""


def test_config_help_wraps_to_the_width_and_marks_the_keys_of_an_optional_table() -> None:
    long_doc = "word " * 60
    Wide = msgspec.defstruct("Wide", [("choice", Annotated[Literal[tuple(f"option_{i}" for i in range(20))],
                                                           msgspec.Meta(description=long_doc)], "option_0"),
                                      ("judge", Optional_, msgspec.field(default_factory=Optional_))],
                             kw_only=True, frozen=True)
    for width in (60, 80, 120):
        text = config_help(Wide, width=width)
        assert max(map(len, text.splitlines())) <= width
        assert text.count("word") == 60 and text.count("option_19") == 1
    text = config_help(Wide, width=80)
    assert "\n[judge.spec]  (optional)\n  judge.spec.module  str = (required in the table)\n" in text
    assert "\n  judge.spec  str | JudgeConfig | None = null\n      A registered spec's name, or the table.\n" in text


class RenamedConfig(AppConfig, kw_only=True, frozen=True):
    """`Config` after a release that renamed three keys, one of them out of a table that is gone."""

    RENAMED: ClassVar[dict[str, str]] = {"optim.learning_rate": "optim.lr", "policy.n": "steps",
                                         "max_grad_norm": "optim.warmup"}
    steps: int = 100
    optim: OptimConfig = msgspec.field(default_factory=OptimConfig)


@pytest.mark.parametrize("where", ["file", "yaml", "table gone", "override", "env"])
def test_a_renamed_key_is_refused_in_one_line_naming_the_new_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 where: str) -> None:
    monkeypatch.setenv("TEST_RL_LR", "0.5")
    calls = {
        "file": lambda: load_config(RenamedConfig, _write(tmp_path / "c.toml", "[optim]\nlearning_rate = 0.5\n")),
        "yaml": lambda: load_config(RenamedConfig, _write(tmp_path / "c.yaml", "optim:\n  learning_rate: 0.5\n")),
        "table gone": lambda: load_config(RenamedConfig, _write(tmp_path / "p.toml", "steps = 3\n[policy]\nn = 4\n")),
        "override": lambda: load_config(RenamedConfig, overrides=["steps=3", "optim.learning_rate=0.5"]),
        "env": lambda: load_config(RenamedConfig, env={"TEST_RL_LR": "optim.learning_rate"}),
    }
    with pytest.raises(ConfigError) as refused:
        calls[where]()
    old, new = ("policy.n", "steps") if where == "table gone" else ("optim.learning_rate", "optim.lr")
    assert str(refused.value) == f"{old} was renamed: use {new}"


def test_the_new_keys_load_and_help_lists_the_renames(tmp_path: Path) -> None:
    cfg = load_config(RenamedConfig, _write(tmp_path / "c.toml", "[optim]\nlr = 0.5\n"), ["optim.warmup=2"])
    assert (cfg.optim.lr, cfg.optim.warmup) == (0.5, 2)
    with pytest.raises(ConfigError, match=r"^max_grad_norm was renamed: use optim\.warmup$"):
        load_config(RenamedConfig, overrides=["max_grad_norm=1"])
    with pytest.raises(ConfigError, match=r"unknown config key 'policy\.x'"):  # a gone table's other keys are unknown
        load_config(RenamedConfig, _write(tmp_path / "p.toml", "[policy]\nx = 4\n"))
    text = config_help(RenamedConfig)
    assert text.endswith("renamed keys (the old name is refused):\n  optim.learning_rate  -> optim.lr\n"
                         "  policy.n             -> steps\n  max_grad_norm        -> optim.warmup\n")


@pytest.mark.parametrize("renamed", [{"steps": "optim.lr"}, {"optim.learning_rate": "optim.lrr"}])
def test_a_rename_table_that_keeps_the_old_key_or_names_no_key_is_a_bug(renamed: dict[str, str]) -> None:
    class Broken(RenamedConfig, kw_only=True, frozen=True):
        RENAMED: ClassVar[dict[str, str]] = renamed

    with pytest.raises(TypeError, match=r"Broken\.RENAMED maps"):
        load_config(Broken)


@pytest.mark.parametrize(("argv", "expected"), [
    ([], CliArgs()),
    (["--config", "c.toml", "a.b=1", "c=x y"],
     CliArgs(config=Path("c.toml"), overrides=("a.b=1", "c=x y"))),
    (["--config=c.yaml", "--resume"], CliArgs(config=Path("c.yaml"), resume="latest")),
    (["--resume", "a=1"], CliArgs(resume="latest", overrides=("a=1",))),
    (["--resume", "runs/x/checkpoints/checkpoint-3", "-h"],
     CliArgs(resume="runs/x/checkpoints/checkpoint-3", help=True)),
    (["--resume=ck", "--help"], CliArgs(resume="ck", help=True)),
    (["a=1", "--verbose"], CliArgs(overrides=("a=1", "train.verbose=true"))),
])
def test_parse_cli(argv: list[str], expected: CliArgs) -> None:
    assert parse_cli(argv) == expected


@pytest.mark.parametrize(("argv", "pattern"), [
    (["--confg", "x"], "unknown option '--confg'"),
    (["steps"], "'steps' is not key=value"),
    (["--config"], "--config needs a file"),
])
def test_parse_cli_errors(argv: list[str], pattern: str) -> None:
    with pytest.raises(ConfigError, match=pattern):
        parse_cli(argv)


def test_imports_stay_light() -> None:
    """`import rl_core` pulls in no train dependency; `rl_core.train` never imports accelerate."""
    code = ("import sys, rl_core; assert 'msgspec' not in sys.modules, 'msgspec'; "
            "import rl_core.train; assert 'accelerate' not in sys.modules, 'accelerate'")
    subprocess.run([sys.executable, "-c", code], check=True)


class _Spec(msgspec.Struct, kw_only=True, frozen=True):
    components: dict[str, dict[str, str]]


class _TableOrPath(msgspec.Struct, kw_only=True, frozen=True):
    spec: str | _Spec | None = None
    log_with: list[str] = []


class _WithSpec(msgspec.Struct, kw_only=True, frozen=True):
    reward: _TableOrPath = _TableOrPath()


def test_a_table_or_path_field_takes_an_inline_table_and_bare_word_lists() -> None:
    cfg = load_config(_WithSpec, None, ['reward.spec={components = {len = {scorer = "length"}}}',
                                        "reward.log_with=[tensorboard, wandb]"])
    assert cfg.reward.spec == _Spec(components={"len": {"scorer": "length"}})
    assert cfg.reward.log_with == ["tensorboard", "wandb"]  # the README's form, without quotes
    assert load_config(_WithSpec, None, ["reward.spec=my_reward.toml"]).reward.spec == "my_reward.toml"


class _Algo(msgspec.Struct, kw_only=True, frozen=True):
    advantage: AdvantageName = "grpo"


class _WithAlgo(msgspec.Struct, kw_only=True, frozen=True):
    algo: _Algo = _Algo()


def test_registry_names_are_checked_when_the_config_loads() -> None:
    Cfg = _WithAlgo
    assert load_config(Cfg, None, ["algo.advantage=rloo"]).algo.advantage == "rloo"
    with pytest.raises(ConfigError, match=r"^algo\.advantage: unknown advantage estimator 'nope'; valid names: "
                                          r"dr_grpo, gae, grpo, reinforce_pp, reinforce_pp_baseline, rloo "
                                          r"\(from override algo\.advantage=nope\)$"):
        load_config(Cfg, None, ["algo.advantage=nope"])
    assert "str (one of: dr_grpo, gae, grpo" in config_help(Cfg)



class _Choices(msgspec.Struct, kw_only=True, frozen=True):
    dtype: DType = "bfloat16"
    combine: list[Literal["add", "mul"]] = []
    judges: list[JudgeConfig] = []


class _WithChoices(msgspec.Struct, kw_only=True, frozen=True):
    model: _Choices = _Choices()
    train: RunFields = RunFields()


@pytest.mark.parametrize(("where", "pattern"), [
    ("model.dtype=float8", r"^model\.dtype: unknown value 'float8'; valid choices: auto, float32, fp32, bfloat16, bf16, "
                           r"float16, fp16 \(from override model\.dtype=float8\)$"),
    ("model.combine=[add, max]", r"^model\.combine\[1\]: unknown value 'max'; valid choices: add, mul \(from override "),
    ("train.log_with=[tensorbord]", r"^train\.log_with\[0\]: unknown value 'tensorbord'; valid choices: all, aim, "
                                    r"tensorboard, wandb, "),
    ("train.sharding=fsdp", r"^train\.sharding: unknown value 'fsdp'; valid choices: none, fsdp2 \(from override "),
    ("file", r"^model\.dtype: unknown value 'fp8'; valid choices: auto, float32, .* \(from .*c\.toml\)$"),
])
def test_a_value_outside_its_choices_names_the_key_the_value_and_the_choices(tmp_path: Path, where: str,
                                                                             pattern: str) -> None:
    """A field with a closed set of strings (a Literal) is refused when the config loads, in one
    line with the valid choices (msgspec alone says "Invalid enum value")."""
    path = _write(tmp_path / "c.toml", '[model]\ndtype = "fp8"\n') if where == "file" else None
    with pytest.raises(ConfigError, match=pattern):
        load_config(_WithChoices, path, [] if where == "file" else [where])
    assert load_config(_WithChoices, None, ["model.dtype=fp16", "train.log_with=[wandb]"]).model.dtype == "fp16"


def test_the_closed_sets_equal_the_libraries_lists() -> None:
    """`CompileMode` and `TrackerName` mirror torch's and Accelerate's lists, which a config
    cannot import before torch; a mode or tracker added upstream fails here until added."""
    import torch._inductor
    from accelerate.utils import LoggerType

    assert set(get_args(CompileMode)) == {"auto", *torch._inductor.list_mode_options()}
    assert set(get_args(TrackerName)) == {t.value for t in LoggerType}


class _Rewards(msgspec.Struct, kw_only=True, frozen=True):
    reward_aggregation: RewardAggregationName = "sum_then_normalize"


class _WithRewards(msgspec.Struct, kw_only=True, frozen=True):
    algo: _Rewards = _Rewards()


def test_a_reward_aggregation_field_names_an_entry_of_its_registry() -> None:
    Cfg = _WithRewards
    cfg = load_config(Cfg, None, ["algo.reward_aggregation=normalize_then_sum"])
    assert cfg.algo.reward_aggregation == "normalize_then_sum"
    with pytest.raises(ConfigError, match=r"^algo\.reward_aggregation: unknown reward aggregation 'gdpo'; valid "
                                          r"names: normalize_then_sum, sum_then_normalize \(from override "):
        load_config(Cfg, None, ["algo.reward_aggregation=gdpo"])
    assert "str (one of: normalize_then_sum, sum_then_normalize)" in config_help(Cfg)
