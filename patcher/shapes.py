"""Structural patterns over libcst nodes: the part of `libcst.matchers` the patches use.

Why not `libcst.matchers` itself: importing it (and `libcst.codemod`, which imports it) costs
about 0.2 s, as much as importing libcst and parsing both target files together, and it is
the same on every apply. The API is the same in the small: `shapes.Call(func=shapes.Name("x"))`
fits a `cst.Call` whose `func` is a `cst.Name` with value "x"; fields not given fit anything;
a list fits a sequence element by element, `ZeroOrMore()` standing for any run of elements;
`a | b` fits what either fits; plain values (strings) compare equal. Types are exact, as in
libcst.matchers (`Name` does not fit a subclass).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

import libcst as cst


class Shape:
    def fits(self, value: Any) -> bool:
        raise NotImplementedError

    def __or__(self, other: Shape) -> Shape:
        return OneOf(self, other)


class NodeShape(Shape):
    __slots__ = ("fields", "node_type")

    def __init__(self, node_type: type, fields: dict[str, Any]) -> None:
        self.node_type = node_type
        self.fields = fields

    def fits(self, value: Any) -> bool:
        if type(value) is not self.node_type:
            return False
        return all(_fits(getattr(value, name), want) for name, want in self.fields.items())

    def __repr__(self) -> str:
        inner = ", ".join(f"{k}={v!r}" for k, v in self.fields.items())
        return f"{self.node_type.__name__}({inner})"


class OneOf(Shape):
    __slots__ = ("options",)

    def __init__(self, *options: Shape) -> None:
        self.options = options

    def fits(self, value: Any) -> bool:
        return any(_fits(value, option) for option in self.options)

    def __repr__(self) -> str:
        return " | ".join(map(repr, self.options))


class ZeroOrMore(Shape):
    """In a list shape: any number (zero included) of elements."""

    def fits(self, value: Any) -> bool:
        return True

    def __repr__(self) -> str:
        return "ZeroOrMore()"


def _fits(value: Any, want: Any) -> bool:
    if isinstance(want, Shape):
        return want.fits(value)
    if isinstance(want, (list, tuple)):
        return isinstance(value, (list, tuple)) and _fits_sequence(value, 0, want, 0)
    return value == want


def _fits_sequence(values: Sequence[Any], i: int, wants: Sequence[Any], j: int) -> bool:
    if j == len(wants):
        return i == len(values)
    if isinstance(wants[j], ZeroOrMore):
        return any(_fits_sequence(values, k, wants, j + 1) for k in range(i, len(values) + 1))
    return i < len(values) and _fits(values[i], wants[j]) and _fits_sequence(values, i + 1, wants, j + 1)


def matches(node: Any, shape: Shape) -> bool:
    return _fits(node, shape)


_CHILD_FIELDS: dict[type, tuple[str, ...]] = {}


def _child_fields(node_type: type) -> tuple[str, ...]:
    names = _CHILD_FIELDS.get(node_type)
    if names is None:
        names = _CHILD_FIELDS[node_type] = tuple(f.name for f in dataclasses.fields(node_type))
    return names


def walk(tree: cst.CSTNode) -> Iterator[cst.CSTNode]:
    """Every node of `tree`, itself first, parents before their children (children in field
    order). Read straight from the node fields: a libcst visitor rebuilds every node on its way,
    three times the cost for a search."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        children: list = []
        for name in _child_fields(type(node)):
            value = getattr(node, name)
            kind: type = type(value)
            if kind is list or kind is tuple:
                children.extend(v for v in value if _is_node(type(v)))  # type: ignore[arg-type]  # a type is hashable
            elif _is_node(kind):
                children.append(value)
        stack.extend(reversed(children))


@functools.cache
def _is_node(kind: type) -> bool:
    return issubclass(kind, cst.CSTNode)  # an ABC: isinstance per value would cost a third of walk()


def findall(tree: cst.CSTNode, shape: Shape) -> list[cst.CSTNode]:
    """Every node of `tree` (itself included) that fits, parents before their children."""
    return [node for node in walk(tree) if shape.fits(node)]


Replacement = Callable[[cst.CSTNode, dict], cst.CSTNode]


class _Replacer(cst.CSTTransformer):
    def __init__(self, shape: Shape, replacement: Replacement) -> None:
        self.shape = shape
        self.replacement = replacement

    def on_leave(self, original: cst.CSTNode, updated: cst.CSTNode):
        # Fitted on the original node, as libcst.matchers.replace does; shapes capture nothing,
        # so the extracted nodes are always {} (libcst's SaveMatchedNode is not part of shapes).
        return self.replacement(updated, {}) if self.shape.fits(original) else updated


def replace(tree: cst.CSTNode, shape: Shape, replacement: Replacement) -> cst.CSTNode:
    """`tree` with every node that fits replaced by `replacement(node, extracted)` (children
    first), as libcst.matchers.replace calls it."""
    return cast(cst.CSTNode, tree.visit(_Replacer(shape, replacement)))  # the root is never removed


def _shape_factory(node_type: type) -> Callable[..., NodeShape]:
    names = [f.name for f in dataclasses.fields(node_type)]

    def make(*args: Any, **fields: Any) -> NodeShape:
        if len(args) > len(names):
            raise TypeError(f"{node_type.__name__}() takes at most {len(names)} positional fields")
        fields.update(zip(names, args))
        unknown = set(fields) - set(names)
        if unknown:
            raise TypeError(f"{node_type.__name__} has no field {', '.join(sorted(unknown))}")
        return NodeShape(node_type, fields)

    make.__name__ = node_type.__name__
    return make


def __getattr__(name: str) -> Callable[..., NodeShape]:
    # shapes.Call, shapes.Name, ...: one factory per libcst node class, made on first use.
    node_type = getattr(cst, name, None)
    if not (isinstance(node_type, type) and issubclass(node_type, cst.CSTNode)):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")  # noqa: TRY004 - a module __getattr__'s contract
    factory = _shape_factory(node_type)
    globals()[name] = factory
    return factory
