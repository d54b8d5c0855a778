"""The speculators 0.5+ path: hs-connectors' KV connector modules bound against each vLLM release.

speculators 0.5.0 and later import nothing of vLLM: extraction runs in `vllm serve` with the
speculative method `extract_hidden_states` and a KV connector, vLLM's own
ExampleHiddenStatesConnector or one of hs-connectors' (0.8+ requires hs-connectors; 0.7 vendors its
transfer.py only, which imports nothing of vLLM), loaded by vLLM from `kv_connector_module_path`.
Those modules import vLLM's internals and subclass its connector classes, so they are what can
drift on this path. Each module of each hs-connectors release on the index that imports vLLM is
bound (binding.bind_file with its class checks) against every vLLM release read that has the
speculative method. What a module meets is upstream's, not a patch's: each problem must be one
patches/connector_drift.py declares (CONNECTOR_DRIFT) for exactly the releases it is met on, as a gate
must select exactly the releases where its fact holds.
"""

from __future__ import annotations

import ast
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from packaging.version import Version

from ..model import ConnectorDrift
from ..plan.selection import condition_holds
from .binding import Binding
from .facts import parse
from .sources import ReleaseFiles

DISTRIBUTION = "hs-connectors"
PACKAGE = "hs_connectors"
# The module of the speculative method `extract_hidden_states` (vLLM 0.17.0 on): where it is
# missing, `vllm serve` cannot run the 0.5+ path at all, and nothing is bound there.
PATH_MODULE = "vllm/model_executor/models/extract_hidden_states.py"


@dataclass(frozen=True)
class ConnectorFile:
    """One module of an hs-connectors release, as binding.bind_cached binds it (a patched.Variant's shape)."""

    path: str
    versions: tuple[tuple[str, str], ...]  # ((DISTRIBUTION, "0.9.0"),)
    code: str
    used: frozenset[str]  # every attribute name its package refers to: a method named there is its own
    patches: tuple[str, ...] = ()
    attribute_calls: tuple[dict, ...] = ()

    @property
    def release(self) -> str:
        return dict(self.versions)[DISTRIBUTION]


def read_connector(files: ReleaseFiles) -> list[ConnectorFile]:
    """The modules of this hs-connectors release that import vLLM (its wheel's RECORD lists them)."""
    record = files.read(f"{PACKAGE}-{files.version}.dist-info/RECORD") or ""
    paths = sorted(
        {row.split(",")[0] for row in record.splitlines() if row.startswith(f"{PACKAGE}/") and ".py," in row}
    )
    sources = {path: files.read(path) or "" for path in paths}
    trees = {path: parse(code) for path, code in sources.items()}
    used = frozenset(n.attr for tree in trees.values() for n in ast.walk(tree) if isinstance(n, ast.Attribute))
    return [
        ConnectorFile(path, ((DISTRIBUTION, files.version),), sources[path], used)
        for path, tree in trees.items()
        if _imports_vllm(tree)
    ]


def _imports_vllm(tree: ast.AST) -> bool:
    for node in ast.walk(tree):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        if any(n == "vllm" or n.startswith("vllm.") for n in names):
            return True
    return False


@dataclass
class Finding:
    """One problem a module meets, with every vLLM release it is met on and what declares it."""

    problem: str  # the binder's line, without " in vllm X"
    vllm: list[str] = field(default_factory=list)
    declared: ConnectorDrift | None = None

    def unexpected(self) -> list[str]:
        """The releases it is met on that no declaration gives it."""
        spec = self.declared.vllm if self.declared else None
        return [v for v in self.vllm if spec is None or not condition_holds(spec, v)]

    def to_json(self) -> dict:
        return {
            "problem": self.problem,
            "vllm": self.vllm,
            "declared": self.declared.vllm if self.declared else None,
            "why": self.declared.why if self.declared else "",
            "unexpected": self.unexpected(),
        }


@dataclass
class ModuleVerdict:
    """One module of one hs-connectors release over the vLLM releases the path runs on."""

    connector: str  # the hs-connectors release
    file: str
    binds_on: list[str] = field(default_factory=list)
    fails_on: list[str] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    # declarations for this module whose vLLM range selects releases where they are not met
    too_wide: list[tuple[ConnectorDrift, list[str]]] = field(default_factory=list)
    checked: int = 0  # imports, calls, bases and methods bound, over every release

    @property
    def releases(self) -> list[str]:
        """Every vLLM release it was bound on, oldest first."""
        return sorted([*self.binds_on, *self.fails_on], key=Version)

    def span(self, versions: Sequence[str]) -> str:
        """`versions` as runs of consecutive releases bound: "0.17.0–0.21.0"."""
        return ranges(versions, self.releases)

    @property
    def unexpected(self) -> list[str]:
        """Releases where it meets a problem CONNECTOR_DRIFT does not declare there."""
        return sorted({v for f in self.findings for v in f.unexpected()}, key=Version)

    @property
    def status(self) -> str:
        if self.unexpected:
            return "undeclared drift"
        if self.too_wide:
            return "declaration too wide"
        return "as declared" if self.findings else "binds"

    def to_json(self) -> dict:
        return {
            "connector": self.connector,
            "file": self.file,
            "status": self.status,
            "binds_on": self.binds_on,
            "fails_on": self.fails_on,
            "checked": self.checked,
            "findings": [f.to_json() for f in self.findings],
            "too_wide": [{"subject": d.subject, "declared": d.vllm, "not_met_on": vs} for d, vs in self.too_wide],
        }


def verdicts(
    bindings: Sequence[Binding], path_releases: Sequence[str], declared: Sequence[ConnectorDrift]
) -> list[ModuleVerdict]:
    """Per hs-connectors release and module: where it binds, where not and why, against CONNECTOR_DRIFT."""
    by_module: dict[tuple[str, str], list[Binding]] = {}
    for binding in bindings:
        by_module.setdefault((binding.versions[DISTRIBUTION], binding.file), []).append(binding)
    out = []
    for (connector, file), found in sorted(by_module.items(), key=lambda kv: (Version(kv[0][0]), kv[0][1])):
        mine = [
            d
            for d in declared
            if d.distribution == DISTRIBUTION
            and d.path == file
            and (not d.connector or condition_holds(d.connector, connector))
        ]
        verdict = ModuleVerdict(connector, file)
        findings: dict[str, Finding] = {}
        for binding in sorted(found, key=lambda b: Version(b.versions["vllm"])):
            vllm = binding.versions["vllm"]
            if vllm not in path_releases:
                continue
            verdict.checked += binding.checked
            (verdict.fails_on if binding.problems else verdict.binds_on).append(vllm)
            for problem in binding.problems:
                key = problem.replace(f" in {binding.release}", "")
                declaration = next((d for d in mine if d.subject in key), None)
                findings.setdefault(key, Finding(key, declared=declaration)).vllm.append(vllm)
        verdict.findings = list(findings.values())
        for declaration in mine:
            met = {v for f in verdict.findings if f.declared is declaration for v in f.vllm}
            missed = [v for v in verdict.releases if condition_holds(declaration.vllm, v) and v not in met]
            if missed:
                verdict.too_wide.append((declaration, missed))
        out.append(verdict)
    return out


def verdict_problems(verdict: ModuleVerdict) -> list[str]:
    """What makes check-upstream fail for this module, one line each."""
    head = f"speculators 0.5+ path: {DISTRIBUTION} {verdict.connector} {verdict.file}"
    out = []
    for finding in verdict.findings:
        hit = finding.unexpected()
        if hit:
            where = f"declared for vllm {finding.declared.vllm}" if finding.declared else "not in CONNECTOR_DRIFT"
            out.append(f"{head}: {finding.problem} (vllm {verdict.span(hit)}; {where})")
    for declaration, missed in verdict.too_wide:
        out.append(
            f"{head}: CONNECTOR_DRIFT's {declaration.subject!r} (vllm {declaration.vllm}) is not met on vllm "
            f"{verdict.span(missed)}: narrow it"
        )
    return out


def ranges(versions: Sequence[str], universe: Sequence[str]) -> str:
    """Runs of consecutive members of `universe` (ordered) that are in `versions`: "0.17.0–0.21.0, 0.34.0"."""
    chosen = set(versions)
    runs: list[list[str]] = []
    previous = False
    for version in universe:
        if version in chosen:
            if previous:
                runs[-1].append(version)
            else:
                runs.append([version])
        previous = version in chosen
    return ", ".join(r[0] if len(r) == 1 else f"{r[0]}–{r[-1]}" for r in runs) or "none"


def path_summary(path: Mapping[str, bool]) -> tuple[list[str], list[str]]:
    """(the vLLM releases read that have the speculative method, those that do not)."""
    ordered = sorted(path, key=Version)
    return [v for v in ordered if path[v]], [v for v in ordered if not path[v]]
