"""The app module (loaded from __main__.py), offline."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

APP = Path(__file__).resolve().parents[1]
REPO = APP.parents[1]
sys.path.insert(0, str(APP))  # what `python apps/arith-grpo` does: siblings of __main__ import


def _load_app():
    spec = importlib.util.spec_from_file_location("arith_grpo_app", APP / "__main__.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses and msgspec resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


app = _load_app()
