"""Many hosts at once: `run_target` per host over ssh, in parallel, in batches, stopping a
rollout that fails too often. Each host's work is one ssh session (a subprocess) with two
round trips, so threads are enough; the codemods run once per distinct file thanks to the transform cache.

- `--forks N`: at most N hosts in flight (one ssh process and one remote interpreter each).
- `--serial N` (or `N%`): batches of N hosts; a batch starts when the previous one is done.
- `--max-fail P`: when more than P% of a batch's hosts did not succeed, no further host is
  started (hosts already running finish); the rest are reported as `skipped`, not started.
A host "succeeds" when its exit code is 0, or 6 for `plan` (changes pending).
"""

from __future__ import annotations

import dataclasses
import re
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

from ..report import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_PENDING, TargetReport, document
from ..target_run import RunOptions, run_target
from ..transport.ssh import SshSettings, SshTransport
from .host_address import Host
from .options import DEFAULT_FORKS

SKIPPED = "skipped"


@dataclass
class FleetOptions:
    forks: int = DEFAULT_FORKS
    serial: str | None = None  # "N" hosts or "N%" of them per batch; None: one batch
    max_fail: float | None = None  # percent of a batch; None: never stop


@dataclass
class HostResult:
    host: Host
    report: TargetReport
    started: bool = True
    ssh_invocations: int = 0


class FleetProgress:
    """What a fleet run tells as it goes. The default tells nothing."""

    def start(self, total: int) -> None: ...

    def host_started(self, host: Host) -> None: ...

    def host_step(self, host: Host, message: str) -> None: ...

    def host_done(self, result: HostResult) -> None: ...

    def stopped(self, message: str) -> None: ...

    def finish(self) -> None: ...


def succeeded(report: TargetReport) -> bool:
    return report.exit_code == 0 or report.exit_code == EXIT_PENDING


def batch_size(serial: str | None, total: int) -> int:
    if not serial:
        return max(total, 1)
    text = serial.strip()
    if text.endswith("%"):
        if not re.fullmatch(r"\d+(\.\d+)?%", text):
            raise ValueError(f"--serial {serial}: expected a number of hosts (1 or more) or a percentage like 25%")
        percent = float(text[:-1])
        if not 0 < percent <= 100:
            raise ValueError(f"--serial {serial}: a percentage must be above 0 and at most 100")
        return max(1, int(total * percent / 100))
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"--serial {serial}: expected a number of hosts (1 or more) or a percentage like 25%")
    return int(text)


def not_started(host: Host, python: str | None, why: str) -> HostResult:
    return HostResult(host, skipped_report(host, python, why), False)


def skipped_report(host: Host, python: str | None, why: str) -> TargetReport:
    report = TargetReport(target=host.name, python=host.python or python)
    report.status = SKIPPED
    report.exit_code = EXIT_FAILED
    report.message = why
    return report


def run_fleet(
    hosts: Sequence[Host],
    python: str | None,
    settings: SshSettings,
    patches,
    options: RunOptions,
    fleet: FleetOptions,
    progress: FleetProgress | None = None,
    transport_factory: Callable[[Host, str | None, SshSettings], SshTransport] = SshTransport,
) -> list[HostResult]:
    """Run `options.command` on every host, batch after batch; results in the hosts' order.
    Ctrl-C ends the hosts in flight and raises FleetInterrupted with every host's result."""
    rollout = _Rollout(hosts, python, settings, patches, options, fleet, progress or FleetProgress(), transport_factory)
    rollout.progress.start(len(hosts))
    interrupted = False
    try:
        with ThreadPoolExecutor(max_workers=max(1, fleet.forks), thread_name_prefix="patcher-host") as pool:
            for number, batch in enumerate(rollout.batches, 1):
                if rollout.stop_reason:
                    break
                rollout.run_batch(pool, number, batch)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        rollout.progress.finish()
    ordered = rollout.in_host_order()
    if interrupted:
        raise FleetInterrupted(ordered)
    return ordered


class _Rollout:
    """One fleet run's shared state: the results so far, why the rollout stopped (if it did), and
    the transports in flight (ended through these on Ctrl-C)."""

    def __init__(
        self,
        hosts: Sequence[Host],
        python: str | None,
        settings: SshSettings,
        patches,
        options: RunOptions,
        fleet: FleetOptions,
        progress: FleetProgress,
        transport_factory: Callable[[Host, str | None, SshSettings], SshTransport],
    ) -> None:
        self.hosts, self.python, self.settings, self.patches = hosts, python, settings, patches
        self.options, self.fleet, self.progress = options, fleet, progress
        self.transport_factory = transport_factory
        size = batch_size(fleet.serial, len(hosts))
        self.batches = [list(range(i, min(i + size, len(hosts)))) for i in range(0, len(hosts), size)]
        self.results: dict[int, HostResult] = {}
        self.stop_reason = ""
        self.lock = threading.Lock()
        self.live: dict[int, SshTransport] = {}  # the hosts in flight
        self.stopping = threading.Event()  # set on Ctrl-C

    def run_batch(self, pool: ThreadPoolExecutor, number: int, batch: list[int]) -> None:
        """At most --forks hosts of the batch at a time; past --max-fail, start no more."""
        waiting = list(batch)
        running: dict[Future, int] = {}
        failed = 0
        try:
            while waiting or running:
                while waiting and len(running) < self.fleet.forks and not self.stop_reason:
                    index = waiting.pop(0)
                    running[pool.submit(self.run_host, index)] = index
                if not running:
                    break
                done, _ = wait(list(running), return_when=FIRST_COMPLETED)
                for future in done:
                    index = running.pop(future)
                    self.results[index] = future.result()
                    if not succeeded(self.results[index].report):
                        failed += 1
                max_fail = self.fleet.max_fail
                if max_fail is not None and not self.stop_reason and failed * 100 / len(batch) > max_fail:
                    with self.lock:
                        self.stop_reason = (
                            f"not started: the rollout stopped because {failed} of {len(batch)} host(s) "
                            f"in batch {number} did not succeed (more than --max-fail {max_fail:g}%)"
                        )
                    self.progress.stopped(self.stop_reason)
        except KeyboardInterrupt:
            self._interrupt(running)
            raise

    def _interrupt(self, running: dict[Future, int]) -> None:
        """Ctrl-C: start nothing more, end every session in flight (each agent stops at once) and
        collect those hosts' reports, which say `interrupted`."""
        self.stop_reason = "not started: interrupted"
        with self.lock:
            self.stopping.set()
            for transport in self.live.values():
                transport.interrupt()
        self.progress.stopped(self.stop_reason)
        for future, index in running.items():
            self.results[index] = future.result()

    def run_host(self, index: int) -> HostResult:
        """One host, start to end, in a worker thread; a bug becomes that host's failure."""
        host = self.hosts[index]
        self.progress.host_started(host)
        prefix = f"{host.name}: "

        def step(message: str) -> None:
            self.progress.host_step(host, message.removeprefix(prefix))

        transport = None
        try:
            transport = self.transport_factory(host, self.python, self.settings)
            with self.lock:
                self.live[index] = transport
                if self.stopping.is_set():
                    transport.interrupt()  # created after the Ctrl-C: it never starts
            report = run_target(transport, self.patches, dataclasses.replace(self.options, progress=step))
        except Exception as exc:  # a bug must not take the other hosts down  # noqa: BLE001
            report = TargetReport(target=host.name, python=host.python or self.python)
            report.status, report.exit_code = "failed", EXIT_FAILED
            report.message = f"internal error: {type(exc).__name__}: {exc}"
        finally:
            if transport is not None:
                transport.close()
        report.notes = [*host.notes, *report.notes]
        result = HostResult(host, report, True, getattr(transport, "invocations", 0))
        self.progress.host_done(result)
        return result

    def in_host_order(self) -> list[HostResult]:
        """Every host's result; a host never started is `skipped`, saying why."""
        return [
            self.results[index]
            if index in self.results
            else HostResult(host, skipped_report(host, self.python, self.stop_reason or "not started"), False)
            for index, host in enumerate(self.hosts)
        ]


class FleetInterrupted(KeyboardInterrupt):
    def __init__(self, results: list[HostResult]) -> None:
        super().__init__("interrupted")
        self.results = results


# ------------------------------------------------------------------ reporting


TALLY_ORDER = ("ok", "changed", "failed", "unreachable", "timed-out", "rolled-back", "interrupted", SKIPPED)


def tally(results: Sequence[HostResult]) -> dict[str, int]:
    counts = {status: 0 for status in TALLY_ORDER}
    for result in results:
        counts[result.report.status] = counts.get(result.report.status, 0) + 1
    return counts


def fleet_document(command: str, results: Sequence[HostResult], interrupted: bool = False) -> dict:
    """The engine's JSON document (schema_version 1), one entry per host, with fields added:
    per target `host` (the ssh address) and `started`; at the top, `summary` (count per status).
    An interrupted run's exit code is 130, whatever its hosts say."""
    doc = document(command, [r.report for r in results])
    if interrupted:
        doc["exit_code"] = EXIT_INTERRUPTED
    for entry, result in zip(doc["targets"], results):
        entry["host"] = result.host.spec
        entry["started"] = result.started
    doc["summary"] = tally(results)
    return doc
