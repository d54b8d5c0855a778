"""The Flask releases this set answers for: a target on another is refused (exit 7)."""

from patcher.model import ReleaseLine

RELEASE_LINES = (
    ReleaseLine(
        "flask",
        ">=2.2.0,<2.2.4",
        ("2.2.0", "2.2.1", "2.2.2", "2.2.3"),
        patched=True,
        path="Flask 2.2.0-2.2.3 import helpers Werkzeug 3.0 removed: this set's patches",
    ),
    ReleaseLine(
        "flask",
        ">=2.2.4,<4",
        ("2.2.4", "2.2.5", "2.3.0", "3.0.0"),
        patched=False,
        path="Flask 2.2.4 and later import nothing Werkzeug 3.0 removed; no file is patched",
    ),
)
