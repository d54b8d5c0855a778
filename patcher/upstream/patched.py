"""The patched files check-upstream binds: for a release of the patched distribution and a
release of vLLM, the pristine file transformed by the patches (and edits) `apply` would select
for that pair of versions: the same selection, the same codemods, the same canonical order."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..model import Patch
from ..selection import select_patches
from ..transforms import shared_transforms, transform_source
from .sources import ReleaseFiles


@dataclass(frozen=True)
class Variant:
    """One patched file: what `apply` writes for `versions`."""

    path: str
    versions: tuple[tuple[str, str], ...]  # (("speculators", "0.3.0"), ("vllm", "0.17.0"))
    patches: tuple[str, ...]  # the ids selected (in canonical order)
    code: str
    attribute_calls: tuple[dict, ...]
    anchor_missing: tuple[str, ...] = ()  # selected patches whose codemod found no anchor (drift)


def variants(
    patches: Sequence[Patch], distribution: str, version: str, files: ReleaseFiles, vllm_versions: Sequence[str],
    cache: Path | None = None,
) -> dict[str, list[Variant]]:
    """vLLM release -> the patched files of `distribution` `version` there (only files that at
    least one selected patch changes or is meant for)."""
    targets: dict[str, list[Patch]] = {}
    for patch in patches:
        if patch.target.distribution == distribution:
            targets.setdefault(patch.target.path, []).append(patch)
    sources = {path: files.read(path) for path in targets}
    out: dict[str, list[Variant]] = {}
    with shared_transforms(persist=cache):
        for vllm in vllm_versions:
            versions = {distribution: version, "vllm": vllm}
            chosen = select_patches(patches, versions)
            for path, group in targets.items():
                source = sources[path]
                steps = [(p, chosen[p.id].edits) for p in group if chosen[p.id].selected]
                if source is None or not steps:
                    continue
                result = transform_source(source, steps, filename=path)
                calls = tuple(
                    {"receiver": c.receiver, "method": c.method, "implementation": c.implementation}
                    for p, _ in steps for c in p.attribute_calls
                )  # fmt: skip
                missing = tuple(o.patch_id for o in result.outcomes if o.outcome == "anchor-missing")
                out.setdefault(vllm, []).append(
                    Variant(path, tuple(sorted(versions.items())), tuple(p.id for p, _ in steps), result.result,
                            calls, missing)
                )  # fmt: skip
    return out
