"""Reading the image a sample refers to (`Sample.metadata["image"]`: a path or a PIL image)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

try:
    from PIL import Image
except ImportError as e:
    raise ImportError(f'image scorers need pillow: pip install "rl-rewards[ocr]" or "rl-rewards[vision]"; in a clone of the repository: uv sync --all-packages --extra ocr or --extra vision ({e})') from e


def load_image(metadata: dict[str, Any]) -> Image.Image:
    """The sample's image as RGB; a missing key or file is a clear per-sample error."""
    if "image" not in metadata:
        raise ValueError(f"no image: Sample.metadata has no 'image' (keys: {sorted(metadata)})")
    image = metadata["image"]
    if isinstance(image, Image.Image):
        return image.convert("RGB")
    path = Path(image)
    if not path.is_file():
        raise FileNotFoundError(f"image file {str(path)!r} does not exist")
    with Image.open(path) as opened:
        return opened.convert("RGB")
