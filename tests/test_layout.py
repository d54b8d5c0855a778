"""The shape of the code: no import cycle among patcher's modules (lazy imports inside functions
count too: a cycle there is still two modules that cannot be read one without the other)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
INSTALLED_AS = {"patcher": ("patcher",), "patches": ("patcher", "patches"), "remote": ("patcher", "remote")}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    parts = [*INSTALLED_AS[parts[0]], *parts[1:]]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    paths = {module_name(p): p for top in INSTALLED_AS for p in (ROOT / top).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom):
                base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
                target = ".".join(base + ([node.module] if node.module else []))
                candidates = [target, *(f"{target}.{a.name}" for a in node.names)]
            elif isinstance(node, ast.Import):
                candidates = [a.name for a in node.names]
            else:
                continue
            deps |= {c for c in candidates if c in paths and c != name and not name.startswith(c + ".")}
        graph[name] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for dep in graph[node]:
            if dep not in index:
                visit(dep)
                low[node] = min(low[node], low[dep])
            elif dep in stack:
                low[node] = min(low[node], index[dep])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_cycle():
    graph = import_graph()
    assert "patcher.transform.combined" in graph["patcher.transform.transforms"]  # the graph sees lazy imports
    assert cycles(graph) == []


def test_the_check_sees_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == [["a", "b", "c"]]


def test_every_package_is_installed():
    import pytest

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {
        module_name(init.parent / "__init__.py") for top in INSTALLED_AS for init in (ROOT / top).rglob("__init__.py")
    }
    assert found - listed == set(), "add them to [tool.setuptools] packages in pyproject.toml"


# Names Python or Ansible give several modules on purpose: a package's __init__ and __main__, and
# an Ansible action plugin, which Ansible pairs with its module by their shared name.
SHARED_NAMES = {"__init__.py", "__main__.py", "patch.py"}


def test_one_module_per_name():
    # two modules of one name that mean different things (a runcheck.py on each side, four
    # command(s).py) make every mention of one ambiguous
    seen: dict[str, list[str]] = {}
    for top in INSTALLED_AS:
        for path in (ROOT / top).rglob("*.py"):
            seen.setdefault(path.name, []).append(str(path.relative_to(ROOT)))
    assert {name: paths for name, paths in seen.items() if len(paths) > 1 and name not in SHARED_NAMES} == {}


# A path in the tree as the product's docstrings and comments name one: `patcher/cli/entry.py`
# (a name with a wildcard or a placeholder, `bench/gpu/results/*/`, `<release>-<key>.json`, is not one)
TREE_PATH = re.compile(r"(?<![\w./-])((?:patcher|patches|remote|bench|tests|scripts|docs)/[\w./-]*\w)(?![\w*<{])")


def test_the_products_texts_name_only_files_that_exist():
    missing = {
        f"{path.relative_to(ROOT)}: {name}"
        for top in INSTALLED_AS
        for path in (ROOT / top).rglob("*.py")
        for name in TREE_PATH.findall(path.read_text(encoding="utf-8"))
        if not (ROOT / name).exists()
    }
    assert missing == set()
