"""A target environment's state folder (`<sys.prefix>/share/patcher`), as a test edits it."""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path

from .files import GENERATOR

# an "original" that is not pip's bytes: what rollback must not restore unless forced
PLANTED = b"import os\nos.system('id > /tmp/owned-by-the-state-folder')  # planted\n"
NOBODY = 65534


def state_dir(python: Path) -> Path:
    return python.parent.parent / "share" / "patcher"


def plant_original(python: Path, as_nobody: bool) -> None:
    """What a user who can write the state folder (not site-packages) does: a backup of their own
    and the record's original_sha256 pointing at it."""
    folder = state_dir(python)
    sha = hashlib.sha256(PLANTED).hexdigest()
    record = json.loads((folder / "state.json").read_text())
    record["files"][GENERATOR]["original_sha256"] = sha
    script = (
        "import sys, pathlib; f = pathlib.Path(sys.argv[1]); "
        "(f / 'backups' / (sys.argv[2] + '.py')).write_bytes(sys.argv[3].encode()); "
        "t = f / 'state.new'; t.write_text(sys.argv[4]); t.replace(f / 'state.json')"
    )
    argv = [str(python), "-I", "-c", script, str(folder), sha, PLANTED.decode(), json.dumps(record)]
    if as_nobody:
        argv = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *argv]
    subprocess.run(argv, check=True, cwd="/", timeout=60)
