"""The `main()` contract every app follows, and how user errors end a run.

    def main(argv: list[str] | None = None) -> Path | None: ...   # the run directory, None after --help

    if __name__ == "__main__":
        sys.exit(run_app("caption-rl", main))

A `UserError` (a missing file, a refused value, empty data: something the user fixes by
changing the command) prints one line naming the cause and the knob and exits 2, without a
traceback; `--debug` anywhere on the command line shows the traceback instead. Any other
exception is a bug or a broken environment and keeps its traceback.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

from rl_core.errors import UserError

__all__ = ["UserError", "run_app"]


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
