"""`ansible-test sanity` on the patcher.fleet collection (remote/ansible/), without docker and with
no network but the package index.

ansible-test runs each sanity test in a virtual environment of its own, made under
~/.ansible/test/venv with that test's pinned requirements, and bootstraps pip into each with a
get-pip script it downloads from a host of the Ansible project (not the package index), caching
it as ~/.ansible/test/cache/get_pip_<version>.py. Here HOME is a folder of patcher's cache, so the
environments are made once and reused, and that cached script is a stand-in written beforehand:
it installs the interpreter's bundled pip (`ensurepip`), then the pip release ansible-test asks
for, from the package index, as the real script would. Everything else is ansible-test's own.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
COLLECTION = ROOT / "remote" / "ansible"
NAMESPACE, NAME = "patcher", "fleet"
ANSIBLE_TEST = Path(sys.executable).parent / "ansible-test"

# What ansible-test runs as `python get_pip.py [pip options] pip==X [--no-setuptools] [--no-wheel]`
# in a new environment with no pip. ensurepip runs in a process of its own: it sets
# PIP_CONFIG_FILE=/dev/null in its process, which would hide the system's pip configuration (its
# index and certificates) from the install that follows.
GET_PIP_STAND_IN = """\
import subprocess
import sys

args = [a for a in sys.argv[1:] if a not in ("--no-setuptools", "--no-wheel")]
subprocess.run([sys.executable, "-m", "ensurepip", "--upgrade"], check=True, stdout=subprocess.DEVNULL)
sys.exit(subprocess.run([sys.executable, "-m", "pip", "install", *args]).returncode)
"""

# The tests whose environments are small and whose subject is the collection's documentation and
# metadata (validate-modules checks DOCUMENTATION, EXAMPLES and RETURN against the schema), plus
# ansible-test's own checks that need no environment: the suite's short form. The full run adds
# pylint, pep8 and import (ruff and mypy already cover the Python in tests/test_lint.py).
SHORT_FORM = (
    "action-plugin-docs",
    "ansible-doc",
    "validate-modules",
    "yamllint",
    "runtime-metadata",
    "ignores",
    "compile",
    "empty-init",
    "line-endings",
    "no-assert",
    "no-illegal-filenames",
    "no-smart-quotes",
    "shebang",
    "symlinks",
)


def pip_version() -> str:
    """The pip release ansible-test bootstraps into its environments."""
    from ansible_test._internal.python_requirements import get_venv_packages

    return get_venv_packages(SimpleNamespace(version=f"{sys.version_info[0]}.{sys.version_info[1]}"))["pip"]


def lay_out(work: Path) -> Path:
    """A copy of the collection where ansible-test looks for one: .../ansible_collections/NS/NAME."""
    tree = work / "ansible_collections" / NAMESPACE / NAME
    shutil.rmtree(tree, ignore_errors=True)
    shutil.copytree(COLLECTION, tree, ignore=shutil.ignore_patterns("__pycache__", "*.tar.gz"))
    return tree


def prepare_home(home: Path) -> Path:
    cache = home / ".ansible" / "test" / "cache"
    cache.mkdir(parents=True, exist_ok=True)
    (cache / f"get_pip_{pip_version().replace('.', '_')}.py").write_text(GET_PIP_STAND_IN)
    return home


def run_sanity(
    work: Path, home: Path, tests: tuple[str, ...] = (), timeout: float = 1800
) -> subprocess.CompletedProcess:
    """`ansible-test sanity --python X.Y [--test T ...]` on a fresh copy of the collection; its output."""
    tree = lay_out(work)
    python = f"{sys.version_info[0]}.{sys.version_info[1]}"
    args = [str(ANSIBLE_TEST), "sanity", "--python", python, "--color", "no"]
    for test in tests:
        args += ["--test", test]
    env = {"HOME": str(prepare_home(home)), "PATH": f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin"}
    return subprocess.run(args, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout)
