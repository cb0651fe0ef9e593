"""Shared test setup. Must not import torch: the `no_torch` tests run in an env without it."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
