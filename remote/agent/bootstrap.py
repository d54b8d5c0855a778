"""How the agent reaches a target interpreter, without a file there.

The controller runs `python -c BOOTSTRAP` and writes {"agent": TEXTS, "mark": ..., ...} as the
first line of its input, where TEXTS maps each module the agent may import (this package and the
modules of patcher's it shares, patcher.core.errors and .syntax) to (is a package, its source text). BOOTSTRAP runs this
module's text, whose start() puts a finder of those texts first on sys.meta_path and imports
the agent from it: every module runs under its own name (patcher.remote.agent.state, ...), as in the
controller, compiled from memory. No folder is put on sys.path for it, nothing is written, and a
`patcher` found on the target's own path is never used (the finder comes first, and its packages
have no folder to search). A bundle installs the same finder for the texts it carries.
"""

import os
import sys

# The first line is read before the version check so that even an old Python's refusal carries
# the mark (and it is read in a way Python 2 runs too). `-c` puts the current folder first on
# sys.path (as ''): it goes before the first import (sys is built in), so a json.py planted in
# /tmp or the login home never runs.
BOOTSTRAP = (
    "import sys\n"
    "if sys.path[:1]==['']:del sys.path[0]\n"
    "import json\n"
    "d=json.loads(getattr(sys.stdin,'buffer',sys.stdin).readline().decode('utf-8'))\n"
    "if sys.version_info<(3,9):\n"
    " print(d.get('mark','')+' '+json.dumps({'ok':False,'error':{'kind':'python-too-old','message':"
    "'the target Python is %d.%d; patcher needs 3.9 or newer' % sys.version_info[:2]}}));sys.exit(0)\n"
    "ns={'__name__':'patcher_agent_bootstrap'}\n"
    "exec(compile(d['agent']['patcher.remote.agent.bootstrap'][1],'<patcher.remote.agent.bootstrap>','exec'),ns)\n"
    "ns['start'](d)\n"
)

# The modules of patcher's the agent imports (`patcher.core.errors`, `.syntax`), named from
# `patcher`: sent with it.
AGENT_SHARED_MODULES = ("core.errors", "core.syntax")

# In an agent (or a bundle): the texts it was started with, which its verification passes on to
# the fresh interpreter it starts. Empty in the controller, which reads them from its files.
TEXTS: dict = {}
_FROM_FILES: dict = {}


class ModuleTexts:
    """A finder and loader (importlib's protocols) for module texts held in memory."""

    def __init__(self, texts: dict) -> None:
        self.texts = texts

    def find_spec(self, name: str, path=None, target=None):
        entry = self.texts.get(name)
        if entry is None:
            return None  # not ours: the target's own path, as usual
        from importlib.machinery import ModuleSpec

        # A package's submodules are searched in no folder (is_package: an empty search path).
        # (importlib.abc.Loader is not subclassed: importing it costs more than the whole protocol)
        return ModuleSpec(name, self, origin=f"<{name}>", is_package=bool(entry[0]))  # type: ignore[arg-type]

    def create_module(self, spec):
        return None  # the default module object

    def exec_module(self, module) -> None:
        name = module.__spec__.name
        exec(compile(self.texts[name][1], f"<{name}>", "exec"), module.__dict__)  # noqa: S102 - the agent's own text

    def get_source(self, name: str) -> str:
        return self.texts[name][1]  # what a traceback shows


def install(texts: dict) -> None:
    """Make `texts` importable under their names, before anything on the target's own path."""
    import importlib

    sys.meta_path.insert(0, ModuleTexts(texts))
    # This module as a module of the texts (BOOTSTRAP, or a bundle, ran a copy of its text to get here).
    importlib.import_module("patcher.remote.agent.bootstrap").TEXTS.update(texts)


def start(first: dict) -> None:
    """BOOTSTRAP's entry: install the texts, then serve the request or the session."""
    import importlib

    install(first["agent"])
    importlib.import_module("patcher.remote.agent.session").main(first)


def read_texts(shared_modules=()) -> dict:
    """The controller's side: this package's modules, the agent's shared ones and the further
    `shared_modules` of patcher's (named from `patcher`, e.g. "plan.planning"), read from their files. `patcher` and the packages that
    hold a shared module are sent empty: their own __init__ files belong to the controller."""

    def read(path: str) -> str:
        with open(path, encoding="utf-8") as fh:
            return fh.read()

    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    # Installed, this package is patcher.remote.agent; in a checkout it is remote/agent/ beside
    # patcher/ (pyproject maps it): the shared modules are found by their names, not by folders.
    texts: dict = {"patcher": [True, ""], "patcher.remote": [True, ""]}
    for entry in sorted(os.listdir(here)):
        if entry.endswith(".py"):
            stem = entry[: -len(".py")]
            name = "patcher.remote.agent" if stem == "__init__" else "patcher.remote.agent." + stem
            texts[name] = [stem == "__init__", read(os.path.join(here, entry))]
    for dotted in dict.fromkeys((*AGENT_SHARED_MODULES, *shared_modules)):
        package, stem = dotted.rsplit(".", 1)
        texts.setdefault("patcher." + package, [True, ""])
        spec = importlib.util.find_spec("patcher." + dotted)
        assert spec is not None and spec.origin is not None, dotted
        texts["patcher." + dotted] = [False, read(spec.origin)]
    return texts


def module_texts() -> dict:
    """The agent's texts, as they are sent to a target: in an agent, those it was started with;
    in the controller, its files (read once)."""
    if TEXTS:
        return TEXTS
    if not _FROM_FILES:
        _FROM_FILES.update(read_texts())
    return _FROM_FILES
