"""`brightness`: the mean grey level of a sample's image, by name through the registry."""

import pytest

pytest.importorskip("PIL")  # the [ocr] or [vision] extra; skipped in the torch-free session

from PIL import Image

from rl_rewards.registry import build_scorer
from rl_rewards.samples import Sample


def test_brightness_is_the_mean_grey_level_and_a_missing_image_fails_alone(tmp_path):
    half = Image.new("L", (4, 4), 0)
    half.paste(255, (0, 0, 4, 2))  # the top half white
    half.save(tmp_path / "half.png")
    results = build_scorer("brightness").score([
        Sample(completion="", metadata={"image": Image.new("RGB", (4, 4), "white")}),
        Sample(completion="", metadata={"image": str(tmp_path / "half.png")}),
        Sample(completion="", metadata={"image": str(tmp_path / "missing.png")}),
    ])
    assert [r.score for r in results[:2]] == [1.0, 0.5]
    assert results[2].score is None and "missing.png" in str(results[2].error)
