"""Concurrency stress: rounds of real patcher runs started at once on one environment.

Each round starts two to four runs — `apply --no-verify`, `rollback`, with `--only`/`--skip`
mixed in, now and then a `status` — in random order at random offsets (0 to `max_offset`
seconds apart), each locally or over ssh (a real sshd on loopback), all with a lock timeout long
enough that none gives up. Then it checks what patcher promises:

- every run exits 0 and no report speaks of an interrupted run (none was);
- the environment ends in the state some successful run reported as its end state (with the
  lock held from facts to the last write the runs are serial, so it is the last one's), or in
  the round's starting state when none changed anything; every read-only report shows a state
  that existed (the start or a writer's end);
- `status` agrees: each patch applied exactly when the files carry it, nothing pending that the
  files lack;
- each file is byte for byte what applying that set of patches to the pristine file gives (the
  reference is computed here from the pristine facts, not read back from patcher's record);
- no temporary file is left, beside the files or in the state folder.

A bad round is described (the runs, their messages, the state found) and the environment is
reset to pristine so the next round starts clean. bench/race.py runs hundreds of rounds;
tests/test_race.py runs a few tens.
"""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from patcher.patchset.registry import load_patches
from patcher.plan.planning import condition_names, target_files
from patcher.plan.target_plan import plan_target
from patcher.target_run import RunOptions, run_target
from patcher.transport.local import LocalTransport

from .envs import site_file
from .patcher_env import patcher_env

PATCHES = load_patches()
TARGETS = sorted({p.target.path for p in PATCHES})
SHORT = {p.id: p.id.split("-", 1)[0] for p in PATCHES}  # v7-worker-embed-input-ids -> v7
APPLIED = ("applied", "already-satisfied")
SCRIPT = Path(sys.executable).parent / "patcher"
PATCHER = [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "patcher.cli.entry"]


@dataclass
class Run:
    argv: list[str]
    via: str  # local | ssh
    offset: float
    code: int = -1
    doc: dict = field(default_factory=dict)
    err: str = ""

    @property
    def command(self) -> str:
        return self.argv[0]

    def target(self) -> dict:
        return (self.doc.get("targets") or [{}])[0]

    def end_state(self) -> frozenset:
        """The patches this run reports in place when it ended."""
        return frozenset(p["id"] for p in self.target().get("patches", []) if p["state"] in APPLIED)

    def describe(self) -> str:
        target = self.target()
        return (
            f"+{self.offset * 1000:.0f}ms {self.via} patcher {' '.join(self.argv)} -> exit {self.code}: "
            f"{target.get('message', self.err.strip()[-300:])!r} notes={target.get('notes', [])}"
        )


class Stress:
    def __init__(self, python: Path, vias: dict[str, list[str]], seed: int, max_offset: float = 0.08) -> None:
        """`python`: a pristine environment's interpreter. `vias`: how to reach it, by name:
        [] for local, the --host and ssh options for a remote way; each run picks one of the
        ways its round allows at random."""
        self.python = python
        self.vias = vias
        assert not self.state_dir().exists(), "the stress starts from a pristine environment"
        self.rng = random.Random(seed)
        self.max_offset = max_offset
        # no ssh agent or cache of the user's (a failed ssh run writes a retry file into the cache)
        self.env = {k: v for k, v in patcher_env(clean_ssh=True).items() if k != "PATCHER_FAULT"}
        self.pristine = {rel: site_file(python, rel).read_bytes() for rel in TARGETS}
        with LocalTransport(str(python)) as session:
            self.pristine_facts = session.call(
                {"op": "facts", "names": condition_names(PATCHES), "files": target_files(p.spec() for p in PATCHES)}
            )
        self.expected: dict[frozenset, dict[str, bytes]] = {}
        self.state = self.status_state()
        self.rounds = 0
        self.bad: list[str] = []
        self.runs_by_command: dict[str, int] = {}
        self.runs_by_way: dict[str, int] = {}

    # ------------------------------------------------------------ one round

    def random_runs(self, ways: list[str]) -> list[Run]:
        ids = [SHORT[p.id] for p in PATCHES]
        runs = []
        for _ in range(self.rng.choice((2, 3, 3, 3, 4))):
            kind = self.rng.choices(("apply", "rollback", "status"), weights=(5, 4, 1))[0]
            argv = [kind]
            if kind == "apply":
                argv.append("--no-verify")
                pick = self.rng.random()
                if pick < 0.25:
                    argv += [x for i in self.rng.sample(ids, self.rng.randint(1, 3)) for x in ("--only", i)]
                elif pick < 0.5:
                    argv += [x for i in self.rng.sample(ids, self.rng.randint(1, 2)) for x in ("--skip", i)]
            elif kind == "rollback" and self.rng.random() < 0.35:
                argv += [x for i in self.rng.sample(ids, self.rng.randint(1, 2)) for x in ("--only", i)]
            via = self.rng.choice(ways)
            runs.append(Run(argv, via, self.rng.uniform(0, self.max_offset)))
        return runs

    def start(self, run: Run) -> subprocess.Popen:
        timeout = [] if run.command == "status" else ["--lock-timeout", "120"]
        return subprocess.Popen(
            [*PATCHER, *run.argv, *timeout, *self.vias[run.via], "--python", str(self.python), "--json", "-q"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=self.env,
        )

    def round(self, ways: list[str] | None = None) -> list[str]:
        """One round, its runs reaching the environment by `ways` (default: every way); what
        went wrong in it (empty: a good round)."""
        runs = self.random_runs(sorted(ways or self.vias))
        before = self.state
        began = time.monotonic()
        procs = []
        for run in sorted(runs, key=lambda r: r.offset):
            time.sleep(max(0.0, began + run.offset - time.monotonic()))
            procs.append((run, self.start(run)))
        for run, proc in procs:
            out, run.err = proc.communicate(timeout=600)
            run.code = proc.returncode
            try:
                run.doc = json.loads(out) if out.strip() else {}
            except ValueError:
                run.doc = {}
            self.runs_by_command[run.command] = self.runs_by_command.get(run.command, 0) + 1
            self.runs_by_way[run.via] = self.runs_by_way.get(run.via, 0) + 1
        problems = self.check(runs, before)
        self.rounds += 1
        if problems:
            report = "\n".join(
                [f"round {self.rounds}: {'; '.join(problems)}", f"  started from {sorted(SHORT[i] for i in before)}"]
                + ["  " + run.describe() for run in runs]
            )
            self.bad.append(report)
            self.reset()
        return problems

    def check(self, runs: list[Run], before: frozenset) -> list[str]:
        problems = []
        for run in runs:
            if run.code != 0:
                problems.append(f"{run.command} exited {run.code}")
            if any("interrupted" in note for note in run.target().get("notes", [])):
                problems.append(f"{run.command} speaks of an interrupted run")
        if problems:
            return problems
        writers = [r for r in runs if r.target().get("status") == "changed"]
        possible = {r.end_state() for r in writers} | ({before} if not writers else set())
        readers = [r for r in runs if r not in writers]
        seen = {before} | {r.end_state() for r in writers}
        for run in readers:
            busy = any("held the lock" in note for note in run.target().get("notes", []))
            if not busy and run.end_state() not in seen:  # a busy status says it read a run half done
                problems.append(
                    f"{run.command} reported {sorted(SHORT[i] for i in run.end_state())}, a state that never was"
                )
        try:
            now = self.status_state()
        except AssertionError as exc:
            return problems + [str(exc)]
        if now not in possible:
            problems.append(
                f"the environment carries {sorted(SHORT[i] for i in now)}, which no successful run reported"
            )
        expected = self.expected_bytes(now)
        for rel in TARGETS:
            if site_file(self.python, rel).read_bytes() != expected[rel]:
                problems.append(f"{rel} is not the bytes of {sorted(SHORT[i] for i in now)}")
        leftovers = [p.name for rel in TARGETS for p in site_file(self.python, rel).parent.glob(".patcher-*")]
        leftovers += [p.name for p in self.state_dir().rglob(".patcher-*")]
        if leftovers:
            problems.append(f"temporary files left: {sorted(set(leftovers))}")
        self.state = now
        return problems

    # ------------------------------------------------------------ the environment

    def state_dir(self) -> Path:
        return self.python.parent.parent / "share" / "patcher"

    def status_state(self) -> frozenset:
        """The patches in place, as `status` reports them (it must say nothing is half done)."""
        report = run_target(LocalTransport(str(self.python)), PATCHES, RunOptions(command="status"))
        assert report.exit_code == 0, f"status exited {report.exit_code}: {report.message}"
        states = {p.id: p.state for p in report.patches}
        odd = {pid: s for pid, s in states.items() if s not in (*APPLIED, "pending", "not-selected")}
        # the model runner's note says which runner vLLM picks: not a state of the files
        notes = [note for note in report.notes if not note.startswith("model runner:")]
        assert not odd and not notes, f"status: {odd} {notes}"
        return frozenset(pid for pid, s in states.items() if s in APPLIED)

    def expected_bytes(self, applied: frozenset) -> dict[str, bytes]:
        """Each file as applying exactly `applied` to the pristine files makes it."""
        if applied not in self.expected:
            out = dict(self.pristine)
            if applied:
                plan = plan_target(self.pristine_facts, PATCHES, "apply", only=sorted(applied))
                assert not plan.conflicts, plan.conflicts
                for change in plan.changes:
                    out[change.path] = change.new_content.encode("utf-8")
            self.expected[applied] = out
        return self.expected[applied]

    def reset(self) -> None:
        """Pristine files, no record: after a bad round, so the next starts from a known state."""
        for rel, data in self.pristine.items():
            site_file(self.python, rel).write_bytes(data)
        for rel in TARGETS:
            for leftover in site_file(self.python, rel).parent.glob(".patcher-*"):
                leftover.unlink()
        shutil.rmtree(self.state_dir(), ignore_errors=True)
        self.state = self.status_state()

    def summary(self) -> dict:
        return {
            "rounds": self.rounds,
            "bad_rounds": len(self.bad),
            "runs": dict(sorted(self.runs_by_command.items())),
            "ways": dict(sorted(self.runs_by_way.items())),
            "max_offset_ms": round(self.max_offset * 1000),
        }
