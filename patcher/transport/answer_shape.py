"""A target's answer line, read as the agent protocol (patcher/core/protocol.py) before anything
reads a field of it: valid JSON of another shape (a list, a result missing its files, a sha256
that is a number) is one line saying the target answered something that is not patcher's
protocol (exit 2), never a TypeError deep in planning. Every transport reads answers here: the
agent's session (local, ssh) and the Ansible task's.

The agent is patcher's own code, but the interpreter running it is the target's: a `.pth` file or
a sitecustomize there runs first and can change what the agent prints. Fields are checked as the
protocol's TypedDicts declare them; fields the protocol does not name are left alone (a newer
agent may add some).
"""

from __future__ import annotations

from typing import Any

from .interface import TransportError

ANY = object()  # a value of any shape


class Map:
    """An object whose keys are names and whose values all have one shape."""

    def __init__(self, values: Any) -> None:
        self.values = values


class List:
    def __init__(self, items: Any) -> None:
        self.items = items


class OneOf:
    """One of these exact texts."""

    def __init__(self, *texts: str) -> None:
        self.texts = texts


# A shape: str, bool, int, float (an int too), None (JSON null), ANY, a tuple (any of its shapes),
# Map, List, OneOf, or a dict of fields (an object with them; a name ending in "?" may be absent).
TEXTS = List(str)
VERSIONS = Map((str, None))
PENDING = {"sha256": str, "patches": TEXTS, "edits?": Map(TEXTS), "outcomes?": Map(str), "versions?": VERSIONS}
RECORD_ENTRY = {
    "root": (str, None),
    "distribution": str,
    "distribution_version": str,
    "original_sha256": str,
    "patched_sha256": (str, None),
    "patches": TEXTS,
    "original_adopted?": bool,
    "edits?": Map(TEXTS),
    "outcomes?": Map(str),
    "versions?": VERSIONS,
    "written_by?": str,
    "pending?": PENDING,
}
FILE_FACTS = {
    "exists": bool,
    "root?": str,
    "temporaries?": TEXTS,
    "sha256?": str,
    "record_sha256?": (str, None),
    "content?": str,
    "writable?": bool,
    "original?": (str, None),
    "original_intact?": bool,
    "refused?": str,
}
FACTS = {
    "python": {"executable": str, "version": str, "prefix": str},
    "state_dir": str,
    "distributions": Map({"name": str, "version": str, "location": str, "registered?": bool}),
    "files": Map(FILE_FACTS),
    "state": {"schema_version?": int, "files": Map(RECORD_ENTRY)},
    "state_error?": (str, None),
    "lock?": (str, None),
    "snapshot": {"state_sha256": (str, None), "files": Map({"root": (str, None), "sha256": (str, None)})},
}
VERIFICATION = {"ok": bool, "problems": TEXTS, "modules?": TEXTS}
RESULTS: dict[str, Any] = {
    "facts": FACTS,
    "apply": {"status": OneOf("ok", "changed", "rolled-back"), "verification": (VERIFICATION, None)},
    "forget": {"forgotten": TEXTS},
    "verify": VERIFICATION,
    "run-check": {
        "ok?": bool,
        "cannot_run?": (str, None),
        "device?": (str, None),
        "problems?": TEXTS,
        "max_rel_diff?": (float, None),
        "tolerance?": (float, None),
        "peak_rss_mib?": (int, None),
        "model?": (str, None),
        "compared?": bool,
        "usage_error?": (str, None),
    },
}
ERROR = {"kind": str, "message": str}


def _kind(value: Any) -> str:
    """What a JSON value is, in words."""
    if value is None:
        return "null"
    for shape, word in ((bool, "true or false"), (str, "text"), (int, "a number"), (float, "a number")):
        if isinstance(value, shape):
            return word
    return "a list" if isinstance(value, list) else "an object"


def _want(shape: Any) -> str:
    if isinstance(shape, tuple):
        return " or ".join(_want(s) for s in shape)
    if isinstance(shape, OneOf):
        return "one of " + ", ".join(repr(t) for t in shape.texts)
    if isinstance(shape, (dict, Map)):
        return "an object"
    if isinstance(shape, List):
        return "a list"
    return {str: "text", bool: "true or false", int: "a whole number", float: "a number", None: "null"}[shape]


def mismatch(value: Any, shape: Any, where: str) -> str | None:
    """Where `value` differs from `shape`, in words (the first place found), or None."""
    if shape is ANY:
        return None
    if isinstance(shape, tuple):
        if any(mismatch(value, s, where) is None for s in shape):
            return None
        return f"{where} is {_kind(value)}, not {_want(shape)}"
    if shape is None:
        return None if value is None else f"{where} is {_kind(value)}, not null"
    if shape in (int, float):
        ok = isinstance(value, (int, float) if shape is float else int) and not isinstance(value, bool)
        return None if ok else f"{where} is {_kind(value)}, not {_want(shape)}"
    if shape in (str, bool):
        return None if isinstance(value, shape) else f"{where} is {_kind(value)}, not {_want(shape)}"
    if isinstance(shape, OneOf):
        return None if value in shape.texts else f"{where} is {str(value)[:40]!r}, not {_want(shape)}"
    if isinstance(shape, List):
        if not isinstance(value, list):
            return f"{where} is {_kind(value)}, not a list"
        return next((m for i, v in enumerate(value) if (m := mismatch(v, shape.items, f"{where}[{i}]"))), None)
    if not isinstance(value, dict):
        return f"{where} is {_kind(value)}, not an object"
    if isinstance(shape, Map):
        return next((m for k, v in value.items() if (m := mismatch(v, shape.values, f"{where}[{k!r}]"))), None)
    for name, field in shape.items():
        key = name.rstrip("?")
        if key not in value:
            if name.endswith("?"):
                continue
            return f"{where} has no {key!r}"
        found = mismatch(value[key], field, f"{where}.{key}")
        if found:
            return found
    return None


def checked_answer(op: str, text: str, who: str, python: str, outcome: str = "") -> dict[str, Any]:
    """One answer line's JSON (`text`, after the mark) to an `op` request, checked against the
    protocol: {"ok": true, "result": ...} with the result `op` gives, or {"ok": false, "error":
    {"kind", "message"}}; else TransportError (usage, exit 2). `who` names the target, `python`
    its interpreter; `outcome` is what an apply or forget whose answer cannot be read left."""
    import json

    try:
        answer = json.loads(text)
        why = mismatch(answer, {"ok": bool}, "answer")
    except ValueError:
        why = f"answer is not JSON: {text[:200]!r}"
    if why is None:
        shape = {"result": RESULTS.get(op, ANY)} if answer["ok"] else {"error": ERROR}
        why = mismatch(answer, shape, "answer")
    if why is None:
        return answer
    raise TransportError(
        "usage",
        f"{who}: the target answered something that is not patcher's protocol (to the {op} request: {why}); "
        f"something in {python} (a .pth file or sitecustomize in its environment, a wrapper script) changes "
        f"what patcher's agent prints: run patcher with a plain Python 3.9+ interpreter{outcome}",
    )
