"""Append benchmark figures to benchmarks/RESULTS.md with device, versions and date.

Every benchmark prints its table and calls `append_results`; a ratio is always against a
baseline measured in the same run.
"""

from __future__ import annotations

import datetime as dt
import json
import platform
import subprocess
from collections.abc import Sequence
from pathlib import Path

RESULTS = Path(__file__).with_name("RESULTS.md")
# HBM bytes/s by device-name substring, first match wins (docs/reference.md §5: H100 SXM, H200)
BANDWIDTH = {"H100 PCIe": 2.0e12, "H100 NVL": 3.9e12, "H100": 3.35e12, "H200": 4.8e12}


def hbm_bandwidth(device_name: str) -> float | None:
    """HBM bytes/s of a card by its `torch.cuda.get_device_name`, None for one not in `BANDWIDTH`."""
    return next((bw for key, bw in BANDWIDTH.items() if key in device_name), None)


def environment() -> dict[str, str]:
    """Device and library versions of this process, for the results header."""
    env = {"python": platform.python_version()}
    try:
        import torch

        env["torch"] = torch.__version__
        env["device"] = (
            torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"CPU ({platform.processor() or platform.machine()})"
        )
    except ImportError:
        env["device"] = f"CPU ({platform.machine()})"
    for name in ("transformers", "diffusers", "accelerate", "peft", "vllm", "trl"):
        try:
            module = __import__(name)
            env[name] = module.__version__
        except ImportError:
            pass
    return env


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def append_results(
    title: str, header: Sequence[str], rows: Sequence[Sequence[object]], notes: str = "", path: Path = RESULTS
) -> str:
    """Print the table and append it, with an environment line, to RESULTS.md."""
    env = environment()
    stamp = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    env_line = ", ".join(f"{k} {v}" for k, v in env.items())
    block = f"\n## {title}\n\n{stamp} — {env_line}\n\n{markdown_table(header, rows)}\n"
    if notes:
        block += f"\n{notes}\n"
    print(block)
    if not path.exists():
        path.write_text("# Benchmark results\n\nAppended by the scripts in this folder; newest last.\n")
    with path.open("a") as f:
        f.write(block)
    return block


def seconds_from_fresh_process(cmd: Sequence[str], mark: str, *, env: dict[str, str] | None = None) -> float:
    """Run a benchmark's peer alone in a fresh process (`cmd`) and return the `seconds` of the
    JSON object on its last stdout line starting with `mark` (the peer's own logs share stdout)."""
    done = subprocess.run(list(cmd), capture_output=True, text=True, env=env, timeout=900)
    if done.returncode:
        raise RuntimeError(f"{cmd[1]} alone exited with {done.returncode}: {done.stderr[-600:]}")
    found = [line for line in done.stdout.splitlines() if line.startswith(mark)]
    if not found:
        raise RuntimeError(f"{cmd[1]} alone printed no result: {(done.stdout + done.stderr)[-600:]}")
    return float(json.loads(found[-1].removeprefix(mark))["seconds"])


def cached_figures(cache: Path | None, name: str) -> Path | None:
    """Where `--cache DIR` keeps one run's figures (`DIR/<name>.json`, spaces as `_`), so a benchmark
    too long for one command runs its parts in several on one machine; None without `--cache`."""
    return cache / f"{name.replace(' ', '_')}.json" if cache is not None else None


def load_figures(path: Path | None) -> dict | None:
    """The figures kept at `path` by `save_figures`, or None (no cache, or not run yet)."""
    return json.loads(path.read_text()) if path is not None and path.exists() else None


def save_figures(path: Path | None, figures: dict) -> None:
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(figures))


def kernel_times(prof, kind, top: int = 0) -> tuple[dict[str, float], list[tuple[float, int, str]]]:
    """A `torch.profiler` run's CUDA milliseconds summed by `kind(kernel name)`, and every kernel
    as (ms, calls, name), longest first; `top` > 0 prints the longest kernels."""
    from collections import defaultdict

    import torch

    times: dict[str, float] = defaultdict(float)
    kernels = []
    for event in prof.key_averages():
        cuda_us = getattr(event, "device_time_total", 0.0) or getattr(event, "cuda_time_total", 0.0)
        if event.device_type == torch.autograd.DeviceType.CUDA and cuda_us:
            times[kind(event.key)] += cuda_us / 1e3
            kernels.append((cuda_us / 1e3, event.count, event.key))
    kernels.sort(reverse=True)
    for ms, count, name in kernels[:top]:
        print(f"  {ms:9.2f} ms  x{count:<6d} [{kind(name)}] {name[:140]}")
    return dict(times), kernels
