"""App configuration: a msgspec Struct filled from defaults, a TOML/YAML file, environment
variables and dotted `key=value` command-line overrides, in that order of precedence.

    class TrainConfig(msgspec.Struct, kw_only=True, frozen=True):
        lr: Annotated[float, msgspec.Meta(gt=0)] = 1e-5  # AdamW learning rate
        steps: int = 100

    class Config(msgspec.Struct, kw_only=True, frozen=True):
        train: TrainConfig = msgspec.field(default_factory=TrainConfig)

    cli = parse_cli(sys.argv[1:])
    if cli.help:
        sys.exit(print(config_help(Config, env={"ACTOR_LR": "train.lr"}, prog="my-app")))
    cfg = load_config(Config, cli.config, cli.overrides, env={"ACTOR_LR": "train.lr"})

An app's top-level Struct subclasses `AppConfig` and lists the keys it has renamed in `RENAMED`
(old dotted key -> new dotted key): an old key, from a file, an env mapping or an override, is
refused in one line naming the new one (`algo.kl_loss_coef was renamed: use algo.kl_coef`).

Configs stop at the app edge (torchtune's builders): library code takes flat keyword arguments.
Every error names the dotted field and where its value came from (file, env var, CLI).
"""

from __future__ import annotations

import ast
import difflib
import inspect
import io
import json
import math
import os
import re
import shutil
import textwrap
import tokenize
import tomllib
import types
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, TypeVar, Union, get_args, get_origin

import msgspec
import yaml

from rl_core import names
from rl_core.errors import UserError
from rl_core.names import RegistryRef
from rl_core.registry import Registry

__all__ = [
    "AdvantageName",
    "AggregationName",
    "AppConfig",
    "CliArgs",
    "ConfigError",
    "KLName",
    "NonNegative",
    "NonNegativeFloat",
    "PolicyLossName",
    "Positive",
    "PositiveFloat",
    "RewardAggregationName",
    "RolloutCorrectionName",
    "UnitInterval",
    "config_help",
    "dump_config",
    "flat_config",
    "load_config",
    "parse_cli",
    "resolve_path",
]

# Ranges for numeric config fields: every numeric knob declares one, so a refused value names the
# key, the range and where the value came from (file, env var, override). NaN/inf are refused for
# every float field whatever its range (`load_config`).
Positive = Annotated[int, msgspec.Meta(ge=1)]
NonNegative = Annotated[int, msgspec.Meta(ge=0)]
PositiveFloat = Annotated[float, msgspec.Meta(gt=0)]
NonNegativeFloat = Annotated[float, msgspec.Meta(ge=0)]
UnitInterval = Annotated[float, msgspec.Meta(ge=0, le=1)]

# Fields naming a registry entry: the value is checked against the registry when the config loads,
# so `algo.advantage=nope` stops in a line naming the key and the valid names, before any model loads.
# They hold a `rl_core.names.RegistryRef` (a `Registry` works too): the names without torch.
AdvantageName = Annotated[str, msgspec.Meta(extra={"registry": names.ADVANTAGE_ESTIMATORS})]
PolicyLossName = Annotated[str, msgspec.Meta(extra={"registry": names.POLICY_LOSSES})]
KLName = Annotated[str, msgspec.Meta(extra={"registry": names.KL_ESTIMATORS})]
AggregationName = Annotated[str, msgspec.Meta(extra={"registry": names.AGGREGATIONS})]
RewardAggregationName = Annotated[str, msgspec.Meta(extra={"registry": names.REWARD_AGGREGATIONS})]
RolloutCorrectionName = Annotated[str, msgspec.Meta(extra={"registry": names.ROLLOUT_CORRECTIONS})]

T = TypeVar("T", bound=msgspec.Struct)
_NULLS = frozenset({"null", "none", "None"})


class ConfigError(UserError, ValueError):
    """A config value or key is wrong; the message names the dotted key and its source."""


class AppConfig(msgspec.Struct, kw_only=True, frozen=True):
    """An app's top-level config (its tables are the fields of a subclass). `RENAMED` maps each
    dotted key the app has renamed to its new key (`{"algo.kl_loss_coef": "algo.kl_coef"}`):
    `load_config` refuses the old key, from a file, an env mapping or an override, with one line
    `algo.kl_loss_coef was renamed: use algo.kl_coef`, so one idea keeps one name in every app
    and an old launch line stops at once instead of failing as an unknown key. An old key that
    named a table (`[policy]`) is refused for the keys under it. Presets that translate another
    system's names (verl, CapRL++'s variables) map them to the new keys."""

    RENAMED: ClassVar[Mapping[str, str]] = {}


# ---------------------------------------------------------------- type helpers


def _unwrap(tp: Any) -> tuple[Any, list[Any]]:
    """Strip `Annotated[...]`, returning the bare type and its metadata."""
    if get_origin(tp) is Annotated:
        base, *meta = get_args(tp)
        return base, meta
    return tp, []


def _members(tp: Any) -> tuple[Any, ...]:
    """Members of a union (`A | None` -> (A, NoneType)); a non-union is its own one member."""
    tp, _ = _unwrap(tp)
    if get_origin(tp) in (Union, types.UnionType):
        return tuple(_unwrap(arg)[0] for arg in get_args(tp))
    return (tp,)


def _struct_of(tp: Any) -> type[msgspec.Struct] | None:
    """The Struct type behind `S`, `Annotated[S, ...]` or `S | None`; None for leaf types."""
    structs = [m for m in _members(tp) if isinstance(m, type) and issubclass(m, msgspec.Struct)]
    return structs[0] if len(structs) == 1 else None


def _admits(tp: Any, kind: type) -> bool:
    """Whether a value of `kind` (str, list, NoneType) is valid for `tp`."""
    for member in _members(tp):
        if get_origin(member) is Literal:
            if any(isinstance(arg, kind) for arg in get_args(member)):
                return True
        elif (get_origin(member) or member) is kind:
            return True
    return False


def _registry(tp: Any) -> Registry[Any] | RegistryRef | None:
    """The registry a field's value must name (`AdvantageName`, ...), else None."""
    for meta in _unwrap(tp)[1]:
        if isinstance(meta, msgspec.Meta) and meta.extra and isinstance(meta.extra.get("registry"),
                                                                         Registry | RegistryRef):
            return meta.extra["registry"]
    return None


def _type_name(tp: Any) -> str:
    registry = _registry(tp)
    if registry is not None:
        return f"str (one of: {', '.join(registry.names())})"
    tp, meta = _unwrap(tp)
    bounds = [f"{sym} {getattr(m, attr)}" for m in meta if isinstance(m, msgspec.Meta)
              for attr, sym in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")) if getattr(m, attr) is not None]
    if bounds:
        return f"{_type_name(tp)} {', '.join(bounds)}"
    origin = get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(arg) for arg in get_args(tp))
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(arg) for arg in get_args(tp))
    if origin is not None:
        return f"{origin.__name__}[{', '.join(_type_name(arg) for arg in get_args(tp))}]"
    if tp is type(None):
        return "None"
    return tp.__name__ if isinstance(tp, type) else repr(tp)


def _fields(cls: type[msgspec.Struct]) -> dict[str, msgspec.structs.FieldInfo]:
    return {f.encode_name: f for f in msgspec.structs.fields(cls)}


def _all_keys(cls: type[msgspec.Struct], prefix: str = "") -> list[str]:
    """Every dotted key of `cls`, nested Structs included (`train`, `train.lr`, ...)."""
    keys = []
    for name, info in _fields(cls).items():
        keys.append(prefix + name)
        sub = _struct_of(info.type)
        if sub is not None:
            keys += _all_keys(sub, f"{prefix}{name}.")
    return keys


def _field_type(cls: type[msgspec.Struct], dotted: str, source: str) -> Any:
    """The annotated type of `dotted` in `cls`; an unknown key raises with close matches."""
    tp: Any = cls
    parts = dotted.split(".")
    for i, part in enumerate(parts):
        if get_origin(_unwrap(tp)[0]) is dict:  # `weights.ocr=2` sets one key of a dict field
            tp = get_args(_unwrap(tp)[0])[1]
            continue
        struct = _struct_of(tp)
        fields = _fields(struct) if struct is not None else {}
        if part not in fields:
            known = _all_keys(cls)
            close = difflib.get_close_matches(dotted, known, n=3, cutoff=0.6)
            close = close or difflib.get_close_matches(part, [k.split(".")[-1] for k in known])
            hint = f"; did you mean: {', '.join(close)}?" if close else ""
            where = ".".join(parts[:i]) or "the top level"
            raise ConfigError(f"unknown config key {dotted!r} ({source}): no field {part!r} "
                              f"in {where}{hint}")
        tp = fields[part].type
    return tp


# ---------------------------------------------------------------- loading


def _read_file(path: Path) -> dict[str, Any]:
    text = path.read_text(encoding="utf-8")
    try:
        if path.suffix == ".toml":
            data = tomllib.loads(text)
        elif path.suffix in (".yaml", ".yml"):
            data = yaml.safe_load(text) or {}
        else:
            raise ConfigError(f"{path}: config files must end in .toml, .yaml or .yml")
    except (tomllib.TOMLDecodeError, yaml.YAMLError) as e:
        raise ConfigError(f"{path}: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a table/mapping, got {type(data).__name__}")
    return data


def _renames(cls: type[msgspec.Struct]) -> Mapping[str, str]:
    """`cls.RENAMED` for an `AppConfig` ({} for any other Struct): each old key is gone from
    `cls` and each new key is one of its keys, else the app's table is wrong (a TypeError)."""
    renamed = cls.RENAMED if issubclass(cls, AppConfig) else {}
    known = set(_all_keys(cls)) if renamed else set()
    for old, new in renamed.items():
        if old in known or new not in known:
            raise TypeError(f"{cls.__name__}.RENAMED maps {old!r} to {new!r}: the old key must be gone from "
                            f"{cls.__name__} and the new one must be one of its keys")
    return renamed


def _refuse_renamed(dotted: str, renamed: Mapping[str, str]) -> None:
    if dotted in renamed:
        raise ConfigError(f"{dotted} was renamed: use {renamed[dotted]}")


def _old_table(cls: type[msgspec.Struct], dotted: str, renamed: Mapping[str, str]) -> bool:
    """Whether `dotted` is a table that is gone but held renamed keys (`policy` of `policy.n`)."""
    return any(old.startswith(dotted + ".") for old in renamed) and dotted not in _all_keys(cls)


def _flatten(data: Mapping[str, Any], cls: type[msgspec.Struct], source: str,
             renamed: Mapping[str, str], prefix: str = "") -> dict[str, Any]:
    """Nested file data -> {dotted key: value}, descending only into Struct-typed fields (and
    into a renamed table, whose keys are then refused with their new names)."""
    flat = {}
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        _refuse_renamed(dotted, renamed)
        if isinstance(value, dict) and _old_table(cls, dotted, renamed):
            flat.update(_flatten(value, cls, source, renamed, dotted + "."))
            continue
        tp = _field_type(cls, dotted, source)  # raises on an unknown key
        if isinstance(value, dict) and _struct_of(tp) is not None:
            flat.update(_flatten(value, cls, source, renamed, dotted + "."))
        else:
            flat[dotted] = value
    return flat


def _parse_value(raw: str, tp: Any) -> Any:
    """A command-line / env string -> a Python value for a field of type `tp`.

    Quoted strings, numbers, booleans, arrays and inline tables are read as TOML literals;
    `null`/`none` means None for optional fields; a list field also takes `a,b,c`; a str field
    takes the raw text. Anything else is left as a string for msgspec to convert or reject.
    """
    if raw in _NULLS and _admits(tp, type(None)):
        return None
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        if _admits(tp, list):  # `a,b` or `[a, b]` of bare words
            inner = raw.strip()
            inner = inner[1:-1] if inner.startswith("[") and inner.endswith("]") else inner
            return [item.strip() for item in inner.split(",") if item.strip()]
        return raw
    if isinstance(value, dict) and _struct_of(tp) is not None:
        return value  # an inline table for a table-or-path field (`reward.spec={components = ...}`)
    if _admits(tp, str) and not isinstance(value, str):
        return raw  # `name=123` for a str field means the string "123"
    return value


def _checked(value: Any, tp: Any, dotted: str, source: str) -> Any:
    """Convert one env/CLI value on its own, so an error names the exact key (even a dict key)."""
    try:
        msgspec.convert(value, tp, strict=False)
    except msgspec.ValidationError as e:
        message, sub = _split_error(e)
        raise ConfigError(_describe(message, dotted + sub, value if not sub else None, source,
                                    _type_at(tp, sub))) from None
    return value


def _set(data: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = data
    for part in parents:
        if node.get(part) is None:  # absent, or `null` in the file: start a table
            node[part] = {}
        node = node[part]
        if not isinstance(node, dict):
            raise ConfigError(f"cannot set {dotted!r}: {part!r} is not a table")
    node[leaf] = value


def _split_error(err: msgspec.ValidationError) -> tuple[str, str]:
    """"Expected `int`, got `str` - at `$.a.b[0]`" -> ("expected int, got str", ".a.b[0]")."""
    match = re.fullmatch(r"(.*?)(?: - at `\$(.*)`)?", str(err), flags=re.S)
    assert match is not None  # the pattern matches any text
    message = match.group(1).replace("`", "")
    return message[:1].lower() + message[1:], match.group(2) or ""


def _describe(message: str, key: str, value: Any, source: str | None, tp: Any = None) -> str:
    bad = re.fullmatch(r"invalid enum value (.*)", message)
    choices = _choices(tp)
    if bad and choices:  # a Literal field: msgspec names the value, not what it may be
        message = f"unknown value {bad.group(1)}; valid choices: {', '.join(map(str, choices))}"
    elif isinstance(value, str | int | float | bool):  # the value itself says more than its type
        message = re.sub(r", got \w+$", "", message) + f", got {value!r}"
    return f"{key}: {message}" + (f" (from {source})" if source else "")


def _choices(tp: Any) -> list[Any]:
    """The values a `Literal[...]` field (or `Literal[...] | None`) takes; [] for other types."""
    members = [m for m in _members(tp) if m is not type(None)] if tp is not None else []
    if not members or any(get_origin(m) is not Literal for m in members):
        return []
    return [arg for m in members for arg in get_args(m)]


def _type_at(tp: Any, path: str) -> Any:
    """The type at a msgspec error path (`.reward.judges[0].engine`) inside `tp`; None where the
    path leaves what this can follow."""
    for field in re.findall(r"\.([^.[]+)|\[[^]]*\]", path):  # "" for a `[...]` step
        if field:
            struct = _struct_of(tp)
            info = _fields(struct).get(field) if struct is not None else None
            tp = info.type if info is not None else None
        else:  # a list item or a dict value
            items = [m for m in _members(tp) if get_origin(m) in (list, tuple, dict)]
            tp = get_args(items[0])[-1] if items else None
        if tp is None:
            return None
    return tp


def _error_message(cls: type[msgspec.Struct], err: msgspec.ValidationError, data: dict[str, Any],
                   sources: dict[str, str]) -> str:
    message, path = _split_error(err)
    dotted = re.sub(r"\[[^]]*\]", "", path).lstrip(".")
    value: Any = data
    for part in dotted.split(".") if dotted else []:
        value = value.get(part) if isinstance(value, dict) else None
    source = next((sources[k] for k in sorted(sources, key=len, reverse=True)
                   if dotted == k or dotted.startswith(k + ".") or k.startswith(dotted + ".")), None)
    return _describe(message, path.lstrip(".") or "config", value if dotted == path.lstrip(".")
                     else None, source, _type_at(cls, path))


def load_config(
    cls: type[T],
    path: str | os.PathLike[str] | None = None,
    overrides: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
) -> T:
    """Build `cls` from its defaults < `path` (.toml/.yaml) < `env` < `overrides`.

    `overrides` are `dotted.key=value` strings (see `_parse_value` for the value syntax).
    `env` maps an environment variable to a dotted key (`{"ACTOR_LR": "train.lr"}`); a variable
    that is set supplies that key's value. Unknown keys raise `ConfigError` listing close matches;
    a key `cls.RENAMED` lists (an `AppConfig`) raises `ConfigError` naming its new key; type
    errors name the dotted field and where the value came from. Values are converted with
    msgspec in lax mode, so YAML's `1e-5` (a string in YAML 1.1) still fills a float field.
    """
    renamed = _renames(cls)
    data: dict[str, Any] = {}
    sources: dict[str, str] = {}
    if path is not None:
        file = Path(path)
        for dotted, value in _flatten(_read_file(file), cls, str(file), renamed).items():
            _set(data, dotted, value)
            sources[dotted] = str(file)
    for var, dotted in (env or {}).items():
        _refuse_renamed(dotted, renamed)
        tp = _field_type(cls, dotted, f"env mapping {var}")
        if var in os.environ:
            source = f"env {var}={os.environ[var]}"
            _set(data, dotted, _checked(_parse_value(os.environ[var], tp), tp, dotted, source))
            sources[dotted] = source
    for item in overrides:
        dotted, sep, raw = item.partition("=")
        if not sep or not dotted.strip():
            raise ConfigError(f"override {item!r} must look like dotted.key=value")
        dotted, source = dotted.strip(), f"override {item}"
        _refuse_renamed(dotted, renamed)
        tp = _field_type(cls, dotted, source)
        _set(data, dotted, _checked(_parse_value(raw, tp), tp, dotted, source))
        sources[dotted] = source
    try:
        config = msgspec.convert(data, cls, strict=False)
    except msgspec.ValidationError as e:
        raise ConfigError(_error_message(cls, e, data, sources)) from None
    _check_finite(msgspec.to_builtins(config), "", sources)
    _check_registry_names(cls, config, "", sources)
    return config


def _source_of(dotted: str, sources: Mapping[str, str], default: str = "the default") -> str:
    return next((sources[k] for k in sorted(sources, key=len, reverse=True)
                 if dotted == k or dotted.startswith(k + ".") or dotted.startswith(k + "[")), default)


def _check_registry_names(cls: type[msgspec.Struct], value: msgspec.Struct, prefix: str,
                          sources: Mapping[str, str]) -> None:
    """Every field typed with a registry (`AdvantageName`, ...) names an entry of it."""
    for info in msgspec.structs.fields(cls):
        dotted, field_value = prefix + info.encode_name, getattr(value, info.name)
        sub = _struct_of(info.type)
        if sub is not None and isinstance(field_value, msgspec.Struct):
            _check_registry_names(sub, field_value, dotted + ".", sources)
            continue
        registry = _registry(info.type)
        if registry is not None and field_value not in registry:
            raise ConfigError(f"{dotted}: unknown {registry.kind} {field_value!r}; valid names: "
                              f"{', '.join(registry.names())} (from {_source_of(dotted, sources)})")


def _check_finite(tree: Any, dotted: str, sources: Mapping[str, str]) -> None:
    """No config float may be NaN or infinite (a NaN temperature or learning rate would train
    on garbage without an error); the message names the key and where the value came from."""
    if isinstance(tree, dict):
        for key, value in tree.items():
            _check_finite(value, f"{dotted}.{key}" if dotted else str(key), sources)
    elif isinstance(tree, list):
        for i, value in enumerate(tree):
            _check_finite(value, f"{dotted}[{i}]", sources)
    elif isinstance(tree, float) and not math.isfinite(tree):
        source = _source_of(dotted, sources)
        raise ConfigError(f"{dotted}: must be a finite number, got {tree} (from {source})")


# ---------------------------------------------------------------- command line


class CliArgs(msgspec.Struct, frozen=True, kw_only=True):
    """What `parse_cli` found. `resume` is None (start fresh), "latest", or a path."""

    config: Path | None = None
    resume: str | None = None
    help: bool = False
    overrides: tuple[str, ...] = ()


_OPTIONS = "--config FILE, --resume [PATH], --verbose, --help and key=value overrides"


def resolve_path(path: str, root: Path) -> str:
    """A config's file path as given when it exists (or is absolute), else under `root` (an app's
    repository: `examples/...` from any working directory) when it exists there, else as given
    (a Hub id, or a missing path whose error names it as the user wrote it)."""
    if Path(path).exists() or Path(path).is_absolute() or not (root / path).exists():
        return path
    return str(root / path)


def parse_cli(argv: Sequence[str]) -> CliArgs:
    """Split an app's argv into `--config FILE`, `--resume [PATH]`, `-h/--help`, `key=value`.

    A bare `--resume` (or one followed by an override or option) means "latest"; `--flag=value`
    spellings work too. Anything else raises `ConfigError` naming the token.
    """
    config: Path | None = None
    resume: str | None = None
    show_help = False
    overrides: list[str] = []
    tokens = list(argv)
    i = 0
    while i < len(tokens):
        token = tokens[i]
        flag, eq, inline = token.partition("=") if token.startswith("--") else (token, "", "")
        following = tokens[i + 1] if i + 1 < len(tokens) else None
        takes_next = following is not None and not following.startswith("-") and "=" not in following
        if token in ("-h", "--help"):
            show_help = True
        elif token == "--verbose":
            overrides.append("train.verbose=true")
        elif flag == "--config":
            if not (eq or takes_next):
                raise ConfigError("--config needs a file: --config FILE")
            config = Path(inline if eq else tokens[i + 1])
            i += 0 if eq else 1
        elif flag == "--resume":
            resume = inline if eq else (following if takes_next else "latest")
            i += 1 if takes_next and not eq else 0
        elif token.startswith("-"):
            raise ConfigError(f"unknown option {token!r}; an app takes {_OPTIONS}")
        elif "=" in token:
            overrides.append(token)
        else:
            raise ConfigError(f"argument {token!r} is not key=value; an app takes {_OPTIONS}")
        i += 1
    return CliArgs(config=config, resume=resume, help=show_help, overrides=tuple(overrides))


def _field_docs(cls: type) -> dict[str, str]:
    """Field name -> its attribute docstring or trailing `# comment` in the source of `cls` or of
    the Struct it inherits the field from (the nearest definition wins)."""
    docs: dict[str, str] = {}
    for base in reversed(cls.__mro__):
        if base is not msgspec.Struct and isinstance(base, type) and issubclass(base, msgspec.Struct):
            docs |= _own_field_docs(base)
    return docs


def _own_field_docs(cls: type) -> dict[str, str]:
    """Field name -> its attribute docstring or trailing `# comment` in the class's own source."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):  # defined in a REPL or exec'd string: no source to read
        return {}
    comments = {tok.start[0]: tok.string.lstrip("#").strip()
                for tok in tokenize.generate_tokens(io.StringIO(source).readline)
                if tok.type == tokenize.COMMENT}
    cls_node = ast.parse(source).body[0]
    if not isinstance(cls_node, ast.ClassDef):  # getsource of a class is its class statement
        return {}
    body = cls_node.body
    docs = {}
    for node, nxt in zip(body, [*body[1:], None], strict=True):
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant) and isinstance(
                nxt.value.value, str):
            docs[node.target.id] = inspect.cleandoc(nxt.value.value).replace("\n", " ")
        elif node.end_lineno in comments:
            docs[node.target.id] = comments[node.end_lineno]
    return docs


class _HelpRow(msgspec.Struct, frozen=True):
    table: str  # the key's table: "" (top level), "model", "reward.spec", "reward.judges[i]"
    key: str
    typed: str  # "int >= 1 = 8": the type, its range and the default
    doc: str


def _default_text(info: msgspec.structs.FieldInfo, value: Any, has_values: bool, optional: bool) -> str:
    if has_values:
        return _toml_value(msgspec.to_builtins(value)) if value is not None else "null"
    if info.default is not msgspec.NODEFAULT:
        return _toml_value(info.default) if info.default is not None else "null"
    if info.default_factory is not msgspec.NODEFAULT:
        return _toml_value(msgspec.to_builtins(info.default_factory()))
    return "(required in the table)" if optional else "(required)"


def _help_rows(cls: type[msgspec.Struct], prefix: str = "", values: Any = None,
               optional: bool = False) -> tuple[list[_HelpRow], dict[str, str]]:
    """Every leaf key of `cls` as a row, and the tables met on the way -> their heading note
    (`optional`: a table the config may leave out; its keys marked required are required only
    when the table is given)."""
    docs = _field_docs(cls)
    table = prefix[:-1]
    rows: list[_HelpRow] = []
    tables: dict[str, str] = {}
    for info in msgspec.structs.fields(cls):
        key = prefix + info.encode_name
        sub = _struct_of(info.type)
        value = getattr(values, info.name) if values is not None else None
        described = [m.description for m in _unwrap(info.type)[1]
                     if isinstance(m, msgspec.Meta) and m.description]
        doc = described[0] if described else docs.get(info.name, "")
        if sub is not None:
            leaf_too = len(_members(info.type)) > 1  # `S | None`, `str | S | None`: the key itself is set too
            if leaf_too:
                rows.append(_HelpRow(table, key, f"{_type_name(info.type)} = "
                                     f"{_default_text(info, value, values is not None, optional)}", doc))
            sub_optional = optional or (leaf_too and value is None and info.default is None)
            tables[key] = "optional" if sub_optional else ""
            sub_rows, sub_tables = _help_rows(sub, key + ".", value, sub_optional)
            rows += sub_rows
            tables |= sub_tables
            continue
        rows.append(_HelpRow(table, key, f"{_type_name(info.type)} = "
                             f"{_default_text(info, value, values is not None, optional)}", doc))
        item = _list_item_struct(info.type)
        if item is not None:  # a list of tables (`[[reward.judges]]`): the keys each entry takes
            tables[key + "[i]"] = "each entry"
            sub_rows, sub_tables = _help_rows(item, key + "[i].")
            rows += sub_rows
            tables |= sub_tables
    return rows, tables


def _list_item_struct(tp: Any) -> type[msgspec.Struct] | None:
    """`S` for a `list[S]` field (also optional or annotated) whose items are Structs."""
    for member in _members(tp):
        if get_origin(member) is list:
            return _struct_of(get_args(member)[0])
    return None


_HELP_OPTIONS = [
    ("--config FILE", "TOML (.toml) or YAML (.yaml) file setting any key below"),
    ("--resume [PATH]", "resume from a checkpoint or run directory (default: the latest run)"),
    ("key=value", "set one key; precedence: defaults < --config < env < key=value"),
    ("--verbose", "print the libraries' warnings and progress bars (train.verbose=true)"),
    ("--debug", "show the full traceback of a user error"),
]


def config_help(cls: type[msgspec.Struct], *, env: Mapping[str, str] | None = None,
                prog: str = "app", defaults: msgspec.Struct | None = None, defaults_from: str = "",
                width: int | None = None) -> str:
    """`--help` text: usage, then every dotted key grouped by its table (`[model]`, `[[reward.judges]]`
    for the keys of each list entry; a table the config may leave out says so), each with its type
    and range, default and env var on one line and its doc wrapped below it.

    Docs come from `msgspec.Meta(description=...)`, else the field's attribute docstring,
    else its trailing `# comment`. `defaults` (an instance, e.g. the app's embedded default
    config) shows the values a bare run uses instead of the class defaults; `defaults_from`
    says where they come from. An `AppConfig`'s `RENAMED` keys close the list, old -> new.
    `width`: the line length to wrap to (default: the terminal's, 100 off a terminal).
    """
    width = max(60, width or shutil.get_terminal_size((100, 24)).columns - 1)
    env_of = {dotted: var for var, dotted in (env or {}).items()}
    rows, tables = _help_rows(cls, values=defaults)

    def wrap(text: str, indent: int) -> list[str]:  # continued lines at the doc's indent (6)
        return textwrap.wrap(text, width, initial_indent=" " * indent, subsequent_indent=" " * 6,
                             break_long_words=False, break_on_hyphens=False)

    lines = [f"usage: {prog} [--config FILE] [--resume [PATH]] [key=value ...]", ""]
    for option, text in _HELP_OPTIONS:
        lines += textwrap.wrap(f"  {option:<15}  {text}", width, subsequent_indent=" " * 19)
    lines += ["", f"keys (defaults: {defaults_from}):" if defaults_from else "keys:"]
    for table in dict.fromkeys(row.table for row in rows):  # tables in the order their first key comes
        grouped = [row for row in rows if row.table == table]
        if table:
            note = tables.get(table, "")
            heading = f"[[{table.removesuffix('[i]')}]]" if table.endswith("[i]") else f"[{table}]"
            lines += ["", heading + (f"  ({note})" if note and not table.endswith("[i]") else
                                     "  (each entry of the list)" if table.endswith("[i]") else "")]
        for row in grouped:
            env_note = f"  [env {env_of[row.key]}]" if row.key in env_of else ""
            lines += wrap(f"{row.key}  {row.typed}{env_note}", 2)
            if row.doc:
                lines += wrap(row.doc, 6)
    renamed = _renames(cls)
    if renamed:
        old_w = max(len(old) for old in renamed)
        lines += ["", "renamed keys (the old name is refused):",
                  *(f"  {old:<{old_w}}  -> {new}" for old, new in renamed.items())]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- dumping


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return ("nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
                if math.isinf(value) else repr(value))
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):  # None entries left out: TOML has no null (exact where the default is None)
        return "{" + ", ".join(f"{_toml_key(k)} = {_toml_value(v)}" for k, v in value.items() if v is not None) + "}"
    raise ConfigError(f"cannot write {value!r} ({type(value).__name__}) to TOML")


def _toml_key(key: str) -> str:
    return key if re.fullmatch(r"[A-Za-z0-9_-]+", key) else json.dumps(key, ensure_ascii=False)


def _toml_lines(table: dict[str, Any], cls: type[msgspec.Struct], prefix: str) -> list[str]:
    fields = _fields(cls)
    lines, tables = [], []
    for key, value in table.items():
        sub = _struct_of(fields[key].type)
        if sub is not None and isinstance(value, dict):
            tables.append((key, value, sub))
        elif value is None:  # TOML has no null; `key=null` on the command line restores it
            lines.append(f"# {_toml_key(key)} = null")
        else:
            lines.append(f"{_toml_key(key)} = {_toml_value(value)}")
    for key, value, sub in tables:
        name = f"{prefix}{_toml_key(key)}"
        lines += ["", f"[{name}]", *_toml_lines(value, sub, name + ".")]
    return lines


def flat_config(cfg: msgspec.Struct) -> dict[str, int | float | str | bool]:
    """The config as flat `{"train.lr": 1e-5, ...}` scalars (lists and tables as text), for
    experiment trackers."""
    out: dict[str, int | float | str | bool] = {}

    def walk(tree: dict[str, Any], prefix: str) -> None:
        for key, value in tree.items():
            if isinstance(value, dict) and _struct_keys(cfg, prefix + key):
                walk(value, f"{prefix}{key}.")
            else:
                out[prefix + key] = value if isinstance(value, int | float | str | bool) else str(value)

    walk(msgspec.to_builtins(cfg), "")
    return out


def _struct_keys(cfg: msgspec.Struct, dotted: str) -> bool:
    """Whether `dotted` is a table (a nested Struct) of `cfg`'s type, not a dict-valued field."""
    return _struct_of(_field_type(type(cfg), dotted, "flat_config")) is not None


def dump_config(cfg: msgspec.Struct) -> str:
    """`cfg` as a TOML document that `load_config(type(cfg), file)` reads back to an equal value.

    None values become comments (TOML has no null): exact when the field's default is None.
    """
    return "\n".join(_toml_lines(msgspec.to_builtins(cfg), type(cfg), "")).lstrip("\n") + "\n"
