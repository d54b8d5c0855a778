"""The `patcher` click group and the commands on targets (list, status, plan, apply, verify,
rollback, forget, bundle); `demo` and `check-upstream` load from patcher/demo/demo_command.py and
patcher/upstream/check_upstream_command.py when they run. Messages and progress go to stderr;
--json alone to stdout."""

from __future__ import annotations

import functools
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

import click

from .. import __version__
from ..core.errors import printable, time_limit_problem
from ..fleet.options import DEFAULT_CONNECT_TIMEOUT, DEFAULT_FORKS, RemoteOptions

if TYPE_CHECKING:
    from .ticker import Ticker

PYTHON_HELP = (
    "the target environment's interpreter, e.g. /root/ml-env/bin/python3 (default: the interpreter "
    "patcher runs in; on --host targets: python3 on the remote PATH, and an inventory's "
    "ansible_python_interpreter wins for its host)"
)


class Output:
    """Progress and errors on stderr. Progress lines go through a Ticker (cli/ticker.py): until
    the next line, the time since shows (a spinner on a terminal, a line every 30 s in a pipe),
    so a step that takes long (apply's verification) is not silent; settle() ends that before a
    report is printed."""

    def __init__(self, json_mode: bool, quiet: bool) -> None:
        self.json_mode = json_mode
        self.quiet = quiet
        self._ticker: Ticker | None = None

    def _echo(self, message: str) -> None:
        # Every line on stderr may carry a target's words (a host's step, its failure): escaped.
        click.echo(printable(message, keep_newlines=True), err=True, color=_color())

    def progress(self, message: str) -> None:
        if self.quiet:
            return
        if self._ticker is None:
            from .ticker import Ticker

            self._ticker = Ticker(self._echo)
        self._ticker.say(printable(message, keep_newlines=True))

    def settle(self) -> None:
        """No more time shown: what follows (a report, a live fleet view) prints plainly."""
        if self._ticker is not None:
            self._ticker.close()

    def error(self, message: str) -> None:
        self.settle()
        click.echo(
            click.style("error: ", fg="red", bold=True) + printable(message, keep_newlines=True),
            err=True,
            color=_color(),
        )


def _color() -> bool | None:
    return False if os.environ.get("NO_COLOR") else None


def _transport(python: str | None):
    from ..transport.local import LocalTransport

    return LocalTransport(python or sys.executable)


def _transform_cache() -> Path | None:
    """Where transform results are kept across runs (keyed by the source's sha256, the patches
    and the code fingerprint, see patcher.transform.transforms): the next environment or host with the same
    files needs no libcst. PATCHER_NO_TRANSFORM_CACHE=1 turns it off."""
    from ..cache import trusted_subfolder

    if os.environ.get("PATCHER_NO_TRANSFORM_CACHE"):
        return None
    return trusted_subfolder("transforms")


def _resolve(ids: tuple[str, ...], out: Output) -> list[str]:
    from ..patchset.registry import UnknownPatch, load_patches, resolve_ids

    try:
        return resolve_ids(load_patches(), list(ids))
    except UnknownPatch as exc:
        out.error(f"{exc}; see `patcher list`")
        sys.exit(2)


def _run(command: str, python: str | None, json_mode: bool, quiet: bool, remote: RemoteOptions, **kwargs) -> None:
    """One command on its target: the local interpreter (`--python`), or the hosts `remote` names
    (patcher.fleet.fleet_run does that part; cli/fleetview.py shows it). Exits with the run's code."""
    if not remote.is_fleet:
        # The agent's interpreter starts (and compiles the agent) while patcher loads the rest.
        local = _transport(python)
        local.prestart()
    from ..target_run import RunOptions

    out = Output(json_mode, quiet)
    only = _resolve(kwargs.pop("only", ()), out)
    skip = _resolve(kwargs.pop("skip", ()), out)
    options = RunOptions(command=command, only=only, skip=skip, progress=out.progress, **kwargs)
    if remote.is_fleet:
        from ..fleet.fleet_run import run_fleet_command
        from .fleetview import TerminalFleetView

        view = TerminalFleetView(out.progress, out.error, json_mode, quiet, diff=options.diff, settle=out.settle)
        sys.exit(run_fleet_command(command, python, remote, options, view, _transform_cache()))
    given = remote.remote_only_given()
    if given:
        out.error(f"{', '.join(given)} only apply to remote hosts; name them with --host or --inventory")
        sys.exit(2)
    _run_local(command, local, options, out)


def _run_local(command: str, local, options, out: Output) -> None:
    """One local interpreter: run, show (--json: the document on stdout) and exit."""
    from ..patchset.registry import load_patches
    from ..report import document, overall_exit
    from ..target_run import run_target
    from ..transform.transforms import shared_transforms
    from .render import render_reports

    try:
        with shared_transforms(persist=_transform_cache()):
            report = run_target(local, load_patches(), options)
    except KeyboardInterrupt:  # before run_target took over (it reports its own interruptions)
        from ..report import EXIT_INTERRUPTED, TargetReport

        local.interrupt()
        local.close()
        report = TargetReport(
            target=local.label, status="interrupted", exit_code=EXIT_INTERRUPTED, message=local.interrupted_message()
        )
    out.settle()
    reports = [report]
    code = overall_exit(reports)
    try:
        if out.json_mode:
            click.echo(json.dumps(document(command, reports), indent=2))
        if not out.quiet or report.exit_code not in (0, 6):
            render_reports(command, reports, show_diff=options.diff and not out.json_mode, quiet=out.quiet)
        sys.stdout.flush()
    except OSError as exc:  # stdout is full or closed: the run's outcome stands, its report is lost
        from ..report import report_lost

        code = report_lost(exc, code)
    sys.exit(code)


def _an_interpreter(ctx, param, value: str | None) -> str | None:
    """--python names one: '' (or blanks) once meant patcher's own interpreter, silently."""
    if value is not None and not value.strip():
        raise click.BadParameter(
            f"{value!r} names no interpreter; leave --python out for the default (patcher's own, or python3 on "
            "--host targets)"
        )
    return value


python_option = click.option("--python", "python", metavar="PATH", help=PYTHON_HELP, callback=_an_interpreter)
json_option = click.option(
    "--json", "json_mode", is_flag=True, help="print the JSON report (schema_version 1) on stdout"
)
quiet_option = click.option("--quiet", "-q", is_flag=True, help="no progress, only errors")
only_option = click.option("--only", multiple=True, metavar="ID", help="only this patch (vN or full id); repeatable")
skip_option = click.option(
    "--skip", multiple=True, metavar="ID", help="leave this patch out (vN or full id); repeatable"
)


class TimeLimit(click.ParamType):
    """A time option's value: finite, more than 0 (or 0 too, where `zero_ok`), at most a week
    (patcher/core/errors.py time_limit_problem, which a bundle and the Ansible task use too);
    anything else is a usage error (exit 2), never an OverflowError or a wait of `nan` seconds."""

    name = "seconds"

    def __init__(self, zero_ok: bool = False) -> None:
        self.zero_ok = zero_ok

    def convert(self, value, param, ctx) -> float:
        problem = time_limit_problem(value, self.zero_ok)
        if problem:
            self.fail(problem, param, ctx)
        return float(value)


lock_option = click.option(
    "--lock-timeout",
    default=10.0,
    show_default=True,
    type=TimeLimit(zero_ok=True),
    metavar="SECONDS",
    help="wait this long for another run's lock (0: try once)",
)
_SECONDS = TimeLimit()
facts_timeout_option = click.option(
    "--facts-timeout",
    default=60.0,
    show_default=True,
    type=_SECONDS,
    metavar="SECONDS",
    help="time limit for the target to start and report its versions and files (over ssh, --connect-timeout "
    "comes on top)",
)
write_timeout_option = click.option(
    "--write-timeout",
    default=120.0,
    show_default=True,
    type=_SECONDS,
    metavar="SECONDS",
    help="time limit for the writes once the lock is held (backups, files, record)",
)
model_option = click.option(
    "--model",
    "run_model",
    metavar="DIR",
    help="run the check on this checkpoint instead of a tiny Llama: a directory with config.json on the "
    "target (its path there; never downloaded); compared with transformers only where that fits in host memory",
)
tensor_parallel_option = click.option(
    "--tensor-parallel",
    type=click.IntRange(min=1),
    metavar="N",
    help="split --model over N devices (default 1; at most the GPUs the target sees)",
)


def _model_usage(run_check: bool, flag: str, run_model: str | None, tensor_parallel: int | None, remote) -> str | None:
    """--model and --tensor-parallel: a bad combination (one line, exit 2) or None; a local
    target's relative path made absolute (a remote one must be given absolute)."""
    out = Output(False, False)
    if run_model is not None and not run_check:
        out.error(f"--model names the checkpoint {flag} runs: add {flag}")
        sys.exit(2)
    if tensor_parallel is not None and run_model is None:
        out.error("--tensor-parallel splits --model's checkpoint: add --model DIR")
        sys.exit(2)
    if run_model is not None and not remote.is_fleet:
        return os.path.abspath(os.path.expanduser(run_model))
    return run_model


verify_timeout_option = click.option(
    "--verify-timeout",
    default=600.0,
    show_default=True,
    type=_SECONDS,
    metavar="SECONDS",
    help="time limit for the verification in a fresh target interpreter (past it: verification failed, files restored)",
)


REMOTE_OPTIONS = [
    click.option(
        "--host",
        "hosts",
        multiple=True,
        metavar="[USER@]HOST[:PORT]",
        help="a remote host, reached with the system ssh (e.g. root@10.1.2.3); repeatable",
    ),
    click.option(
        "--inventory",
        "-i",
        "inventories",
        multiple=True,
        metavar="FILE",
        help="hosts from an Ansible inventory (file, directory, script or plugin) or a plain list; repeatable",
    ),
    click.option(
        "--ansible-inventory",
        metavar="PATH",
        help="read inventories with this ansible-inventory (default: the one installed beside patcher, if any)",
    ),
    click.option(
        "--no-ansible-inventory",
        is_flag=True,
        help="read inventories with patcher's built-in reader even where ansible-core is installed",
    ),
    click.option(
        "--limit",
        "-l",
        metavar="PATTERN",
        help="only these hosts, as Ansible's --limit: host or group names, ',' or ':' between terms, "
        "wildcards, ~regex, group[0]; !x drops, &x intersects",
    ),
    click.option(
        "--forks",
        "-f",
        default=DEFAULT_FORKS,
        show_default=True,
        type=click.IntRange(1, 1024),
        metavar="N",
        help="hosts worked on at the same time",
    ),
    click.option(
        "--serial", metavar="N|N%", help="roll out in batches of N hosts (or N% of them), one batch after another"
    ),
    click.option(
        "--max-fail",
        type=click.FloatRange(0, 100),
        metavar="PERCENT",
        help="stop starting hosts once more than PERCENT of a batch did not succeed (0: at the first failure)",
    ),
    click.option("--sudo", is_flag=True, help="run the remote side through `sudo -n` (never prompts)"),
    click.option(
        "--ssh-option",
        "ssh_options",
        multiple=True,
        metavar="KEY=VALUE",
        help="an ssh -o option, e.g. IdentityFile=~/.ssh/gpu; wins over patcher's defaults; repeatable; "
        "none that runs a local command or takes the session (ProxyCommand, LocalCommand, RemoteCommand, ...: "
        "put those in an ssh configuration file)",
    ),
    click.option("--ssh-config", metavar="FILE", help="ssh -F FILE instead of ~/.ssh/config"),
    click.option(
        "--connect-timeout",
        default=DEFAULT_CONNECT_TIMEOUT,
        show_default=True,
        type=click.IntRange(1, 3600),
        metavar="SECONDS",
        help="ssh ConnectTimeout",
    ),
    click.option(
        "--retry-file",
        metavar="FILE",
        # never the current folder by default: it is often a git checkout
        help="where to list the hosts that did not succeed (an inventory for the next run)  "
        "[default: $PATCHER_CACHE/patcher.retry]",
    ),
    click.option("--no-retry-file", is_flag=True, help="write no retry file"),
]


def remote_options(f):
    """--host, --inventory and the fleet and ssh options, gathered into `remote=` (a RemoteOptions):
    the one place where these flags become its fields."""

    @functools.wraps(f)
    def wrapper(
        *args,
        hosts,
        inventories,
        ansible_inventory,
        no_ansible_inventory,
        limit,
        forks,
        serial,
        max_fail,
        sudo,
        ssh_options,
        ssh_config,
        connect_timeout,
        retry_file,
        no_retry_file,
        **kwargs,
    ):
        remote = RemoteOptions(
            hosts=tuple(hosts),
            inventories=tuple(inventories),
            ansible_inventory=ansible_inventory,
            no_ansible_inventory=no_ansible_inventory,
            limit=limit,
            forks=forks,
            serial=serial,
            max_fail=max_fail,
            sudo=sudo,
            ssh_options=tuple(ssh_options),
            ssh_config=ssh_config,
            connect_timeout=connect_timeout,
            retry_file=retry_file,
            no_retry_file=no_retry_file,
        )
        return f(*args, remote=remote, **kwargs)

    for option in reversed(REMOTE_OPTIONS):
        wrapper = option(wrapper)
    return wrapper


class _Commands(click.Group):
    """The commands; those in LAZY are imported only when they run (or help lists them)."""

    LAZY: ClassVar[dict[str, str]] = {
        "demo": "patcher.demo.demo_command:demo",
        "check-upstream": "patcher.upstream.check_upstream_command:check_upstream",
        "test-patches": "patcher.patchset.set_commands:test_patches",
        "new": "patcher.patchset.set_commands:new_patch",
    }

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted([*super().list_commands(ctx), *self.LAZY])

    def invoke(self, ctx: click.Context):
        # A Ctrl-C that a command did not turn into its report (the runs do, see patcher.target_run):
        # exit 130 as a shell would, rather than click's "Aborted!" and 1.
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            sys.exit(130)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name in self.LAZY:
            import importlib

            module, _, attribute = self.LAZY[name].partition(":")
            return getattr(importlib.import_module(module), attribute)
        return super().get_command(ctx, name)


def _use_patch_folders(ctx: click.Context, param: click.Parameter, value: tuple[str, ...]) -> tuple[str, ...]:
    if value:
        from ..patchset.registry import use_folders
        from ..patchset.sets import PatchSetError

        try:
            use_folders(list(value))
        except PatchSetError as exc:
            Output(False, False).error(str(exc))
            sys.exit(2)
    return value


@click.group(cls=_Commands, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="patcher")
@click.option(
    "--patches",
    "patch_folders",
    multiple=True,
    metavar="DIR",
    envvar="PATCHER_PATCHES",
    type=click.Path(file_okay=False),
    expose_value=False,
    is_eager=True,
    callback=_use_patch_folders,
    help="also use the patch set in DIR (patch modules vN_*.py and their targets.py, laid out as "
    "patcher's own patches/); repeatable; PATCHER_PATCHES holds DIRs separated by ':'",
)
def main() -> None:
    """Versioned, verified, reversible patches that keep speculators running on newer vLLM.

    Exit codes: 0 ok (also nothing to do), 1 a patch or verification failed (rolled back),
    2 usage error, 3 conflict (file modified by hand, anchor missing, a link on the way),
    4 target unreachable or timed out, 5 target locked by another run, 6 `plan` only: changes
    pending, 7 unsupported (a speculators or vLLM release patcher cannot make work: the message
    says what to do), 8 the report could not be written, 130 interrupted (Ctrl-C). Each in
    full: docs/reference/exit-codes.md.
    """


@main.command("list")
@json_option
def list_patches(json_mode: bool) -> None:
    """Every patch: id, title, target file, conditions, upstream reference."""
    from ..patchset.registry import load_patches
    from ..patchset.sets import active_sets
    from .render import render_patch_list

    patches = load_patches()
    sets = active_sets()
    first_party = next((s.name for s in sets if not s.qualifier), "")
    if json_mode:
        rows = [
            {
                "id": p.id,
                "set": p.patch_set or first_party,
                "title": p.title,
                "distribution": p.target.distribution,
                "file": p.target.path,
                "requires": dict(p.requires),
                "needs": list(p.needs),
                "edits": [{"name": e.name, "when": dict(e.when), "answers": e.answers} for e in p.edits],
                "upstream": p.upstream,
                "fixed_in": p.fixed_in,
                "without_it": p.without_it,
            }
            for p in patches
        ]
        in_use = [{"name": x.name, "package": x.package, "origin": x.origin} for x in sets]
        click.echo(json.dumps({"schema_version": 1, "patches": rows, "sets": in_use}, indent=2))
        return
    render_patch_list(patches)
    if len(sets) > 1:  # beside patcher's own: say where each came from
        Output(False, False).progress("patch sets in use: " + "; ".join(f"{x.name} ({x.origin})" for x in sets))


@main.command()
@python_option
@remote_options
@facts_timeout_option
@json_option
@quiet_option
def status(python, remote, facts_timeout, json_mode, quiet) -> None:
    """Detected versions; per patch: selected or why not, and its state on disk."""
    _run("status", python, json_mode, quiet, remote, facts_timeout=facts_timeout)


@main.command()
@python_option
@remote_options
@click.option("--diff", is_flag=True, help="show the unified diff of every file that would change")
@only_option
@skip_option
@click.option("--force", is_flag=True, help="as apply --force")
@facts_timeout_option
@json_option
@quiet_option
def plan(python, remote, diff, only, skip, force, facts_timeout, json_mode, quiet) -> None:
    """What apply would change; writes nothing. Exit 6 when changes are pending, 0 when none."""
    _run(
        "plan",
        python,
        json_mode,
        quiet,
        remote,
        diff=diff,
        only=only,
        skip=skip,
        force=force,
        facts_timeout=facts_timeout,
    )


@main.command()
@python_option
@remote_options
@only_option
@skip_option
@click.option("--no-verify", is_flag=True, help="skip verification in a fresh target interpreter")
@click.option(
    "--run-check",
    is_flag=True,
    help="then run a tiny model through speculators and vLLM there and compare with transformers "
    "(minutes; not under the lock; a failure exits 1, files stay written)",
)
@model_option
@tensor_parallel_option
@click.option(
    "--force",
    is_flag=True,
    help="adopt a file changed by hand as the new original (backed up, restored by rollback)",
)
@lock_option
@facts_timeout_option
@write_timeout_option
@verify_timeout_option
@json_option
@quiet_option
def apply(
    python,
    remote,
    only,
    skip,
    no_verify,
    run_check,
    run_model,
    tensor_parallel,
    force,
    lock_timeout,
    facts_timeout,
    write_timeout,
    verify_timeout,
    json_mode,
    quiet,
) -> None:
    """Apply the selected patches, verify, record; on a failed verification, restore."""
    run_model = _model_usage(run_check, "--run-check", run_model, tensor_parallel, remote)
    _run(
        "apply",
        python,
        json_mode,
        quiet,
        remote,
        only=only,
        skip=skip,
        verify=not no_verify,
        force=force,
        lock_timeout=lock_timeout,
        facts_timeout=facts_timeout,
        write_timeout=write_timeout,
        verify_timeout=verify_timeout,
        run_check=run_check,
        run_model=run_model,
        tensor_parallel=tensor_parallel or 1,
    )


@main.command()
@python_option
@remote_options
@click.option(
    "--run",
    "run_check",
    is_flag=True,
    help="also run a tiny random Llama through speculators and vLLM in the target and compare the "
    "hidden states with transformers (minutes; writes nothing of the environment's)",
)
@model_option
@tensor_parallel_option
@facts_timeout_option
@verify_timeout_option
@json_option
@quiet_option
def verify(
    python, remote, run_check, run_model, tensor_parallel, facts_timeout, verify_timeout, json_mode, quiet
) -> None:
    """Check the installed files as they are: imports and vLLM call bindings; --run runs them."""
    run_model = _model_usage(run_check, "--run", run_model, tensor_parallel, remote)
    _run(
        "verify",
        python,
        json_mode,
        quiet,
        remote,
        run_check=run_check,
        run_model=run_model,
        tensor_parallel=tensor_parallel or 1,
        facts_timeout=facts_timeout,
        verify_timeout=verify_timeout,
    )


@main.command()
@python_option
@remote_options
@only_option
@click.option(
    "--force",
    is_flag=True,
    help="restore a kept original even where pip's RECORD gives other bytes and the record does not "
    "say it was adopted with apply --force",
)
@lock_option
@facts_timeout_option
@write_timeout_option
@json_option
@quiet_option
def rollback(python, remote, only, force, lock_timeout, facts_timeout, write_timeout, json_mode, quiet) -> None:
    """Restore the original files (byte-identical); --only takes out single patches."""
    _run(
        "rollback",
        python,
        json_mode,
        quiet,
        remote,
        only=only,
        force_restore=force,
        lock_timeout=lock_timeout,
        facts_timeout=facts_timeout,
        write_timeout=write_timeout,
    )


@main.command()
@python_option
@remote_options
@click.option("--all", "forget_all", is_flag=True, help="forget every record, not only those pip made obsolete")
@lock_option
@facts_timeout_option
@write_timeout_option
@json_option
@quiet_option
def forget(python, remote, forget_all, lock_timeout, facts_timeout, write_timeout, json_mode, quiet) -> None:
    """Clear the records of files pip has replaced since patcher wrote them."""
    _run(
        "forget",
        python,
        json_mode,
        quiet,
        remote,
        forget_all=forget_all,
        lock_timeout=lock_timeout,
        facts_timeout=facts_timeout,
        write_timeout=write_timeout,
    )


@main.command()
@click.option("-o", "--output", required=True, metavar="FILE", help="where to write the bundle (a Python file)")
@click.option(
    "--release",
    "releases",
    multiple=True,
    metavar="NAME==VERSION",
    help="a release whose pristine files the bundle knows (default: those the patches are written for)",
)
@click.option(
    "--wheel", "wheels", multiple=True, metavar="FILE", help="take the pristine files from this wheel (offline)"
)
@click.option(
    "--set",
    "set_names",
    multiple=True,
    metavar="NAME",
    help="carry only this patch set (see `patcher list`; default: every set in use); repeatable",
)
@quiet_option
def bundle(output, releases, wheels, set_names, quiet) -> None:
    """Write one self-contained Python file for hosts patcher cannot reach.

    Copy it to the host (scp, a container image) and run it with the environment's Python:
    `/root/ml-env/bin/python3 patcher-bundle.py status|plan|apply|rollback` (standard library
    only; the same agent, records and exit codes as patcher). It knows the pristine files by
    sha256 and carries their patched bytes; it refuses any other file.
    """
    from ..frontends.bundle import BundleError, build, default_releases, write
    from ..output_files import OutputFileError, check_destination
    from ..patchset.registry import UnknownPatch, patches_of_sets
    from ..upstream.wheels import find_or_download

    def wheel(name: str, version: str) -> Path:
        try:
            return find_or_download(name, version, out.progress)
        except Exception as exc:  # DownloadFailed, IndexUnreachable  # noqa: BLE001
            raise BundleError(f"cannot get the {name} {version} wheel ({exc}); give it with --wheel FILE") from None

    out = Output(False, quiet)
    try:
        patches, lines = patches_of_sets(set_names)
    except UnknownPatch as exc:
        out.error(str(exc))
        sys.exit(2)
    try:
        check_destination(output)  # before the minutes of work a bundle takes
        chosen = []
        for item in releases:
            name, sep, version = item.partition("==")
            if not sep or not name or not version:
                raise BundleError(f"--release {item!r}: expected NAME==VERSION, e.g. speculators==0.3.0")
            chosen.append((name, version))
        paths = [Path(w) for w in wheels]
        if not paths or chosen:
            paths += [wheel(n, v) for n, v in (chosen or default_releases(patches, lines))]
        source, summary = build(patches, paths, out.progress, lines)
        write(Path(output), source)
    except (BundleError, OutputFileError, OSError) as exc:
        out.error(str(exc))
        sys.exit(2)
    files = ", ".join(f"{path.rsplit('/', 1)[-1]} ({len(shas)})" for path, shas in summary["files"].items())
    out.progress(
        f"wrote {output}: {summary['bytes'] // 1024} KiB, pristine files known: {files}, "
        f"{summary['variants']} patched variant(s)"
    )
    out.progress(f"on the host: /path/to/env/bin/python3 {Path(output).name} status   (then apply, rollback)")


if __name__ == "__main__":
    from .fastexit import run_and_exit

    run_and_exit(main)
