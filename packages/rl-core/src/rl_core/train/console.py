"""What a run prints: its own lines (the engine picks, one line per step, the summary). The
libraries under it (transformers, diffusers, accelerate, peft, huggingface_hub, RapidOCR, ...)
log warnings and notices and draw progress bars ("Loading weights", "Writing model shards");
by default those go to `third_party.log` in the run directory instead, each distinct message
once (a repeat is counted, not written again), and the summary says how many there were.
`train.verbose = true` (`--verbose` on the command line) leaves them on the console.

Python warnings raised in this project's own code (`rl_*` packages, the apps) still print.
"""

from __future__ import annotations

import logging
import sys
import warnings
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TextIO

__all__ = ["ThirdPartyLog", "third_party_output"]

# top-level loggers of the libraries a run loads (a child logger, e.g. transformers.modeling_utils,
# propagates to its library's)
THIRD_PARTY_LOGGERS = ("transformers", "diffusers", "accelerate", "peft", "huggingface_hub", "datasets", "torch",
                       "safetensors", "PIL", "RapidOCR", "rapidocr", "rapidocr_onnxruntime", "filelock", "urllib3",
                       "httpx", "py.warnings")
_OWN = ("rl_core", "rl_models", "rl_rollout", "rl_policy", "rl_rewards", "rl_data", "/apps/")


class ThirdPartyLog(logging.Handler):
    """Writes each distinct third-party message once to `path` and counts every one."""

    def __init__(self, path: Path) -> None:
        super().__init__(logging.DEBUG)
        self.path = path
        self.counts: Counter[str] = Counter()
        self._file: TextIO | None = None

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = f"{record.levelname} {record.name}: {record.getMessage()}"
        except Exception:  # a library's malformed format arguments: keep what there is
            text = f"{record.levelname} {record.name}: {record.msg!r}"
        self.note(text)

    def note(self, text: str) -> None:
        self.counts[text] += 1
        if self.counts[text] > 1:
            return
        if self._file is None:
            self._file = self.path.open("a", encoding="utf-8")
        self._file.write(text.rstrip() + "\n")
        self._file.flush()

    def close(self) -> None:
        repeated = [(text, n) for text, n in self.counts.items() if n > 1]
        if self._file is not None:
            if repeated:
                self._file.write("\nrepeated messages (times in all):\n")
                self._file.writelines(f"  {n}x {text.splitlines()[0][:200]}\n" for text, n in repeated)
            self._file.close()
            self._file = None
        super().close()

    def summary(self) -> str | None:
        """The summary's line, or None when nothing was logged."""
        if not self.counts:
            return None
        total, distinct = sum(self.counts.values()), len(self.counts)
        count = f"{total} message{'s' * (total != 1)}" + (f" ({distinct} distinct)" if distinct != total else "")
        return f"{count} in {self.path} (--verbose prints them)"


def _own(filename: str) -> bool:
    return any(part in filename for part in _OWN)


@contextmanager
def third_party_output(run_dir: Path, *, verbose: bool, rank: int = 0) -> Iterator[ThirdPartyLog | None]:
    """Within the block, third-party log records and Python warnings go to
    `run_dir/third_party.log` (`third_party-rank<N>.log` for other processes) and their progress
    bars are off; yields the handler (its `summary()`), or None when `verbose` (nothing changes).
    Everything is restored on exit."""
    if verbose:
        yield None
        return
    handler = ThirdPartyLog(run_dir / ("third_party.log" if rank == 0 else f"third_party-rank{rank}.log"))
    saved: list[tuple[logging.Logger, list[logging.Handler], bool]] = []
    for name in THIRD_PARTY_LOGGERS:
        logger = logging.getLogger(name)
        saved.append((logger, logger.handlers[:], logger.propagate))
        for old in logger.handlers[:]:
            logger.removeHandler(old)
        logger.addHandler(handler)
        logger.propagate = False
    show = warnings.showwarning

    def showwarning(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                    file: TextIO | None = None, line: str | None = None) -> None:
        if _own(filename):
            show(message, category, filename, lineno, file, line)
        else:
            handler.note(f"{category.__name__}: {message} ({filename}:{lineno})")

    warnings.showwarning = showwarning
    bars = _progress_bars_off()
    try:
        yield handler
    finally:
        warnings.showwarning = show
        for enable in bars:
            enable()
        for logger, handlers, propagate in saved:
            logger.removeHandler(handler)
            for old in handlers:
                logger.addHandler(old)
            logger.propagate = propagate
        handler.close()


def _progress_bars_off() -> list[Any]:
    """Turn off the progress bars of the libraries already imported; the calls that turn each
    back on."""
    undo: list[Any] = []
    for name in ("transformers", "diffusers"):  # the same switches in both libraries' utils.logging
        library = sys.modules.get(name)
        if library is not None and library.utils.logging.is_progress_bar_enabled():
            library.utils.logging.disable_progress_bar()
            undo.append(library.utils.logging.enable_progress_bar)
    hub = sys.modules.get("huggingface_hub")
    if hub is not None and not hub.utils.are_progress_bars_disabled():
        hub.utils.disable_progress_bars()
        undo.append(hub.utils.enable_progress_bars)
    return undo
