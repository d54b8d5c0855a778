"""The patch declarations as data, kept on disk, so a run that transforms nothing never imports
libcst or a patch module.

Importing the patch modules costs about as much as a whole no-op apply should (they import
libcst to define their codemods); what `status`, `plan` and a no-op `apply` need from them is
declarations: ids, targets, version conditions, facts, examples. The first run after any change
to the patch package (or the model) writes them to `$PATCHER_CACHE/declarations/<digest>.json`,
the digest covering every byte they come from; later runs read that file and refer to each
codemod by module and name (`LazyCodemod`), imported on first use. Decoding accepts the model's
own dataclasses only.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib
import importlib.util
import json
import re
import sys
from pathlib import Path
from typing import Any

from .. import __version__, model
from ..cache import cache_root, trusted, write_cache_file

_TYPES = {
    cls.__name__: cls
    for cls in (
        model.TargetFile,
        model.Fact,
        model.Edit,
        model.Example,
        model.AttributeCall,
        model.Symptom,
        model.LeaveOneOut,
        model.Patch,
    )
}


class LazyCodemod:
    """Stands for a codemod class until it is called (or an attribute of it is read)."""

    def __init__(self, module: str, qualname: str) -> None:
        self.__module__ = module
        self.__qualname__ = qualname
        self.__name__ = qualname.rpartition(".")[2]
        self._resolved: type | None = None

    def resolve(self) -> type:
        if self._resolved is None:
            from ..codemod import PatchCodemod

            target: Any = importlib.import_module(self.__module__)
            for part in self.__qualname__.split("."):
                target = getattr(target, part)
            if not (isinstance(target, type) and issubclass(target, PatchCodemod)):
                raise TypeError(f"{self.__module__}.{self.__qualname__} is not a patch's codemod")
            self._resolved = target
        return self._resolved

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.resolve()(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name == "_resolved":
            raise AttributeError(name)
        return getattr(self.resolve(), name)

    def __eq__(self, other: object) -> bool:
        return (self.__module__, self.__qualname__) == (
            getattr(other, "__module__", None),
            getattr(other, "__qualname__", None),
        )

    def __hash__(self) -> int:
        return hash((self.__module__, self.__qualname__))

    def __repr__(self) -> str:
        return f"<codemod {self.__module__}.{self.__qualname__} (not imported yet)>"


# `from patcher.shared_states import ...`, `from patcher import shapes as m`: a controller module
# whose values a patch declares with (the generated source of v21 and v26, for one)
_CONTROLLER_IMPORT = re.compile(r"^\s*from patcher(?:\.(?P<module>[\w.]+))? import \(?(?P<names>[\w ,]*)", re.MULTILINE)


def controller_modules(sources: dict[Path, bytes], controller_dir: Path) -> dict[Path, bytes]:
    """The files (and bytes) of the controller's modules that sources import, and those they
    import in turn; each file is read once."""
    found: dict[Path, bytes] = {}
    pending = list(sources.values())
    while pending:
        text = pending.pop().decode("utf-8")
        for match in _CONTROLLER_IMPORT.finditer(text):
            if match["module"]:
                candidates = [match["module"]]
            else:  # from patcher import shapes as m, model
                candidates = [name.split()[0] for name in match["names"].split(",") if name.strip()]
            for name in candidates:
                path = controller_dir.joinpath(*name.split(".")).with_suffix(".py")
                if path not in found and path.is_file():
                    found[path] = path.read_bytes()
                    pending.append(found[path])
    return found


def package_digest(package_dir: Path, controller_dir: Path | None = None) -> str:
    """Every byte a declaration can come from: the patch package's files, the controller modules
    they import (controller_dir: patcher's own by default), the model, versions."""
    controller_dir = controller_dir or Path(model.__file__).parent
    sources = {path: path.read_bytes() for path in sorted(package_dir.rglob("*.py"))}
    controller = controller_modules(sources, controller_dir)
    model_file = controller_dir / "model.py"
    model_bytes = controller.pop(model_file, None) or model_file.read_bytes()  # the model last
    digest = hashlib.sha256(f"{__version__}\0{sys.version_info[:2]}\0".encode())
    for path, data in [*sources.items(), *sorted(controller.items()), (model_file, model_bytes)]:
        digest.update(str(path.relative_to(path.parent.parent)).encode() + b"\0" + data + b"\0")
    return digest.hexdigest()


def index_path(package_dir: Path) -> Path:
    return cache_root() / "declarations" / f"{package_digest(package_dir)}.json"


def encode(value: Any) -> Any:
    if isinstance(value, type):
        return {"@codemod": [value.__module__, value.__qualname__]}
    if isinstance(value, LazyCodemod):
        return {"@codemod": [value.__module__, value.__qualname__]}
    if dataclasses.is_dataclass(value):
        return {
            "@": type(value).__name__,
            **{f.name: encode(getattr(value, f.name)) for f in dataclasses.fields(value)},
        }
    if isinstance(value, tuple):
        return {"@tuple": [encode(v) for v in value]}
    if isinstance(value, dict):
        return {"@dict": {k: encode(v) for k, v in value.items()}}
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    raise TypeError(f"cannot keep {type(value).__name__} in the declaration index")


@functools.cache
def _declares_class(module: str, qualname: str) -> bool:
    """Whether `module` is a patch module of a set in use and its source defines the top-level class
    `qualname` (read, not imported: the index exists so that no patch module is imported)."""
    from .sets import active_sets

    package, _, name = module.rpartition(".")
    if package not in {s.package for s in active_sets()} or not name.isidentifier() or not qualname.isidentifier():
        return False
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return False
    try:
        source = (Path(next(iter(spec.submodule_search_locations))) / f"{name}.py").read_text(encoding="utf-8")
    except OSError:
        return False
    return re.search(rf"^class {qualname}\b", source, re.MULTILINE) is not None


def decode(value: Any) -> Any:
    if isinstance(value, dict):
        if "@codemod" in value:
            module, qualname = value["@codemod"]
            if not _declares_class(module, qualname):  # only the codemods of the sets in use, ever
                raise ValueError(f"the index names {module}.{qualname}, which no patch module defines as a class")
            return LazyCodemod(module, qualname)
        if "@tuple" in value:
            return tuple(decode(v) for v in value["@tuple"])
        if "@dict" in value:
            return {k: decode(v) for k, v in value["@dict"].items()}
        cls = _TYPES[value["@"]]  # KeyError: not one of the model's types
        return cls(**{k: decode(v) for k, v in value.items() if k != "@"})
    if isinstance(value, list):
        raise ValueError("lists are not part of the declaration index")  # noqa: TRY004 - read_index takes any of its errors as a stale index
    return value


def read_index(path: Path) -> tuple[model.Patch, ...] | None:
    if not trusted(path):
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        patches = tuple(decode(item) for item in data["patches"])
    except (OSError, ValueError, KeyError, TypeError):
        return None  # absent or damaged: the patch modules are imported and it is written again
    if not all(isinstance(p, model.Patch) for p in patches):
        return None
    return patches


def write_index(path: Path, patches: tuple[model.Patch, ...]) -> None:
    """An index that cannot be written only makes the next run slower."""
    write_cache_file(path, json.dumps({"patches": [encode(p) for p in patches]}).encode("utf-8"))
