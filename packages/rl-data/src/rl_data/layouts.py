"""Column mapping: a dataset's columns onto the row shape the converters in :mod:`rl_data.records`
read, so a published dataset is read as it is, with no conversion script.

The published layouts already use our field names — rl-data's JSONL schemas were taken from them:

- **CapRL++** caption-QA (``internlm/CapRL-Video-QA-20K`` and its image counterpart; verl's
  multimodal parquet is the same): ``prompt`` (chat messages), ``videos`` (paths) or
  ``image``/``images`` (``datasets.Image``: bytes or paths), ``data_source``,
  ``reward_model.ground_truth`` (list of ``{question, choices, answer}``), ``extra_info``.
- **verl** generative-judge parquet: ``prompt``, ``rm_prompt_{i}``, ``reward_model.ground_truth``,
  ``extra_info``, ``data_source`` (``ability`` and ``reward_model.style`` are ignored).
- **TRL** prompt-only datasets: ``prompt`` as text or as messages; other columns are kept.
- **Flow-GRPO / VRL** prompt manifests: one prompt per row in ``prompt`` (their GenEval metadata)
  or ``text`` (what ``load_dataset("text", ...)`` makes of their ``.txt`` manifests).
- **Preference pairs** for Diffusion-DPO: ``prompt``, ``chosen``, ``rejected`` (image or video
  paths, or ``datasets.Image``'s ``{bytes, path}``); or Pick-a-Pic's ``caption``, ``jpg_0``,
  ``jpg_1`` (image bytes) and ``label_0`` (1: ``jpg_0`` preferred, 0: ``jpg_1``, 0.5: a tie,
  refused), which :func:`~rl_data.records.preference_from_row` reads as they are.

What differs is how Arrow stores rows, and :func:`tidy_arrow_row` undoes that. Any other column
names are one ``mapping={our_field: their_column}`` away (dotted on both sides:
``{"reward_model.ground_truth": "qa", "prompt": "meta.question"}``); a bad row's error then names
their column, not ours.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Literal

__all__ = ["KINDS", "ColumnMap", "Kind", "tidy_arrow_row"]

Kind = Literal["caption_qa", "judge", "prompts", "ocr", "preference"]
KINDS: tuple[Kind, ...] = ("caption_qa", "judge", "prompts", "ocr", "preference")

# Our field -> the columns it may come from when the caller maps nothing, first present wins.
# Fields not listed are read under their own name.
_DEFAULT_SOURCES: dict[Kind, dict[str, tuple[str, ...]]] = {
    "caption_qa": {},
    "judge": {},
    "prompts": {},
    "ocr": {"prompt": ("prompt", "text")},
    "preference": {"prompt": ("prompt", "caption")},  # Pick-a-Pic names it caption
}
# Fields a mapping may fill, per kind (None: any name, the rest of the row is kept as is).
_TARGETS: dict[Kind, tuple[str, ...] | None] = {
    "caption_qa": ("prompt", "image", "images", "videos", "reward_model",
                   "reward_model.ground_truth", "data_source", "extra_info"),
    "judge": ("prompt", "reward_model", "reward_model.ground_truth", "extra_info", "data_source"),
    "prompts": None,
    "ocr": ("prompt", "image", "video"),
    "preference": ("prompt", "chosen", "rejected"),
}
_RM_PROMPT = re.compile(r"^rm_prompt_\d+$")
_MISSING = object()


def _get(row: Mapping[str, Any], dotted: str) -> Any:
    value: Any = row
    for key in dotted.split("."):
        if not isinstance(value, Mapping) or key not in value:
            return _MISSING
        value = value[key]
    return value


def _put(row: dict[str, Any], dotted: str, value: Any) -> None:
    """Set ``row[a][b] = value`` for ``"a.b"``, copying the parents; ``_MISSING`` removes the key."""
    *parents, last = dotted.split(".")
    node = row
    for key in parents:
        child = dict(node[key]) if isinstance(node.get(key), Mapping) else {}
        node[key] = child
        node = child
    if value is _MISSING:
        node.pop(last, None)
    else:
        node[last] = value


class ColumnMap:
    """Moves a row's columns onto our field names, and names a bad field by the caller's column.

    Args:
        kind: which converter the rows go to (``"caption_qa"``, ``"judge"``, ``"prompts"``,
            ``"ocr"``, ``"preference"``).
        mapping: ``{our_field: their_column}``, both dotted paths. Give it when a dataset names a
            column differently from the layouts above; columns it does not name pass unchanged.
    """

    def __init__(self, kind: Kind, mapping: Mapping[str, str] | None = None) -> None:
        if kind not in KINDS:
            raise ValueError(f"unknown kind {kind!r}; expected one of {list(KINDS)}")
        self.kind = kind
        self.mapping = dict(mapping or {})
        allowed = _TARGETS[kind]
        for target, column in self.mapping.items():
            if not isinstance(column, str) or not column:
                raise ValueError(f"mapping[{target!r}] must name a column, got {column!r}")
            if allowed is not None and target not in allowed and not (
                kind == "judge" and _RM_PROMPT.match(target)
            ):
                raise ValueError(f"mapping target {target!r} is not a {kind} field; "
                                 f"map onto one of {[*allowed, *(['rm_prompt_0'] if kind == 'judge' else [])]}")

    def apply(self, row: Any) -> Any:
        """The row with mapped (and default-layout) columns moved onto our fields. A mapped
        column that the row lacks is left out, so the converter reports it missing."""
        if not isinstance(row, Mapping):
            return row
        out = dict(row)
        for target, sources in _DEFAULT_SOURCES[self.kind].items():
            if target not in self.mapping and target not in out:
                found = next((s for s in sources if s in out), None)
                if found is not None:
                    out[target] = out.pop(found)
        values = {target: _get(row, column) for target, column in self.mapping.items()}
        for column in self.mapping.values():
            if "." not in column:
                out.pop(column, None)  # a rename, not a copy: PromptRecord.fields keeps no duplicate
        for target, value in values.items():
            _put(out, target, value)
        return out

    def source_field(self, field: str | None, row: Any = None) -> str | None:
        """Our dotted field path -> the caller's (``reward_model.ground_truth[1].answer`` ->
        ``qa[1].answer`` under ``{"reward_model.ground_truth": "qa"}``); ``row`` is the row as
        read, to name a default-layout column (``text`` for an OCR prompt)."""
        if field is None:
            return None
        renames = dict(self.mapping)
        if isinstance(row, Mapping):
            for target, sources in _DEFAULT_SOURCES[self.kind].items():
                if target not in renames and target not in row:
                    renames[target] = next((s for s in sources if s in row), target)
        for target in sorted(renames, key=len, reverse=True):
            if field == target or field.startswith((f"{target}.", f"{target}[")):
                return renames[target] + field[len(target):]
        return field


def _unstack(value: Any) -> Any:
    """A legacy ``datasets.Sequence`` of structs comes back as a struct of equal-length lists
    (``{"role": [...], "content": [...]}``); turn it back into the list of structs it was."""
    lists = isinstance(value, dict) and value and all(isinstance(v, list) for v in value.values())
    if lists and len({len(v) for v in value.values()}) == 1:
        return [dict(zip(value, items, strict=True)) for items in zip(*value.values(), strict=True)]
    return value


def tidy_arrow_row(row: Any, kind: Kind) -> Any:
    """Undo Arrow's storage artefacts on a row read from parquet or a ``datasets`` dataset:
    struct columns are unified across rows, so a chat content part ``{"type": "image"}`` comes
    back as ``{"type": "image", "text": None, ...}`` (the ``None`` keys are dropped), and a legacy
    ``Sequence`` of structs comes back as a struct of lists (turned back into a list, for the
    fields that must be lists: ``prompt`` and caption-QA ``reward_model.ground_truth``)."""
    if not isinstance(row, dict):
        return row
    row = dict(row)
    prompt = _unstack(row.get("prompt"))
    if isinstance(prompt, list):
        prompt = [_tidy_message(m) for m in prompt]
    if "prompt" in row:
        row["prompt"] = prompt
    reward = row.get("reward_model")
    if kind == "caption_qa" and isinstance(reward, dict) and "ground_truth" in reward:
        row["reward_model"] = {**reward, "ground_truth": _unstack(reward["ground_truth"])}
    return row


def _tidy_message(message: Any) -> Any:
    if isinstance(message, dict) and isinstance(message.get("content"), list):
        parts = [{k: v for k, v in p.items() if v is not None} if isinstance(p, dict) else p
                 for p in message["content"]]
        return {**message, "content": parts}
    return message
