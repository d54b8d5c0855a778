"""The agent protocol's shapes, patcher/core/protocol.py: the one definition the controller's and
the agent's (remote/agent/) signatures both use, for the type checker only. Read here as source:
it defines nothing at run time, and every operation the agent serves has its request there."""

import ast
from pathlib import Path

from patcher.core import protocol
from tests.support.files import agent_modules

ROOT = Path(__file__).resolve().parent.parent


def shapes(path: Path) -> dict:
    """name -> (bases, keywords, [(key, annotation)]) for each class of the file's top-level
    `if TYPE_CHECKING:` block, and name -> text for each alias there (Request = A | B)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    block = next(n for n in tree.body if isinstance(n, ast.If) and getattr(n.test, "id", "") == "TYPE_CHECKING")
    found: dict = {}
    for node in block.body:
        if isinstance(node, ast.ClassDef):
            fields = [(s.target.id, ast.unparse(s.annotation)) for s in node.body if isinstance(s, ast.AnnAssign)]
            found[node.name] = ([ast.unparse(b) for b in node.bases], [ast.unparse(k) for k in node.keywords], fields)
        elif isinstance(node, ast.Assign):
            found[node.targets[0].id] = ast.unparse(node.value)
    return found


CORE = shapes(ROOT / "patcher" / "core" / "protocol.py")


def test_every_class_is_a_typed_dict_and_every_agent_operation_has_a_request():
    for name, shape in CORE.items():
        if not isinstance(shape, str):
            assert all(b == "TypedDict" or b in CORE for b in shape[0]), name
    ops = set()
    for shape in CORE.values():
        if not isinstance(shape, str):
            for key, annotation in shape[2]:
                if key == "op":
                    ops |= {e.value for e in ast.walk(ast.parse(annotation)) if isinstance(e, ast.Constant)}
    from patcher.remote.agent import session

    assert ops == set(session.OPERATIONS)
    assert all(callable(session.operation(op)) for op in ops)


def test_no_agent_module_defines_a_protocol_shape_of_its_own():
    names = set(CORE)
    for path in sorted(agent_modules()):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        defined = {n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
        assert not defined & names, f"{path.name} defines {sorted(defined & names)}: use patcher.core.protocol's"


def test_the_core_module_defines_nothing_at_run_time():
    # Only the type checker sees the classes: a bundle or a target runs no typing for them.
    assert protocol.TYPE_CHECKING is False
    assert not [n for n in vars(protocol) if n[0].isupper() and n != "TYPE_CHECKING"]
