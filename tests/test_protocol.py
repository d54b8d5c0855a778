"""The agent protocol's shapes exist twice: patcher/core/protocol.py, which the controller's
signatures use, and the type-check-only block at the top of remote/agent.py (the agent is one
standard-library text sent to the target and imports nothing of patcher's). Both are read here as
source: neither defines anything at run time."""

import ast
from pathlib import Path

from patcher.core import protocol

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


def test_the_agent_mirrors_the_protocol_class_by_class_and_key_by_key():
    agent = shapes(ROOT / "remote" / "agent.py")
    assert {"Facts", "FileFacts", "ApplyRequest", "ApplyItem", "StateRecord", "RecordEntry", "Answer"} <= set(CORE)
    assert sorted(agent) == sorted(CORE), "the same classes in remote/agent.py as in patcher/core/protocol.py"
    for name, shape in CORE.items():
        if isinstance(shape, str):
            assert agent[name] == shape, f"{name}: {agent[name]} in remote/agent.py, {shape} in the core"
            continue
        bases, keywords, fields = agent[name]
        assert (bases, keywords) == shape[:2], f"{name}: bases or totality differ"
        assert dict(fields) == dict(shape[2]), (
            f"{name}: remote/agent.py has {sorted(set(fields) - set(shape[2]))}, "
            f"the core {sorted(set(shape[2]) - set(fields))}"
        )
        assert [k for k, _ in fields] == [k for k, _ in shape[2]], f"{name}: keys in another order"


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
    tree = ast.parse((ROOT / "remote" / "agent.py").read_text(encoding="utf-8"))
    table = next(
        n.value for n in tree.body if isinstance(n, ast.AnnAssign) and getattr(n.target, "id", "") == "OPERATIONS"
    )
    assert isinstance(table, ast.Dict)
    assert ops == {k.value for k in table.keys if isinstance(k, ast.Constant)}


def test_the_core_module_defines_nothing_at_run_time():
    # Only the type checker sees the classes: a bundle or a target runs no typing for them.
    assert protocol.TYPE_CHECKING is False
    assert not [n for n in vars(protocol) if n[0].isupper() and n != "TYPE_CHECKING"]
