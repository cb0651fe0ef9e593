"""`ocr` scorer: rapidocr reads text rendered with PIL (offline models from the wheel)."""

import logging

import pytest

pytest.importorskip("rapidocr")  # the [ocr] extra; skipped in the torch-free session

from PIL import Image, ImageDraw, ImageFont

from rl_rewards.registry import build_scorer
from rl_rewards.samples import Sample
from rl_rewards.scorers.ocr import quoted_target


def _render(text: str, path):
    image = Image.new("RGB", (420, 160), "white")
    ImageDraw.Draw(image).text((30, 30), text, fill="black", font=ImageFont.load_default(size=72))
    image.save(path)
    return path


@pytest.fixture(scope="module")
def scorer():
    return build_scorer("ocr")


def test_quoted_target():
    assert quoted_target('A sign that says "Hello World" on a wall') == "Hello World"
    assert quoted_target('one "quote only') is None
    assert quoted_target("no quotes") is None


def test_reads_rendered_text(scorer, tmp_path):
    path = _render("HELLO", tmp_path / "hello.png")
    results = scorer.score([
        Sample(prompt='a poster reading "hello"', completion="", metadata={"image": str(path)}),
        Sample(prompt='a poster reading "help"', completion="", metadata={"image": Image.open(path)}),
        Sample(prompt="no quotes", completion="", reference="HELLO", metadata={"image": str(path)}),
        Sample(prompt='"HELLO"', completion="", metadata={"image": str(tmp_path / "missing.png")}),
        Sample(prompt="no target", completion="", metadata={"image": str(path)}),
    ])
    assert results[0].score == 1.0
    assert results[1].score == pytest.approx(0.5)  # "hello" vs "help": l->p and drop o, 2 edits over 4 chars
    assert results[2].score == 1.0
    assert results[3].error is not None and "missing.png" in results[3].error
    assert results[4].error is not None and "no target text" in results[4].error


def test_an_image_without_text_scores_0_without_rapidocrs_empty_warning(scorer, tmp_path):
    """rapidocr warns "The text detection result is empty" for each image without text (39
    lines in the diffusion-grpo default run); that warning is dropped, rapidocr's others pass."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    rapidocr_log = logging.getLogger("RapidOCR")
    rapidocr_log.addHandler(handler)
    try:
        Image.new("RGB", (64, 64), "white").save(tmp_path / "blank.png")
        [result] = scorer.score([Sample(prompt='"OPEN"', completion="", metadata={"image": str(tmp_path / "blank.png")})])
        rapidocr_log.warning("model file corrupt")
    finally:
        rapidocr_log.removeHandler(handler)
    assert result.score == 0.0
    assert [r.getMessage() for r in records if r.levelno >= logging.WARNING] == ["model file corrupt"]
