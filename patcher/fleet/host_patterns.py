"""`--limit PATTERN` with ansible-core's host-pattern semantics (inventory/manager.py there):
terms separated by `,` (or `:` when the whole is not one address), `!term` drops, `&term`
intersects, `~regex` matches names by regular expression, shell wildcards otherwise, `group[0]`,
`group[1:3]`, `group[-1]` take hosts of the group by position. A term matches group names and host
names, never addresses (`ansible_host`). The hosts kept are in the inventory's order.

One deliberate difference: a term that matches nothing is refused (ansible-core warns and goes
on), so a typo can neither leave hosts unpatched nor fail to keep hosts out.
"""

from __future__ import annotations

import fnmatch
import re

from .inventory_files import Entry, Inventory, InventoryError, parse_address

_SUBSCRIPT = re.compile(r"^(.+)\[(?:(-?[0-9]+)|([0-9]+)([:-])([0-9]*))\]$")
_COLON_TERMS = re.compile(r"(?:[^\s:\[\]]|\[[^\]]*\])+")


def split_pattern(pattern: str) -> list[str]:
    if "," in pattern:
        terms = pattern.split(",")
    else:
        terms = [pattern] if parse_address(pattern.strip()) else _COLON_TERMS.findall(pattern)
    return [t.strip() for t in terms if t.strip()]


def _matcher(term: str):
    try:
        return re.compile(term[1:] if term.startswith("~") else fnmatch.translate(term))
    except re.error as exc:
        raise InventoryError(f"--limit: {term!r} is not a valid pattern ({exc})") from None


def _enumerate(inventory: Inventory, term: str) -> list[str]:
    subscript = None
    if not term.startswith("~"):
        m = _SUBSCRIPT.match(term)
        if m:
            term, index, start, _, end = m.groups()
            subscript = (int(index), None) if index else (int(start), int(end) if end else -1)
    regex = _matcher(term)
    found: dict[str, None] = {}  # an ordered set
    groups = [g for g in inventory.group_hosts if regex.match(g)]
    for group in groups:
        found.update(dict.fromkeys(inventory.group_hosts[group]))
    if not groups or term.startswith("~") or any(c in term for c in ".?*["):
        found.update(dict.fromkeys(e.name for e in inventory.entries if regex.match(e.name)))
    return _subscripted(list(found), term, subscript)


def _subscripted(found: list[str], term: str, subscript) -> list[str]:
    if subscript and found:
        start, end = subscript
        try:
            if end is None:
                found = [found[start]]
            else:
                found = found[start : (len(found) - 1 if end == -1 else end) + 1]
        except IndexError:
            raise InventoryError(f"--limit: no host at position {start} of {term!r} ({len(found)} host(s))") from None
    return found


def select(inventory: Inventory, pattern: str) -> list[Entry]:
    terms = split_pattern(pattern)
    if not terms:
        raise InventoryError("--limit needs a pattern: host or group names, comma-separated")
    regular = [t for t in terms if t[0] not in "!&"]
    ordered = (regular or ["all"]) + [t for t in terms if t[0] == "&"] + [t for t in terms if t[0] == "!"]
    names = {e.name for e in inventory.entries}
    kept: dict[str, None] = {}  # an ordered set
    for term in ordered:
        bare = term[1:] if term[0] in "!&" else term
        matched = [term] if term in names else _enumerate(inventory, bare)
        if not matched and bare != "all":
            groups = sorted(set(inventory.group_hosts) - {"all", "ungrouped"})
            known = f"; groups: {', '.join(groups)}" if groups else ""
            raise InventoryError(f"--limit: {bare!r} matches no host or group{known}; check the name")
        if term[0] == "!":
            drop = set(matched)
            kept = {h: None for h in kept if h not in drop}
        elif term[0] == "&":
            keep = set(matched)
            kept = {h: None for h in kept if h in keep}
        else:
            kept.update(dict.fromkeys(matched))
    chosen = set(kept)
    result = [e for e in inventory.entries if e.name in chosen]
    if not result:
        raise InventoryError(f"--limit {pattern!r} leaves no host to run on")
    return result
