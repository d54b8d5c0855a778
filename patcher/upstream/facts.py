"""Evaluate a Fact statically on one release's source files (stdlib `ast`; nothing is imported).

Names are resolved the simple way Python would at import time: a module's top-level
definitions, then its `from X import name` re-exports; a class's members, then those of its
bases (resolved in the class's module), staying within the distribution's own package.
"""

from __future__ import annotations

import ast
import threading
from dataclasses import dataclass, replace
from typing import Protocol, cast

from ..model import Fact

MAX_DEPTH = 8  # re-exports / base classes followed before giving up

# check-upstream reads releases in threads. CPython 3.11 keeps the AST constructor's recursion
# depth in per-interpreter state: a thread switch inside ast.parse (a finalizer run by the GC
# while the tree is built) lets another thread's parse change it, and the parse fails with
# `SystemError: AST constructor recursion depth mismatch`. Parsing holds the GIL anyway, so
# parses run one at a time on every interpreter (tests/test_ast_threads.py).
_PARSE_LOCK = threading.Lock()


def parse(source: str, mode: str = "exec") -> ast.AST:
    with _PARSE_LOCK:
        return ast.parse(source, mode=mode)


class Files(Protocol):
    def read(self, path: str) -> str | None: ...


@dataclass(frozen=True)
class Verdict:
    holds: bool
    detail: str  # what was found, e.g. "block_size: int (no default)" or "no module vllm.utils.hashing"


Definition = ast.AST  # ClassDef | FunctionDef | AsyncFunctionDef | AnnAssign | Assign


class SourceTree:
    """The modules of one release, parsed on demand (each at most once)."""

    def __init__(self, files: Files, package: str) -> None:
        self.files = files
        self.package = package  # top-level import package, e.g. "vllm"
        self._modules: dict[str, ast.Module | None] = {}

    def module(self, dotted: str) -> ast.Module | None:
        if dotted not in self._modules:
            base = dotted.replace(".", "/")
            source = self.files.read(f"{base}.py")
            if source is None:
                source = self.files.read(f"{base}/__init__.py")
            self._modules[dotted] = None if source is None else cast(ast.Module, parse(source))
        return self._modules[dotted]

    def is_package(self, dotted: str) -> bool:
        return self.files.read(dotted.replace(".", "/") + "/__init__.py") is not None

    def _inside(self, dotted: str) -> bool:
        return dotted == self.package or dotted.startswith(self.package + ".")

    def absolute(self, module: str, level: int, target: str | None) -> str:
        """The absolute module of `from <level dots><target> import ...` written in `module`."""
        if level == 0:
            return target or ""
        parts = module.split(".")
        if not self.is_package(module):
            parts = parts[:-1]
        parts = parts[: len(parts) - (level - 1)] if level > 1 else parts
        return ".".join(parts + ([target] if target else []))

    # ------------------------------------------------------------------ lookup

    def find(self, module: str, name: str, depth: int = 0) -> tuple[str, Definition] | None:
        """The top-level definition of `name` in `module`, following from-import re-exports."""
        tree = self.module(module)
        if tree is None or depth > MAX_DEPTH:
            return None
        found = last_definition(tree.body, name)
        if found is not None:
            return module, found
        for node in top_level(tree.body):
            if isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    if (alias.asname or alias.name) == name and alias.name != "*":
                        source = self.absolute(module, node.level, node.module)
                        if not self._inside(source):
                            return None
                        hit = self.find(source, alias.name, depth + 1)
                        if hit is None and self.module(f"{source}.{alias.name}") is not None:
                            return None  # a submodule, not a definition
                        return hit
        return None

    def resolve(self, module: str, qualname: str) -> tuple[str, Definition] | None:
        """Module-level `A`, then members `A.b.c` through classes (and their bases)."""
        parts = qualname.split(".")
        hit = self.find(module, parts[0])
        for part in parts[1:]:
            if hit is None or not isinstance(hit[1], ast.ClassDef):
                return None
            hit = self.member(hit[0], hit[1], part)
        return hit

    def member(self, module: str, cls: ast.ClassDef, name: str, depth: int = 0) -> tuple[str, Definition] | None:
        """A class attribute, method or field; else an instance attribute its methods assign
        (`self.name = ...`); else the same in its bases."""
        found = last_definition(cls.body, name) or instance_attribute(cls, name)
        if found is not None:
            return module, found
        if depth > MAX_DEPTH:
            return None
        for base_module, base in self.bases(module, cls):
            hit = self.member(base_module, base, name, depth + 1)
            if hit is not None:
                return hit
        return None

    def bases(self, module: str, cls: ast.ClassDef) -> list[tuple[str, ast.ClassDef]]:
        """The base classes of `cls` that are defined within the package (in order)."""
        out = []
        for expr in cls.bases:
            if isinstance(expr, ast.Subscript):  # Generic[T], Base[X]
                expr = expr.value
            hit = None
            if isinstance(expr, ast.Name):
                hit = self.find(module, expr.id)
            elif isinstance(expr, ast.Attribute) and isinstance(expr.value, ast.Name):
                target = self._module_alias(module, expr.value.id)
                if target is not None:
                    hit = self.find(target, expr.attr)
            if hit is not None and isinstance(hit[1], ast.ClassDef):
                out.append((hit[0], hit[1]))
        return out

    def _module_alias(self, module: str, alias_name: str) -> str | None:
        tree = self.module(module)
        for node in top_level(tree.body) if tree is not None else ():
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname == alias_name:
                        return alias.name
            elif isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    if (alias.asname or alias.name) == alias_name:
                        candidate = f"{self.absolute(module, node.level, node.module)}.{alias.name}"
                        if self.module(candidate) is not None:
                            return candidate
        return None

    def base_names(self, module: str, cls: ast.ClassDef, depth: int = 0) -> set[str]:
        """Simple names of every base class, transitively through the package's own classes."""
        names = set()
        for expr in cls.bases:
            if isinstance(expr, ast.Subscript):
                expr = expr.value
            if isinstance(expr, ast.Name):
                names.add(expr.id)
            elif isinstance(expr, ast.Attribute):
                names.add(expr.attr)
        if depth < MAX_DEPTH:
            for base_module, base in self.bases(module, cls):
                names.add(base.name)
                names |= self.base_names(base_module, base, depth + 1)
        return names


def top_level(body: list[ast.stmt]) -> list[ast.stmt]:
    """The statements of a module body, including those inside top-level if/try blocks."""
    out = []
    for node in body:
        out.append(node)
        if isinstance(node, ast.If):
            out += top_level(node.body) + top_level(node.orelse)
        elif isinstance(node, ast.Try):
            out += top_level(node.body)
            for handler in node.handlers:
                out += top_level(handler.body)
            out += top_level(node.orelse) + top_level(node.finalbody)
    return out


def instance_attribute(cls: ast.ClassDef, name: str) -> Definition | None:
    """The first `self.<name> = ...` (or annotated) in a method of `cls`."""
    for method in cls.body:
        if not isinstance(method, (ast.FunctionDef, ast.AsyncFunctionDef)) or not method.args.args:
            continue
        me = method.args.args[0].arg
        for node in ast.walk(method):
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, ast.AnnAssign):
                targets = [node.target]
            else:
                continue
            for target in targets:
                if (
                    isinstance(target, ast.Attribute)
                    and target.attr == name
                    and isinstance(target.value, ast.Name)
                    and target.value.id == me
                ):
                    return node
    return None


def is_overload(node: ast.AST) -> bool:
    for decorator in getattr(node, "decorator_list", ()):
        if isinstance(decorator, ast.Name) and decorator.id == "overload":
            return True
        if isinstance(decorator, ast.Attribute) and decorator.attr == "overload":
            return True
    return False


def defined_names(node: ast.AST) -> list[str]:
    if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
        return [node.name]
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return [node.target.id]
    if isinstance(node, ast.Assign):
        return [t.id for t in node.targets if isinstance(t, ast.Name)]
    return []


def last_definition(body: list[ast.stmt], name: str) -> Definition | None:
    """The definition of `name` in a block as Python leaves it (the last one; @overload stubs skipped)."""
    found = None
    for node in body:
        if name in defined_names(node) and not is_overload(node):
            found = node
    return found


# ---------------------------------------------------------------------- kinds


@dataclass(frozen=True)
class Param:
    name: str
    default: ast.expr | None
    has_default: bool
    annotation: str


def parameters(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[Param]:
    args = fn.args
    positional = [*args.posonlyargs, *args.args]
    defaults: list[ast.expr | None] = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
    out = [
        Param(a.arg, d, d is not None, ast.unparse(a.annotation) if a.annotation else "")
        for a, d in zip(positional, defaults)
    ]
    for a, d in zip(args.kwonlyargs, args.kw_defaults):
        out.append(Param(a.arg, d, d is not None, ast.unparse(a.annotation) if a.annotation else ""))
    return out


def _describe_param(p: Param) -> str:
    text = p.name + (f": {p.annotation}" if p.annotation else "")
    return text + (f" = {ast.unparse(p.default)}" if p.default is not None else " (no default)")


FIELD_CALLS = {"Field", "field"}


def field_default(node: Definition) -> tuple[bool, ast.expr | None]:
    """(has a default, the default expression if a plain value) of a class-body field."""
    value = node.value if isinstance(node, (ast.AnnAssign, ast.Assign)) else None
    if value is None:
        return False, None
    if isinstance(value, ast.Call):
        func = value.func
        called = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
        if called in FIELD_CALLS:
            for keyword in value.keywords:
                if keyword.arg == "default":
                    return True, keyword.value
                if keyword.arg == "default_factory":
                    return True, None
            if value.args and not (isinstance(value.args[0], ast.Constant) and value.args[0].value is Ellipsis):
                return True, value.args[0]
            return False, None
    return True, value


def _same_source(expr: ast.expr, expected: str) -> bool:
    try:
        return ast.unparse(expr) == ast.unparse(cast(ast.Expression, parse(expected, mode="eval")).body)
    except SyntaxError:
        return False


def _first_item(expr: ast.expr | None) -> bool:
    if isinstance(expr, ast.Subscript):
        index = expr.slice
        return isinstance(index, ast.Constant) and index.value == 0
    if isinstance(expr, ast.IfExp):
        return _first_item(expr.body) or _first_item(expr.orelse)
    return False


def evaluate(fact: Fact, tree: SourceTree) -> Verdict:
    """Whether `fact` holds in the release `tree` reads, and what was found."""
    if isinstance(fact.module, tuple):
        # Candidate modules: the first that defines the head of the qualname (or the name).
        head = (fact.qualname or fact.name).split(".")[0]
        chosen = next((c for c in fact.module if tree.find(c, head) is not None), None)
        if chosen is None:
            return Verdict(False, f"{head} defined in none of {', '.join(fact.module)}")
        verdict = evaluate(replace(fact, module=chosen), tree)
        return Verdict(verdict.holds, f"{chosen}: {verdict.detail}")
    if fact.kind == "lacks-module":
        return Verdict(
            tree.module(fact.module) is None,
            f"module {fact.module} " + ("absent" if tree.module(fact.module) is None else "present"),
        )
    if tree.module(fact.module) is None:
        return Verdict(False, f"no module {fact.module}")
    kind = fact.kind
    if kind in ("defines", "lacks"):
        if fact.qualname:
            owner = tree.resolve(fact.module, fact.qualname)
            if owner is None or not isinstance(owner[1], ast.ClassDef):
                return Verdict(False, f"no class {fact.where}")
            hit = tree.member(owner[0], owner[1], fact.name)
        else:
            hit = tree.find(fact.module, fact.name)
        where = f"{hit[0]}:{getattr(hit[1], 'lineno', '?')}" if hit else ""
        if kind == "defines":
            return Verdict(hit is not None, f"{fact.name} defined in {where}" if hit else f"{fact.name} not defined")
        return Verdict(hit is None, f"{fact.name} defined in {where}" if hit else f"{fact.name} not defined")

    target = tree.resolve(fact.module, fact.qualname) if fact.qualname else None
    if target is None:
        return Verdict(False, f"no {fact.where}")
    module, node = target
    if kind in ("has-param", "lacks-param", "required-param") or (
        kind == "default-value" and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
    ):
        return _about_parameter(fact, node)
    if kind in ("field-required", "default-value"):
        return _about_field(fact, tree, module, node)
    if kind in ("has-base", "lacks-base"):
        return _about_bases(fact, tree, module, node)
    if kind in ("returns-first-item", "returns-value"):
        return _about_returns(fact, node)
    raise ValueError(f"unknown fact kind {kind!r}")


def _about_parameter(fact: Fact, node: ast.AST) -> Verdict:
    """has-param, lacks-param, required-param, and default-value on a function."""
    kind = fact.kind
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return Verdict(False, f"{fact.where} is not a function")
    params = {p.name: p for p in parameters(node)}
    param = params.get(fact.name)
    found = _describe_param(param) if param else f"no parameter {fact.name}"
    if kind == "has-param":
        return Verdict(param is not None, found)
    if kind == "lacks-param":
        return Verdict(param is None, found)
    if kind == "required-param":
        return Verdict(param is not None and not param.has_default, found)
    same = param is not None and param.default is not None and _same_source(param.default, fact.value)
    return Verdict(same, found)


def _about_field(fact: Fact, tree: SourceTree, module: str, node: ast.AST) -> Verdict:
    """field-required, and default-value on a class field."""
    if not isinstance(node, ast.ClassDef):
        return Verdict(False, f"{fact.where} is not a class")
    hit = tree.member(module, node, fact.name)
    if hit is None or not isinstance(hit[1], (ast.AnnAssign, ast.Assign)):
        return Verdict(False, f"no field {fact.name}")
    has_default, default = field_default(hit[1])
    found = ast.unparse(hit[1]).splitlines()[0]
    if fact.kind == "field-required":
        return Verdict(not has_default, found)
    return Verdict(default is not None and _same_source(default, fact.value), found)


def _about_bases(fact: Fact, tree: SourceTree, module: str, node: ast.AST) -> Verdict:
    """has-base, lacks-base."""
    if not isinstance(node, ast.ClassDef):
        return Verdict(False, f"{fact.where} is not a class")
    derives = fact.name in tree.base_names(module, node)
    shown = ", ".join(ast.unparse(b) for b in node.bases)
    return Verdict(derives == (fact.kind == "has-base"), f"class {node.name}({shown})")


def _about_returns(fact: Fact, node: ast.AST) -> Verdict:
    """returns-first-item, returns-value."""
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return Verdict(False, f"{fact.where} is not a function")
    if fact.kind == "returns-first-item":
        returns = [n for n in ast.walk(node) if isinstance(n, ast.Return)]
        hits = [n.value for n in returns if n.value is not None and _first_item(n.value)]
        if hits:
            return Verdict(True, f"return {ast.unparse(hits[0])}")
        shown = "; ".join(sorted({ast.unparse(n.value) for n in returns if n.value is not None}))
        return Verdict(False, f"returns {shown or 'nothing'}")
    values = [n.value for n in ast.walk(node) if isinstance(n, ast.Return) and n.value is not None]
    shown = "; ".join(sorted({ast.unparse(v) for v in values}))
    return Verdict(any(_same_source(v, fact.value) for v in values), f"returns {shown or 'nothing'}")
