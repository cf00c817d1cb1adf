"""Typed attrs converters: a sequence as a tuple of its items' type.

``converter=tuple`` works at run time, but mypy's attrs plugin then types the
field's ``__init__`` argument as ``Iterable[_T_co]`` with nothing to bind
``_T_co``, and every call that passes a tuple fails to type-check. These name the
item type, so ``__init__`` takes ``Iterable[float]`` and the like.
"""

from __future__ import annotations

from collections.abc import Iterable


def floats(items: Iterable[float]) -> tuple[float, ...]:
    """``items`` as a tuple (attrs converter for a ``tuple[float, ...]`` field)."""
    return tuple(items)


def ints(items: Iterable[int]) -> tuple[int, ...]:
    """``items`` as a tuple (attrs converter for a ``tuple[int, ...]`` field)."""
    return tuple(items)


def strs(items: Iterable[str]) -> tuple[str, ...]:
    """``items`` as a tuple (attrs converter for a ``tuple[str, ...]`` field)."""
    return tuple(items)


def bools(items: Iterable[bool]) -> tuple[bool, ...]:
    """``items`` as a tuple (attrs converter for a ``tuple[bool, ...]`` field)."""
    return tuple(items)
