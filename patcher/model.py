"""What a patch is: declarations only, no I/O and no libcst work happens here."""

from __future__ import annotations

import re
import textwrap
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .core.versions import clauses, parse_clause, upper_bound

if TYPE_CHECKING:  # libcst is imported only where a codemod actually runs
    from .codemod import PatchCodemod
    from .plan.planning import PatchSpec

# `vN-slug`; a patch of a set other than patcher's own reads `SET:vN-slug` once loaded
# (patcher.patchset.sets): its module declares the bare form
PATCH_ID = re.compile(r"^(?:(?P<set>[a-z0-9][a-z0-9-]*):)?(?P<local>v(?P<number>[0-9]+)-[a-z0-9]+(?:-[a-z0-9]+)*)$")


@dataclass(frozen=True)
class TargetFile:
    """A file inside site-packages that belongs to one distribution."""

    distribution: str  # the name conditions use for it, e.g. "speculators"
    path: str  # POSIX path relative to site-packages

    @property
    def module(self) -> str:
        """Dotted module name of the file, e.g. speculators.data_generation.custom_worker."""
        return self.path[: -len(".py")].replace("/", ".").removesuffix(".__init__")


# What each kind of Fact asserts about `module` (in the source of one release of `distribution`).
# `qualname` is a dotted path inside the module ("Scheduler.__init__", "CacheConfig"); "" is the
# module itself. Members of classes are looked up through base classes within the distribution.
FACT_KINDS = {
    "defines": "{where} defines {name}",
    "lacks": "{where} does not define {name}",
    "has-param": "{where} has a parameter {name}",
    "lacks-param": "{where} has no parameter {name}",
    "required-param": "{where} requires the parameter {name} (no default)",
    "field-required": "{where} requires the field {name} (declared without default)",
    "default-value": "{where}.{name} defaults to {value}",
    "has-base": "{where} derives from {name}",
    "lacks-base": "{where} does not derive from {name}",
    "returns-first-item": "{where} returns the single reply itself (a return of x[0])",
    "returns-value": "{where} returns {value}",
    "lacks-module": "{where} does not exist",
}


@dataclass(frozen=True)
class Fact:
    """An upstream API fact, checkable statically (stdlib `ast`) on one release's source files.

    `needs` are facts the edit's code also relies on: they must hold on every release the edit
    is selected for, but (unlike the fact itself) may already hold on earlier ones.
    """

    kind: str
    # e.g. "vllm.v1.core.sched.scheduler"; or candidates, for a name vLLM moved: the fact is about
    # the first of them that defines the qualname's (or name's) head in that release
    module: str | tuple[str, ...]
    qualname: str = ""  # e.g. "Scheduler.__init__"; "" for the module itself
    name: str = ""  # the parameter, attribute, field or base class
    value: str = ""  # default-value only: the default as Python source, e.g. "True"
    distribution: str = "vllm"  # the name conditions use for the distribution it is about
    needs: tuple[Fact, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in FACT_KINDS:
            raise ValueError(f"unknown fact kind {self.kind!r}; known: {', '.join(FACT_KINDS)}")
        if self.kind not in ("returns-first-item", "returns-value", "lacks-module") and not self.name:
            raise ValueError(f"a {self.kind} fact names the parameter, attribute or field it is about")
        if self.kind in ("default-value", "returns-value") and not self.value:
            raise ValueError(f"a {self.kind} fact gives the expected value as Python source")

    @property
    def modules(self) -> tuple[str, ...]:
        return self.module if isinstance(self.module, tuple) else (self.module,)

    @property
    def module_text(self) -> str:
        return self.modules[0] if len(self.modules) == 1 else "(" + " | ".join(self.modules) + ")"

    @property
    def where(self) -> str:
        return f"{self.module_text}.{self.qualname}" if self.qualname else self.module_text

    def describe(self) -> str:
        return FACT_KINDS[self.kind].format(where=self.where, name=self.name, value=self.value)


@dataclass(frozen=True)
class Edit:
    """One codemod of a patch, gated by its own version condition.

    `codemod` is a PatchCodemod class (a libcst transformer). It rewrites only the unpatched shape, leaves the
    patched shape alone (and records that it saw it), and raises SkipFile naming the shape
    it expected when it finds neither.
    """

    codemod: type[PatchCodemod]
    when: Mapping[str, str] = field(default_factory=dict)  # {"vllm": ">=0.12.0"}
    answers: str = ""  # the upstream API fact this edit answers, in words
    fact: Fact | None = None  # the same fact, statically checkable (patcher check-upstream)

    @property
    def name(self) -> str:
        return self.codemod.__name__


def dedented(text: str) -> str:
    """Source as a declaration writes it in a triple-quoted string, read as a file would hold it
    (as LibCST's assertCodemod reads its fixtures): the newline right after the opening quotes is
    dropped and the lines' common indentation removed. Text already at column 0 is unchanged."""
    return textwrap.dedent(text.removeprefix("\n"))


@dataclass(frozen=True)
class Example:
    """A before/after pair: applying every edit of the patch to `before` gives `after`. Both are
    read dedented (see `dedented`), so they may be written indented inside the declaration."""

    before: str
    after: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "before", dedented(self.before))
        object.__setattr__(self, "after", dedented(self.after))


@dataclass(frozen=True)
class AttributeCall:
    """An attribute call the verifier checks against a real vLLM callable.

    `receiver` is the dotted expression in the patched file (e.g. "self.executor"), `method`
    the attribute called on it, and `implementation` "module:Qualname.method" of the callable
    the receiver really is at run time.
    """

    receiver: str
    method: str
    implementation: str


@dataclass(frozen=True)
class ReleaseLine:
    """Releases of a target distribution patcher knows, and how a target on one of them is served.

    `patched`: by the patches whose `requires` names exactly `spec` (their patch set); otherwise by
    no source patch at all (`path` says what extraction goes through there). A release in no line is
    refused (exit 7, README "Exit codes"): patcher never says all is well on a release it has not read.
    """

    distribution: str  # the name conditions use, e.g. "speculators"
    spec: str  # PEP 440, e.g. ">=0.4.0,<0.5.0"
    releases: tuple[str, ...]  # the releases read for it (the bundle carries their files)
    patched: bool
    path: str  # what extraction goes through on these releases, in words (status says it)
    # what the line needs of the other distributions installed beside it, PEP 440: speculators 0.4
    # drives vLLM 0.12's engine API (its datagen extra allows 0.12-0.16) and cannot run on 0.11;
    # 0.3's and 0.4's worker drives the v1 GPU model runner, which vLLM 0.34.0 removed
    requires: Mapping[str, str] = field(default_factory=dict)
    # why the line stops at each clause of `requires`, keyed "<name><clause>" ("vllm<0.34.0"): the
    # refusal of a target past it says so (patcher.plan.planning.coverage), as check-upstream does
    requires_why: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        named = {f"{name}{c}" for name, spec in self.requires.items() for c in clauses(spec)}
        stray = sorted(set(self.requires_why) - named)
        if stray:
            raise ValueError(f"release line {self.spec}: requires_why names {stray}, no clause of requires {named}")

    def as_json(self) -> dict:
        return {
            "distribution": self.distribution,
            "spec": self.spec,
            "releases": list(self.releases),
            "patched": self.patched,
            "path": self.path,
            "requires": dict(self.requires),
            "requires_why": dict(self.requires_why),
        }


@dataclass(frozen=True)
class ConnectorDrift:
    """A known way a KV connector module of the speculators 0.5+ path (not patched: `vllm serve`
    loads it) does not bind on some vLLM releases. check-upstream binds every module on every vLLM
    release with the speculative method extract_hidden_states: each problem it meets must be
    declared here for exactly the releases it is met on."""

    distribution: str  # the distribution that ships the module, e.g. "hs-connectors"
    path: str  # e.g. "hs_connectors/fp8_hidden_states_connector.py"
    subject: (
        str  # a part of the binder's line naming it, e.g. "FP8HiddenStatesConnector._write_tensors overrides nothing"
    )
    vllm: str  # PEP 440: the vLLM releases it is met on
    why: str  # what it does there, in words
    connector: str = ""  # PEP 440: the releases of `distribution` this speaks for ("": every one)


# What a patch's codemods may say on the files of the speculators release that fixed it upstream.
FIXED_IN_OUTCOMES = ("already-satisfied", "anchor-missing", "applies")

# Where a leave-one-out's symptom shows: the extraction driver's phase (patcher/run_check/extract.py:
# "import", "init", "generate N"), "verify" (apply's verification refuses and restores every
# file: the release matrix's row says so) or "rows" (no error: rows come back short or wrong).
SYMPTOM_PHASES = ("import", "init", "verify", "rows")
DEVICES = ("cpu", "cuda")


@dataclass(frozen=True)
class Symptom:
    """What a run shows without the patch, as the extraction driver (or apply) reports it.

    `error` is the exception's type ("" for any), `messages` parts of its message (or traceback)
    that must all appear, `where` a part of the "file.py:function" it was raised in (or of the
    traceback). With phase "rows" there is no error: some prompt's rows come back short or wrong.
    """

    phase: str  # one of SYMPTOM_PHASES, or "generate N"
    error: str = ""
    messages: tuple[str, ...] = ()
    where: str = ""

    def __post_init__(self) -> None:
        if self.phase not in SYMPTOM_PHASES and not re.fullmatch(r"generate [0-9]+", self.phase):
            raise ValueError(f"symptom phase {self.phase!r}: one of {', '.join(SYMPTOM_PHASES)} or 'generate N'")
        if self.phase == "rows" and (self.error or self.messages):
            raise ValueError("a 'rows' symptom has no error: the run returns, with short or wrong rows")
        if self.phase != "rows" and not (self.messages or self.where):
            raise ValueError(f"a {self.phase!r} symptom names a part of its message (messages=) or where= it is raised")


@dataclass(frozen=True)
class LeaveOneOut:
    """The evidence of a patch's need on one release: the run with every patch but this one.

    `symptom` None: the run passes without it there (not needed on that release). Where it is
    checked follows from `vllm` and `device`: on the CPU build, 0.16.0 and 0.32.0 by the end-to-end
    tests (tests/test_e2e_vllm.py, tests/test_e2e_vllm_032.py), any other release by its recorded
    row of the release matrix (bench/results/releases/<vllm>-without-vN-*.json); on CUDA by the
    GPU run's record (bench/gpu/results/<vllm>-*/e2e-without-vN.json, or `record`). `speculators`
    is the release on top: a run on another than 0.3.0 (the end-to-end tests') is the matrix's
    recorded row (bench/results/releases/<vllm>-speculators-<V>-without-vN-*.json), on any release;
    so is a run at `tensor_parallel` 2 or more on the CPU build (`<vllm>[-speculators-<V>]-tpN-without-vN`).
    """

    vllm: str  # the vLLM release, e.g. "0.16.0"
    symptom: Symptom | None
    device: str = "cpu"  # one of DEVICES
    calls: str = "1"  # the extraction driver's --calls: "1", "1,2", "3", "all"
    also_skip: tuple[str, ...] = ()  # short ids left out with it (v1's symptom shows only without v6)
    record: str = ""  # the record that shows it, where it is not at the default place (a file under bench/)
    speculators: str = "0.3.0"  # the speculators release on top
    # ranks the model is split over: a patch that only several ranks need declares its run at 2 or
    # more (on the CPU build, the release matrix's `-tpN` row: bench/releases.py --tensor-parallel)
    tensor_parallel: int = 1

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise ValueError(f"leave-one-out device {self.device!r}: one of {', '.join(DEVICES)}")
        if not (isinstance(self.tensor_parallel, int) and self.tensor_parallel >= 1):
            raise ValueError(f"leave-one-out tensor_parallel={self.tensor_parallel!r}: a number of ranks, 1 or more")
        if not re.fullmatch(r"[0-9]+\.[0-9]+\.[0-9]+(\.post[0-9]+)?", self.vllm):
            raise ValueError(f"leave-one-out vllm={self.vllm!r}: a vLLM release, e.g. 0.16.0")


@dataclass(frozen=True)
class Patch:
    """Everything about one patch, in one place: patcher's engine, `patcher list`, the generated
    patch reference (scripts/generate.py) and the tests' per-patch expectations read it from here.

    Required: id (`vN-slug`, in a module named `vN_slug.py`), title, target, requires, edits
    (each with `when`, `answers` and `fact`), examples, satisfied, upstream. Expected of every
    module in patches/ (the patch reference and tests/test_patch_examples.py fail without them):
    without_it, leave_one_out, near_misses. Optional: fixed_in, on_fixed_in, attribute_calls, needs, since.
    """

    id: str
    title: str
    target: TargetFile
    requires: Mapping[str, str]  # conditions on installed distributions, PEP 440
    edits: tuple[Edit, ...]
    examples: tuple[Example, ...]
    satisfied: tuple[str, ...]  # sources on which every edit is already satisfied
    upstream: str  # the upstream change this patch answers (link or release)
    fixed_in: str | None = None  # the speculators release that fixed it upstream
    attribute_calls: tuple[AttributeCall, ...] = ()
    # ids of other PATCHES this one relies on: it is never applied without them (unlike
    # Fact.needs, which names upstream facts an edit relies on)
    needs: tuple[str, ...] = ()
    # why no release selects it any more, in words ("" while it is in use): planning never selects
    # a withdrawn patch, so `apply` removes it from a file that carries it (its state: stale), and
    # check-upstream does not judge its gates. Its module stays, so targets patched with it are
    # told, and its records keep their meaning.
    withdrawn: str = ""
    # what breaks without it, in words (`code` in backticks): `patcher list` (its JSON's
    # `without_it`) and the patch reference's "without it" cell
    without_it: str = ""
    # the patch reference's "since vLLM" cell; default: the vLLM lower bounds its conditions name
    since: str = ""
    # tests: what its codemods say on the files of `next_release` (the release of its target's
    # distribution just past `requires`: speculators 0.4.0, where `fixed_in` names it):
    # already-satisfied (upstream's fix is recognised), anchor-missing (the shape it rewrites is
    # gone; the file is left alone) or applies (the fix is needed there too)
    on_fixed_in: str = ""
    # the runs that show it is needed (or not) on named releases: the end-to-end tests run them,
    # or the records under bench/ hold them (tests/test_declarations.py checks each)
    leave_one_out: tuple[LeaveOneOut, ...] = ()
    # sources that look like its anchor but must be left alone: each reads "anchor not found" and
    # keeps its bytes (tests/test_patch_examples.py)
    near_misses: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        where = f"patch {self.id}"
        # sources may be written indented in triple quotes, as examples are (see `dedented`)
        object.__setattr__(self, "satisfied", tuple(dedented(s) for s in self.satisfied))
        object.__setattr__(self, "near_misses", tuple(dedented(s) for s in self.near_misses))
        if not PATCH_ID.match(self.id):
            raise ValueError(f"patch id {self.id!r} is not of the form vN-slug (e.g. v1-block-hasher)")
        if not self.edits:
            raise ValueError(f"{where} declares no edits")
        if not self.examples:
            raise ValueError(f"{where} declares no before/after example")
        if self.on_fixed_in and self.on_fixed_in not in FIXED_IN_OUTCOMES:
            raise ValueError(f"{where}: on_fixed_in={self.on_fixed_in!r}; one of {', '.join(FIXED_IN_OUTCOMES)}")
        if self.on_fixed_in and not self.next_release:
            raise ValueError(
                f"{where}: on_fixed_in= needs an upper bound on {self.target.distribution} in requires= "
                "(the release it is about)"
            )
        if self.id in self.needs:
            raise ValueError(f"{where} needs itself")
        for run in self.leave_one_out:
            for short in run.also_skip:
                if not re.fullmatch(r"v[0-9]+", short):
                    raise ValueError(f"{where}: leave_one_out also_skip={short!r}: a short id, e.g. v6")

    @property
    def module_name(self) -> str:
        """The module that must declare it: v12-kv-cache-planning in v12_kv_cache_planning.py."""
        return self.local_id.replace("-", "_")

    @property
    def patch_set(self) -> str:
        """The set its id is qualified by ("" for patcher's own patches)."""
        match = PATCH_ID.match(self.id)
        assert match is not None
        return match.group("set") or ""

    @property
    def local_id(self) -> str:
        """Its id as its module declares it, without the set."""
        match = PATCH_ID.match(self.id)
        assert match is not None
        return match.group("local")

    @property
    def next_release(self) -> str:
        """The first release of its target's distribution past `requires` ("0.4.0" for <0.4.0),
        or "" where `requires` sets no upper bound: what on_fixed_in is about."""
        return upper_bound(self.requires.get(self.target.distribution, "")) or ""

    @property
    def since_cell(self) -> str:
        if self.since:
            return self.since
        bounds = []
        for spec in self.conditions().get("vllm", []):
            for item in clauses(spec):
                op, version = parse_clause(item)
                text = version if op == ">=" else item
                if text not in bounds:
                    bounds.append(text)
        return " / ".join(bounds) or "any"

    @property
    def number(self) -> int:
        match = PATCH_ID.match(self.id)
        assert match is not None
        return int(match.group("number"))

    @property
    def short_id(self) -> str:
        return f"{self.patch_set}:v{self.number}" if self.patch_set else f"v{self.number}"

    def spec(self) -> PatchSpec:
        """What the shared planning core needs of this declaration, as plain data."""
        from .plan.planning import PatchSpec

        return PatchSpec(
            id=self.id,
            file=self.target.path,
            distribution=self.target.distribution,
            module=self.target.module,
            requires=dict(self.requires),
            edits=tuple((e.name, dict(e.when)) for e in self.edits),
            needs=tuple(self.needs),
            withdrawn=self.withdrawn,
            attribute_calls=tuple(
                {"receiver": c.receiver, "method": c.method, "implementation": c.implementation}
                for c in self.attribute_calls
            ),
        )

    def conditions(self) -> dict[str, list[str]]:
        """Every distribution the patch or one of its edits looks at, with its specifiers (as
        planning reads them from the spec: one definition)."""
        return dict(self.spec().conditions())
