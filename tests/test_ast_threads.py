"""check-upstream parses release sources from several threads. On CPython 3.11 (3.11.2 and
3.11.7 here, the interpreters `.ci/bootstrap` picks) `ast.parse` from several threads at once
fails with `SystemError: AST constructor recursion depth mismatch` whenever a thread switch
happens while a tree is built: a finalizer the garbage collector runs in the middle of the
parse is enough. These tests make that happen on purpose (cyclic garbage with finalizers, a
tiny switch interval) and check that patcher's parses never meet it."""

from __future__ import annotations

import sys
import sysconfig
import threading
from pathlib import Path

import pytest

from patcher.upstream.facts import SourceTree

STDLIB = Path(sysconfig.get_paths()["stdlib"])
MODULES = ["dataclasses", "ast", "shlex", "textwrap"]


class StdlibFiles:
    """Real Python sources (the standard library's) behind the `Files` protocol SourceTree reads."""

    def read(self, path: str) -> str | None:
        try:
            return (STDLIB / path).read_text(encoding="utf-8")
        except FileNotFoundError:
            return None


class _Finalized:
    def __del__(self) -> None:
        pass


def _stress(parse_all, threads: int = 4, rounds: int = 2) -> list[str]:
    """Run `parse_all` in several threads while the collector keeps finding cyclic garbage with
    finalizers, thread switches as often as the interpreter allows; the SystemErrors seen."""
    errors: list[str] = []

    def work() -> None:
        for _ in range(rounds):
            garbage = _Finalized()
            garbage.self = garbage  # a cycle: only the collector frees it, running __del__ mid-parse
            del garbage
            try:
                parse_all()
            except SystemError as exc:
                errors.append(str(exc))
                return

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        workers = [threading.Thread(target=work) for _ in range(threads)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
    finally:
        sys.setswitchinterval(interval)
    return errors


def test_source_trees_parse_from_many_threads_without_the_311_ast_race():
    files = StdlibFiles()

    def parse_all() -> None:
        tree = SourceTree(files, "stdlib")  # a fresh tree: every module is parsed again
        for name in MODULES:
            assert tree.module(name) is not None, name

    assert _stress(parse_all) == []


@pytest.mark.skipif(sys.version_info[:2] != (3, 11), reason="the race is CPython 3.11's")
def test_the_stress_does_reproduce_the_race_with_bare_ast_parse():
    """Without patcher's lock the same stress fails on this interpreter: the test above would see it."""
    import ast

    sources = [StdlibFiles().read(f"{name}.py") for name in MODULES]

    def parse_all() -> None:
        for source in sources:
            ast.parse(source)

    for _ in range(10):  # a race: usually the first attempt shows it
        if _stress(parse_all):
            return
    pytest.fail("ast.parse from several threads never failed here: this interpreter may not have the race")


def test_binding_patched_code_from_many_threads_without_the_311_ast_race():
    """check-upstream binds each release's patched files in its own thread: bind_file parses the
    patched code, so it must take the same lock (it once called ast.parse directly, and a fresh
    clone's `.ci/run` failed three binding tests with the SystemError)."""
    from patcher.upstream.binding import bind_file

    files = StdlibFiles()
    code = "".join(files.read(f"{name}.py") or "" for name in MODULES) + "from shlex import split\nsplit('a b')\n"

    def parse_all() -> None:
        binding = bind_file(code, "mixed.py", SourceTree(files, "stdlib"), "stdlib", prefixes=("shlex",))
        assert binding.checked, binding

    assert _stress(parse_all) == []


def test_every_parse_in_patcher_takes_the_lock():
    """The one place patcher's controller parses Python with `ast` is facts.parse (the lock)."""
    root = Path(__file__).resolve().parent.parent / "patcher"
    bare = [
        f"{path.relative_to(root.parent)}:{number}"
        for path in sorted(root.rglob("*.py"))
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if "ast.parse(" in line and not line.lstrip().startswith("#")
    ]
    assert bare == ["patcher/upstream/facts.py:29"], bare
