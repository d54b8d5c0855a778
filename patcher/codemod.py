"""The base every patch codemod derives from: rewrite the unpatched shape, recognise the patched one."""

from __future__ import annotations

from typing import ClassVar

import libcst as cst


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
