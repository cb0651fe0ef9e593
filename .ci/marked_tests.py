#!/usr/bin/env python3
"""Run the tests carrying one marker (`gpu`, `vllm`, `slow`) in every package and app, with this
Python. `nox -s vllm` runs it in an environment it builds; on a GPU machine that cannot reach a
package index (vLLM from a wheel set, see docs/install.md), run it directly from the repository
root:

    python .ci/marked_tests.py vllm          # or gpu; extra arguments go to every pytest run
    MARKED_ONLY=apps/caption-rl python .ci/marked_tests.py vllm     # some folders (comma-separated)

Where the workspace packages are not installed, their `src` folders are put on PYTHONPATH. A
folder with no test of that marker counts as passed; any failure makes the exit status 1.
`vllm` tests run one per process: vLLM keeps process-wide state (its distributed groups, the
sleep-mode allocator) after an engine is deleted, so a second engine in the same process would
test that leftover state rather than the code.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = [
    *(f"packages/{p}/tests" for p in ("rl-core", "rl-data", "rl-models", "rl-rollout", "rl-policy", "rl-rewards")),
    *sorted(f"apps/{main.parent.name}/tests" for main in ROOT.glob("apps/*/__main__.py")),  # every recipe
]
# vLLM, its kernel packages and inductor warn about themselves (deprecations, TF32 hints, zmq
# contexts left to the garbage collector at teardown): shown, not turned into errors of ours
WARNINGS = {"vllm": ["-W", "default"]}


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("gpu", "vllm", "slow"):
        print(__doc__)
        return 2
    marker, extra = argv[0], argv[1:]
    env = dict(os.environ)
    sources = [str(ROOT / "packages" / p / "src") for p in ("rl-core", "rl-data", "rl-models", "rl-rollout", "rl-policy", "rl-rewards")]
    env["PYTHONPATH"] = os.pathsep.join([*sources, *filter(None, [env.get("PYTHONPATH")])])
    failed = []
    pytest = [sys.executable, "-m", "pytest", "-m", marker, "-q", "-p", "no:cacheprovider", *WARNINGS.get(marker, [])]
    only = [p for p in os.environ.get("MARKED_ONLY", "").split(",") if p]
    for folder in [f for f in FOLDERS if not only or any(f.startswith(p) for p in only)]:
        print(f"\n=== {folder}: -m {marker}", flush=True)
        home = (ROOT / folder).parent  # the package or app: pytest's rootdir, node ids are relative to it
        targets = ["tests"]
        if marker == "vllm":
            listed = subprocess.run([*pytest, "--collect-only", "tests"], env=env, cwd=home,
                                    capture_output=True, text=True).stdout.splitlines()
            targets = [line for line in listed if "::" in line] or targets
        for target in targets:
            code = subprocess.call([*pytest, target, *extra], env=env, cwd=home)
            if code not in (0, 5):  # 5: no test with this marker here
                failed.append(f"{target} (exit {code})")
    print("\nfailed: " + ", ".join(failed) if failed else f"\nall {marker} tests passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
