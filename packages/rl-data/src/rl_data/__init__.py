"""rl-data: records in, batches out.

Record Structs and streaming readers for CapRL caption-QA rows, verl-style generative-judge
parquet, Flow-GRPO OCR prompt manifests, plain prompt JSONL and Diffusion-DPO preference pairs
(bad records named by file, line and field) — and, with ``rl-data[datasets]``, for Hugging Face
datasets in the same layouts (bad records named by split, row and field); multiple-choice option
normalization; image loading and video frame sampling (PyAV); a resumable group sampler, and a
resumable group stream for iterable datasets sharded by rank.

Names are re-exported lazily: ``import rl_data.choices`` does not load pyarrow or PyAV, and no
name loads ``datasets`` until a dataset is read.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "choices": ["Choice", "format_options", "format_question_text", "normalize_choices",
                "parse_question_text", "split_label", "answer_index"],
    "errors": ["RecordError", "ReadStats"],
    "records": ["CaptionQARecord", "ChatMessage", "FieldError", "ImageSource", "JudgeRecord",
                "OCRPrompt", "PreferenceRecord", "PromptRecord", "QAItem", "caption_qa_from_row",
                "judge_from_row", "ocr_prompt_from_line", "ocr_prompt_from_row", "preference_from_row", "prompt_from_row",
                "qa_from_question_text"],
    "readers": ["Location", "Reader", "read_caption_qa", "read_judge_records", "read_ocr_prompts",
                "read_preferences", "read_prompts"],
    "sources": ["open_source"],
    "layouts": ["ColumnMap"],
    "hf": ["shard_by_rank"],
    "writers": ["RecordWriter"],
    "media": ["VideoFrames", "chat_messages", "fit_image", "load_frames", "load_image", "load_pixels", "sample_video"],
    "sampler": ["GroupSampler", "GroupStream"],
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_MODULE_OF)


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'rl_data' has no attribute {name!r}")
    return getattr(importlib.import_module(f"rl_data.{module}"), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
