"""The shared planning core and error table, as plain functions: no subprocess, no target."""

from __future__ import annotations

import ast
import hashlib
from pathlib import Path

from patcher.core import errors, protocol
from patcher.patchset.registry import load_patches
from patcher.plan import planning as core
from patcher.plan.selection import condition_holds
from tests.support.files import agent_modules

ROOT = Path(__file__).resolve().parent.parent
GEN = "pkg/gen.py"


def sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def spec(pid: str, needs: tuple = (), requires: dict | None = None) -> core.PatchSpec:
    return core.PatchSpec(pid, GEN, "pkg", "pkg.gen", requires or {"vllm": ">=1.0"}, (("Edit", {}),), needs)


SPECS = [spec("v1-a"), spec("v2-b", requires={"vllm": ">=2.0"}), spec("v3-c", needs=("v1-a",))]


def facts(content: str = "x = 1\n", vllm: str = "2.0", record: dict | None = None, original: str | None = None) -> dict:
    info = {
        "exists": True,
        "root": "/site",
        "sha256": sha(content),
        "record_sha256": sha(original or content),
        "content": content,
        "original": original,
        "original_intact": original is not None,
    }
    return {
        "distributions": {"pkg": {"name": "pkg", "version": "1.0"}, "vllm": {"name": "vllm", "version": vllm}},
        "files": {GEN: info},
        "state": {"files": {GEN: record} if record else {}},
        "state_error": None,
    }


def transformed(d: core.Draft) -> dict:
    """Every request answered as a codemod would: the pristine text plus one line per patch."""
    return {
        r.path: core.TransformResult(
            r.pristine + "".join(f"# {pid}\n" for pid, _ in r.steps), {pid: "applied" for pid, _ in r.steps}
        )
        for r in d.requests
    }


def states(plan: core.TargetPlan) -> dict:
    return {p.id: p.state for p in plan.patches}


def test_classify():
    info = {"sha256": "b", "record_sha256": "a"}
    assert core.classify({"sha256": "a", "record_sha256": "a"}, None).kind == "pristine"
    assert core.classify(info, None).kind == "modified"
    assert core.classify(info, {"patched_sha256": "b", "patches": ["v1-a"]}).applied == ["v1-a"]
    assert core.classify(info, {"original_sha256": "b"}).kind == "pristine"
    assert core.classify({"sha256": "b", "record_sha256": "b"}, {"original_sha256": "z"}).kind == "replaced"
    interrupted = core.classify(info, {"pending": {"sha256": "b", "patches": ["v1-a"]}})
    assert (interrupted.kind, interrupted.interrupted, interrupted.applied) == ("patched", True, ["v1-a"])


def test_needs_are_dropped_until_stable():
    kept, dropped = core.drop_unmet_needs(["a", "b", "c"], {"b": ("x",), "c": ("b",)})
    assert kept == ["a"] and dropped == {"b": ["x"], "c": ["b"]}


def test_selection_uses_the_matching_it_is_given():
    never = core.select(SPECS, {"vllm": "2.0", "pkg": "1.0"}, lambda spec, version: False)
    assert not any(s.selected for s in never.values())
    chosen = core.select(SPECS, {"vllm": "1.5", "pkg": "1.0"}, condition_holds)
    assert [pid for pid, s in chosen.items() if s.selected] == ["v1-a", "v3-c"]
    assert chosen["v2-b"].reason == "vllm 1.5 does not satisfy >=2.0"


def test_draft_names_the_transforms_and_finish_plans_their_results():
    d = core.draft(facts(), SPECS, condition_holds)
    assert [(r.path, [pid for pid, _ in r.steps]) for r in d.requests] == [(GEN, ["v1-a", "v2-b", "v3-c"])]
    plan = core.finish(d, transformed(d))
    assert states(plan) == {"v1-a": "pending", "v2-b": "pending", "v3-c": "pending"}
    (change,) = plan.changes
    assert change.new_content == "x = 1\n# v1-a\n# v2-b\n# v3-c\n" and change.expected_sha256 == sha("x = 1\n")
    after = core.after_write(plan.patches, plan.changes, "apply")
    assert {p.state for p in after} == {"applied"}


def test_skip_leaves_out_what_needs_it():
    d = core.draft(facts(), SPECS, condition_holds, skip=("v1-a",))
    plan = core.finish(d, transformed(d))
    assert states(plan) == {"v1-a": "pending", "v2-b": "pending", "v3-c": "not-selected"}
    assert plan.patches[2].reason == "needs v1-a, which is not part of this run"
    assert plan.changes[0].patches == ["v2-b"]


def test_stale_then_removed_by_this_run():
    applied = "x = 1\n# v1-a\n# v2-b\n"
    record = {
        "patched_sha256": sha(applied),
        "original_sha256": sha("x = 1\n"),
        "patches": ["v1-a", "v2-b"],
        "edits": {"v1-a": ["Edit"], "v2-b": ["Edit"]},
    }
    d = core.draft(facts(applied, vllm="1.5", record=record, original="x = 1\n"), SPECS, condition_holds)
    plan = core.finish(d, transformed(d))
    stale = plan.patches[1]
    assert (stale.state, stale.reason) == (
        "stale",
        "no longer selected: vllm 1.5 does not satisfy >=2.0; apply removes it",
    )
    assert plan.changes[0].new_content == "x = 1\n# v1-a\n# v3-c\n"
    removed = core.after_write(plan.patches, plan.changes, "apply")[1]
    assert (removed.state, removed.reason) == (
        "not-selected",
        "no longer selected: vllm 1.5 does not satisfy >=2.0; removed by this run",
    )


def test_nothing_to_do_needs_no_transform_and_rollback_restores():
    applied = "x = 1\n# v1-a\n# v3-c\n"
    record = {
        "patched_sha256": sha(applied),
        "original_sha256": sha("x = 1\n"),
        "patches": ["v1-a", "v3-c"],
        "edits": {"v1-a": ["Edit"], "v3-c": ["Edit"]},
    }
    target = facts(applied, vllm="1.5", record=record, original="x = 1\n")
    d = core.draft(target, SPECS, condition_holds)
    assert d.requests == []
    assert core.finish(d, {}).changes == []
    back = core.draft(target, SPECS, condition_holds, "rollback")
    (change,) = core.finish(back, {}).changes
    assert change.new_content is None and change.original_sha256 == sha("x = 1\n")


def test_modified_and_anchor_missing_are_conflicts():
    d = core.draft(facts("x = 2\n", original=None) | {}, SPECS, condition_holds)
    d2 = core.draft(
        {**facts(), "files": {GEN: {**facts()["files"][GEN], "record_sha256": "other"}}}, SPECS, condition_holds
    )
    assert [c.kind for c in core.finish(d2, {}).conflicts] == ["modified"]
    missing = {GEN: core.TransformResult("", {}, [("v2-b", "anchor not found")])}
    plan = core.finish(d, missing)
    assert [c.kind for c in plan.conflicts] == ["anchor-missing"] and plan.changes == []
    assert states(plan)["v2-b"] == "anchor-missing"


def test_specs_carry_every_declaration_and_round_trip_as_json():
    for s in (p.spec() for p in load_patches()):
        assert core.PatchSpec.from_json(s.as_json()) == s


def test_core_is_standard_library_only_and_imports_nothing_of_patcher_but_what_a_bundle_carries():
    from patcher.core import versions
    from patcher.frontends.bundle import BUNDLE_SHARED_MODULES

    for module in (core, errors, protocol, versions):
        tree = ast.parse(Path(module.__file__).read_text())
        # What runs: an `if TYPE_CHECKING:` block is the type checker's only (TYPE_CHECKING is False there).
        for block in [
            n for n in ast.walk(tree) if isinstance(n, ast.If) and getattr(n.test, "id", "") == "TYPE_CHECKING"
        ]:
            block.body = []
        imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level == 0}
        # of patcher, only the modules a bundle carries beside it (planning reads specifiers with versions)
        package = module.__name__.rsplit(".", 1)[0].split(".")
        relative = {
            ".".join([*package[: len(package) - n.level + 1], n.module or ""])
            for n in ast.walk(tree)
            if isinstance(n, ast.ImportFrom) and n.level
        }
        assert relative <= {f"patcher.{m}" for m in BUNDLE_SHARED_MODULES} - {module.__name__}, module.__name__
        assert imported <= {"__future__", "dataclasses", "json", "difflib", "shlex", "re"}, (module.__name__, imported)
        flags = [
            n.value
            for n in ast.walk(tree)
            if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "TYPE_CHECKING"
        ]
        assert all(isinstance(v, ast.Constant) and v.value is False for v in flags), module.__name__


def test_the_agent_imports_only_the_standard_library_and_the_texts_it_is_sent():
    """What runs in a target: each agent module's imports (lazy ones too, the type checker's
    aside) are standard library or modules of the texts the controller sends with it (and vLLM's
    own platform detection, which verification asks the target's vLLM for)."""
    import sys

    from patcher.remote.agent.bootstrap import read_texts

    sent = set(read_texts())
    for path in sorted(agent_modules()):
        tree = ast.parse(path.read_text())
        for block in [
            n for n in ast.walk(tree) if isinstance(n, ast.If) and getattr(n.test, "id", "") == "TYPE_CHECKING"
        ]:
            block.body = []
        package = "patcher.remote.agent"
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = package.rsplit(".", node.level - 1)[0] if node.level else ""
                module = ".".join(p for p in (base, node.module or "") if p)
                names = [module] if node.module else [f"{module}.{a.name}" for a in node.names]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                own = name in sent or name == "vllm.platforms"
                assert own or (top != "patcher" and top in sys.stdlib_module_names), (path.name, name)


def test_every_kind_the_agent_raises_or_answers_is_in_the_table():
    trees = [ast.parse(p.read_text()) for p in sorted(agent_modules())]
    raised = {
        n.args[0].value
        for tree in trees
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "AgentError" and isinstance(n.args[0], ast.Constant)
    }
    answered = {
        n.values[0].value
        for tree in trees
        for n in ast.walk(tree)
        if isinstance(n, ast.Dict)
        and n.keys
        and isinstance(n.keys[0], ast.Constant)
        and n.keys[0].value == "kind"
        and isinstance(n.values[0], ast.Constant)
    }
    assert {"hostile-path", "timeout", "internal", "not-writable"} <= raised | answered  # the scan sees them
    assert raised | answered <= set(errors.AGENT_KINDS), (raised | answered) - set(errors.AGENT_KINDS)
    assert set(errors.AGENT_KINDS) <= set(errors.ERROR_KINDS)
    assert errors.outcome("stale-plan") == ("failed", errors.EXIT_CONFLICT)
