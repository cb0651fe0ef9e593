"""How a multi-process run ends: `end_training(accelerator)` instead of Accelerate's own.

Accelerate's `end_training()` closes the trackers and destroys the process group, and the
process exits right after. Two things can go wrong there:

- a process ends while another still works. Rank 1 is done as soon as the last gather returns,
  while rank 0 is still writing the export it gathered; if rank 1 then fails on its way out, the
  launcher stops rank 0 mid-write (`accelerate launch` sends it SIGTERM);
- the interpreter finalizes while a gloo worker thread is still freeing the last collective.
  The waiting process is woken when the collective completes; the worker drops its reference to
  the collective's tensors a moment later, and dropping a tensor Python has also seen takes the
  GIL. If the interpreter is finalizing by then, Python 3.11 to 3.13 ends that thread inside a
  C++ destructor and the whole process aborts (`terminate called without an active exception`,
  SIGABRT, exit code -6) after a run that finished and saved everything. A barrier alone does
  not prevent it: the worker can still hold the reference after the barrier completes.

Measured on a 2-core CPU, 2-process FSDP2 runs that gather the full weights and exit: with
Accelerate's `end_training()`, 3 of 40 launches aborted (tests/train/mp_shutdown_script.py);
in a smaller script, 3 of 40 without a barrier, 2 of 40 with one, 0 of 80 with the barrier and
the pause below; the test script with this function, 0 of 40.
"""

from __future__ import annotations

import time
from typing import Any

__all__ = ["DRAIN_SECONDS", "end_training"]

# A worker waiting for the GIL gets it as soon as the main thread sleeps; 0.2 s leaves room for
# a loaded machine, once per run.
DRAIN_SECONDS = 0.2


def end_training(accelerator: Any, *, drain_s: float = DRAIN_SECONDS) -> None:
    """End a run on every process: wait for all processes, run `accelerator.end_training()`, then
    pause `drain_s` with the GIL released so the collective backend's threads finish freeing
    their last work before the interpreter exits. Call it once, after the last collective and
    after dropping a DDP wrapper the app no longer needs. One process: no barrier and no pause."""
    import torch.distributed as dist

    distributed = dist.is_available() and dist.is_initialized()
    if distributed:
        accelerator.wait_for_everyone()
    accelerator.end_training()
    if distributed:
        time.sleep(drain_s)
