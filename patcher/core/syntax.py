"""Reading Python syntax trees the same way in the controller (check-upstream's binder) and in a
target (the agent's verification): standard library only, Python 3.9+."""

from __future__ import annotations

import ast


def dotted_name(node: ast.AST) -> str | None:
    """`a.b.c` for a chain of attributes on a name; None for anything else (a call, a subscript)."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return None
