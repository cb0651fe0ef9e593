"""`rl-rewards` command line: `score` a file offline, `serve` rewards over HTTP."""

from __future__ import annotations

import typer

from rl_rewards.offline import score_command
from rl_rewards.server.command import serve_command

app = typer.Typer(
    help="Reward scorers for RL post-training: score files offline or serve them over HTTP.",
    no_args_is_help=True,
    add_completion=False,
    # plain help: rich markup would take `[ray-serve]`, `[rewards.NAME]` for style tags and drop them
    rich_markup_mode=None,
)
app.command("score")(score_command)
app.command("serve")(serve_command)

if __name__ == "__main__":
    app()
