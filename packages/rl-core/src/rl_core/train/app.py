"""The `main()` contract every app follows, how an app reads its command line, and how user
errors end a run.

    def main(argv: list[str] | None = None) -> Path | None:   # the run directory, None after --help
        parsed = parse_run("caption-rl", Config, DEFAULT_CONFIG, ENV, argv)  # no torch imported yet
        if parsed is None:
            return None
        from caption_recipe import RECIPE  # torch, transformers, ...
        return train(RECIPE, *parsed)

    if __name__ == "__main__":
        sys.exit(run_app("caption-rl", main))

`parse_run` needs only the app's config module: `--help` and a config error answer at once,
before the recipe, torch and transformers load.

A `UserError` (a missing file, a refused value, empty data: something the user fixes by
changing the command) prints one line naming the cause and the knob and exits 2, without a
traceback; `--debug` anywhere on the command line shows the traceback instead. Any other
exception is a bug or a broken environment and keeps its traceback.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import msgspec

from rl_core.errors import UserError
from rl_core.train.config import config_help, load_config, parse_cli
from rl_core.train.fields import run_fields
from rl_core.train.rundir import resume_point
from rl_core.train.trackers import check_trackers

__all__ = ["UserError", "parse_run", "run_app"]

C = TypeVar("C", bound=msgspec.Struct)


def parse_run(name: str, config: type[C], default_config: Path | None, env: Mapping[str, str] | None = None,
              argv: Sequence[str] | None = None) -> tuple[C, str | None] | None:
    """Read an app's command line (`--config FILE`, `--resume [PATH]`, `--help`, `key=value`)
    without importing torch. After `--help`: prints every key (defaults from `default_config`,
    the embedded default a bare run reads) and returns None. Else returns the config (defaults <
    `--config FILE`, or `default_config` without one < `env` (variable -> dotted key) <
    `key=value`; registry names checked) and the `--resume` value, for `rl_core.train.train`. A config error, a missing
    `--config` file, a tracker not installed or a `--resume` that finds no checkpoint raises a
    `UserError`."""
    cli = parse_cli(sys.argv[1:] if argv is None else argv)
    if cli.help:
        print(config_help(config, env=env, prog=name,
                          defaults=load_config(config, default_config) if default_config is not None else None,
                          defaults_from=f"{default_config.name} (the embedded default)" if default_config is not None
                          else ""))
        return None
    path = cli.config if cli.config is not None else default_config
    if path is not None and not Path(path).is_file():
        raise UserError(f"--config {path}: no such file")
    cfg = load_config(config, path, cli.overrides, env=env)
    t = run_fields(cfg)
    check_trackers(t.log_with)
    resume_point(cli.resume, t.output_dir, t.run_name)  # refused now, not after torch and the accelerator
    return cfg, cli.resume


def run_app(prog: str, main: Callable[[list[str]], Any], argv: Sequence[str] | None = None) -> int:
    """Run `main(argv)` (argv without `--debug`); returns the process exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args
    args = [a for a in args if a != "--debug"]
    try:
        main(args)
    except UserError as e:
        if debug:
            raise
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    return 0
