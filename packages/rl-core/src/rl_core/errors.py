"""The error type for mistakes a user fixes by changing the command, the config or the data."""

from __future__ import annotations

__all__ = ["UserError"]


class UserError(Exception):
    """Something the user fixes by changing the command, the config or the data; the message
    names the cause and the knob (`data.train_files`, `rollout.temperature`, ...). Apps print it as one
    line and exit 2 (`rl_core.train.run_app`)."""
