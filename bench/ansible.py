"""Fleets through Ansible: on 8 and 32 loopback hosts (and 1, for the inventory reader), in one run,
from pristine files each time, verification left out everywhere (--no-verify / verify: false),
every path on the same Ansible INI inventory:

- patcher's own runner: `patcher apply -i HOSTS.ini --forks 8` (built-in inventory reader, warm
  transform cache: the baseline of the ratios);
- the collection: `ansible-playbook` with `patcher.fleet.patch command=apply` (forks 8, pipelining
  and ControlPersist on), built and installed from remote/ansible;
- the same with pipelining off (each request a file put in the host's remote tmp);
- the collection as it was before patcher was imported in ansible-playbook's own process (the
  action plugin importing patcher in run(), so once per host's worker): what that change saved;
- Ansible copying the patched files (`copy` with backup: yes, same settings);
- pyinfra 3 putting the same files (`files.put`, --parallel 8): a second anchor, not Ansible;
- one host: `patcher status -i` with the built-in reader and through `ansible-inventory --list`
  (what reading the inventory with ansible-core adds to a run).

Each timed run also counts the ssh client processes started (one per command over Ansible's ssh
connection, one per host for patcher's runner), per host.

    sudo .venv/bin/python bench/ansible.py [--hosts 8,32] [--repeat 1] [--json bench/results/ansible.json]

Needs root (sshd), /usr/sbin/sshd, ansible-core beside patcher (the test extra); pyinfra is
installed into ~/.cache/patcher/bench-pyinfra the first time (from the package index).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))
sys.path.append(str(ROOT / "bench"))

import record  # noqa: E402  (bench/record.py, beside this script)
from fleet import PATCHER, TARGETS, Fleet, ansible_base_env, sh  # noqa: E402

from workbench.envs import site_file  # noqa: E402
from workbench.sshd import why_no_sshd  # noqa: E402

BIN = Path(sys.executable).parent
PYINFRA_VERSION = "3.10.0"


def ansible_env(fleet: Fleet, collections: Path) -> dict:
    return {
        **ansible_base_env(fleet),
        "PATH": fleet.env["PATH"],  # the ssh that counts its sessions (bench/fleet.py)
        "ANSIBLE_COLLECTIONS_PATH": str(collections),
        "PATCHER_CACHE": str(fleet.work / "cache-warm"),
    }


# The action plugin before patcher was imported in ansible-playbook's own process: the import
# (and the patch set's reading) in run(), so in each host's forked worker.
ACTION_IMPORTING_PER_WORKER = """\
from ansible.plugins.action import ActionBase


class ActionModule(ActionBase):
    TRANSFERS_FILES = False
    _VALID_ARGS = frozenset(("command", "python", "only", "skip", "verify", "force", "lock_timeout"))

    def run(self, tmp=None, task_vars=None):
        result = super().run(tmp, task_vars)
        from patcher.frontends.ansible_task import run_task

        result.update(
            run_task(self, dict(self._task.args), task_vars or {}, bool(self._task.check_mode), bool(self._task.diff))
        )
        return result
"""


def install_collection(work: Path, name: str, action: str | None = None) -> Path:
    """remote/ansible built and installed under work/NAME (its action plugin replaced by `action`)."""
    source = work / f"{name}-src"
    shutil.copytree(ROOT / "remote" / "ansible", source, ignore=shutil.ignore_patterns("__pycache__", "*.tar.gz"))
    if action is not None:
        (source / "plugins" / "action" / "patch.py").write_text(action)
    built = work / f"{name}-built"
    sh([str(BIN / "ansible-galaxy"), "collection", "build", str(source), "--output-path", str(built)])
    target = work / name
    sh([str(BIN / "ansible-galaxy"), "collection", "install", str(next(built.glob("*.tar.gz"))), "-p", str(target)])
    return target


def sessions(fleet: Fleet) -> int:
    """ssh client processes started since the last reset (bench/fleet.py's counting ssh)."""
    try:
        return sum(1 for line in fleet.counter.read_text().splitlines() if line == "session")
    except FileNotFoundError:
        return 0


def ansible_inventory(fleet: Fleet, n: int) -> Path:
    path = fleet.work / f"ansible-{n}.ini"
    path.write_text(
        "[gpus]\n"
        + "".join(
            f"h{i} ansible_host={s.address} ansible_port={s.port} ansible_user=root ansible_python_interpreter={p} "
            f"site={site_file(p, '')}\n"
            for i, (s, p) in enumerate(zip(fleet.servers[:n], fleet.pythons[:n]))
        )
    )
    return path


LAST_CPU = [0.0]  # the controller's CPU seconds (the command and its children) of the last timed run


def cold_connections(env: dict, fleet: Fleet) -> dict:
    """`env` with a control path folder of its own: the run starts its ssh connections (ControlPersist
    keeps them for the run), as patcher's runner does, rather than reusing the last run's."""
    runs = fleet.work / "control-paths"
    runs.mkdir(exist_ok=True)
    return {**env, "ANSIBLE_SSH_CONTROL_PATH_DIR": tempfile.mkdtemp(dir=runs)}


def timed(command: list[str], env: dict, cwd: Path) -> float:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=cwd)
    elapsed = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    LAST_CPU[0] = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    if done.returncode != 0:
        raise SystemExit(
            f"{' '.join(command[:4])} ... exited {done.returncode}:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
        )
    return elapsed


def time_runner(fleet: Fleet, n: int, extra: list[str], command: str = "apply") -> float:
    fleet.reset(n)
    args = [
        *PATCHER,
        command,
        "-q",
        "--no-retry-file",
        "-i",
        str(ansible_inventory(fleet, n)),
        "--forks",
        "8",
        "--ssh-config",
        str(fleet.client.config),
        *extra,
    ]
    if command == "apply":
        args.append("--no-verify")
    return timed(args, {**fleet.env, "PATCHER_CACHE": str(fleet.work / "cache-warm")}, fleet.work)


def time_collection(fleet: Fleet, n: int, env: dict) -> float:
    """The collection's apply; `env` picks the installed collection and Ansible's settings."""
    fleet.reset(n)
    book = fleet.work / "collection.yml"
    book.write_text(
        "- hosts: gpus\n  gather_facts: false\n  tasks:\n    - patcher.fleet.patch: {command: apply, verify: false}\n"
    )
    return timed(
        [str(BIN / "ansible-playbook"), "-i", str(ansible_inventory(fleet, n)), "-f", "8", str(book)],
        cold_connections(env, fleet),
        fleet.work,
    )


def time_copy(fleet: Fleet, n: int, env: dict, patched: dict[str, bytes]) -> float:
    fleet.reset(n)
    folder = fleet.work / "patched"
    folder.mkdir(exist_ok=True)
    for rel, data in patched.items():
        (folder / Path(rel).name).write_bytes(data)
    tasks = "".join(
        f'    - copy:\n        src: {folder / Path(rel).name}\n        dest: "{{{{ site }}}}/{rel}"\n        backup: yes\n'
        for rel in TARGETS
    )
    book = fleet.work / "copy.yml"
    book.write_text(f"- hosts: gpus\n  gather_facts: false\n  tasks:\n{tasks}")
    return timed(
        [str(BIN / "ansible-playbook"), "-i", str(ansible_inventory(fleet, n)), "-f", "8", str(book)],
        cold_connections(env, fleet),
        fleet.work,
    )


def pyinfra_bin() -> Path:
    venv = Path(os.environ.get("PATCHER_CACHE", "~/.cache/patcher")).expanduser() / "bench-pyinfra"
    binary = venv / "bin" / "pyinfra"
    if not binary.exists():
        print("installing pyinfra into", venv, file=sys.stderr)
        sh([sys.executable, "-m", "venv", str(venv)])
        sh([str(venv / "bin" / "pip"), "install", "-q", "--disable-pip-version-check", f"pyinfra=={PYINFRA_VERSION}"])
    return binary


def time_pyinfra(fleet: Fleet, n: int, binary: Path, patched: dict[str, bytes]) -> float:
    fleet.reset(n)
    folder = fleet.work / "patched"
    folder.mkdir(exist_ok=True)
    for rel, data in patched.items():
        (folder / Path(rel).name).write_bytes(data)
    inventory = fleet.work / f"pyinfra_{n}.py"
    inventory.write_text(
        "gpus = [\n"
        + "".join(
            f"    ({s.address!r}, {{'ssh_port': {s.port}, 'ssh_user': 'root', 'ssh_key': {str(fleet.client.key)!r}, "
            f"'ssh_known_hosts_file': {str(fleet.client.known_hosts)!r}, 'site': {str(site_file(p, ''))!r}}}),\n"
            for s, p in zip(fleet.servers[:n], fleet.pythons[:n])
        )
        + "]\n"
    )
    deploy = fleet.work / "deploy.py"
    deploy.write_text(
        "from pyinfra import host\nfrom pyinfra.operations import files\n"
        + "".join(
            f"files.put(name={rel!r}, src={str(folder / Path(rel).name)!r}, dest=host.data.site + '/' + {rel!r})\n"
            for rel in TARGETS
        )
    )
    env = {**os.environ}
    env.pop("SSH_AUTH_SOCK", None)
    return timed([str(binary), str(inventory), str(deploy), "--yes", "--parallel", "8"], env, fleet.work)


PATHS = (
    ("runner", "patcher apply -i"),
    ("collection", "collection"),
    ("collection_unpipelined", "collection, pipelining off"),
    ("collection_import_per_worker", "collection, import per worker (before)"),
    ("ansible_copy", "Ansible copy"),
    ("pyinfra", "pyinfra put"),
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hosts", default="8,32")
    parser.add_argument("--repeat", type=int, default=1, help="timed runs per point, round robin; medians reported")
    parser.add_argument("--no-pyinfra", action="store_true")
    parser.add_argument("--json", metavar="FILE")
    parser.add_argument("--record", action="store_true", help="also record them: bench/results/benchmarks/ansible.json")
    args = parser.parse_args()
    if why_no_sshd():
        raise SystemExit(why_no_sshd())
    if not (BIN / "ansible-playbook").exists():
        raise SystemExit("ansible-core is not installed beside patcher: pip install -e '.[test]'")
    sizes = [int(x) for x in args.hosts.split(",")]
    work = Path(tempfile.mkdtemp(prefix="patcher-bench-ansible-"))
    fleet = Fleet(work, max(sizes))
    results: dict = {"cpus": os.cpu_count(), "repeat": args.repeat, "forks": 8, "points": []}

    def one_run(run, n: int) -> tuple[float, float, int]:
        """One timed run: wall seconds, the controller's CPU seconds, ssh client processes."""
        seconds = run()
        return seconds, LAST_CPU[0], sessions(fleet)

    try:
        env = ansible_env(fleet, install_collection(work, "collections"))
        unpipelined = {**env, "ANSIBLE_PIPELINING": "False"}
        per_worker = ansible_env(fleet, install_collection(work, "collections-before", ACTION_IMPORTING_PER_WORKER))
        time_runner(fleet, 1, ["--no-ansible-inventory"])  # warms the transform cache
        patched = {rel: site_file(fleet.pythons[0], rel).read_bytes() for rel in TARGETS}
        # one host: the inventory read by the built-in reader, then by ansible-inventory
        one = {
            "builtin_s": round(
                statistics.median(
                    time_runner(fleet, 1, ["--no-ansible-inventory"], "status") for _ in range(args.repeat)
                ),
                2,
            ),
            "ansible_inventory_s": round(
                statistics.median(time_runner(fleet, 1, [], "status") for _ in range(args.repeat)), 2
            ),
        }
        results["one_host_status"] = one
        print(json.dumps(one), file=sys.stderr)
        pyinfra = None if args.no_pyinfra else pyinfra_bin()
        for n in sizes:
            runs = {
                "runner": lambda n=n: time_runner(fleet, n, ["--no-ansible-inventory"]),
                "collection": lambda n=n: time_collection(fleet, n, env),
                "collection_unpipelined": lambda n=n: time_collection(fleet, n, unpipelined),
                "collection_import_per_worker": lambda n=n: time_collection(fleet, n, per_worker),
                "ansible_copy": lambda n=n: time_copy(fleet, n, env, patched),
            }
            if pyinfra:
                runs["pyinfra"] = lambda n=n: time_pyinfra(fleet, n, pyinfra, patched)
            point: dict = {"hosts": n}
            samples: dict[str, list[tuple[float, float, int]]] = {name: [] for name in runs}
            # round robin: a load that drifts during the run (a shared machine) weighs on every path alike
            for _ in range(args.repeat):
                for name, run in runs.items():
                    samples[name].append(one_run(run, n))
                    fleet.check_patched(n, patched)
                    print(n, name, samples[name][-1], file=sys.stderr)
            for name, taken in samples.items():
                point[name] = {
                    "s": round(statistics.median(t[0] for t in taken), 2),
                    "cpu_s": round(statistics.median(t[1] for t in taken), 2),
                    "ssh_per_host": round(statistics.median(t[2] for t in taken) / n, 1),
                    "runs_s": [round(t[0], 2) for t in taken],
                }
            results["points"].append(point)
    finally:
        fleet.stop()
        shutil.rmtree(work, ignore_errors=True)
    load = os.getloadavg()
    results["load_at_end"] = [round(x, 1) for x in load]
    one = results["one_host_status"]
    print(
        f"\none host, `patcher status -i`: built-in reader {one['builtin_s']:.2f} s, through ansible-inventory "
        f"{one['ansible_inventory_s']:.2f} s (+{one['ansible_inventory_s'] - one['builtin_s']:.2f} s, "
        f"{one['ansible_inventory_s'] / one['builtin_s']:.1f}x)"
    )
    print(
        f"apply on loopback hosts, {results['cpus']} CPUs, forks 8, median of {args.repeat}; ratio: wall time "
        "against patcher's runner; cpu: the controller's CPU seconds; ssh: ssh client processes per host"
    )
    for p in results["points"]:
        base = p["runner"]["s"]
        print(f"{p['hosts']} hosts")
        for name, label in PATHS:
            if name in p:
                m = p[name]
                print(
                    f"  {label:40} {m['s']:>8.2f} s {m['s'] / base:>5.1f}x  cpu {m['cpu_s']:>6.2f} s"
                    f"  ssh {m['ssh_per_host']:>4.1f}"
                )
    print(f"load average at the end: {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")
    record.write("ansible", results, args.json, args.record)


if __name__ == "__main__":
    main()
