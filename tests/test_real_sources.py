"""The patches against the real released files: each patch set on the files of its speculators
release (0.3.0; 0.4.0.1, whose target files are 0.4.0's), and the 0.3.0 set's patches on 0.4.0's
files, where those that fixed upstream must find their work done and the others leave the file alone.

The wheels are fetched once with pip into a cache (see workbench/release_files.py); without
network access and without a filled cache these tests are skipped, naming the pip error.
"""

from __future__ import annotations

import hashlib
import itertools

import pytest

from patcher.patches.targets import EAGLE3_CORE, GENERATOR, WORKER
from patcher.patchset.registry import load_patches
from patcher.plan.selection import condition_holds
from patcher.transform.transforms import transform_source
from workbench.release_files import DownloadFailed, release_files

# The pristine speculators 0.3.0 target files: the sha256 of each as the released wheel has it.
PRISTINE_0_3_0_SHA256 = {
    GENERATOR.path: "514f3f585afa335b558f98c1954a1dc5b804003cd7b08aeeac7c4cd333cd5106",
    WORKER.path: "e9a95cf6422fa3e3efb3edb658e4898ba23ee141619f58d7096ea7fbde8af548",
    EAGLE3_CORE.path: "adec1633736c5c3f9d9cef895e48576ebbed6e43ca74e4d7e0af77388f876dd6",
}

PATCHES = load_patches()
TARGET_PATHS = tuple(sorted({GENERATOR.path, WORKER.path} | {p.target.path for p in PATCHES}))
# Each patch set: the patches a target on that release selects (by `requires`), canonical order.
RELEASES = ("0.3.0", "0.4.0.1")
PATCH_SETS = {r: tuple(p for p in PATCHES if condition_holds(p.requires["speculators"], r)) for r in RELEASES}


def _subsets(patches):
    """Subsets, each in canonical order (combinations keep the order of their input): every one
    and every pair (each interaction), every all-but-one (each leave-one-out the end-to-end test
    applies) and all of them; test_sampled_subsets_apply_and_compile draws others."""
    n = len(patches)
    sizes = sorted({1, 2, n - 1, n} & set(range(1, n + 1)))
    return [subset for size in sizes for subset in itertools.combinations(patches, size)]


def _by_target(release):
    targets: dict = {}
    for patch in PATCH_SETS[release]:
        targets.setdefault(patch.target, []).append(patch)
    return targets


SUBSETS = [
    pytest.param(
        release,
        target,
        subset,
        id=f"{release}:{target.path.rsplit('/', 1)[-1][:-3]}:" + "+".join(p.short_id for p in subset),
    )
    for release in RELEASES
    for target, patches in _by_target(release).items()
    for subset in _subsets(patches)
]

# What each patch's codemods say on the files of the release just past its `requires`
# (Patch.next_release: speculators 0.4.0 for the 0.3.0 set, upstream's own fix where fixed_in says
# so) is declared by the patch itself: Patch.on_fixed_in. Patches never run there; this checks they
# recognise upstream's fix as their own, find the shape they rewrite gone and leave the file alone
# (anchor-missing), or would rewrite it (applies). The reasons are in each patch module, beside its
# on_fixed_in. Every patch outside the 0.4 set declares what it says on 0.4.0's files.
EXPECTED_ON_NEXT = {p.id: (p.next_release, p.on_fixed_in) for p in PATCHES if p.on_fixed_in}
OUTSIDE_THE_0_4_SET = [p for p in PATCHES if p not in PATCH_SETS["0.4.0.1"]]


def _release(version: str) -> dict[str, str]:
    try:
        files = release_files("speculators", version, TARGET_PATHS)
    except DownloadFailed as error:
        pytest.skip(f"speculators {version} not available: {error}")
    return {path: file.read_text(encoding="utf-8") for path, file in files.items()}


_SOURCES: dict = {}


def sources(release: str) -> dict[str, str]:
    if release not in _SOURCES:
        _SOURCES[release] = _release(release)
    return _SOURCES[release]


@pytest.fixture(scope="session")
def speculators_0_3_0() -> dict[str, str]:
    return sources("0.3.0")


@pytest.fixture(scope="session")
def speculators_0_4_0() -> dict[str, str]:
    return sources("0.4.0")


def test_0_4_0_and_0_4_0_1_have_the_same_target_files(speculators_0_4_0):
    assert sources("0.4.0.1") == speculators_0_4_0


def edits_for(patch, release):
    """The patch's edits a target on `release` selects by its speculators condition (v8's guard edit
    is for 0.3.0 only); all of them when release is None."""
    return tuple(
        e for e in patch.edits if release is None or condition_holds(e.when.get("speculators", ">=0"), release)
    )


def run(source, patches, filename, release=None):
    return transform_source(source, [(p, edits_for(p, release)) for p in patches], filename=filename)


_FIRST_PASS: dict = {}


def run_cached(source, patches, filename, release):
    """The first pass of a subset, shared by the applies- and the idempotence test."""
    key = (hashlib.sha256(source.encode()).hexdigest(), tuple(p.id for p in patches), filename, release)
    if key not in _FIRST_PASS:
        _FIRST_PASS[key] = run(source, patches, filename, release)
    return _FIRST_PASS[key]


@pytest.mark.parametrize("path", sorted(PRISTINE_0_3_0_SHA256))
def test_pristine_0_3_0_files_are_the_known_ones(speculators_0_3_0, path):
    digest = hashlib.sha256(speculators_0_3_0[path].encode("utf-8")).hexdigest()
    assert digest == PRISTINE_0_3_0_SHA256[path]


@pytest.mark.parametrize(
    "release,patch",
    [(r, p) for r in RELEASES for p in PATCH_SETS[r]],
    ids=[f"{r}:{p.id}" for r in RELEASES for p in PATCH_SETS[r]],
)
def test_each_patch_applies_to_its_release_and_compiles(release, patch):
    source = sources(release)[patch.target.path]
    result = run(source, [patch], patch.target.path, release)
    outcome = result.outcome(patch.id)
    assert outcome.outcome == "applied", outcome
    assert all(state == "applied" for state in outcome.edits.values()), outcome.edits
    compile(result.result, patch.target.path, "exec")


def check_subset(source: str, target, subset, release) -> None:
    """`subset` (canonical order) applied one patch after another: every patch applies and the
    result compiles; and run the way apply runs it, every edit in one traversal
    (patcher.transform.combined), it gives the same code and outcomes."""
    import libcst as cst

    from patcher.transform.combined import apply_together
    from patcher.transform.transforms import apply_patch

    pristine = cst.parse_module(source)
    tree = pristine
    for patch in subset:
        tree, outcome = apply_patch(tree, patch, edits_for(patch, release), target.path)
        assert outcome.outcome == "applied", ([p.short_id for p in subset], outcome)
    compile(tree.code, target.path, "exec")
    steps = [(p, edits_for(p, release)) for p in subset]
    together = apply_together(pristine, steps, target.path)
    assert together is not None, [p.short_id for p in subset]
    assert together[0].code == tree.code, [p.short_id for p in subset]
    assert [(o.outcome, o.edits) for o in together[1]] == [
        ("applied", {e.name: "applied" for e in edits}) for _, edits in steps
    ]


@pytest.mark.parametrize("release,target,subset", SUBSETS)
def test_subset_applies_and_compiles(release, target, subset):
    """Every one, every pair (each interaction), every leave-one-out and all of them: their number
    grows as n^2, not 2^n (the hypothesis test below samples the rest)."""
    check_subset(sources(release)[target.path], target, subset, release)


@pytest.mark.parametrize(
    "release,target",
    [(r, t) for r in RELEASES for t in (GENERATOR, WORKER) if len(_by_target(r).get(t, [])) > 2],
    ids=lambda v: v if isinstance(v, str) else v.path.rsplit("/", 1)[-1][:-3],
)
def test_sampled_subsets_apply_and_compile(release, target):
    """Subsets of any size, drawn by hypothesis (shrunk to the smallest failing one)."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    source = sources(release)[target.path]
    patches = _by_target(release)[target]

    @settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(st.sets(st.sampled_from(range(len(patches))), min_size=1))
    def check(indices):
        check_subset(source, target, [patches[i] for i in sorted(indices)], release)

    check()


@pytest.mark.parametrize("release,target,subset", SUBSETS)
def test_subsets_are_idempotent(release, target, subset):
    once = run_cached(sources(release)[target.path], subset, target.path, release).result
    twice = run(once, subset, target.path, release)
    assert [o.outcome for o in twice.outcomes] == ["already-satisfied"] * len(subset), twice.outcomes
    assert twice.result == once


@pytest.mark.parametrize("release", sorted({release for release, _ in EXPECTED_ON_NEXT.values()}))
def test_what_the_patches_say_on_the_next_release(release, capsys):
    files = sources(release)
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
    if release == "0.4.0":
        assert {p.id for p in OUTSIDE_THE_0_4_SET} <= set(report), "every patch outside the 0.4 set says"
    for patch_id, (outcome, edits, changed) in report.items():
        expected = EXPECTED_ON_NEXT[patch_id][1]
        if expected == "applies":
            assert outcome == "applied" and changed, (patch_id, outcome, edits)
            continue
        assert outcome == expected, (patch_id, outcome, edits)
        assert not changed, patch_id
        if expected == "already-satisfied":
            assert set(edits.values()) == {"satisfied"}, (patch_id, edits)
