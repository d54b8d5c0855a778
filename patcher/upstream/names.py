"""What a name in a patched file refers to in one release's sources, statically (stdlib `ast`).

`from M import NAME` through M's definitions, its from-import re-exports within the package, and
its `import *` (within a budget: transformers re-exports hundreds of modules that way); a dotted
call on an imported module (`torch.cuda.mem_get_info`) through the longest prefix that is a
module; imports guarded by `except ImportError` and the fallbacks their handlers define.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from typing import cast

from .facts import MAX_DEPTH, SourceTree, is_overload, last_definition, parse, top_level

# Packages whose functions are mostly compiled, with their signatures in type stubs: torch's
# `torch.cat`, `torch.arange`... are `torch._C._VariableFunctions`, described by its .pyi.
STUBBED = {"torch"}


class StubTree(SourceTree):
    """A SourceTree that reads a module's .pyi stub where the module has no Python source."""

    def module(self, dotted: str) -> ast.Module | None:
        if dotted not in self._modules:
            found = super().module(dotted)
            if found is None:
                base = dotted.replace(".", "/")
                source = self.files.read(f"{base}.pyi")
                if source is None:
                    source = self.files.read(f"{base}/__init__.pyi")  # torch._C
                self._modules[dotted] = None if source is None else cast(ast.Module, parse(source))
        return self._modules[dotted]


def source_tree(files, package: str) -> SourceTree:
    return StubTree(files, package) if package in STUBBED else SourceTree(files, package)


@dataclass(frozen=True)
class Target:
    kind: str  # def | module | external | missing
    module: str = ""
    node: ast.AST | None = None
    detail: str = ""
    overloads: tuple = ()  # a stub's @overload definitions (node is the first): a call must bind to one


def lookup(tree: SourceTree, module: str, name: str, depth: int = 0, budget: list[int] | None = None) -> Target:
    """What `from module import name` gives in this release."""
    budget = [STAR_BUDGET] if budget is None else budget
    source_module = tree.module(module)
    if source_module is None:
        return Target("missing", detail=f"no module {module}")
    found = last_definition(source_module.body, name)
    if found is not None:
        return Target("def", module, found)
    overloads = tuple(
        n
        for n in source_module.body
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name and is_overload(n)
    )
    if overloads:  # only @overload stubs: a .pyi
        return Target("def", module, overloads[0], overloads=overloads)
    if depth <= MAX_DEPTH:
        for node in top_level(source_module.body):
            if isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    if alias.name == "*":
                        continue
                    if (alias.asname or alias.name) == name:
                        source = tree.absolute(module, node.level, node.module)
                        if not (source == tree.package or source.startswith(tree.package + ".")):
                            return Target("external", detail=f"{module} re-exports it from {source}")
                        return lookup(tree, source, alias.name, depth + 1, budget)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if (alias.asname or alias.name.split(".")[0]) == name:
                        return Target("module", alias.name)
    if tree.module(f"{module}.{name}") is not None:
        return Target("module", f"{module}.{name}")
    body = source_module.body
    if depth <= MAX_DEPTH:
        for node in top_level(body):
            if isinstance(node, ast.ImportFrom) and any(a.name == "*" for a in node.names):
                star = _through_star(tree, tree.absolute(module, node.level, node.module), name, depth, budget)
                if star is not None:
                    return star
    if any(isinstance(n, ast.FunctionDef) and n.name == "__getattr__" for n in top_level(body)) or any(
        isinstance(n, ast.ImportFrom) and any(a.name == "*" for a in n.names) for n in top_level(body)
    ):
        return Target("external", detail=f"{module} may provide it at run time (module __getattr__ or import *)")
    return Target("missing", detail=f"{module} has no {name}")


STAR_BUDGET = 12  # modules a lookup may open through `import *` (transformers re-exports hundreds)


def _through_star(tree: SourceTree, source: str, name: str, depth: int, budget: list[int]) -> Target | None:
    """`name` as `from source import *` gives it, when that can be told within the budget: the
    module's literal `__all__` decides what a star import takes (torch.cuda: `from .memory import *`)."""
    if not (source == tree.package or source.startswith(tree.package + ".")) or budget[0] <= 0:
        return None
    budget[0] -= 1
    module = tree.module(source)
    if module is None:
        return None
    exported = _literal_all(module)
    if exported is not None and name not in exported:
        return None
    if exported is None and name.startswith("_"):
        return None
    found = lookup(tree, source, name, depth + 1, budget)
    return found if found.kind in ("def", "module") else None


def _literal_all(module: ast.Module) -> set[str] | None:
    value = last_definition(module.body, "__all__")
    if isinstance(value, (ast.Assign, ast.AnnAssign)) and isinstance(value.value, (ast.List, ast.Tuple)):
        names = {e.value for e in value.value.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)}
        if len(names) == len(value.value.elts):
            return names
    return None


def guarded_imports(module: ast.AST) -> dict[int, dict[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """id of each `from ... import` inside a `try:` that catches ImportError -> the functions its
    handlers define (the fallback that is called when the import fails)."""
    catches = {"ImportError", "ModuleNotFoundError", "Exception", "BaseException"}
    out: dict[int, dict[str, ast.FunctionDef | ast.AsyncFunctionDef]] = {}
    for node in ast.walk(module):
        if not isinstance(node, ast.Try):
            continue
        handlers = [h for h in node.handlers if h.type is None or _names_in(h.type) & catches]
        if not handlers:
            continue
        fallbacks = {
            s.name: s for h in handlers for s in h.body if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef))
        }
        for statement in node.body:
            for inner in ast.walk(statement):
                if isinstance(inner, ast.ImportFrom):
                    out[id(inner)] = fallbacks
    return out


def _names_in(expr: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(expr) if isinstance(n, ast.Name)} | {
        n.attr for n in ast.walk(expr) if isinstance(n, ast.Attribute)
    }


def attribute_target(tree: SourceTree, dotted: str) -> tuple[str, str, Target]:
    """`torch.cuda.mem_get_info` -> (module, name, what it is): the longest prefix that is a module,
    then its names one by one (a submodule reached by a name; a class's members are not bound)."""
    parts = dotted.split(".")
    cut = len(parts) - 1
    while cut > 1 and tree.module(".".join(parts[:cut])) is None:
        cut -= 1
    module = ".".join(parts[:cut])
    if tree.module(module) is None:
        return module, parts[cut], Target("missing", detail=f"no module {module}")
    target = lookup(tree, module, parts[cut])
    name = parts[cut]
    for part in parts[cut + 1 :]:
        if target.kind == "module":
            module, name, target = target.module, part, lookup(tree, target.module, part)
        elif target.kind == "missing":
            break
        else:  # a class's members (classmethods, descriptors) and anything else: not bound here
            detail = f"an attribute of a {'definition' if target.kind == 'def' else 'name from outside'} (not bound statically)"
            return module, f"{name}.{part}", Target("external", detail=detail)
    return module, name, target
