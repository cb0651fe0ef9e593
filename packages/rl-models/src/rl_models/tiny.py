"""Tiny random-weight checkpoints with real tokenizers and processors, built offline in seconds.

`build("qwen3")` returns a folder that `AutoModelForCausalLM.from_pretrained` and
`AutoTokenizer.from_pretrained` load exactly as they load a hub checkpoint, so tests and examples
exercise the real loading code with no network. Weights are random (`torch.manual_seed(seed)`
before init), so the same seed gives byte-identical safetensors.

With `out_dir=None` the checkpoint is cached under `$RL_MODELS_CACHE` (default
`~/.cache/rl-models/tiny`) as `<family>-s<seed>-<builder version>`; it is written to a temporary
folder and renamed into place, so concurrent test processes never see half a checkpoint.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from rl_core.errors import UserError
from rl_models import tiny_families, tiny_janus, tiny_sd3, tiny_vl

Builder = Callable[[Path], None]
# family -> (builder version, builder). Bump a version whenever its output changes.
_BUILDERS: dict[str, tuple[str, Builder]] = {}


def register_family(name: str, version: str, builder: Builder) -> None:
    """Register a tiny-checkpoint builder; registering a name twice raises."""
    if name in _BUILDERS:
        raise ValueError(f"tiny family {name!r} is already registered")
    _BUILDERS[name] = (version, builder)


def families() -> list[str]:
    """Names of the registered tiny families."""
    return sorted(_BUILDERS)


def _lookup(family: str) -> tuple[str, Builder]:
    if family not in _BUILDERS:
        raise KeyError(f"unknown tiny family {family!r}; valid: {', '.join(families())}")
    return _BUILDERS[family]


def cache_dir() -> Path:
    """Root of the tiny-checkpoint cache: `$RL_MODELS_CACHE` or `~/.cache/rl-models/tiny`."""
    root = os.environ.get("RL_MODELS_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "rl-models" / "tiny"


_HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")


def resolve(spec: str, *, key: str = "model.path") -> str:
    """A model spec as the apps take it -> something `from_pretrained` loads.

    `tiny:<family>[:<seed>]` builds (or reuses) a tiny random checkpoint (`build`); a local
    folder is used as is; `org/name` is a hub id (with `HF_HUB_OFFLINE` set, it must be in the
    local Hugging Face cache). Anything else raises `UserError` naming `key` and what was tried.
    """
    if spec.startswith("tiny:"):
        family, _, seed = spec.removeprefix("tiny:").partition(":")
        if family not in _BUILDERS:
            raise UserError(f"{key}={spec!r}: unknown tiny family {family!r}; valid: {', '.join(families())}")
        if not seed.isdigit() and seed:
            raise UserError(f"{key}={spec!r}: the seed after tiny:{family}: must be a number")
        return str(build(family, seed=int(seed or 0)))
    if Path(spec).exists():
        return spec
    if _HUB_ID.fullmatch(spec):
        _check_cached_when_offline(spec, key)
        return spec
    raise UserError(f"model not found: {key}={spec!r} is no local folder (no such path: {Path(spec).absolute()}), "
                    f"no hub id (org/name) and no tiny:<family> ({', '.join(families())})")


def _check_cached_when_offline(repo_id: str, key: str, *, timeout: float = 5.0) -> None:
    """A hub id loads from the local cache, or from the Hub when it answers: say now, in one line
    naming both places tried, when neither can work, rather than let `from_pretrained` retry
    for a minute and fail with a traceback about the network. Online, one metadata request
    (`timeout` seconds) tells a missing model and an unreachable Hub apart."""
    from huggingface_hub import HfApi, constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
    )

    where = f"{key}={repo_id!r} is no local folder (no such path: {Path(repo_id).absolute()}), and as a hub id"
    try:
        snapshot_download(repo_id, local_files_only=True)
        return  # cached: from_pretrained loads it without the network
    except LocalEntryNotFoundError:
        if constants.HF_HUB_OFFLINE:
            raise UserError(f"model not found: {where} it is not in the local Hugging Face cache (HF_HUB_OFFLINE "
                            "is set, so nothing is downloaded)") from None
    try:
        HfApi().model_info(repo_id, timeout=timeout)
    except GatedRepoError:
        return  # exists; from_pretrained explains the access it needs
    except RepositoryNotFoundError:
        raise UserError(f"model not found: {where} it is not on the Hugging Face Hub (a typo, or a private model: "
                        "log in with `hf auth login`)") from None
    except Exception as e:  # httpx connection errors and timeouts, proxies answering garbage
        raise UserError(f"model not found: {where} it is not in the local Hugging Face cache and the Hub is not "
                        f"reachable ({type(e).__name__}); give a local path, or download it where the Hub is "
                        "reachable and set HF_HUB_OFFLINE=1 here") from None


def build(family: str, out_dir: str | Path | None = None, *, seed: int = 0) -> Path:
    """Build (or reuse from the cache) the tiny checkpoint of `family`; returns its folder.

    With `out_dir` given, the checkpoint is always (re)written there. Families: see `families()`.
    """
    version, builder = _lookup(family)
    if out_dir is not None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        _run_builder(builder, out, seed)
        return out
    final = cache_dir() / f"{family}-s{seed}-{version}"
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        _run_builder(builder, tmp, seed)
        os.replace(tmp, final)
    except OSError:
        if not final.is_dir():  # a real failure, not a lost race with another process
            raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def _run_builder(builder: Builder, out: Path, seed: int) -> None:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        builder(out)


register_family("qwen3", "v2", tiny_families.build_qwen3)
register_family("qwen3_vllm", "v1", tiny_families.build_qwen3_vllm)
register_family("embedding", "v1", tiny_families.build_embedding)
register_family("clip", "v1", tiny_families.build_clip)
register_family("qwen2_5_vl", "v1", tiny_vl.build_qwen2_5_vl)
register_family("qwen3_vl", "v1", tiny_vl.build_qwen3_vl)
register_family("sd3", "v1", tiny_sd3.build_sd3)
register_family("janus", "v1", tiny_janus.build_janus)
