"""patcher's PEP 440 (patcher/core/versions.py: the one implementation patcher, a bundle and
check-upstream select with) against `packaging`, the reference: on generated versions and
conditions, on the cases patches meet, and on every condition the patches declare at the versions
around each of their boundaries (what `patcher bundle` checks too before it writes a bundle)."""

from __future__ import annotations

import packaging
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

from patcher.core.versions import clauses, condition_holds, lower_bounds, parse_clause, upper_bound
from patcher.patchset.registry import load_patches


def packaging_holds(spec: str, version: str | None) -> bool:
    """packaging's answer, with pre-releases allowed (as patcher selects)."""
    if version is None:
        return False
    try:
        return SpecifierSet(spec, prereleases=True).contains(Version(version), prereleases=True)
    except (InvalidSpecifier, InvalidVersion):
        return False


def test_plan_selection_selects_with_this_implementation():
    from patcher.plan import selection

    assert selection.condition_holds is condition_holds


def test_every_declared_condition_at_every_probe_is_packagings():
    from patcher.frontends.bundle import _all_specs, check_runtime_versions, probe_versions

    specs = _all_specs(load_patches())
    probes = {name: probe_versions(conditions) for name, conditions in specs.items()}
    assert check_runtime_versions(specs, probes) > 100


_numbers = st.integers(min_value=0, max_value=12)
_release = st.lists(_numbers, min_size=1, max_size=4).map(lambda parts: ".".join(map(str, parts)))
_suffix = st.sampled_from(
    [
        "",
        "a1",
        "b2",
        "rc1",
        "rc2",
        ".dev0",
        ".dev3",
        "rc1.dev2",
        ".post1",
        ".post2.dev1",
        "+cpu",
        "+cu121.x",
        "rc1+local",
        ".post1+l",
    ]
)
_versions = st.builds(lambda r, s: r + s, _release, _suffix)
_operators = st.sampled_from(["<", "<=", ">", ">=", "==", "!=", "~="])


@pytest.mark.skipif(
    Version(packaging.__version__) < Version("26"),
    reason="packaging before 26 reads a few post-release edge cases (<1.post1 and 1a1) differently",
)
@settings(max_examples=3000, deadline=None)
@given(version=_versions, operator=_operators, bound=_versions, wildcard=st.booleans())
def test_patchers_version_logic_is_packagings(version: str, operator: str, bound: str, wildcard: bool):
    if wildcard and operator in ("==", "!="):
        spec = f"{operator}{Version(bound).base_version}.*"
    else:
        if "+" in bound and operator not in ("==", "!="):
            bound = bound.split("+")[0]  # packaging refuses a local label there
        if operator == "~=" and len(Version(bound).release) < 2:
            bound = bound.replace(str(Version(bound).release[0]), f"{Version(bound).release[0]}.0", 1)
        spec = f"{operator}{bound}"
    try:
        SpecifierSet(spec)
    except Exception:  # noqa: BLE001 - packaging refuses it: not a case to compare
        return
    assert condition_holds(spec, version) == packaging_holds(spec, version), (spec, version)


def test_version_logic_on_the_cases_that_matter():
    cases = {
        (">=0.12.0", "0.16.0rc2.dev45+g1a2b3c4"): True,
        (">=0.16.0", "0.16.0rc2.dev45+g1a2b3c4"): False,
        (">=0.3.0,<0.4.0", "0.4.0rc1"): False,
        (">=0.3.0,<0.4.0", "0.3.0+cpu"): True,
        (">0.11.0", "0.11.0.post1"): False,
        (">0.11.0", "0.11.1.dev0"): True,
        ("==0.16.*", "0.16.0rc1"): True,
    }
    for (spec, version), expected in cases.items():
        assert condition_holds(spec, version) is expected, (spec, version)
        assert packaging_holds(spec, version) is expected, (spec, version)


def test_a_specifier_string_read_once():
    assert clauses(">=0.4.0, <0.5.0") == [">=0.4.0", "<0.5.0"]
    assert clauses("") == [] and clauses(" , >=1.0 ,") == [">=1.0"]
    assert parse_clause("<0.5.0") == ("<", "0.5.0")
    assert parse_clause(" == 0.16.* ") == ("==", "0.16.*")
    assert parse_clause("~=1.4.2") == ("~=", "1.4.2") and parse_clause("===1.0") == ("===", "1.0")
    for bad in ("0.4.0", "=>0.4.0", "", "<"):
        with pytest.raises(ValueError, match="unsupported version condition"):
            parse_clause(bad)


def test_bounds_of_a_specifier_string():
    assert lower_bounds(">=0.4.0,<0.5.0") == ["0.4.0"]
    assert lower_bounds("==0.3.0") == ["0.3.0"] and lower_bounds("==0.16.*") == []
    assert lower_bounds(">0.4.0,>=0.4.1") == ["0.4.1"] and lower_bounds(">0.4.0", (">",)) == ["0.4.0"]
    assert lower_bounds(">=1.0,>=1.0") == ["1.0"] and lower_bounds("") == []
    assert upper_bound(">=0.4.0,<0.5.0") == "0.5.0"
    assert upper_bound("<=0.5.0") is None and upper_bound(">=0.4.0") is None and upper_bound("") is None
    assert upper_bound("!=0.4.1, < 0.6, <0.7") == "0.6"


def test_every_declared_condition_reads_as_packaging_reads_it():
    declared = {spec for patch in load_patches() for specs in patch.conditions().values() for spec in specs}
    assert declared
    for spec in declared:
        theirs = sorted((s.operator, s.version) for s in SpecifierSet(spec))
        assert sorted(parse_clause(c) for c in clauses(spec)) == theirs, spec
