"""The Flask 2.2 / Werkzeug 3 patch set of tests/support/flask_werkzeug3 as the tests use it
(tests/test_patch_sets.py, tests/test_ansible_collection.py)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

SET_SOURCE = Path(__file__).parent / "flask_werkzeug3"
IDS = ["flask-werkzeug3:v1-url-quote", "flask-werkzeug3:v2-url-parse"]
FILES = ("flask/app.py", "flask/testing.py")


def copy_of_set(tmp_path: Path, name: str = "flask_werkzeug3") -> Path:
    """The set as a user keeps it: a folder of their own, nobody else can write."""
    folder = tmp_path / "sets" / name
    shutil.copytree(SET_SOURCE, folder, ignore=shutil.ignore_patterns("__pycache__"))
    for path in [folder.parent, folder, *folder.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    return folder


def flask_works(python: Path) -> subprocess.CompletedProcess:
    code = "import flask\napp = flask.Flask('t')\napp.add_url_rule('/', 'i', lambda: 'hi')\n"
    code += "print(app.test_client().get('/').data.decode())\n"
    return subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=120)
