"""Shared test setup. Must not import torch: the `no_torch` tests run in an env without it."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
# Under `uv run nox` (CI), a Ray started here or by a server these tests start would run every
# worker as `uv run python` in a copy of the repository, and that `uv run` re-syncs the workspace
# into the session's environment (editable installs then point into /tmp/ray, undeclared packages
# appear). Ray reads this when it is imported, so it is set before any test module imports it.
os.environ["RAY_ENABLE_UV_RUN_RUNTIME_ENV"] = "0"
