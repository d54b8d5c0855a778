"""The shape of the code: no import cycle among patcher's modules, and no import upward through
the layers (LAYERS); lazy imports inside functions count too: a cycle there is still two modules
that cannot be read one without the other, and a lazy upward import still ties a lower place to
a higher one."""

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


# The layers, lowest first (docs/development.md's layout names the places): a module imports from
# its own layer and those below, never from one above. A module is in the layer of the longest
# prefix listed that names it.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        # standard library only, sent to targets or written into them (the agent, planning's core
        # that a bundle carries), and the controller's small utilities that know nothing of a run
        "ground",
        (
            "patcher.core",
            "patcher.remote",
            "patcher.plan.planning",
            "patcher.shared_states",
            "patcher.device_memory",
            "patcher.cache",
            "patcher.output_files",
            # the host-address grammar: the fleet parses hosts with it, the ssh transport takes a Host
            "patcher.fleet.host_address",
        ),
    ),
    # what a patch is written in, and the patches
    ("vocabulary", ("patcher.model", "patcher.codemod", "patcher.shapes", "patcher.patches")),
    # the places of one run's flow: which patches exist, select and plan, transform, what a run says
    (
        "places",
        ("patcher.patchset", "patcher.plan", "patcher.transform", "patcher.report", "patcher.run_check"),
    ),
    # one target end to end and the transports that carry it
    ("spine", ("patcher.target_run", "patcher.transport")),
    # many hosts, the front ends besides the command line (a bundle, the Ansible action's work, which
    # runs run_target), check-upstream and the release matrix, the demo's environments
    ("many", ("patcher.fleet", "patcher.frontends", "patcher.upstream", "patcher.demo")),
    # the commands: the command line, `patcher demo`'s command, the Ansible collection's plugins
    # (controller side: Ansible runs them, and they call patcher)
    (
        "commands",
        (
            "patcher.cli",
            "patcher.__main__",
            "patcher.demo.demo_command",
            "patcher.patchset.set_commands",
            "patcher.remote.ansible",
        ),
    ),
)
PACKAGE_ROOT = "patcher"  # patcher/__init__.py: the version only, importable by every layer


def layer_of(module: str) -> int:
    if module == PACKAGE_ROOT:
        return 0
    named = [
        (len(prefix), index)
        for index, (_, prefixes) in enumerate(LAYERS)
        for prefix in prefixes
        if module == prefix or module.startswith(prefix + ".")
    ]
    if not named:
        raise AssertionError(f"{module} is in no layer: add it to LAYERS in tests/test_layout.py")
    return max(named)[1]


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return [
        f"{module} ({LAYERS[layer_of(module)][0]}) imports {dep} ({LAYERS[layer_of(dep)][0]}), a layer above it"
        for module in sorted(graph)
        for dep in sorted(graph[module])
        if layer_of(dep) > layer_of(module)
    ]


def test_no_import_goes_up_a_layer():
    graph = import_graph()
    assert upward_imports(graph) == [], "move the code it needs down, or pass it in"


def test_the_check_sees_an_upward_import():
    graph = {"patcher.target_run": {"patcher.core.errors"}, "patcher.core.errors": {"patcher.cli.render"}}
    assert upward_imports(graph) == [
        "patcher.core.errors (ground) imports patcher.cli.render (commands), a layer above it"
    ]
    assert layer_of("patcher.plan.planning") == 0 and layer_of("patcher.plan.selection") == 2
    assert layer_of("patcher.demo.demo_command") == 5 and layer_of("patcher.demo.recipes") == 4


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
TREE_PATH = re.compile(
    r"(?<![\w./-])((?:patcher|patches|remote|bench|tests|workbench|scripts|docs)/[\w./-]*\w)(?![\w*<{])"
)


def test_the_products_texts_name_only_files_that_exist():
    missing = {
        f"{path.relative_to(ROOT)}: {name}"
        for top in INSTALLED_AS
        for path in (ROOT / top).rglob("*.py")
        for name in TREE_PATH.findall(path.read_text(encoding="utf-8"))
        if not (ROOT / name).exists()
    }
    assert missing == set()
