"""The README's Hugging Face datasets snippets run from the repository root, as written."""

import re
from pathlib import Path

import pytest

datasets = pytest.importorskip("datasets")

ROOT = Path(__file__).resolve().parents[3]
README = (ROOT / "packages" / "rl-data" / "README.md").read_text()
SECTION = README.split("## Hugging Face datasets", 1)[1].split("\n## ", 1)[0]
BLOCKS = re.findall(r"```python\n(.*?)```", SECTION, re.DOTALL)

# what each snippet must leave behind, in README order
CHECKS = [
    lambda ns: len(ns["records"]) == 3 and ns["records"][0].videos[0].endswith("videos/clip_00.mp4"),
    lambda ns: len(ns["train"]) == 16 and len(ns["train"][0].rm_prompts) == 2,
    lambda ns: ns["records"][0].fields == {"meta": {"id": 7}},
    lambda ns: ns["record"].images[0].bytes is not None,
    lambda ns: len(ns["batch"]) == 8 and ns["state"]["position"] == 2 and ns["state"]["shard"] == [0, 2],
    lambda ns: len(ns["records"]) == 16,
]


def test_every_snippet_has_a_check():
    assert len(BLOCKS) == len(CHECKS)


@pytest.mark.parametrize("index", range(len(CHECKS)))
def test_readme_datasets_snippet_runs(index, monkeypatch, tmp_path):
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path))  # load_dataset's cache
    namespace: dict = {}
    exec(compile(BLOCKS[index], f"README.md python block {index}", "exec"), namespace)
    assert CHECKS[index](namespace)
