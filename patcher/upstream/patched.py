"""The patched files check-upstream binds: for a release of the patched distribution and a
release of vLLM, the pristine file transformed by the patches (and edits) `apply` would select
for that pair of versions: the same selection, the same codemods, the same canonical order.

Patches gated on transformers or torch (v16-v18) are selected per release of those that the vLLM
release allows (its Requires-Dist): one file per distinct selection, with the transformers and
torch releases it is written for (`where`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import product
from pathlib import Path

from ..model import Patch, TargetFile
from ..plan.selection import condition_holds, select_patches
from ..transform.transforms import shared_transforms, transform_source
from .sources import ReleaseFiles


@dataclass(frozen=True)
class Variant:
    """One patched file: what `apply` writes for `versions` (and each release in `where`)."""

    path: str
    versions: tuple[tuple[str, str], ...]  # (("speculators", "0.3.0"), ("vllm", "0.17.0"))
    patches: tuple[str, ...]  # the ids selected (in canonical order)
    code: str
    attribute_calls: tuple[dict, ...]
    anchor_missing: tuple[str, ...] = ()  # selected patches whose codemod found no anchor (drift)
    # (("torch", ("2.10.0",)), ("transformers", ("4.57.6", ...))): the releases of the distributions
    # the vLLM release allows for which apply writes this same file; empty when none were known
    where: tuple[tuple[str, tuple[str, ...]], ...] = ()

    def releases_of(self, distribution: str) -> tuple[str, ...]:
        return dict(self.where).get(distribution, ())


def variants(
    patches: Sequence[Patch],
    distribution: str,
    version: str,
    files: ReleaseFiles,
    vllm_versions: Sequence[str],
    cache: Path | None = None,
    allowed: Mapping[str, Mapping[str, Sequence[str]]] | None = None,
    targets: Sequence[TargetFile] = (),
) -> dict[str, list[Variant]]:
    """vLLM release -> the patched files of `distribution` `version` there: the files at least one
    selected patch changes or is meant for, and each of `targets` (pristine where nothing selected
    changes it) when some patch is meant for this release. `allowed`: vLLM release -> distribution
    (transformers, torch) -> its releases that vLLM release allows."""
    groups: dict[str, list[Patch]] = {}
    for patch in patches:
        if patch.target.distribution == distribution:
            groups.setdefault(patch.target.path, []).append(patch)
    meant = any(condition_holds(p.requires.get(distribution, ""), version) for p in patches)
    pristine = {t.path for t in targets if t.distribution == distribution} if meant else set()
    if meant:
        for target in targets:
            if target.distribution == distribution:
                groups.setdefault(target.path, [])
    sources = {path: files.read(path) for path in groups}
    out: dict[str, list[Variant]] = {}
    with shared_transforms(persist=cache):
        for vllm in vllm_versions:
            others = {d: list(v) for d, v in sorted((allowed or {}).get(vllm, {}).items()) if v}
            # one selection per combination of the other distributions' releases (one release per
            # class of releases every condition on that distribution treats alike), grouped per file
            classes = {d: _alike(patches, d, releases) for d, releases in others.items()}
            found: dict[tuple[str, tuple], dict[str, set[str]]] = {}
            for combination in product(*classes.values()):
                versions = {distribution: version, "vllm": vllm, **{d: c[0] for d, c in zip(others, combination)}}
                chosen = select_patches(patches, versions)
                for path, group in groups.items():
                    key = tuple(
                        (p.id, tuple(e.name for e in chosen[p.id].edits)) for p in group if chosen[p.id].selected
                    )
                    where = found.setdefault((path, key), {d: set() for d in others})
                    for dist, members in zip(others, combination):
                        where[dist].update(members)
            for (path, key), where in found.items():
                source = sources[path]
                chosen_edits = dict(key)
                steps = [
                    (p, [e for e in p.edits if e.name in chosen_edits[p.id]])
                    for p in groups[path]
                    if p.id in chosen_edits
                ]
                if source is None or (not steps and path not in pristine):
                    continue
                result = transform_source(source, steps, filename=path) if steps else None
                calls = tuple(
                    {"receiver": c.receiver, "method": c.method, "implementation": c.implementation}
                    for p, _ in steps
                    for c in p.attribute_calls
                )
                missing = tuple(o.patch_id for o in result.outcomes if o.outcome == "anchor-missing") if result else ()
                out.setdefault(vllm, []).append(
                    Variant(
                        path,
                        tuple(sorted({distribution: version, "vllm": vllm}.items())),
                        tuple(p.id for p, _ in steps),
                        result.result if result else source,
                        calls,
                        missing,
                        tuple((d, tuple(sorted(r, key=_key))) for d, r in sorted(where.items())),
                    )
                )
    return out


def _alike(patches: Sequence[Patch], distribution: str, releases: Sequence[str]) -> list[list[str]]:
    """`releases` grouped by what every condition on `distribution` (a patch's requires, an edit's
    when) says of them: the selection is the same for each release of a group."""
    specs = sorted(
        {p.requires[distribution] for p in patches if distribution in p.requires}
        | {e.when[distribution] for p in patches for e in p.edits if distribution in e.when}
    )
    groups: dict[tuple[bool, ...], list[str]] = {}
    for release in releases:
        groups.setdefault(tuple(condition_holds(spec, release) for spec in specs), []).append(release)
    return list(groups.values())


def _key(version: str):
    from packaging.version import Version

    return Version(version)
