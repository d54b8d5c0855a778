"""PEP 440 version conditions, the part patches use: one implementation for patcher's selection,
the bundle's and check-upstream's (patcher.plan.selection.condition_holds is this one). Standard
library only, Python 3.9+: a bundle runs this text too. tests/test_versions.py checks it against
`packaging` (the reference implementation) on generated cases and on every declared condition.

Pre-releases are allowed explicitly: a vLLM nightly such as 0.16.0rc2.dev45+g1a2b3c4 is what it
is, a pre-release of 0.16.0, so it satisfies ">=0.12.0" and not ">=0.16.0"; local labels (+cpu)
sort after the same public version."""

from __future__ import annotations

import re

_PEP440 = re.compile(
    r"""^\s*v?
    (?:(?P<epoch>[0-9]+)!)?
    (?P<release>[0-9]+(?:\.[0-9]+)*)
    (?P<pre>[-_.]?(?P<pre_l>alpha|a|beta|b|preview|pre|c|rc)[-_.]?(?P<pre_n>[0-9]+)?)?
    (?P<post>(?:-(?P<post_n1>[0-9]+))|(?:[-_.]?(?P<post_l>post|rev|r)[-_.]?(?P<post_n2>[0-9]+)?))?
    (?P<dev>[-_.]?(?P<dev_l>dev)[-_.]?(?P<dev_n>[0-9]+)?)?
    (?:\+(?P<local>[a-z0-9]+(?:[-_.][a-z0-9]+)*))?
    \s*$""",
    re.VERBOSE | re.IGNORECASE,
)
_PRE_ORDER = {"a": 0, "alpha": 0, "b": 1, "beta": 1, "c": 2, "rc": 2, "pre": 2, "preview": 2}


def _key(
    epoch: int,
    release: tuple[int, ...],
    pre: tuple[int, int] | None,
    post: int | None,
    dev: int | None,
    local: str | None = None,
) -> tuple:
    """PEP 440 order: as packaging's Version._key (trailing zeros do not count; a dev release
    of a final sorts before its pre-releases; a local label sorts after the same public version)."""
    trimmed = list(release)
    while len(trimmed) > 1 and trimmed[-1] == 0:
        trimmed.pop()
    pre_key: tuple
    if pre is None and post is None and dev is not None:
        pre_key = (0,)
    elif pre is None:
        pre_key = (2,)
    else:
        pre_key = (1,) + tuple(pre)
    post_key = (0,) if post is None else (1, post)
    dev_key = (1,) if dev is None else (0, dev)
    local_key: tuple
    if local is None:
        local_key = (0,)
    else:
        local_key = (1,) + tuple((1, int(p), "") if p.isdigit() else (0, 0, p) for p in local.split("."))
    return (epoch, tuple(trimmed), pre_key, post_key, dev_key, local_key)


class Version:
    """A parsed version: `key` orders it as packaging's Version does, `public` without its local label."""

    def __init__(self, text: str) -> None:
        m = _PEP440.match(text)
        if not m:
            raise ValueError(f"not a PEP 440 version: {text!r}")
        self.text = text
        self.epoch = int(m.group("epoch") or 0)
        self.release = tuple(int(p) for p in m.group("release").split("."))
        self.pre: tuple[int, int] | None = (
            (_PRE_ORDER[m.group("pre_l").lower()], int(m.group("pre_n") or 0)) if m.group("pre") else None
        )
        if m.group("post"):
            self.post: int | None = int(m.group("post_n1") or m.group("post_n2") or 0)
        else:
            self.post = None
        self.dev: int | None = int(m.group("dev_n") or 0) if m.group("dev") else None
        self.local: str | None = (
            m.group("local").lower().replace("-", ".").replace("_", ".") if m.group("local") else None
        )
        self.key = _key(self.epoch, self.release, self.pre, self.post, self.dev, self.local)
        self.public = self.key[:5]

    @property
    def is_prerelease(self) -> bool:
        return self.pre is not None or self.dev is not None


_SPEC = re.compile(r"^\s*(===|~=|==|!=|<=|>=|<|>)\s*(\S+)\s*$")


# --------------------------------------------------------------------------- reading a specifier
# The one reading of a specifier string for everything that takes it apart (the declarations'
# checks and cells, planning's readable ranges, the tests): its clauses, their operators, its bounds.


def clauses(spec: str) -> list[str]:
    """The clauses of a specifier string, stripped, empty ones left out: ">=0.4.0, <0.5.0" ->
    [">=0.4.0", "<0.5.0"]; "" -> []."""
    return [item.strip() for item in spec.split(",") if item.strip()]


def parse_clause(clause: str) -> tuple[str, str]:
    """(operator, version) of one clause: "<0.5.0" -> ("<", "0.5.0"), "== 0.16.*" -> ("==", "0.16.*");
    ValueError where it is not one."""
    m = _SPEC.match(clause)
    if not m:
        raise ValueError(f"unsupported version condition {clause!r}")
    return m.group(1), m.group(2)


def lower_bounds(spec: str, operators: tuple[str, ...] = (">=", "==")) -> list[str]:
    """The versions the clauses with these operators name, in order: the lowest releases a spec can
    allow (">=0.4.0,<0.5.0" -> ["0.4.0"]). A wildcard (==0.16.*) is not a bound."""
    found = []
    for item in clauses(spec):
        op, text = parse_clause(item)
        if op in operators and not text.endswith(".*") and text not in found:
            found.append(text)
    return found


def upper_bound(spec: str) -> str | None:
    """The version of a spec's first exclusive upper bound, the first release past it ("<0.4.0" ->
    "0.4.0"), or None where it has none (`<=` is not one)."""
    for item in clauses(spec):
        op, text = parse_clause(item)
        if op == "<":
            return text
    return None


def _next_prefix_dev0(epoch: int, release: tuple[int, ...]) -> tuple:
    """1.2 -> the key of 1.3.dev0, the smallest version past the 1.2 prefix."""
    return _key(epoch, release[:-1] + (release[-1] + 1,), None, None, 0)


def specifier_holds(item: str, version: Version) -> bool:
    """One specifier, pre-releases allowed, with the ranges packaging (26) gives each operator."""
    op, text = parse_clause(item)
    v = version
    if op == "===":
        return v.text.strip().lower() == text.lower()
    if op in ("==", "!=") and text.endswith(".*"):
        base = Version(text[:-2])
        inside = _key(base.epoch, base.release, None, None, 0) <= v.key < _next_prefix_dev0(base.epoch, base.release)
        return inside if op == "==" else not inside
    s = Version(text)
    if op == "~=":
        if len(s.release) < 2:
            raise ValueError(f"~= needs two release numbers: {item!r}")
        return s.key <= v.key < _next_prefix_dev0(s.epoch, s.release[:-1])
    if op in ("==", "!="):
        equal = v.key == s.key if s.local is not None else v.public == s.public  # ==1.4 takes 1.4+anything
        return equal if op == "==" else not equal
    if op == ">=":
        return v.key >= s.key
    if op == "<=":
        return v.public <= s.public  # and every local label of it
    if op == "<":
        if s.is_prerelease:
            return v.key < s.key
        return v.key < _key(s.epoch, s.release, s.pre, s.post, 0)  # not V's own dev/pre-releases
    if op == ">":
        if s.dev is not None:
            return v.key >= _key(s.epoch, s.release, s.pre, s.post, s.dev + 1)
        if s.post is not None:
            return v.key >= _key(s.epoch, s.release, s.pre, s.post + 1, 0)
        return v.key[:3] > s.key[:3]  # above V, V+local and every V.postN
    raise ValueError(f"unsupported operator in {item!r}")


def condition_holds(spec: str, version: str | None) -> bool:
    """Whether `version` satisfies `spec` (comma-separated specifiers, pre-releases allowed); a
    missing or unparsable version, or a condition this cannot read, holds for nothing."""
    if version is None:
        return False
    try:
        parsed = Version(version)
        return all(specifier_holds(item, parsed) for item in clauses(spec))
    except ValueError:
        return False
