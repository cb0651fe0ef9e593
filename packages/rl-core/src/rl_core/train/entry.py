"""One app entry for every recipe: the app's config module names its config and its recipe
module, and `AppEntry` does the rest (`main`, the module's lazy names, the process exit).

    # caption_config.py
    ENTRY = AppEntry(NAME, Config, default_config, ENV, recipe="caption_recipe")

    # __main__.py
    from caption_config import ENTRY

    ENTRY.attach(__name__)

The command line and the config are read before the recipe module (and torch) is imported, so
`--help` and config errors answer at once.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, NoReturn

import msgspec

from rl_core.train.app import parse_run, run_app

__all__ = ["AppEntry"]


@dataclass(frozen=True)
class AppEntry:
    """An app's entry point. `default` is the embedded default config a run without `--config`
    reads: a path, or a function that picks one when it depends on the environment (None: the
    config class's own defaults). `recipe` names the module whose `RECIPE` trains."""

    name: str
    config: type[msgspec.Struct]
    default: Path | Callable[[], Path | None] | None
    env: Mapping[str, str] | None = None
    recipe: str = ""

    def main(self, argv: list[str] | None = None) -> Path | None:
        """Run the app; returns the run directory (None after --help)."""
        parsed = parse_run(self.name, self.config, self.default_path(), self.env, argv)
        if parsed is None:
            return None
        from rl_core.train.loop import train

        return train(self._recipe_module().RECIPE, *parsed)

    def default_path(self) -> Path | None:
        """The embedded default config a run without `--config` reads, here and now."""
        return self.default() if callable(self.default) else self.default

    def module_getattr(self, name: str) -> Any:
        """The recipe module's names (`RECIPE`, ...) as the app module's, imported on first use
        (tests load `__main__.py` as the app)."""
        if name.startswith("__"):  # Python's own probes (`__path__`, ...) must not import torch
            raise AttributeError(name)
        return getattr(self._recipe_module(), name)

    def attach(self, module: str) -> None:
        """Make the module `module` (an app's `__main__.py`, by its `__name__`) the app: its
        `main`, and the recipe module's names on first use; run as a script (`__main__`), train
        and exit."""
        sys.modules[module].__dict__.update(main=self.main, __getattr__=self.module_getattr)
        if module == "__main__":
            self.exit()

    def exit(self) -> NoReturn:
        """Run from the command line: exit 0, or 2 after a one-line user error."""
        sys.exit(run_app(self.name, self.main))

    def _recipe_module(self) -> ModuleType:
        return importlib.import_module(self.recipe)
