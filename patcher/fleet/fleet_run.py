"""A run on remote hosts (--host, --inventory), start to end: check every input before any host
is touched, roll out, tell the result, write the retry file. How it looks is the caller's
(`FleetView`: cli/fleetview.py); this module never prints."""

from __future__ import annotations

import os
import shlex
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from ..output_files import OutputFileError
from ..patchset.registry import load_patches
from ..report import EXIT_INTERRUPTED, EXIT_USAGE, overall_exit
from ..target_run import RunOptions
from ..transform.transforms import shared_transforms
from ..transport.ssh import SshSettings, check_settings, check_ssh_option
from . import inventory
from .host_address import Host, check_remote_python
from .options import DEFAULT_RETRY_NAME, RemoteOptions
from .rollout import (
    FleetInterrupted,
    FleetOptions,
    FleetProgress,
    HostResult,
    batch_size,
    fleet_document,
    not_started,
    run_fleet,
    succeeded,
)


class FleetView(Protocol):
    """What the fleet command says, and where: the CLI's terminal and --json output."""

    def note(self, message: str) -> None:
        """A progress line (hidden by --quiet)."""

    def error(self, message: str) -> None:
        """A one-line error."""

    def progress(self, hosts: int) -> FleetProgress | None:
        """How the rollout shows as it goes, for this many hosts (None: it does not)."""

    def show(self, command: str, results: Sequence[HostResult], interrupted: bool, doc: dict) -> None:
        """The outcome: `doc` is the JSON document (--json), then the reports or the summary."""


@dataclass(frozen=True)
class FleetInputs:
    """Every input of a fleet run, checked: the hosts, the inventory readers that read them
    (one per --inventory source), the ssh settings, the rollout's options and where the retry
    file goes (None: nowhere)."""

    hosts: list[Host]
    readers: list[str]
    settings: SshSettings
    rollout: FleetOptions
    retry: Path | None


def run_fleet_command(
    command: str,
    python: str | None,
    remote: RemoteOptions,
    options: RunOptions,
    view: FleetView,
    transform_cache: Path | None,
) -> int:
    """Run `command` on the hosts `remote` names; the exit code (2: an input refused, told
    through `view.error` before any host is touched; 130: interrupted)."""
    try:
        inputs = check_inputs(python, remote)
    except ValueError as exc:  # HostError and InventoryError are ValueErrors
        view.error(str(exc))
        return EXIT_USAGE
    for option in inputs.settings.options:
        if option.lower().replace(" ", "") in ("stricthostkeychecking=no", "stricthostkeychecking=off"):
            view.note("note: host keys are not checked (--ssh-option StrictHostKeyChecking=no)")
    results, interrupted = roll_out(inputs, python, options, view.progress(len(inputs.hosts)), transform_cache)
    lost = None
    try:
        view.show(command, results, interrupted, fleet_json(command, results, interrupted, remote, inputs.readers))
        sys.stdout.flush()
    except OSError as exc:  # stdout is full or closed: the hosts' outcomes stand, the report is lost
        lost = exc
    code = EXIT_INTERRUPTED if interrupted else overall_exit([r.report for r in results])
    if inputs.retry is not None:
        code = write_retry_file(inputs.retry, command, results, code, view, in_cache=not remote.retry_file)
    elif not remote.no_retry_file and any(not succeeded(r.report) for r in results):
        view.note(
            "no retry file written: the cache is not used (the warning above says why); name one with --retry-file"
        )
    code = EXIT_INTERRUPTED if interrupted else code
    if lost is not None:
        from ..report import report_lost

        return report_lost(lost, code)
    return code


def check_inputs(python: str | None, remote: RemoteOptions) -> FleetInputs:
    """The hosts, their readers, the ssh settings and the rollout's options, every one checked
    before any host is touched; a bad one raises its one-line error (HostError, InventoryError,
    ValueError: exit 2)."""
    reader = inventory.find_ansible_inventory(remote.ansible_inventory, remote.no_ansible_inventory)
    loaded = inventory.load_hosts(
        remote.hosts, remote.inventories, remote.limit, reader if remote.inventories else None
    )
    if python is not None:
        check_remote_python(python)
    settings = SshSettings(
        options=tuple(check_ssh_option(o) for o in remote.ssh_options),
        config_file=remote.ssh_config,
        connect_timeout=remote.connect_timeout,
        sudo=remote.sudo,
    )
    rollout = FleetOptions(forks=remote.forks, serial=remote.serial, max_fail=remote.max_fail)
    batch_size(rollout.serial, len(loaded.hosts))
    check_settings(settings)
    retry = retry_destination(remote)
    if retry is not None:  # before any host is touched, not after the rollout
        inventory.check_retry_file(retry, remote.inventories, limited=bool(remote.limit))
    return FleetInputs(list(loaded.hosts), list(loaded.readers), settings, rollout, retry)


def retry_destination(remote: RemoteOptions) -> Path | None:
    """Where the retry file goes: --retry-file, else $PATCHER_CACHE/patcher.retry when the cache
    may be used (cache.trusted: one warning when not), never the current folder; None with
    --no-retry-file or an untrusted cache."""
    if remote.no_retry_file:
        return None
    if remote.retry_file:
        return Path(remote.retry_file)
    from ..cache import cache_root, trusted

    path = cache_root() / DEFAULT_RETRY_NAME
    return path if trusted(path) else None


def roll_out(
    inputs: FleetInputs,
    python: str | None,
    options: RunOptions,
    progress: FleetProgress | None,
    transform_cache: Path | None,
) -> tuple[list[HostResult], bool]:
    """Every host's result, and whether Ctrl-C ended the rollout (the hosts it did not reach
    are then `skipped`, saying so)."""
    try:
        with shared_transforms(persist=transform_cache):
            return run_fleet(
                inputs.hosts, python, inputs.settings, load_patches(), options, inputs.rollout, progress
            ), False
    except FleetInterrupted as exc:
        return exc.results, True
    except KeyboardInterrupt:  # before any host was started
        return [not_started(host, python, "not started: interrupted") for host in inputs.hosts], True


def fleet_json(
    command: str, results: Sequence[HostResult], interrupted: bool, remote: RemoteOptions, readers: Sequence[str]
) -> dict:
    """The --json document: rollout.fleet_document, with the inventory sources and their reader
    when the hosts came from inventories."""
    doc = fleet_document(command, results, interrupted)
    if remote.inventories:
        doc["inventory"] = {"sources": list(remote.inventories), "reader": readers[0]}
    return doc


def write_retry_file(
    retry: Path, command: str, results: Sequence[HostResult], code: int, view: FleetView, in_cache: bool = False
) -> int:
    """The retry file: the hosts that did not succeed, or the old file removed when all did. The
    exit code, raised to 2 when the file appeared during the run. `in_cache`: the default file,
    whose cache folder is made when missing."""
    failed = [(r.host, f"{r.report.status}: {r.report.message}") for r in results if not succeeded(r.report)]
    try:
        if failed:
            if in_cache:
                from ..cache import make_cache_folder

                make_cache_folder(retry.parent)
            inventory.write_retry_file(retry, command, failed)
            again = f"patcher {command} -i {shlex.quote(str(retry))}"
            view.note(
                f"{len(failed)} host(s) did not succeed; listed in {retry}: `{again}` "
                "with this run's other options retries just them"
            )
        elif inventory.is_retry_file(retry):
            os.unlink(retry)
            view.note(f"every host succeeded; removed the old {retry}")
    except inventory.InventoryError as exc:  # the file appeared during the run
        view.error(str(exc))
        code = max(code, EXIT_USAGE)
    except OutputFileError as exc:
        view.error(f"the retry file: {exc}")
    except OSError as exc:
        view.error(f"cannot write the retry file {retry}: {exc}")
    return code
