"""The base every patch codemod derives from: rewrite the unpatched shape, recognise the patched one."""

from __future__ import annotations

from typing import ClassVar

import libcst as cst
from libcst.helpers import get_full_name_for_node

from patcher import shapes as m


class SkipFile(Exception):
    """The file is not the one a codemod was written for: its anchor is not there.

    Named and used like libcst.codemod.SkipFile; ours because importing libcst.codemod (which
    imports libcst.matchers) costs about 0.2 s on every apply.
    """


class PatchCodemod(cst.CSTTransformer):
    """A codemod that knows whether it rewrote something or found its work already done.

    Subclasses call `self.rewrote()` when they change the unpatched shape and
    `self.found_patched()` when they see the shape they would produce. Seeing neither means
    the file is not the one the codemod was written for: SkipFile, naming the expected shape.
    """

    ANCHOR: ClassVar[str] = ""  # the unpatched shape, in words, for "anchor not found"

    def __init__(self, filename: str = "<source>") -> None:
        super().__init__()
        self.filename = filename
        self.rewrites = 0
        self.patched_seen = 0

    def rewrote(self) -> None:
        self.rewrites += 1

    def found_patched(self) -> None:
        self.patched_seen += 1

    def transform_module(self, tree: cst.Module) -> cst.Module:
        """The whole module, rewritten; SkipFile if the anchor is not there."""
        updated = tree.visit(self)
        self.check_anchor()
        return updated

    def check_anchor(self) -> None:
        if not self.rewrites and not self.patched_seen:
            raise SkipFile(f"anchor not found: expected {self.ANCHOR}")


def keyword_arg(name: str, value: cst.BaseExpression) -> cst.Arg:
    return cst.Arg(
        keyword=cst.Name(name),
        value=value,
        equal=cst.AssignEqual(
            whitespace_before=cst.SimpleWhitespace(""),
            whitespace_after=cst.SimpleWhitespace(""),
        ),
    )


def has_keyword(call: cst.Call, name: str) -> bool:
    return any(arg.keyword is not None and arg.keyword.value == name for arg in call.args)


def append_arg(call: cst.Call, new_arg: cst.Arg) -> cst.Call:
    """Add `new_arg` last, in the call's own layout (one line, or one argument per line)."""
    args = list(call.args)
    if not args:
        return call.with_changes(args=[new_arg])
    last = args[-1]
    if isinstance(last.comma, cst.Comma):
        # A trailing comma: one argument per line. The old last argument takes the
        # separator its predecessors use; the new one inherits the trailing comma.
        separator = (
            args[-2].comma
            if len(args) > 1 and isinstance(args[-2].comma, cst.Comma)
            else cst.Comma(whitespace_after=call.whitespace_before_args)
        )
        args[-1] = last.with_changes(comma=separator)
        args.append(new_arg.with_changes(comma=last.comma))
    else:
        args[-1] = last.with_changes(comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" ")))
        args.append(new_arg)
    return call.with_changes(args=args)


def remove_keyword(call: cst.Call, name: str) -> cst.Call:
    """Drop the argument `name=...`, keeping the layout of the others."""
    args = list(call.args)
    index = next(i for i, a in enumerate(args) if a.keyword is not None and a.keyword.value == name)
    removed = args.pop(index)
    if index == len(args) and args:
        # The removed argument was last: its comma (trailing or absent) moves to the new last.
        args[-1] = args[-1].with_changes(comma=removed.comma)
    return call.with_changes(args=args)


def _is_import_line(statement: cst.BaseStatement) -> bool:
    return (
        isinstance(statement, cst.SimpleStatementLine)
        and len(statement.body) == 1
        and isinstance(statement.body[0], (cst.Import, cst.ImportFrom))
    )


def with_import_first(module: cst.Module, name: str) -> cst.Module | None:
    """`module` with `import NAME` (a top-level name) added as its first import, taking over the
    blank lines above the imports; None when the module already has that very line."""
    body = list(module.body)
    for statement in body:
        if not (isinstance(statement, cst.SimpleStatementLine) and _is_import_line(statement)):
            continue
        imp = statement.body[0]
        if isinstance(imp, cst.Import) and len(imp.names) == 1:
            alias = imp.names[0]
            if alias.asname is None and isinstance(alias.name, cst.Name) and alias.name.value == name:
                return None
    imports = [i for i, s in enumerate(body) if _is_import_line(s)]
    at = imports[0] if imports else 0
    line = cst.parse_statement(f"import {name}\n")
    if imports:
        line = line.with_changes(leading_lines=body[at].leading_lines)
        body[at] = body[at].with_changes(leading_lines=())
    return module.with_changes(body=[*body[:at], line, *body[at:]])


# Shared by several patches (each one reads alone: none imports another patch module).


def imported_names(body: list[cst.BaseStatement] | tuple[cst.BaseStatement, ...]) -> set[tuple[str, str]]:
    """(module, name) of every top-level `from module import name` (unaliased, or aliased to itself)."""
    found: set[tuple[str, str]] = set()
    for statement in body:
        if not (
            isinstance(statement, cst.SimpleStatementLine)
            and m.matches(statement, m.SimpleStatementLine(body=[m.ImportFrom()]))
        ):
            continue
        node = statement.body[0]
        assert isinstance(node, cst.ImportFrom)  # matched above
        if node.relative or node.module is None or isinstance(node.names, cst.ImportStar):
            continue
        module = get_full_name_for_node(node.module) or ""
        for alias in node.names:
            if alias.evaluated_alias in (None, alias.evaluated_name):
                found.add((module, alias.evaluated_name))
    return found


def import_after_last_vllm_import(
    body: list[cst.BaseStatement], statement: cst.BaseStatement
) -> list[cst.BaseStatement]:
    """`statement` after the last top-level `from vllm... import`, else after the last import."""
    imports = [i for i, s in enumerate(body) if m.matches(s, m.SimpleStatementLine(body=[m.ImportFrom() | m.Import()]))]

    def from_vllm(statement: cst.BaseStatement) -> bool:
        if not m.matches(statement, m.SimpleStatementLine(body=[m.ImportFrom(relative=[])])):
            return False
        node = statement.body[0] if isinstance(statement, cst.SimpleStatementLine) else None
        module = node.module if isinstance(node, cst.ImportFrom) else None
        return module is not None and (get_full_name_for_node(module) or "").split(".")[0] == "vllm"

    vllm = [i for i in imports if from_vllm(body[i])]
    at = (vllm or imports or [-1])[-1] + 1
    return [*body[:at], statement, *body[at:]]


def torch_cuda_call(name: str) -> m.Shape:
    return m.Call(
        func=m.Attribute(value=m.Attribute(value=m.Name("torch"), attr=m.Name("cuda")), attr=m.Name(name)),
        args=[],
    )


def defines_function(body, name: str) -> bool:
    return any(isinstance(s, cst.FunctionDef) and s.name.value == name for s in body)


class CudaCallToDeviceHelper(PatchCodemod):
    """torch.cuda.<CUDA_FUNCTION>() -> <HELPER>(), with HELPER defined at module level
    (placed before the first top-level class, or at the end).

    Patched: a call HELPER() outside the helper itself (the helper is then ensured).
    """

    CUDA_FUNCTION: ClassVar[str]
    HELPER: ClassVar[str]
    HELPER_SOURCE: ClassVar[str]

    def __init__(self, filename: str = "<source>") -> None:
        super().__init__(filename)
        self.in_helper = 0

    def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
        if node.name.value == self.HELPER:
            self.in_helper += 1
        return True

    def leave_FunctionDef(self, original: cst.FunctionDef, updated: cst.FunctionDef) -> cst.FunctionDef:
        if original.name.value == self.HELPER:
            self.in_helper -= 1
        return updated

    def leave_Call(self, original: cst.Call, updated: cst.Call) -> cst.BaseExpression:
        if self.in_helper:
            return updated
        if m.matches(updated, m.Call(func=m.Name(self.HELPER))):
            self.found_patched()
            return updated
        if not m.matches(updated, torch_cuda_call(self.CUDA_FUNCTION)):
            return updated
        self.rewrote()
        return cst.Call(func=cst.Name(self.HELPER))

    def leave_Module(self, original: cst.Module, updated: cst.Module) -> cst.Module:
        if not (self.rewrites or self.patched_seen) or defines_function(updated.body, self.HELPER):
            return updated
        self.rewrote()
        helper = cst.parse_statement(self.HELPER_SOURCE)
        helper = helper.with_changes(leading_lines=[cst.EmptyLine(), cst.EmptyLine()])
        body = list(updated.body)
        index = next((i for i, s in enumerate(body) if isinstance(s, cst.ClassDef)), len(body))
        body.insert(index, helper)
        return updated.with_changes(body=body)


def statement_code(statement: cst.CSTNode) -> str:
    """A statement's source on its own (its comments above it included, its indentation not)."""
    return cst.Module(body=[]).code_for_node(statement)


def parse_statements(text: str) -> list[cst.BaseStatement]:
    """Statements as statement_code writes them, back as nodes: the comments and blank lines above
    the first one stay with it (parsed alone, they would be the module's header)."""
    module = cst.parse_module(text)
    body = list(module.body)
    if body and module.header:
        body[0] = body[0].with_changes(leading_lines=[*module.header, *body[0].leading_lines])
    # a blank line above a statement is blank in any block (parsed at module level it would carry
    # the block's indentation once placed in one)
    return [
        s.with_changes(
            leading_lines=[
                line.with_changes(indent=False) if line.comment is None else line for line in s.leading_lines
            ]
        )
        for s in body
    ]


def _find_run(texts: list[str], run: list[str]) -> int | None:
    """Where `run` starts in `texts` (consecutive, exactly), when it is there exactly once."""
    found = [i for i in range(len(texts) - len(run) + 1) if texts[i : i + len(run)] == run]
    return found[0] if len(found) == 1 else None


class StatementRun(PatchCodemod):
    """In the block SCOPE names (classes and functions by name, from the module down), the run of
    consecutive statements BEFORE, exactly as written there (comments above them included), becomes
    AFTER. Patched: AFTER is there. What `patcher new --from-edit` writes a hand edit as: it refuses
    any code other than the release's own."""

    SCOPE: ClassVar[tuple[str, ...]] = ()
    BEFORE: ClassVar[str] = ""
    AFTER: ClassVar[str] = ""

    def transform_module(self, tree: cst.Module) -> cst.Module:
        before = [statement_code(s) for s in parse_statements(self.BEFORE)]
        after_nodes = parse_statements(self.AFTER)
        after = [statement_code(s) for s in after_nodes]
        body = self._rewrite(list(tree.body), list(self.SCOPE), before, after, after_nodes)
        self.check_anchor()
        return tree if body is None else tree.with_changes(body=body)

    def _rewrite(self, body: list, scope: list[str], before: list[str], after: list[str], nodes: list) -> list | None:
        if not scope:
            texts = [statement_code(s) for s in body]
            if _find_run(texts, after) is not None:
                self.found_patched()
                return None
            at = _find_run(texts, before)
            if at is None:
                return None
            self.rewrote()
            return [*body[:at], *nodes, *body[at + len(before) :]]
        for index, statement in enumerate(body):
            if (
                isinstance(statement, (cst.FunctionDef, cst.ClassDef))
                and statement.name.value == scope[0]
                and isinstance(statement.body, cst.IndentedBlock)
            ):
                inner = self._rewrite(list(statement.body.body), scope[1:], before, after, nodes)
                if inner is not None:
                    new = statement.with_changes(body=statement.body.with_changes(body=inner))
                    return [*body[:index], new, *body[index + 1 :]]
                if self.rewrites or self.patched_seen:
                    return None
        return None
