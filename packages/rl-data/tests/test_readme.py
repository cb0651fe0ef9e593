"""The README's Hugging Face datasets and preference-pair snippets run from the repository root,
as written."""

import re
from pathlib import Path

import pytest

datasets = pytest.importorskip("datasets")

ROOT = Path(__file__).resolve().parents[3]
README = (ROOT / "packages" / "rl-data" / "README.md").read_text()


def _blocks(heading: str) -> list[str]:
    section = README.split(f"## {heading}", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, re.DOTALL)


# what each snippet must leave behind, in README order
CHECKS = {
    "Hugging Face datasets": [
        lambda ns: len(ns["records"]) == 3 and ns["records"][0].videos[0].endswith("videos/clip_00.mp4"),
        lambda ns: len(ns["train"]) == 16 and len(ns["train"][0].rm_prompts) == 2,
        lambda ns: ns["records"][0].fields == {"meta": {"id": 7}},
        lambda ns: ns["record"].images[0].bytes is not None,
        lambda ns: len(ns["batch"]) == 8 and ns["state"]["position"] == 2 and ns["state"]["shard"] == [0, 2],
        lambda ns: len(ns["records"]) == 16,
    ],
    "Preference pairs (Diffusion-DPO)": [
        lambda ns: ns["red"].media == "image" and ns["clip"].media == "video" and ns["frames"].shape == (4, 32, 32, 3),
        lambda ns: ns["pair"].media == "video" and ns["frames"].shape == (3, 16, 16, 3),
        lambda ns: ns["pair"].prompt == "a red square" and ns["pair"].rejected.bytes == ns["png"]("blue")
        and ns["reader"].skipped == 1 and ns["reader"].stats.errors[0].field == "label_0",
    ],
}
SNIPPETS = [(heading, index) for heading, checks in CHECKS.items() for index in range(len(checks))]


@pytest.mark.parametrize("heading", list(CHECKS))
def test_every_snippet_has_a_check(heading):
    assert len(_blocks(heading)) == len(CHECKS[heading])


@pytest.mark.parametrize(("heading", "index"), SNIPPETS)
def test_readme_snippet_runs(heading, index, monkeypatch, tmp_path):
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path))  # load_dataset's cache
    namespace: dict = {}
    exec(compile(_blocks(heading)[index], f"README.md {heading} python block {index}", "exec"), namespace)
    assert CHECKS[heading][index](namespace)
