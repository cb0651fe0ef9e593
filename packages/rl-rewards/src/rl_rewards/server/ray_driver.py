"""How the server's Ray backends (`--ray`, `--backend ray-serve`) start or join Ray (extra
`rl-rewards[ray]`): `init_ray` is `ray.init` with two of Ray's defaults changed for a server.

- **Workers run the server's own interpreter and environment.** Under `uv run` (the README's
  `uv run --package rl-rewards --extra ray-serve rl-rewards serve ...`), Ray's uv hook
  (`RAY_ENABLE_UV_RUN_RUNTIME_ENV`, on by default) gives the job a runtime_env that
  starts every worker as `uv run ... python` in an upload of the working directory: uv builds an
  environment of its own from the lockfile for the workers (85 packages, 412 MB left under
  /tmp/ray after shutdown for the README's command), a scorer installed in the user's environment
  is missing there (`ModuleNotFoundError` in the replica), and relative paths resolve in the
  upload. `init_ray` keeps the hook off, so workers run as Ray starts them by default: a local
  Ray's with this interpreter (`sys.executable`) in this working directory, a cluster's with the
  Python its nodes were started with (install rl-rewards and your `[scorers]` there). Set
  `RAY_ENABLE_UV_RUN_RUNTIME_ENV=1` to have the hook anyway (a cluster whose nodes have uv and the
  project, not the environment).
- **Without `ray_address`, a Ray of its own, on the loopback only.** `ray.init()` without an
  address joins the cluster the machine's last `ray start` left in /tmp/ray (anyone's, with its
  environment and its Ray Serve), and a Ray it starts binds its GCS, raylet, worker and agent
  ports on every interface (a Ray instance runs code for anyone who reaches them). `init_ray`
  starts a new instance (`address="local"`), a single-machine one on 127.0.0.1 (Ray's own
  setting for that: the node's address is the loopback, as Ray has it on macOS and Windows). To
  use other machines, start a cluster (`ray start --head` on one node, `ray start
  --address=HEAD:6379` on the others) and pass its address (`--ray-address` or `RAY_ADDRESS`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

try:
    import ray
    from ray._private import ray_constants
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError('--ray needs Ray: pip install "rl-rewards[ray]"; in a clone of the repository: uv sync --all-packages --extra ray') from e

UV_HOOK = "RAY_ENABLE_UV_RUN_RUNTIME_ENV"
"""Ray's switch for its uv hook; the server keeps the hook off unless this is set."""
LOCAL_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
"""For the processes of a Ray the server starts: the node is a single-machine instance, so each
of them takes the loopback for the node's address and binds its ports there (Ray reads this
when it is imported; the server, which imported Ray already, is set as `_constants` says)."""


def init_ray(address: str | None, **options: Any) -> None:
    """`ray.init(address, **options)` with the uv hook off (unless `RAY_ENABLE_UV_RUN_RUNTIME_ENV`
    is set) and, without `address`, a new local Ray on the loopback (see the module's docstring)."""
    constants = {} if UV_HOOK in os.environ else {"RAY_ENABLE_UV_RUN_RUNTIME_ENV": False}
    env = {}
    if address is None:
        constants["ENABLE_RAY_CLUSTER"] = False
        env = LOCAL_ENV
    with _constants(constants), _environ(env):  # the Ray processes started here take `env` along
        ray.init(address=address or "local", **options)


@contextlib.contextmanager
def _constants(values: dict[str, bool]) -> Iterator[None]:
    """Ray's module constants `values` for the duration (Ray computed them from the environment
    as this process imported it, before the server could set the environment)."""
    saved = {name: getattr(ray_constants, name) for name in values}  # AttributeError: Ray renamed one
    for name, value in values.items():
        setattr(ray_constants, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(ray_constants, name, value)


@contextlib.contextmanager
def _environ(values: dict[str, str]) -> Iterator[None]:
    """`values` in this process's environment for the duration (the processes Ray starts then
    inherit them), the previous values back after."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                del os.environ[key]
            else:
                os.environ[key] = value
