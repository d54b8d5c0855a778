"""The staged GPU wheel lists (bench/gpu/vllm-*.txt, read by bench/gpu/fetch.py): each name pinned
once (0.20.0's list pinned opentelemetry-api twice, 1.39.1 and 1.45.2, and `pip download -r` refuses
such a list whole: ResolutionImpossible), and what the carried fastapi and opentelemetry wheels
require met by the list's own pins (their METADATA, read 2026-12-05 for issue 42; typing-extensions
is the GPU image's). Without opentelemetry-api, `from vllm import LLM` fails on the GPU machine
("No module named 'opentelemetry'": fastapi 0.142's telemetry imports it), and with it the
benchmark's vLLM baselines."""

from __future__ import annotations

from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

LISTS = sorted((Path(__file__).resolve().parent.parent / "bench" / "gpu").glob("vllm-*.txt"))

# Requires-Dist of the carried wheels that import or need opentelemetry (python 3.12, no extras)
REQUIRES = {
    ("fastapi", "0.142.2"): ["opentelemetry-api>=1.44.0"],
    ("opentelemetry-api", "1.45.2"): [],
    ("opentelemetry-semantic-conventions", "0.66b2"): ["opentelemetry-api==1.45.2"],
    ("opentelemetry-sdk", "1.45.2"): ["opentelemetry-api==1.45.2", "opentelemetry-semantic-conventions==0.66b2"],
    ("opentelemetry-semantic-conventions-ai", "0.5.1"): [
        "opentelemetry-sdk<2,>=1.38.0",
        "opentelemetry-semantic-conventions>=0.59b0",
    ],
}


def pins(listing: Path) -> list[tuple[str, str]]:
    lines = [line.strip() for line in listing.read_text(encoding="utf-8").splitlines()]
    return [
        (canonicalize_name(name), version)
        for name, _, version in (line.partition("==") for line in lines if line and not line.startswith("#"))
    ]


def test_there_are_lists():
    assert {p.name for p in LISTS} >= {"vllm-0.20.0.txt", "vllm-0.26.0.txt", "vllm-0.34.0.txt"}


@pytest.mark.parametrize("listing", LISTS, ids=lambda p: p.stem)
def test_each_name_is_pinned_once(listing: Path):
    names = [name for name, _ in pins(listing)]
    assert not {n for n in names if names.count(n) > 1}, f"{listing.name} pins these more than once"


@pytest.mark.parametrize("listing", LISTS, ids=lambda p: p.stem)
def test_the_opentelemetry_that_fastapi_imports_is_carried_and_its_requirements_met(listing: Path):
    pinned = dict(pins(listing))
    assert "opentelemetry-api" in pinned, f"{listing.name}: no opentelemetry-api (`from vllm import LLM` fails)"
    known = {name: version for name, version in pinned.items() if (name, version) in REQUIRES}
    assert "opentelemetry-api" in known, f"{listing.name}: opentelemetry-api {pinned['opentelemetry-api']} unchecked"
    for name, version in known.items():
        for requirement in map(Requirement, REQUIRES[(name, version)]):
            wanted = canonicalize_name(requirement.name)
            assert wanted in pinned, f"{listing.name}: {name} {version} requires {requirement}, not carried"
            assert requirement.specifier.contains(pinned[wanted], prereleases=True), (
                f"{listing.name}: {name} {version} requires {requirement}; the list pins {pinned[wanted]}"
            )
