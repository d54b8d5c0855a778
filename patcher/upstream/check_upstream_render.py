"""check-upstream's report on the terminal (rich, stderr) and as Markdown (a CI job summary)."""

from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING

from packaging.version import Version

from . import connectors
from .check import Cell, CheckReport
from .gates import GateCheck

if TYPE_CHECKING:  # rich loads only when the terminal report is printed
    from rich.console import Console

CELL_TEXT = {
    "applies": ("applies", "green"),
    "already-satisfied": ("fixed", "cyan"),
    "anchor-missing": ("DRIFT", "bold red"),
    "not-selected": ("not selected", "dim"),
}
CODEMOD_SHORT = {
    "applied": "applies",
    "already-satisfied": "fixed",
    "anchor-missing": "no anchor",
    "no file": "no file",
}


def _versions(values) -> list[str]:
    return sorted(set(values), key=Version)


def _short(patch_id: str) -> str:
    """v1-block-hasher -> v1; flask-werkzeug3:v1-url-quote -> flask-werkzeug3:v1."""
    qualifier, _, local = patch_id.rpartition(":")
    short = local.split("-", 1)[0]
    return f"{qualifier}:{short}" if qualifier else short


def _short_order(short: str) -> tuple[str, int]:
    qualifier, _, local = short.rpartition(":")
    return qualifier, int(local[1:])


def _span(versions: list[str]) -> str:
    if len(versions) <= 3:
        return ", ".join(versions)
    return f"{versions[0]} … {versions[-1]} ({len(versions)})"


def _number(patch_id: str) -> int:
    head = _short(patch_id)[1:]
    return int(head) if head.isdigit() else 0


def matrix_rows(report: CheckReport):
    """Patches (by number) and rows: (distribution, [versions], {patch: cell}); consecutive
    releases whose cells all read the same are one row."""
    patches = sorted({c.patch_id for c in report.cells}, key=_number)
    by_release: dict[tuple[str, str], dict[str, Cell]] = defaultdict(dict)
    for cell in report.cells:
        by_release[(cell.distribution, cell.version)][cell.patch_id] = cell
    rows: list[tuple[str, list[str], dict[str, Cell]]] = []
    for dist, version in sorted(by_release, key=lambda dv: (dv[0], Version(dv[1]))):
        cells = by_release[(dist, version)]
        shape = {p: (cell_text(c), c.reason.removeprefix(f"{dist} {version} ")) for p, c in cells.items()}
        if rows and rows[-1][0] == dist:
            last = rows[-1]
            last_shape = {p: (cell_text(c), c.reason.removeprefix(f"{dist} {last[1][0]} ")) for p, c in last[2].items()}
            if shape == last_shape:
                last[1].append(version)
                continue
        rows.append((dist, [version], cells))
    return patches, rows


def cell_text(cell) -> str:
    if cell.status == "not-selected":
        return f"({CODEMOD_SHORT.get(cell.codemod, cell.codemod)})"
    return CELL_TEXT[cell.status][0]


LEGEND = (
    "applies: selected, the codemods rewrite the file; fixed: selected, already in the patched shape "
    "(fixed upstream); DRIFT: selected, an anchor is missing; (…): not selected there, in brackets "
    "what the codemods would say"
)


def not_selected_reasons(report: CheckReport) -> list[str]:
    """Reasons grouped over releases: 'v1, v2 … on speculators 0.5.0 … 0.9.0: <why>'."""
    grouped: dict[tuple[str, str], list[str]] = defaultdict(list)
    patches_by: dict[tuple[str, str], set[str]] = defaultdict(set)
    for cell in report.cells:
        if cell.status == "not-selected":
            why = cell.reason.removeprefix(f"{cell.distribution} {cell.version} ")
            grouped[(why, cell.distribution)].append(cell.version)
            patches_by[(why, cell.distribution)].add(_short(cell.patch_id))
    out = []
    for (why, dist), versions in grouped.items():
        shown = ", ".join(sorted(patches_by[(why, dist)], key=_short_order))
        out.append(f"{shown} on {dist} {_span(_versions(versions))}: {why}")
    return out


def short_fact(check: GateCheck) -> str:
    """The fact without its module path (the JSON and Markdown carry it)."""
    fact = check.fact
    assert fact is not None  # a gate without its fact has no row
    return fact.describe().replace(fact.module_text + ".", "", 1) if fact.qualname else fact.describe()


def holds_ranges(check: GateCheck) -> str:
    """Runs of consecutive releases read where the fact holds: "0.12.0–0.32.0"."""
    runs: list[list[str]] = []
    previous = False
    for version, verdict in check.holds.items():
        if verdict.holds:
            if previous:
                runs[-1].append(version)
            else:
                runs.append([version])
        previous = verdict.holds
    return ", ".join(r[0] if len(r) == 1 else f"{r[0]}–{r[-1]}" for r in runs) or "none"


def timeline(check: GateCheck) -> str:
    return "".join("✓" if v.holds else "·" for v in check.holds.values())


def read_summary(report: CheckReport) -> list[str]:
    out = []
    for dist, reads in report.reads.items():
        by_wheel: dict[str, list[str]] = defaultdict(list)
        for version, read in reads.items():
            by_wheel[read.wheel if not read.error else f"{read.wheel} (unreadable)"].append(version)
        parts = [f"{wheel} wheels: {_span(_versions(vs))}" for wheel, vs in sorted(by_wheel.items())]
        out.append(f"{dist} sources read from " + "; ".join(parts))
    return out


def first_label(check: GateCheck, report: CheckReport) -> str:
    if check.first is None:
        return "never (in the releases read)"
    read = report.reads.get(check.fact.distribution, {}).get(check.first) if check.fact else None
    wheel = f" ({read.wheel})" if read else ""
    oldest = next(iter(check.holds), None)
    return f"{'≤' if check.first == oldest else ''}{check.first}{wheel}"


def allows(report: CheckReport, version: str) -> str:
    """e.g. "transformers <5,>=4.56.0 (12 read), torch ==2.10.0 (1 read)"."""
    specs = report.requirements.specs.get(version)
    if specs is None:
        return "not read"
    allowed = report.requirements.allowed.get(version, {})
    return ", ".join(
        f"{d} {specs[d]} ({len(allowed.get(d, []))} read)" if d in specs else f"{d}: no requirement"
        for d in ("transformers", "torch")
    )


def release_rows(report: CheckReport) -> list[tuple[str, str, str, str, str, str]]:
    """Per vLLM release bound: (release, what it allows, patches selected, calls bound, static
    verdict, last run). A release's bindings include those against the transformers and torch
    releases it allows."""
    rows = []
    for version in report.binding_releases():
        bindings = [b for b in report.bindings if version in b.vllm_releases]
        patches = sorted({p for b in bindings for p in b.patches}, key=_number)
        problems = sum(len(b.problems) for b in bindings)
        run = report.runs.get(version)
        last = (
            "never run"
            if run is None
            else f"{'ok' if run.ok else 'FAILED'} {run.finished[:10]}"
            + (" (other patches)" if run.stale else "")
            + (f": {run.summary}" if run.summary and not run.ok else "")
        )
        rows.append(
            (
                version,
                allows(report, version),
                " ".join(_short(p) for p in patches),
                str(sum(b.checked for b in bindings)),
                "binds" if not problems else f"{problems} call(s) do not bind",
                last,
            )
        )
    return rows


def not_covered_rows(report: CheckReport) -> list[str]:
    """One line per release no patched release line runs on: refused by patcher, not drift."""
    return [
        f"{dist} {version}: not covered: refused (exit 7): {why}; status, plan, apply and verify refuse a target "
        f"with it, so no gate or binding is checked there"
        for dist, releases in report.not_covered.items()
        for version, why in releases.items()
    ]


CONNECTORS_TITLE = (
    "speculators 0.5+ path: hs-connectors' modules bound per vLLM release with extract_hidden_states (static)"
)


def connector_rows(report: CheckReport) -> list[tuple[str, str, str, str, str]]:
    """Per hs-connectors release and module: (release, module, binds on, does not bind on, status)."""
    return [(v.connector, v.file, v.span(v.binds_on), v.span(v.fails_on), v.status) for v in report.connectors]


def connector_lines(report: CheckReport) -> list[str]:
    """Each module's findings with the vLLM releases they are met on and their declaration, and
    where the path does not run."""
    out = []
    for verdict in report.connectors:
        for finding in verdict.findings:
            declared = finding.declared
            said = (
                f"declared for vllm {declared.vllm}: {declared.why}" if declared else "not declared in CONNECTOR_DRIFT"
            )
            out.append(
                f"{connectors.DISTRIBUTION} {verdict.connector} {finding.problem} "
                f"(vllm {verdict.span(finding.vllm)}; {said})"
            )
    _, without = connectors.path_summary(report.path_vllm)
    if without:
        out.append(
            f"not bound on vllm {connectors.ranges(without, sorted(report.path_vllm, key=Version))}: "
            f"no {connectors.PATH_MODULE} (the 0.5+ path does not run there)"
        )
    return out


def never_run(report: CheckReport) -> str:
    missing = [v for v in report.binding_releases() if v not in report.runs]
    if not missing:
        return "every vLLM release bound has a release-matrix result"
    return f"never run (no release-matrix result): {', '.join(missing)}"


# ---------------------------------------------------------------------- terminal


def render_terminal(report: CheckReport, quiet: bool = False) -> None:
    from rich.console import Console

    console = Console(stderr=True, highlight=False)
    if not console.is_terminal:  # CI logs: wide enough for the tables
        console.width = max(console.width, 200)
    if report.exit_code == 4:
        console.print(f"[bold red]error:[/] {report.message}", soft_wrap=True)
        return
    if not quiet:
        _print_matrix(console, report)
        _print_gates(console, report)
        if report.bindings:
            _print_bindings(console, report)
        if report.connectors:
            _print_connectors(console, report)
        if report.nightlies:
            _print_nightlies(console, report)
    for row in not_covered_rows(report):  # shown even when quiet: why a release was not read
        console.print(f"[yellow]{row}[/]", soft_wrap=True)
    for problem in report.problems:
        console.print(f"[bold red]error:[/] {problem}", soft_wrap=True)
    style = "green" if report.exit_code == 0 else "bold red"
    console.print(f"[{style}]check-upstream: {report.message} (exit {report.exit_code})[/]", soft_wrap=True)


def _print_matrix(console: Console, report: CheckReport) -> None:
    from rich.table import Table

    patches, rows = matrix_rows(report)
    dists = sorted({row[0] for row in rows})
    table = Table(title=f"patches × releases of {', '.join(dists)}")
    table.add_column("release", no_wrap=True)
    for patch_id in patches:
        table.add_column(_short(patch_id), no_wrap=True)
    for _dist, versions, cells in rows:
        shown = []
        for patch_id in patches:
            cell = cells.get(patch_id)
            shown.append("" if cell is None else f"[{CELL_TEXT[cell.status][1]}]{cell_text(cell)}[/]")
        table.add_row(_span(versions), *shown)
    console.print(table)
    console.print(f"  [dim]{LEGEND}[/]", soft_wrap=True)
    for line in not_selected_reasons(report):
        console.print(f"  [dim]{line}[/]", soft_wrap=True)


def _print_gates(console: Console, report: CheckReport) -> None:
    from rich.table import Table

    gates = Table(title="gates: the first release where each edit's fact holds")
    for column in ("patch", "edit", "fact", "gate", "first release", "holds in", ""):
        gates.add_column(column)
    for check in report.gates:
        status = "[green]ok[/]" if check.ok else "[bold red]WRONG[/]"
        gates.add_row(
            _short(check.patch_id),
            check.edit,
            short_fact(check) if check.fact else "[red](no fact declared)[/]",
            check.gate or "any",
            first_label(check, report),
            holds_ranges(check) if check.fact else "",
            status,
        )
    console.print(gates)
    for line in read_summary(report):
        console.print(f"  [dim]{line}[/]", soft_wrap=True)


def _print_bindings(console: Console, report: CheckReport) -> None:
    from rich.table import Table

    bound = Table(
        title="patched files bound per vLLM release and the transformers/torch releases it "
        "allows (static), beside the release matrix's last run"
    )
    for column in ("vllm", "allows", "patches selected", "imports+calls bound", "static", "last run"):
        bound.add_column(column)
    for version, allowed, patches, checked, verdict, last in release_rows(report):
        style = "green" if verdict == "binds" else "bold red"
        bound.add_row(version, allowed, patches, checked, f"[{style}]{verdict}[/]", last)
    console.print(bound)
    console.print(f"  [dim]{never_run(report)}[/]", soft_wrap=True)


def _print_connectors(console: Console, report: CheckReport) -> None:
    from rich.table import Table

    table = Table(title=CONNECTORS_TITLE)
    for column in (connectors.DISTRIBUTION, "module", "binds on", "does not bind on", "status"):
        table.add_column(column)
    for connector, module, binds_on, fails_on, status in connector_rows(report):
        style = "green" if status in ("binds", "as declared") else "bold red"
        table.add_row(connector, module, binds_on, fails_on, f"[{style}]{status}[/]")
    console.print(table)
    for line in connector_lines(report):
        console.print(f"  [dim]{line}[/]", soft_wrap=True)


def _print_nightlies(console: Console, report: CheckReport) -> None:
    from rich.table import Table

    nightly = Table(title="nightlies (fabricated metadata, selection only)")
    nightly.add_column("vllm")
    nightly.add_column("selected edits")
    for nightly_check in report.nightlies:
        chosen = ", ".join(f"{_short(p)}: {len(e)}" for p, e in nightly_check.selected.items() if e) or "none"
        nightly.add_row(nightly_check.version, chosen)
    console.print(nightly)
    for nightly_check in report.nightlies:
        for note in nightly_check.notes:
            console.print(f"  [dim]{nightly_check.version}: {note}[/]", soft_wrap=True)


# ---------------------------------------------------------------------- markdown


def _md(text: str) -> str:
    return text.replace("|", "\\|")


def _md_matrix(report: CheckReport) -> list[str]:
    """The patches × releases table, its legend and why a patch is selected where it is not."""
    lines: list[str] = []
    patches, rows = matrix_rows(report)
    lines += ["## Patches × releases", ""]
    lines.append("| release | " + " | ".join(_short(p) for p in patches) + " |")
    lines.append("|---" * (len(patches) + 1) + "|")
    for dist, versions, cells in rows:
        shown = []
        for patch_id in patches:
            cell = cells.get(patch_id)
            text = "" if cell is None else cell_text(cell)
            shown.append(f"**{text}**" if cell is not None and cell.drift else text)
        lines.append(f"| {dist} {_span(versions)} | " + " | ".join(shown) + " |")
    lines += ["", LEGEND + ".", ""]
    lines += [f"- {_md(line)}" for line in not_selected_reasons(report)] + [""]
    return lines


def _md_gates(report: CheckReport) -> list[str]:
    """Each edit's fact against its gate, and what was read."""
    lines: list[str] = ["## Gates", "", "| patch | edit | fact | gate | first release | holds in | status |"]
    lines.append("|---|---|---|---|---|---|---|")
    for check in report.gates:
        fact = _md(check.fact.describe()) if check.fact else "(no fact declared)"
        lines.append(
            f"| {_short(check.patch_id)} | {check.edit} | {fact} | `{_md(check.gate or 'any')}` | "
            f"{first_label(check, report)} | `{timeline(check)}` | {'ok' if check.ok else '**WRONG**'} |"
        )
    lines.append("")
    versions = _versions(v for check in report.gates for v in check.holds)
    if versions:
        lines.append(f"`holds in`: one mark per release read, {versions[0]} to {versions[-1]} (✓ holds, · not).")
    lines += [f"{_md(line)}." for line in read_summary(report)] + [""]
    return lines


def _md_bindings(report: CheckReport) -> list[str]:
    """The patched files bound per vLLM release."""
    if not report.bindings:
        return []
    lines: list[str] = [
        "## Patched files bound per vLLM release",
        "",
        (
            "Static: every vLLM import and call of the files apply writes there, and every transformers "
            "and torch import and call against each release of those the vLLM release allows; last run: "
            "the release matrix's result (runtime drift is seen only there)."
        ),
        "",
        "| vllm | allows | patches selected | imports+calls bound | static | last run |",
        "|---|---|---|---|---|---|",
    ]
    for version, allowed, patches, checked, verdict, last in release_rows(report):
        lines.append(
            f"| {version} | {_md(allowed)} | {patches} | {checked} | "
            f"{verdict if verdict == 'binds' else '**' + verdict + '**'} | {_md(last)} |"
        )
    lines += ["", _md(never_run(report)) + ".", ""]
    return lines


def _md_connectors(report: CheckReport) -> list[str]:
    """The hs-connectors modules bound per vLLM release."""
    if not report.connectors:
        return []
    lines: list[str] = [
        f"## {CONNECTORS_TITLE[0].upper()}{CONNECTORS_TITLE[1:]}",
        "",
        (
            "Each module of each hs-connectors release that imports vLLM: its imports, calls, base classes and "
            "the methods it overrides; every problem met must be declared in `CONNECTOR_DRIFT` "
            "(patches/connector_drift.py) for exactly the vLLM releases it is met on."
        ),
        "",
        "| hs-connectors | module | binds on | does not bind on | status |",
        "|---|---|---|---|---|",
    ]
    for connector, module, binds_on, fails_on, verdict_status in connector_rows(report):
        bold = verdict_status if verdict_status in ("binds", "as declared") else f"**{verdict_status}**"
        lines.append(f"| {connector} | {module} | {binds_on} | {fails_on} | {bold} |")
    lines += [""] + [f"- {_md(line)}" for line in connector_lines(report)] + [""]
    return lines


def _md_nightlies(report: CheckReport) -> list[str]:
    """The nightlies' selection."""
    if not report.nightlies:
        return []
    lines: list[str] = [
        "## Nightlies (fabricated metadata, selection only)",
        "",
        "| vllm | selected edits |",
        "|---|---|",
    ]
    for nightly_check in report.nightlies:
        chosen = ", ".join(f"{_short(p)}: {', '.join(e)}" for p, e in nightly_check.selected.items() if e) or "none"
        lines.append(f"| `{nightly_check.version}` | {_md(chosen)} |")
    lines.append("")
    return lines


def render_markdown(report: CheckReport) -> str:
    lines = ["# patcher check-upstream", ""]
    if report.exit_code == 4:
        lines += [f"**The package index could not be reached:** {_md(report.message)}", ""]
        return "\n".join(lines)
    verdict = "passed" if report.exit_code == 0 else f"failed (exit {report.exit_code})"
    lines += [f"**{verdict}**: {_md(report.message)}", ""]
    if report.problems:
        lines += ["## Problems", ""] + [f"- {_md(p)}" for p in report.problems] + [""]
    if report.not_covered:
        lines += ["## Not covered (refused, exit 7; not drift)", ""] + [f"- {_md(r)}" for r in not_covered_rows(report)]
        lines.append("")

    lines += _md_matrix(report) + _md_gates(report)
    lines += _md_bindings(report) + _md_connectors(report) + _md_nightlies(report)
    return "\n".join(lines)
