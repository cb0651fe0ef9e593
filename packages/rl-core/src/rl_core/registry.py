"""Name registries for algorithm families (advantage estimators, KL estimators, policy losses).

A registry maps a lowercase paper name to a function. Registering a name twice raises, so two
modules can never silently shadow each other; looking up an unknown name raises a `KeyError`
that lists the valid names, sorted, so a typo in a config is fixed in one read.

    ADVANTAGE_ESTIMATORS = Registry("advantage estimator")

    @ADVANTAGE_ESTIMATORS.register("grpo")
    def compute_grpo(...): ...

    ADVANTAGE_ESTIMATORS["grpo"]          # the function
    ADVANTAGE_ESTIMATORS["gpro"]          # KeyError: unknown advantage estimator 'gpro'; valid: ...

Traits are facts about an entry that callers need without calling it, stored where the entry is
registered (`register("grpo", group_baseline=True)`), so no second list of names can drift from
the registry: `ADVANTAGE_ESTIMATORS.trait("grpo", "group_baseline")`. The one second list,
`rl_core.names` (the built-in names, for checking a config before torch is imported), is
compared with every registry by rl-core's tests.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class UnknownNameError(KeyError, ValueError):
    """An unknown registry name; a `KeyError` and a `ValueError`, so either `except` catches it."""

    def __str__(self) -> str:  # KeyError would quote the message; show it as written
        return str(self.args[0])


class Registry(Generic[T]):
    """A write-once mapping from names to objects (usually functions).

    `kind` names the family in error messages ("advantage estimator", "policy loss").
    """

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: dict[str, T] = {}
        self._traits: dict[str, dict[str, Any]] = {}

    def register(self, name: str, *aliases: str, **traits: Any) -> Callable[[T], T]:
        """Decorator registering the object under `name` (and any `aliases`) with `traits`;
        returns it unchanged."""

        def decorator(obj: T) -> T:
            for key in (name, *aliases):
                self.add(key, obj, **traits)
            return obj

        return decorator

    def add(self, name: str, obj: T, **traits: Any) -> None:
        """Register `obj` under `name` with `traits`; a name already taken raises `ValueError`."""
        if not name or name != name.strip():
            raise ValueError(
                f"{self.kind} name must be a non-empty string without spaces, got {name!r}"
            )
        if name in self._items:
            raise ValueError(
                f"{self.kind} {name!r} is already registered (to {self._items[name]!r}); "
                "pick another name"
            )
        self._items[name] = obj
        self._traits[name] = dict(traits)

    def traits(self, name: str) -> Mapping[str, Any]:
        """The traits `name` was registered with (unknown names raise as `get` does)."""
        self.get(name)
        return dict(self._traits[name])

    def trait(self, name: str, trait: str, default: Any = False) -> Any:
        """One trait of `name`, `default` when it was registered without it."""
        return self.traits(name).get(trait, default)

    def get(self, name: str) -> T:
        """The object registered as `name`; unknown names raise `UnknownNameError` listing valid ones."""
        try:
            return self._items[name]
        except KeyError:
            valid = ", ".join(self.names())
            raise UnknownNameError(f"unknown {self.kind} {name!r}; valid names: {valid}") from None

    __getitem__ = get

    def names(self) -> list[str]:
        """Registered names, sorted."""
        return sorted(self._items)

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._items)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, names={self.names()})"
