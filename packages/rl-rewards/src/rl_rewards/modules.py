"""Loading user code named in a config: VeRL-with-RMs reward modules unchanged, and plain
functions (`load_function`, for the `rule` scorer).

A reward module is any Python module defining
`rm_preprocess(text_prompts, text_responses, tgt_tokenizer) -> list[str]` (the judge's inputs,
usually rendered with the judge tokenizer's chat template) and
`rm_postprocess(results: list[str]) -> list[float]` (judge outputs -> scores). It is named by a
file path (`/path/to/helpful.py`) or an import path (`rl_rewards.judges.yes_no`).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

REQUIRED = ("rm_preprocess", "rm_postprocess")


@dataclass(frozen=True)
class RewardModule:
    """The two functions of a loaded VeRL-with-RMs module, and where it came from."""

    name: str
    preprocess: Callable[..., list[str]]
    postprocess: Callable[[list[str]], list[float]]


def _import(spec: str) -> ModuleType:
    path = Path(spec)
    if spec.endswith(".py") or path.is_file():
        if not path.is_file():
            raise FileNotFoundError(f"reward module file {spec!r} does not exist")
        module_name = f"rl_rewards_user_module_{path.stem}_{abs(hash(str(path.resolve())))}"
        file_spec = importlib.util.spec_from_file_location(module_name, path)
        if file_spec is None or file_spec.loader is None:
            raise ImportError(f"cannot load reward module file {spec!r}")
        module = importlib.util.module_from_spec(file_spec)
        sys.modules[module_name] = module
        file_spec.loader.exec_module(module)
        return module
    return importlib.import_module(spec)


def load_reward_module(spec: str) -> RewardModule:
    """Import `spec` (file path or import path) and check it defines both functions; the error
    names the module and the missing function."""
    module = _import(spec)
    missing = [fn for fn in REQUIRED if not callable(vars(module).get(fn))]
    if missing:
        raise AttributeError(
            f"reward module {spec!r} does not define {' and '.join(missing)}; a VeRL-with-RMs module needs "
            "rm_preprocess(text_prompts, text_responses, tgt_tokenizer) -> list[str] and "
            "rm_postprocess(results) -> list[float]"
        )
    return RewardModule(name=spec, preprocess=module.rm_preprocess, postprocess=module.rm_postprocess)


def load_function(path: str) -> Callable[..., Any]:
    """`"path/to/file.py:fn"` or `"pkg.module:fn"` (`:fn` optional, default `compute_score`, verl's
    name), imported now: a missing file, the module's own import error, or a missing function
    raises here, the error naming the file or module and the function it lacks. Call it where
    a config is checked, so a bad path stops a run before anything heavy loads."""
    target, _, name = path.rpartition(":") if ":" in path else (path, "", "")
    name = name or "compute_score"
    if target.endswith(".py") and not Path(target).is_file():
        raise FileNotFoundError(f"reward function file not found: {target}")
    fn = vars(_import(target)).get(name)
    if not callable(fn):
        raise AttributeError(f"{target} defines no function {name!r} (reward function path {path!r})")
    return fn
