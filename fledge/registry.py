"""The one registry shape every extension point uses: target families, drafter layer kinds, export dialects,
TTT losses and named eval sets (docs/extending.md).

A :class:`Registry` maps names to entries. It knows the config key that selects an entry and the file where
the built-in entries are registered, so that an unknown name is one line naming both::

    LOSSES = Registry("drafter.loss", "train/losses")
    LOSSES.register("ttt_ce", SoftCrossEntropy)
    LOSSES.get("nope")  # ValueError: drafter.loss='nope': expected one of ['ttt_ce'] (registered in train/losses)

Tests add a temporary entry with ``with LOSSES.temporary("mine", Mine): ...``, which removes it again (and
restores what it replaced) however the block ends.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar, overload

T = TypeVar("T")
_MISSING = object()


class Registry(Generic[T]):
    """Names -> entries for one extension point. ``key``: the config key that names an entry (for messages);
    ``where``: the file that registers the built-in entries, where a new one goes; ``reserved``: names that
    are valid for the key without being entries (e.g. ``auto``), refused as entry names."""

    def __init__(self, key: str, where: str, reserved: tuple[str, ...] = ()) -> None:
        self.key, self.where, self.reserved = key, where, tuple(reserved)
        self._entries: dict[str, T] = {}

    @overload
    def register(self, name: str) -> Callable[[T], T]: ...

    @overload
    def register(self, name: str, entry: T, *, replace: bool = False) -> T: ...

    def register(self, name, entry=_MISSING, *, replace=False):
        """Add ``entry`` under ``name`` (returns it), or, without an entry, a decorator that adds what it
        decorates. A name already taken is a ValueError unless ``replace``."""
        if entry is _MISSING:
            return lambda e: self.register(name, e, replace=replace)
        if name in self.reserved:
            raise ValueError(f"{self.key}: {name!r} is reserved and cannot name an entry")
        if name in self._entries and not replace:
            raise ValueError(f"{self.key}={name!r} is already registered ({self.where}); pass replace=True to "
                             "override it")
        self._entries[name] = entry
        return entry

    def get(self, name: str) -> T:
        """The entry registered as ``name``; ValueError naming the key, the choices and the file otherwise."""
        if name not in self._entries:
            raise ValueError(self.unknown(name))
        return self._entries[name]

    def check(self, name: str) -> None:
        """ValueError (as :meth:`get`) unless ``name`` is registered or reserved."""
        if name not in self._entries and name not in self.reserved:
            raise ValueError(self.unknown(name))

    def unknown(self, name: str) -> str:
        choices = [*self.reserved, *self.names()]
        return f"{self.key}={name!r}: expected one of {choices} (a new one is registered in {self.where})"

    def names(self) -> list[str]:
        """The registered names, sorted."""
        return sorted(self._entries)

    def values(self) -> list[T]:
        """The registered entries, in registration order."""
        return list(self._entries.values())

    def items(self) -> list[tuple[str, T]]:
        return list(self._entries.items())

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        """The registered names, sorted (as a dict of them would list its keys, sorted)."""
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._entries)

    @contextlib.contextmanager
    def temporary(self, name: str, entry: T) -> Iterator[T]:
        """``entry`` registered as ``name`` for the block only (for tests); whatever ``name`` held before
        comes back after it."""
        before: T | None = self._entries.get(name, _MISSING)  # type: ignore[assignment]
        self._entries[name] = entry
        try:
            yield entry
        finally:
            if before is _MISSING:
                self._entries.pop(name, None)
            else:
                self._entries[name] = before
