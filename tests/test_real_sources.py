"""The patches against the real released files: speculators 0.3.0 (what they patch) and 0.4.0
(upstream's own fix, where they must find their work already done).

The wheels are fetched once with pip into a cache (see tests/support/releases.py); without
network access and without a filled cache these tests are skipped, naming the pip error.
"""

from __future__ import annotations

import hashlib
import itertools
from pathlib import Path

import pytest

from patcher.patches.targets import EAGLE3_CORE, GENERATOR, WORKER
from patcher.patchset.registry import load_patches
from patcher.transform.transforms import transform_source
from tests.support.releases import DownloadFailed, release_files

# From /work/shared/design/api-drift.md: the pristine speculators 0.3.0 target files.
PRISTINE_0_3_0_SHA256 = {
    GENERATOR.path: "514f3f585afa335b558f98c1954a1dc5b804003cd7b08aeeac7c4cd333cd5106",
    WORKER.path: "e9a95cf6422fa3e3efb3edb658e4898ba23ee141619f58d7096ea7fbde8af548",
    EAGLE3_CORE.path: "adec1633736c5c3f9d9cef895e48576ebbed6e43ca74e4d7e0af77388f876dd6",
}

PATCHES = load_patches()
# every file a patch rewrites, with its patches in canonical order
BY_TARGET = {
    target: tuple(p for p in PATCHES if p.target == target) for target in dict.fromkeys(p.target for p in PATCHES)
}
GENERATOR_PATCHES, WORKER_PATCHES = BY_TARGET[GENERATOR], BY_TARGET[WORKER]
TARGET_PATHS = tuple(sorted({GENERATOR.path, WORKER.path} | {p.target.path for p in PATCHES}))


def _subsets(patches):
    """Subsets, each in canonical order (combinations keep the order of their input): every one
    and every pair (each interaction), every all-but-one (each leave-one-out the end-to-end test
    applies) and all of them; test_sampled_subsets_apply_and_compile draws others."""
    n = len(patches)
    sizes = sorted({1, 2, n - 1, n} & set(range(1, n + 1)))
    return [subset for size in sizes for subset in itertools.combinations(patches, size)]


SUBSETS = [
    pytest.param(target, subset, id=f"{Path(target.path).stem}:" + "+".join(p.short_id for p in subset))
    for target, patches in BY_TARGET.items()
    for subset in _subsets(patches)
]

# What each patch's codemods say on the files of the release just past its `requires`
# (Patch.next_release: speculators 0.4.0, upstream's own fix where fixed_in says so) is declared by
# the patch itself: Patch.on_fixed_in. Patches never run there; this checks they recognise
# upstream's fix as their own, or find the shape they rewrite gone and leave the file alone
# (anchor-missing). The reasons are in each patch module, beside its on_fixed_in.
EXPECTED_ON_NEXT = {p.id: (p.next_release, p.on_fixed_in) for p in PATCHES if p.on_fixed_in}


def _release(version: str) -> dict[str, str]:
    try:
        files = release_files("speculators", version, TARGET_PATHS)
    except DownloadFailed as error:
        pytest.skip(f"speculators {version} not available: {error}")
    return {path: file.read_text(encoding="utf-8") for path, file in files.items()}


@pytest.fixture(scope="session")
def speculators_0_3_0() -> dict[str, str]:
    return _release("0.3.0")


def run(source, patches, filename):
    return transform_source(source, [(p, p.edits) for p in patches], filename=filename)


_FIRST_PASS: dict = {}


def run_cached(source, patches, filename):
    """The first pass of a subset, shared by the applies- and the idempotence test."""
    key = (hashlib.sha256(source.encode()).hexdigest(), tuple(p.id for p in patches), filename)
    if key not in _FIRST_PASS:
        _FIRST_PASS[key] = run(source, patches, filename)
    return _FIRST_PASS[key]


@pytest.mark.parametrize("path", sorted(PRISTINE_0_3_0_SHA256))
def test_pristine_0_3_0_files_are_the_known_ones(speculators_0_3_0, path):
    digest = hashlib.sha256(speculators_0_3_0[path].encode("utf-8")).hexdigest()
    assert digest == PRISTINE_0_3_0_SHA256[path]


@pytest.mark.parametrize("patch", PATCHES, ids=[p.id for p in PATCHES])
def test_each_patch_applies_to_0_3_0_and_compiles(speculators_0_3_0, patch):
    source = speculators_0_3_0[patch.target.path]
    result = run(source, [patch], patch.target.path)
    outcome = result.outcome(patch.id)
    assert outcome.outcome == "applied", outcome
    assert all(state == "applied" for state in outcome.edits.values()), outcome.edits
    compile(result.result, patch.target.path, "exec")


def check_subset(source: str, target, subset) -> None:
    """`subset` (canonical order) applied one patch after another: every patch applies and the
    result compiles; and run the way apply runs it, every edit in one traversal
    (patcher.transform.combined), it gives the same code and outcomes."""
    import libcst as cst

    from patcher.transform.combined import apply_together
    from patcher.transform.transforms import apply_patch

    pristine = cst.parse_module(source)
    tree = pristine
    for patch in subset:
        tree, outcome = apply_patch(tree, patch, patch.edits, target.path)
        assert outcome.outcome == "applied", ([p.short_id for p in subset], outcome)
    compile(tree.code, target.path, "exec")
    steps = [(p, p.edits) for p in subset]
    together = apply_together(pristine, steps, target.path)
    assert together is not None, [p.short_id for p in subset]
    assert together[0].code == tree.code, [p.short_id for p in subset]
    assert [(o.outcome, o.edits) for o in together[1]] == [
        ("applied", {e.name: "applied" for e in p.edits}) for p, _ in steps
    ]


@pytest.mark.parametrize("target,subset", SUBSETS)
def test_subset_applies_and_compiles(speculators_0_3_0, target, subset):
    """Every one, every pair (each interaction), every leave-one-out and all of them: their number
    grows as n^2, not 2^n (the hypothesis test below samples the rest)."""
    check_subset(speculators_0_3_0[target.path], target, subset)


@pytest.mark.parametrize(
    "target,patches", [(GENERATOR, GENERATOR_PATCHES), (WORKER, WORKER_PATCHES)], ids=["generator", "worker"]
)
def test_sampled_subsets_apply_and_compile(speculators_0_3_0, target, patches):
    """Subsets of any size, drawn by hypothesis (shrunk to the smallest failing one)."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    source = speculators_0_3_0[target.path]

    @settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(st.sets(st.sampled_from(range(len(patches))), min_size=1))
    def check(indices):
        check_subset(source, target, [patches[i] for i in sorted(indices)])

    check()


@pytest.mark.parametrize("target,subset", SUBSETS)
def test_subsets_are_idempotent(speculators_0_3_0, target, subset):
    once = run_cached(speculators_0_3_0[target.path], subset, target.path).result
    twice = run(once, subset, target.path)
    assert [o.outcome for o in twice.outcomes] == ["already-satisfied"] * len(subset), twice.outcomes
    assert twice.result == once


@pytest.mark.parametrize("release", sorted({release for release, _ in EXPECTED_ON_NEXT.values()}))
def test_what_the_patches_say_on_the_next_release(release, capsys):
    files = _release(release)
    report = {}
    for patch in PATCHES:
        if EXPECTED_ON_NEXT.get(patch.id, ("",))[0] != release:
            continue
        result = run(files[patch.target.path], [patch], patch.target.path)
        outcome = result.outcome(patch.id)
        report[patch.id] = (outcome.outcome, outcome.edits, result.changed)
    with capsys.disabled():
        print(f"\nspeculators {release}, each patch alone on its file:")
        for patch_id, (outcome, edits, changed) in report.items():
            print(f"  {patch_id}: {outcome} {edits}{' (would change the file)' if changed else ''}")
    assert report, f"no patch declares on_fixed_in for {release}"
    for patch_id, (outcome, edits, changed) in report.items():
        expected = EXPECTED_ON_NEXT[patch_id][1]
        if expected == "applies":
            assert outcome == "applied" and changed, (patch_id, outcome, edits)
            continue
        assert outcome == expected, (patch_id, outcome, edits)
        assert not changed, patch_id
        if expected == "already-satisfied":
            assert set(edits.values()) == {"satisfied"}, (patch_id, edits)
