"""What values a config key may take: its domain, written once, in the schema field's annotation.

Every field of ``conf/schema.py`` that holds a number, a path, a name or a choice says what it accepts
(``save_every: Annotated[int, Range(ge=1, why="steps between checkpoints")] = 1000``); a bool or a section
needs none. :func:`check_domains` holds a composed config to them (``Config.validate`` runs it first), and a
value outside is one line naming the key. A list's or a map's domain holds each of its values. A field that
takes any value says so and why (:class:`Free`); one checked by code the schema cannot import names that code
and a value it refuses (:class:`Elsewhere`). tests/unit/conf/test_domains.py walks the schema (:func:`leaves`):
a field without a domain fails it, and every value :meth:`Domain.outside` names must be refused by
``fledge config`` with one line naming the key.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Annotated, Any, Union


class Domain:
    """The values one config key (or each value of a list or map key) may take."""

    def problem(self, key: str, value: Any) -> str | None:
        """The one-line message for ``value`` outside the domain (naming ``key``), or None."""
        return None

    def outside(self, kind: type) -> list:
        """Values just outside the domain, for a field whose values are of type ``kind`` (the schema walk's)."""
        return []


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


@dataclass(frozen=True)
class Range(Domain):
    """A finite number within the bounds given (ge: >=, gt: >, le: <=, lt: <); ``why``: what it counts."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    why: str = ""

    def text(self) -> str:
        low = f"[{_num(self.ge)}" if self.ge is not None else f"({_num(self.gt)}" if self.gt is not None else None
        high = f"{_num(self.le)}]" if self.le is not None else f"{_num(self.lt)})" if self.lt is not None else None
        if low and high:
            return f"in {low}, {high}"
        if low:
            return f"{'>=' if low[0] == '[' else '>'} {low[1:]}"
        return f"{'<=' if high[-1] == ']' else '<'} {high[:-1]}"

    def holds(self, v: float) -> bool:
        return (math.isfinite(v) and (self.ge is None or v >= self.ge) and (self.gt is None or v > self.gt)
                and (self.le is None or v <= self.le) and (self.lt is None or v < self.lt))

    def problem(self, key: str, value: Any) -> str | None:
        if self.holds(value):
            return None
        finite = "" if math.isfinite(value) else "finite and "
        return f"{key}={value}: must be {finite}{self.text()}" + (f" ({self.why})" if self.why else "")

    def outside(self, kind: type) -> list:
        out = [self.ge - 1 if self.ge is not None else None, self.gt, self.le + 1 if self.le is not None else None,
               self.lt]
        return [kind(v) for v in out if v is not None] + ([math.nan] if kind is float else [])


@dataclass(frozen=True)
class OneOf(Domain):
    """One of ``choices`` (``casefold``: a text compared in lower case, as its reader does)."""

    choices: tuple
    casefold: bool = False

    def __init__(self, *choices: Any, casefold: bool = False):
        object.__setattr__(self, "choices", choices)
        object.__setattr__(self, "casefold", casefold)

    def problem(self, key: str, value: Any) -> str | None:
        if (str(value).lower() if self.casefold else value) in self.choices:
            return None
        return f"{key}={value!r}: expected one of {list(self.choices)}"

    def outside(self, kind: type) -> list:
        return [max(self.choices) + 1] if kind is int else ["no_such_choice"]


@dataclass(frozen=True)
class Location(Domain):
    """A path (or what else ``what`` says it may be): any non-empty text; null where the field is Optional."""

    what: str = "a path"

    def problem(self, key: str, value: Any) -> str | None:
        if str(value).strip():
            return None
        return f"{key}={value!r}: empty; it names {self.what} (null, where the key allows it, for none)"

    def outside(self, kind: type) -> list:
        return [""]


@dataclass(frozen=True)
class DirName(Domain):
    """One directory name, made under a root: no path separator, not '.' or '..' (it would leave the root)."""

    root: str

    def problem(self, key: str, value: Any) -> str | None:
        if value not in ("", ".", "..") and not re.search(r"[/\\\x00]", value):
            return None
        return (f"{key}={value!r}: must be one directory name under {self.root}, not a path (no '/' or '\\', not "
                f"'.', '..' or empty), e.g. {key}=llama3-v2")

    def outside(self, kind: type) -> list:
        return ["..", ".", "", "/", "../elsewhere", "/tmp/elsewhere", "a/b", "a\\b"]


@dataclass(frozen=True)
class ByteSize(Domain):
    """A size as the export's writer reads it (huggingface_hub's parse_size_to_int, held equal by the test): a
    number > 0 and one of TB, GB, MB, KB ("5GB", "500MB")."""

    def problem(self, key: str, value: Any) -> str | None:
        text = str(value).strip()
        try:
            ok = text[-2:].upper() in ("TB", "GB", "MB", "KB") and 0 < float(text[:-2]) < math.inf
        except ValueError:
            ok = False
        if ok:
            return None
        return f"{key}={value!r}: must be a size, a number > 0 and one of TB, GB, MB, KB (e.g. {key}=5GB)"

    def outside(self, kind: type) -> list:
        return ["banana", "0GB", "5GiB", "5", "-1GB"]


@dataclass(frozen=True)
class Elsewhere(Domain):
    """Checked by code the schema cannot import or by a rule across keys (``where``); ``refused``: values it
    refuses, naming the key (the schema walk's test composes each)."""

    where: str
    refused: tuple = ()

    def __init__(self, where: str, *refused: Any):
        object.__setattr__(self, "where", where)
        object.__setattr__(self, "refused", refused)

    def outside(self, kind: type) -> list:
        return list(self.refused)


@dataclass(frozen=True)
class Free(Domain):
    """Any value of the field's type: ``why`` says why none is out of place."""

    why: str


# ------------------------------------------------------------------------------------------ the walk
@dataclass(frozen=True)
class Leaf:
    """One config key of the schema: its dotted name (a list of sections walked at index 0), its values'
    type (a list's or a map's element type; ``container``: list, dict or None) and its domain."""

    key: str
    kind: Any
    container: type | None
    domain: Domain | None


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls, include_extras=True)


def _split(hint: Any) -> tuple[Any, Domain | None]:
    """(the type without Optional and Annotated, the Domain in its Annotated metadata)."""
    domain = None
    while True:
        if typing.get_origin(hint) is Annotated:
            domain = next((m for m in hint.__metadata__ if isinstance(m, Domain)), domain)
            hint = typing.get_args(hint)[0]
        elif typing.get_origin(hint) in (Union, types.UnionType):  # Optional[X], X | None
            hint = next(a for a in typing.get_args(hint) if a is not type(None))
        else:
            return hint, domain


def _element(hint: Any) -> tuple[Any, type | None]:
    origin = typing.get_origin(hint)
    if origin in (list, dict):
        return _split(typing.get_args(hint)[-1])[0], origin
    return hint, None


def leaves(cls: type, prefix: str = "") -> Iterator[Leaf]:
    """Every config key under the dataclass ``cls`` (sections and lists of sections walked into)."""
    for f in dataclasses.fields(cls):
        hint, domain = _split(_hints(cls)[f.name])
        kind, container = _element(hint)
        if dataclasses.is_dataclass(kind):
            yield from leaves(kind, f"{prefix}{f.name}.0." if container else f"{prefix}{f.name}.")
        else:
            yield Leaf(f"{prefix}{f.name}", kind, container, domain)


def check_domains(obj: Any, prefix: str = "") -> None:
    """ValueError naming the key of the first value of ``obj`` (a schema dataclass) outside its domain."""
    for f in dataclasses.fields(obj):
        hint, domain = _split(_hints(type(obj))[f.name])
        value, key = getattr(obj, f.name), f"{prefix}{f.name}"
        if value is None:
            continue
        if dataclasses.is_dataclass(value):
            check_domains(value, f"{key}.")
            continue
        if isinstance(value, dict):
            items = [(f"{key}.{k}", v) for k, v in value.items()]
        elif isinstance(value, (list, tuple)):
            items = [(f"{key}.{i}" if dataclasses.is_dataclass(v) else key, v) for i, v in enumerate(value)]
        else:
            items = [(key, value)]
        for k, v in items:
            if dataclasses.is_dataclass(v):
                check_domains(v, f"{k}.")
            elif domain is not None and v is not None and (msg := domain.problem(k, v)):
                raise ValueError(msg)
