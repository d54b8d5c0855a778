"""How a fleet run looks: live progress on a terminal (rich), plain lines otherwise, the JSON
document on stdout (--json), and one host's report or the per-host summary at the end
(`TerminalFleetView`, what patcher.fleet.fleet_run talks to)."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence

from ..fleet.rollout import SKIPPED, TALLY_ORDER, FleetProgress, HostResult, succeeded, tally
from .render import STATUS_STYLE, render_reports, shown, stderr_console

STYLE = {**STATUS_STYLE, SKIPPED: "yellow"}
SHOWN_WHEN_NONE = {"ok", "changed", "failed", "unreachable", "rolled-back"}  # the others only when they occur


def _label(status: str) -> str:
    return status.replace("-", " ")


class PlainProgress(FleetProgress):
    """One line per step and per finished host: for logs and pipes."""

    def __init__(self, echo, announce_done: bool = True) -> None:
        self.echo = echo
        self.announce_done = announce_done  # one host: its full report follows anyway
        self.lock = threading.Lock()

    def host_step(self, host, message: str) -> None:
        with self.lock:
            self.echo(f"{host.name}: {message}")

    def host_done(self, result: HostResult) -> None:
        r = result.report
        if not self.announce_done:
            return
        with self.lock:
            self.echo(f"{result.host.name}: {_label(r.status)}" + (f": {r.message}" if r.message else ""))

    def stopped(self, message: str) -> None:
        with self.lock:
            self.echo(message.replace("not started: ", "", 1))


class LiveProgress(FleetProgress):
    """A terminal: hosts in flight with their current step, a bar, and the tally so far; each
    finished host is printed above the live area."""

    def __init__(self) -> None:
        from rich.live import Live

        self.console = stderr_console()
        self.lock = threading.RLock()
        self.total = 0
        self.active: dict[str, tuple[str, float]] = {}
        self.done: list[HostResult] = []
        self.note = ""
        self.live = Live(console=self.console, refresh_per_second=8, transient=True, get_renderable=self._render)

    def _render(self):
        from rich.console import Group
        from rich.progress_bar import ProgressBar
        from rich.table import Table
        from rich.text import Text

        with self.lock:
            counts = tally(self.done)
            bar = Table.grid(padding=(0, 1))
            bar.add_row(
                ProgressBar(total=max(self.total, 1), completed=len(self.done), width=30),
                Text(f"{len(self.done)}/{self.total} hosts  ")
                + Text("  ".join(f"{_label(s)} {counts[s]}" for s in TALLY_ORDER if counts[s])),
            )
            rows = Table.grid(padding=(0, 2))
            now = time.monotonic()
            for name, (step, since) in list(self.active.items())[:12]:
                rows.add_row(f"[bold]{shown(name)}[/]", f"{now - since:4.1f}s", shown(step))
            if len(self.active) > 12:
                rows.add_row("", "", f"... and {len(self.active) - 12} more")
            parts: list = [bar, rows]
            if self.note:
                parts.append(Text(self.note, style="yellow"))
            return Group(*parts)

    def start(self, total: int) -> None:
        self.total = total
        self.live.start()

    def host_started(self, host) -> None:
        with self.lock:
            self.active[host.name] = ("connecting", time.monotonic())

    def host_step(self, host, message: str) -> None:
        with self.lock:
            since = self.active.get(host.name, ("", time.monotonic()))[1]
            self.active[host.name] = (message, since)

    def host_done(self, result: HostResult) -> None:
        r = result.report
        with self.lock:
            self.active.pop(result.host.name, None)
            self.done.append(result)
            style = STYLE.get(r.status, "")
            self.console.print(
                f"[bold]{shown(result.host.name)}[/]  [{style}]{_label(r.status)}[/]"
                + (f"  {shown(r.message)}" if r.message else ""),
                highlight=False,
            )

    def stopped(self, message: str) -> None:
        with self.lock:
            self.note = message.replace("not started: ", "", 1)

    def finish(self) -> None:
        self.live.stop()


def render_summary(command: str, results: list[HostResult]) -> None:
    """The per-host table and the tally."""
    from rich.table import Table

    console = stderr_console()
    table = Table(title=f"patcher {command}: {len(results)} host(s)", title_justify="left")
    table.add_column("host", overflow="fold")
    table.add_column("status")
    table.add_column("exit", justify="right")
    table.add_column("patches", overflow="fold")
    table.add_column("message", overflow="fold")
    for result in results:
        r = result.report
        states: dict[str, int] = {}
        for p in r.patches:
            states[p.state] = states.get(p.state, 0) + 1
        table.add_row(
            shown(result.host.name),
            f"[{STYLE.get(r.status, '')}]{_label(r.status)}[/]",
            str(r.exit_code),
            ", ".join(f"{n} {s}" for s, n in states.items()),
            shown(r.message),
        )
    console.print(table)
    counts = tally(results)
    console.print(
        "  ".join(
            f"[{STYLE.get(s, '')}]{_label(s)}[/] {counts[s]}" for s in TALLY_ORDER if counts[s] or s in SHOWN_WHEN_NONE
        )
    )


class TerminalFleetView:
    """The fleet command's output (patcher.fleet.fleet_run.FleetView): progress and errors on
    stderr through the CLI's `note` and `error`, the JSON document and --diff on stdout."""

    def __init__(
        self,
        note: Callable[[str], None],
        error: Callable[[str], None],
        json_mode: bool,
        quiet: bool,
        diff: bool,
        settle: Callable[[], None] = lambda: None,
    ) -> None:
        self.note, self.error, self.settle = note, error, settle
        self.json_mode, self.quiet, self.diff = json_mode, quiet, diff

    def progress(self, hosts: int) -> FleetProgress | None:
        """None (--quiet), a live table (a terminal, several hosts), or plain lines on stderr
        (`note`'s, which show the time a step has taken: cli/ticker.py)."""
        if self.quiet:
            return None
        if sys.stderr.isatty() and os.environ.get("TERM", "") != "dumb" and hosts > 1:
            self.settle()  # the live table shows each host's time itself: one live display at a time
            return LiveProgress()
        return PlainProgress(self.note, announce_done=hosts > 1)

    def show(self, command: str, results: Sequence[HostResult], interrupted: bool, doc: dict) -> None:
        """The JSON document (--json); one host's report as a local run shows it, or the summary table."""
        import click

        self.settle()

        reports = [r.report for r in results]
        if self.json_mode:
            click.echo(json.dumps(doc, indent=2))
        if len(results) == 1:
            report = reports[0]
            if not self.quiet or report.exit_code not in (0, 6):
                render_reports(command, reports, show_diff=self.diff and not self.json_mode, quiet=self.quiet)
            return
        if self.diff and not self.json_mode:
            for result in results:
                for f in result.report.files:
                    if f.get("diff"):
                        sys.stdout.write(f"# {result.host.name}\n" + f["diff"])
        if not self.quiet or any(not succeeded(r) for r in reports):
            render_summary(command, list(results))
