"""Tiny random-weight checkpoints with real tokenizers and processors, built offline in seconds.

`build("qwen3")` returns a folder that `AutoModelForCausalLM.from_pretrained` and
`AutoTokenizer.from_pretrained` load exactly as they load a hub checkpoint, so tests and examples
exercise the real loading code with no network. Weights are random (`torch.manual_seed(seed)`
before init), so the same seed gives byte-identical safetensors.

With `out_dir=None` the checkpoint is cached under `$RL_MODELS_CACHE` (default
`~/.cache/rl-models/tiny`) as `<family>-s<seed>-<builder version>`. One process per machine
builds it (the others wait on a file lock), into a temporary folder renamed into place, and a
manifest of its files' sizes written last marks it complete: a cached folder that does not match
its manifest (or has none) is rebuilt, never loaded. In a rank other than 0 of a running
torch.distributed group the build runs in a child process, since transformers' `save_pretrained`
writes weights on rank 0 only.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from filelock import FileLock

from rl_core.errors import UserError
from rl_models import tiny_cosmos, tiny_families, tiny_janus, tiny_sd3, tiny_vl, tiny_wan

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
        _write(family, builder, out, seed)
        return out
    final = cache_dir() / f"{family}-s{seed}-{version}"
    if _is_complete(final):
        return final
    (cache_dir() / ".locks").mkdir(parents=True, exist_ok=True)
    with FileLock(cache_dir() / ".locks" / f"{final.name}.lock"):
        if _is_complete(final):  # another process built it while this one waited
            return final
        if final.exists():  # half a checkpoint (an older build's lost race, a killed copy)
            shutil.rmtree(final)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
        try:
            _write(family, builder, tmp, seed)
            _write_manifest(tmp)
            os.replace(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final


_MANIFEST = ".rl-models-complete.json"


def _write_manifest(folder: Path) -> None:
    sizes = {str(p.relative_to(folder)): p.stat().st_size for p in sorted(folder.rglob("*")) if p.is_file()}
    (folder / _MANIFEST).write_text(json.dumps(sizes, indent=0))


def _is_complete(folder: Path) -> bool:
    """`folder` holds every file its manifest lists, at the listed size."""
    try:
        sizes: dict[str, int] = json.loads((folder / _MANIFEST).read_text())
        return all((folder / name).stat().st_size == size for name, size in sizes.items())
    except (OSError, ValueError):
        return False


def _in_secondary_rank() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized() and torch.distributed.get_rank() != 0


def _write(family: str, builder: Builder, out: Path, seed: int) -> None:
    if not _in_secondary_rank():
        _run_builder(builder, out, seed)
        return
    # No process group in the child, so save_pretrained writes the weights too.
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    done = subprocess.run([sys.executable, "-m", "rl_models.cli", "tiny", family, str(out), "--seed", str(seed)],
                          capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"building tiny:{family} in a child process failed:\n{done.stderr[-2000:]}")


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
register_family("sd3", "v2", tiny_sd3.build_sd3)
register_family("janus", "v1", tiny_janus.build_janus)
register_family("wan", "v1", tiny_wan.build_wan)
register_family("cosmos", "v1", tiny_cosmos.build_cosmos)
