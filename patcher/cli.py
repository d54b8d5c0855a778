"""The `patcher` command line. Messages and progress go to stderr; --json alone to stdout."""

from __future__ import annotations

import json
import os
import sys

import click

from . import __version__

PYTHON_HELP = (
    "the target environment's interpreter, e.g. /root/ml-env/bin/python3 "
    "(default: the interpreter patcher runs in)"
)


class Output:
    def __init__(self, json_mode: bool, quiet: bool) -> None:
        self.json_mode = json_mode
        self.quiet = quiet

    def progress(self, message: str) -> None:
        if not self.quiet:
            click.echo(message, err=True, color=_color())

    def error(self, message: str) -> None:
        click.echo(click.style("error: ", fg="red", bold=True) + message, err=True, color=_color())


def _color() -> bool | None:
    return False if os.environ.get("NO_COLOR") else None


def _transport(python: str | None):
    from .transport import LocalTransport

    return LocalTransport(python or sys.executable)


def _resolve(ids: tuple[str, ...], out: Output) -> list[str]:
    from .registry import UnknownPatch, load_patches, resolve_ids

    try:
        return resolve_ids(load_patches(), list(ids))
    except UnknownPatch as exc:
        out.error(f"{exc}; see `patcher list`")
        sys.exit(2)


def _run(command: str, python: str | None, json_mode: bool, quiet: bool, **kwargs) -> None:
    from .registry import load_patches
    from .render import render_reports
    from .report import document, overall_exit
    from .run import RunOptions, run_target

    out = Output(json_mode, quiet)
    only = _resolve(kwargs.pop("only", ()), out)
    skip = _resolve(kwargs.pop("skip", ()), out)
    options = RunOptions(command=command, only=only, skip=skip, progress=out.progress, **kwargs)
    report = run_target(_transport(python), load_patches(), options)
    reports = [report]
    if json_mode:
        click.echo(json.dumps(document(command, reports), indent=2))
    if not quiet or report.exit_code not in (0, 6):
        render_reports(command, reports, show_diff=options.diff and not json_mode, quiet=quiet)
    sys.exit(overall_exit(reports))


python_option = click.option("--python", "python", metavar="PATH", help=PYTHON_HELP)
json_option = click.option("--json", "json_mode", is_flag=True, help="print the JSON report (schema_version 1) on stdout")
quiet_option = click.option("--quiet", "-q", is_flag=True, help="no progress, only errors")
only_option = click.option("--only", multiple=True, metavar="ID", help="only this patch (vN or full id); repeatable")
skip_option = click.option("--skip", multiple=True, metavar="ID", help="leave this patch out (vN or full id); repeatable")
lock_option = click.option(
    "--lock-timeout", default=10.0, show_default=True, metavar="SECONDS", help="wait this long for another run's lock"
)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="patcher")
def main() -> None:
    """Versioned, verified, reversible patches that keep speculators running on newer vLLM.

    Exit codes: 0 ok (also nothing to do), 1 a patch or verification failed (rolled back),
    2 usage error, 3 conflict (file modified by hand, anchor missing), 4 target unreachable,
    5 target locked by another run, 6 `plan` only: changes pending.
    """


@main.command("list")
@json_option
def list_patches(json_mode: bool) -> None:
    """Every patch: id, title, target file, conditions, upstream reference."""
    from .registry import load_patches
    from .render import render_patch_list

    patches = load_patches()
    if json_mode:
        rows = [
            {
                "id": p.id,
                "title": p.title,
                "distribution": p.target.distribution,
                "file": p.target.path,
                "requires": dict(p.requires),
                "needs": list(getattr(p, "needs", ())),
                "edits": [{"name": e.name, "when": dict(e.when), "answers": e.answers} for e in p.edits],
                "upstream": p.upstream,
                "fixed_in": p.fixed_in,
                "without_it": p.note,
            }
            for p in patches
        ]
        click.echo(json.dumps({"schema_version": 1, "patches": rows}, indent=2))
        return
    render_patch_list(patches)


@main.command()
@python_option
@json_option
@quiet_option
def status(python, json_mode, quiet) -> None:
    """Detected versions; per patch: selected or why not, and its state on disk."""
    _run("status", python, json_mode, quiet)


@main.command()
@python_option
@click.option("--diff", is_flag=True, help="show the unified diff of every file that would change")
@only_option
@skip_option
@click.option("--force", is_flag=True, help="as apply --force")
@json_option
@quiet_option
def plan(python, diff, only, skip, force, json_mode, quiet) -> None:
    """What apply would change; writes nothing. Exit 6 when changes are pending, 0 when none."""
    _run("plan", python, json_mode, quiet, diff=diff, only=only, skip=skip, force=force)


@main.command()
@python_option
@only_option
@skip_option
@click.option("--no-verify", is_flag=True, help="skip verification in a fresh target interpreter")
@click.option(
    "--force",
    is_flag=True,
    help="adopt a file changed by hand as the new original (backed up, restored by rollback)",
)
@lock_option
@json_option
@quiet_option
def apply(python, only, skip, no_verify, force, lock_timeout, json_mode, quiet) -> None:
    """Apply the selected patches, verify, record; on a failed verification, restore."""
    _run(
        "apply", python, json_mode, quiet, only=only, skip=skip, verify=not no_verify, force=force,
        lock_timeout=lock_timeout,
    )


@main.command()
@python_option
@only_option
@lock_option
@json_option
@quiet_option
def rollback(python, only, lock_timeout, json_mode, quiet) -> None:
    """Restore the original files (byte-identical); --only takes out single patches."""
    _run("rollback", python, json_mode, quiet, only=only, lock_timeout=lock_timeout)


@main.command()
@python_option
@click.option("--all", "forget_all", is_flag=True, help="forget every record, not only those pip made obsolete")
@lock_option
@json_option
@quiet_option
def forget(python, forget_all, lock_timeout, json_mode, quiet) -> None:
    """Clear the records of files pip has replaced since patcher wrote them."""
    _run("forget", python, json_mode, quiet, forget_all=forget_all, lock_timeout=lock_timeout)


from .demo.command import demo  # noqa: E402  (the main job: `patcher demo`)

main.add_command(demo)

if __name__ == "__main__":
    main()
