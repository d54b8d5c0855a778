"""Terminal rendering (rich, to stderr). NO_COLOR is honoured by rich itself."""

from __future__ import annotations

import sys

from ..core.errors import EXIT_PENDING, printable
from ..plan.planning import readable_conditions

STATE_STYLE = {
    "applied": "green",
    "pending": "yellow",
    "already-satisfied": "cyan",
    "not-selected": "dim",
    "stale": "magenta",
    "modified": "red",
    "anchor-missing": "red",
    "failed": "red",
}
STATUS_STYLE = {
    "ok": "green",
    "changed": "green",
    "failed": "red",
    "unreachable": "red",
    "timed-out": "red",
    "rolled-back": "red",
    "interrupted": "yellow",
    "pending": "yellow",
}


def outcome_label(status: str, exit_code: int) -> str:
    """The one word that starts a target's last line: its status, except that `plan`'s exit 6
    (changes pending) reads "pending", never "ok". The status word is the whole prefix: a failed
    target's line reads "failed: <message>", not "failed: error: <message>"."""
    return "pending" if exit_code == EXIT_PENDING else status


def shown(text: str) -> str:
    """Text for a rich console: what a target says escaped (core.errors.printable), then rich's
    markup escaped, so neither a control character nor a `[style]` of theirs takes effect."""
    from rich.markup import escape

    return escape(printable(text))


def stderr_console():
    from rich.console import Console

    return Console(stderr=True, highlight=False, soft_wrap=True)


WIDE_TABLE = 160  # columns from which `list` is one table; below, and in a pipe, one block per patch


def render_patch_list(patches) -> None:
    """Every patch: a table on a wide terminal; otherwise a block per patch (its id whole on its
    own line, then file, conditions and upstream), wrapped at the console's width between words."""
    import textwrap

    from rich.markup import escape
    from rich.table import Table

    console = stderr_console()
    rows = []
    for p in patches:
        spec = p.spec()
        shown = readable_conditions(spec.requires, [when for _, when in spec.edits])
        conditions = "; ".join(f"{n} {text}" for n, text in shown.items()) or "any version"
        rows.append((p.id, p.title, p.target.path, conditions, p.upstream))
    if console.is_terminal and console.width >= WIDE_TABLE:
        table = Table(title="patches, in canonical order")
        for column in ("id", "title", "file", "conditions", "upstream"):
            table.add_column(column, overflow="fold")
        for pid, title, path, conditions, upstream in rows:
            table.add_row(pid, title, path.split("/")[-1], conditions, upstream)
        console.print(table)
        return
    width = max(console.width, 40)
    for pid, title, path, conditions, upstream in rows:
        console.print(f"[bold]{escape(pid)}[/bold]")
        for label, text in (("", title), ("file: ", path), ("when: ", conditions), ("upstream: ", upstream)):
            lines = textwrap.wrap(
                label + text,
                width=width,
                initial_indent="  ",
                subsequent_indent="    ",
                break_long_words=False,
                break_on_hyphens=False,
            )
            for line in lines:
                console.print(escape(line))


def render_reports(command: str, reports, show_diff: bool, quiet: bool) -> None:
    from rich.table import Table

    console = stderr_console()
    for r in reports:
        style = STATUS_STYLE.get(r.status, "")
        if not quiet:
            versions = ", ".join(
                f"{n} {v}" + (f" ({r.distributions[n]})" if r.distributions.get(n, n) != n else "")
                for n, v in sorted(r.versions.items())
            )
            if versions or r.patches:  # a target that could not be read has neither: its error line says why
                console.print(f"[bold]{shown(r.target)}[/bold]  {shown(versions)}")
            if r.patches:
                table = Table(show_header=True, box=None, pad_edge=False)
                table.add_column("patch")
                table.add_column("state")
                table.add_column("why", overflow="fold")
                for p in r.patches:
                    table.add_row(shown(p.id), f"[{STATE_STYLE.get(p.state, '')}]{p.state}[/]", shown(p.reason))
                console.print(table)
            for note in r.notes:
                console.print(f"note: {shown(note)}")
        if r.message:
            label, style = (
                outcome_label(r.status, r.exit_code),
                STATUS_STYLE.get(outcome_label(r.status, r.exit_code), style),
            )
            console.print(f"[{style}]{label}[/]: {shown(r.message)}", markup=True)
        for problem in r.problems[1:] if r.message else r.problems:
            console.print(f"  [red]-[/red] {shown(problem)}", markup=True)
        if show_diff:
            for f in r.files:
                if f.get("diff"):
                    sys.stdout.write(f["diff"])
