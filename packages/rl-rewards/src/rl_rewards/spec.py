"""`RewardSpec`: which scorers make up a reward, with which weights, and how they combine.

A spec is plain data (msgspec Struct), loaded from TOML or built in Python, and turned into a
scorer with `rl_rewards.composition.build_reward`. Example (`reward.toml`, CapRL++ video):

    combine = "sum"

    [components.qa]
    scorer = "caption_qa"
    options = { model = "Qwen/Qwen3-4B-Instruct-2507", task = "video" }

    [components.format]
    scorer = "timestamp_format"
    weight = 0.2

VeRL-with-RMs (rule reward, then judges folded in, each judge only where the rule passed):

    combine = "fold"

    [components.rule]
    scorer = "exact_match"   # your rule, added with rl_rewards.registry.register_scorer

    [components.helpful]
    scorer = "judge"
    op = "add"
    weight = 0.5
    gate = { component = "rule", threshold = 1.0 }
    options = { module = "rl_rewards.judges.yes_no", model = "/models/judge" }
"""

from __future__ import annotations

import math
import tomllib
from pathlib import Path
from typing import Any, Literal

import msgspec


class Gate(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Score this component only for samples where `component` (declared earlier) is >= threshold.

    Checked before the gated scorer is called, so gated-out samples are never sent to it
    (VeRL-with-RMs scores every sample and then discards the gated-out judge scores). Its gate is
    `rule == 1`; with rule rewards in [0, 1], as its rules are, `threshold = 1.0` is the same.

    `gated_out` says what a gated-out component does to the total:

    - `"skip"` (default): it is left out: `add` adds nothing, `mul` multiplies by nothing.
    - `"zero"`: it counts with value 0.0, as in VeRL-with-RMs, whose trainer zeroes a masked judge
      score and still applies its combine function: an `add` judge adds 0 (same as skip), a `mul`
      judge makes the total 0 for that sample. Pick it to reproduce VeRL-with-RMs' `mul` judges;
      keep `skip` when a failed rule should leave the rule's own (e.g. negative) score standing.
    """

    component: str
    threshold: float = 1.0
    gated_out: Literal["skip", "zero"] = "skip"


class Component(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """One named part of a reward.

    - `scorer`: a registered scorer name (`rl_rewards.registry.SCORERS`), `options` its keyword
      arguments.
    - `weight`: multiplies the component's value in the total (the reported component value is
      always the unweighted one).
    - `op`: for `combine = "fold"` only: `add` (total += weight * value) or `mul`
      (total *= weight * value), as in VeRL-with-RMs' per-judge combine functions.
    - `gate`: see `Gate`. A gated-out component is reported as 0.0 and, by default, left out of
      the total (sum: adds nothing; fold: its op is skipped); `gate.gated_out = "zero"` counts it
      as 0.0 instead (a `mul` then zeroes the total).
    - `fallback`: value used when this component fails for a sample; without it the failure
      becomes the sample's error (score None).

    `weight`, `fallback` and `gate.threshold` must be finite: NaN or inf is refused when the spec
    is loaded (`RewardSpec`), with the component and field named.
    """

    scorer: str
    weight: float = 1.0
    options: dict[str, Any] = {}
    op: Literal["add", "mul"] = "add"
    gate: Gate | None = None
    fallback: float | None = None


class RewardSpec(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Components (in declaration order) and the combine rule.

    - `sum` (default): total = sum of weight * value over scored components.
    - `fold`: VeRL-with-RMs' left fold: total = weight_0 * value_0 of the first component (the
      rule reward), then each later component applies its `op` in order.

    Components are scored, gated and folded in declaration order (TOML tables and dicts keep
    it), so order is part of the formula under `fold`: a component declared before the judges
    is added before a `mul` judge multiplies the total. VeRL-with-RMs adds its BGE term right
    after the rule and before the judges: declare the embedding component second.
    """

    components: dict[str, Component]
    combine: Literal["sum", "fold"] = "sum"

    def __post_init__(self) -> None:
        if not self.components:
            raise ValueError("RewardSpec.components is empty: name at least one component")
        seen: list[str] = []
        for name, component in self.components.items():
            _check_finite(name, component)
            gate = component.gate
            if gate is not None and gate.component not in seen:
                where = "is not declared" if gate.component not in self.components else "is declared after it"
                raise ValueError(
                    f"components.{name}.gate.component = {gate.component!r} {where}; a gate must name a "
                    f"component declared before the gated one (declared before: {seen or 'none'})"
                )
            seen.append(name)


def _check_finite(name: str, component: Component) -> None:
    """A NaN or infinite weight, fallback or gate threshold is refused: a total of inf or nan is
    no reward (every sample would fail), a NaN threshold lets every sample through (NaN < t is
    false), and JSON, which carries settings to worker processes, has no such numbers."""
    fields = {"weight": component.weight, "fallback": component.fallback,
              "gate.threshold": component.gate.threshold if component.gate is not None else None}
    for field, value in fields.items():
        if value is not None and not math.isfinite(value):
            raise ValueError(f"components.{name}.{field} = {value} is not a finite number; set a finite value")


def load_spec(path: str | Path) -> RewardSpec:
    """Read a RewardSpec from a TOML file; errors name the file and the bad field."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{path}: invalid TOML: {e}") from None
    return spec_from_dict(data, source=str(path))


def spec_from_dict(data: dict[str, Any], source: str = "reward spec") -> RewardSpec:
    """Validate a plain dict (parsed TOML/JSON) into a RewardSpec."""
    try:
        return msgspec.convert(data, RewardSpec)
    except (msgspec.ValidationError, ValueError) as e:
        raise ValueError(f"{source}: {e}") from None
