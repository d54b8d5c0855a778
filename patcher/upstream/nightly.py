"""Nightly version strings the index does not serve: selection only, on fabricated metadata.

For each nightly string a folder is made with installed-distribution metadata only (vllm at the
nightly version, the patched distribution at the oldest release the patches cover), the real
agent detects the versions there as it would in a target (in a subprocess whose sys.path is that
folder alone), and the patches are selected on what it found. Nothing can be read from a
nightly's sources, so its facts are bounded by the releases around it: a nightly of X.Y.Z is
newer than every release before X.Y.Z and older than X.Y.Z. A gate that leaves out a nightly
newer than a release where the fact already holds, or selects one older than a release where
it does not hold yet, is wrong. A nightly older than every release read is not judged.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from packaging.version import Version

from ..model import Patch
from ..plan.selection import condition_holds, select_patches
from ..transport.local import LocalTransport
from .gates import GateCheck

# The shapes api-drift.md records (a nightly of 0.11.1 with a CUDA label; one of 0.16.0).
DEFAULT_NIGHTLIES = ("0.11.1rc6.dev141+g38f225c2a.cu129", "0.16.0rc2.dev45+g1a2b3c4")


def fabricate_site(root: Path, versions: Mapping[str, str]) -> Path:
    """A folder with only dist-info metadata: `<name>-<version>.dist-info/{METADATA,top_level.txt,RECORD}`."""
    key = re.sub(r"[^A-Za-z0-9.+_-]", "_", "-".join(f"{n}={v}" for n, v in sorted(versions.items())))
    site = root / "nightly" / key
    for name, version in versions.items():
        info = site / f"{name.replace('-', '_')}-{version}.dist-info"
        info.mkdir(parents=True, exist_ok=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        (info / "top_level.txt").write_text(f"{name.replace('-', '_')}\n")
        (info / "RECORD").write_text(f"{info.name}/METADATA,,\n{info.name}/top_level.txt,,\n{info.name}/RECORD,,\n")
    return site


class FabricatedTarget(LocalTransport):
    """This interpreter, without site-packages, seeing only the fabricated folder."""

    def __init__(self, python: str, site: Path) -> None:
        super().__init__(python)
        self.site = site

    @property
    def label(self) -> str:
        return f"fabricated metadata in {self.site}"

    def command(self) -> list[str]:
        return ["env", f"PYTHONPATH={self.site}", self.python, "-S", *super().command()[1:]]


@dataclass
class NightlyCheck:
    version: str
    detected: dict[str, str] = field(default_factory=dict)  # name -> version the agent found
    selected: dict[str, list[str]] = field(default_factory=dict)  # patch id -> selected edit names
    reasons: dict[str, str] = field(default_factory=dict)  # patch id -> why (not) selected
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return {
            "version": self.version,
            "detected": self.detected,
            "selected": self.selected,
            "reasons": self.reasons,
            "problems": self.problems,
            "notes": self.notes,
        }


def detect(python: str, site: Path, names: Sequence[str]) -> dict[str, str]:
    with FabricatedTarget(python, site) as target:
        answer = target.call({"op": "facts", "names": list(names), "files": []}, timeout=60)
    return {name: info["version"] for name, info in answer["distributions"].items()}


def check_nightly(
    nightly: str,
    patches: Sequence[Patch],
    others: Mapping[str, str],
    checks: Sequence[GateCheck],
    cache: Path,
    python: str,
    distribution: str = "vllm",
) -> NightlyCheck:
    """Select on fabricated metadata; compare each checked gate with the releases around the nightly."""
    result = NightlyCheck(nightly)
    Version(nightly)  # InvalidVersion for a string that is not PEP 440
    site = fabricate_site(cache, {distribution: nightly, **others})
    result.detected = detect(python, site, [distribution, *others])
    if result.detected.get(distribution) != nightly:
        result.problems.append(
            f"nightly {nightly}: the agent detected {distribution} {result.detected.get(distribution)} "
            "on the fabricated metadata"
        )
    for patch_id, selection in select_patches(patches, result.detected).items():
        result.selected[patch_id] = selection.edit_names if selection.selected else []
        result.reasons[patch_id] = selection.reason
    base = Version(Version(nightly).base_version)
    judged = [c for c in checks if c.fact is not None and c.fact.distribution == distribution and c.holds]
    if judged and not any(Version(r) < base for c in judged for r in c.holds):
        # older than every release read (`--since vllm=0.33.0` and a nightly of 0.11.1): nothing read
        # says what it has, and a fact read absent later (one vLLM removed since) says nothing of it
        result.notes.append(
            f"nightly {nightly} is older than every {distribution} release read: its gates are not judged"
        )
        return result
    for check in judged:
        assert check.fact is not None  # judged: those with a fact
        picked = not check.gate or condition_holds(check.gate, nightly)
        older = [r for r in check.holds if Version(r) < base]
        newer = [r for r in check.holds if Version(r) >= base]
        label = f"{check.patch_id} {check.edit}: gate {distribution}{check.gate}"
        if older and check.holds[older[-1]].holds and not picked:
            result.problems.append(
                f"{label} leaves out nightly {nightly}, newer than {older[-1]} where the fact already holds "
                f"({check.fact.describe()})"
            )
        elif newer and not check.holds[newer[0]].holds and picked and not any(check.holds[r].holds for r in older):
            result.problems.append(
                f"{label} selects nightly {nightly}, older than {newer[0]} where the fact does not hold yet "
                f"({check.fact.describe()})"
            )
        elif not picked and older and not check.holds[older[-1]].holds and newer and check.holds[newer[0]].holds:
            result.notes.append(
                f"{check.patch_id} {check.edit}: not selected on {nightly}, a pre-release of {base} "
                f"(the fact first holds in {newer[0]}; whether this nightly has it cannot be read)"
            )
    return result
