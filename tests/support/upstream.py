"""The package index and upstream cache the check-upstream tests read: pinned to INDEX_AS_OF, so a
release published later changes no answer; a test module skips when the index cannot be reached."""

from __future__ import annotations

from pathlib import Path

import pytest

from patcher.upstream.index import load_index
from patcher.upstream.wheels import IndexUnreachable
from workbench.release_files import INDEX_AS_OF, cache_dir


def upstream_cache() -> Path:
    return cache_dir() / "upstream"


def pinned_index(distributions: list[str]):
    """The index of these distributions as it stood at INDEX_AS_OF (skips the test if unreachable)."""
    try:
        return load_index(distributions).until(INDEX_AS_OF)
    except IndexUnreachable as error:
        pytest.skip(f"package index unreachable: {error}")
