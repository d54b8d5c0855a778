"""Fleets through Ansible: on 8 and 32 loopback hosts (and 1, for the inventory reader), in one run,
from pristine files each time, verification left out everywhere (--no-verify / verify: false):

- patcher's own runner: `patcher apply -i HOSTS --forks 8` (built-in inventory reader, warm
  transform cache: the baseline of the ratios);
- the collection: `ansible-playbook` with `patcher.fleet.patch command=apply` (forks 8, pipelining
  and ControlPersist on), built and installed from remote/ansible;
- Ansible copying the patched files (`copy` with backup: yes, same settings);
- pyinfra 3 putting the same files (`files.put`, --parallel 8): a second anchor, not Ansible;
- one host: `patcher status -i` with the built-in reader and through `ansible-inventory --list`
  (what reading the inventory with ansible-core adds to a run).

    sudo .venv/bin/python bench/ansible.py [--hosts 8,32] [--repeat 1]

Needs root (sshd), /usr/sbin/sshd, ansible-core beside patcher (the test extra); pyinfra is
installed into ~/.cache/patcher/bench-pyinfra the first time (from the package index).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))
sys.path.append(str(ROOT / "bench"))

import record  # noqa: E402  (bench/record.py, beside this script)
from fleet import PATCHER, TARGETS, Fleet, ansible_base_env, sh  # noqa: E402

from tests.support.envs import site_file  # noqa: E402
from tests.support.sshd import why_no_sshd  # noqa: E402

BIN = Path(sys.executable).parent
PYINFRA_VERSION = "3.10.0"


def ansible_env(fleet: Fleet, collections: Path) -> dict:
    return {
        **ansible_base_env(fleet),
        "ANSIBLE_COLLECTIONS_PATH": str(collections),
        "PATCHER_CACHE": str(fleet.work / "cache-warm"),
    }


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


def timed(command: list[str], env: dict, cwd: Path) -> float:
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=cwd)
    elapsed = time.perf_counter() - started
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
        str(fleet.inventory(n)),
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
    fleet.reset(n)
    book = fleet.work / "collection.yml"
    book.write_text(
        "- hosts: gpus\n  gather_facts: false\n  tasks:\n    - patcher.fleet.patch: {command: apply, verify: false}\n"
    )
    return timed(
        [str(BIN / "ansible-playbook"), "-i", str(ansible_inventory(fleet, n)), "-f", "8", str(book)], env, fleet.work
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
        [str(BIN / "ansible-playbook"), "-i", str(ansible_inventory(fleet, n)), "-f", "8", str(book)], env, fleet.work
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hosts", default="8,32")
    parser.add_argument("--repeat", type=int, default=1, help="timed runs per point; the median is reported")
    parser.add_argument("--no-pyinfra", action="store_true")
    parser.add_argument("--json", metavar="FILE")
    parser.add_argument("--record", action="store_true", help="also record them: bench/results/benchmarks/ansible.json")
    args = parser.parse_args()
    if why_no_sshd():
        raise SystemExit(why_no_sshd())
    if not (BIN / "ansible-playbook").exists():
        raise SystemExit("ansible-core is not installed beside patcher: pip install -e '.[test]'")
    sizes = [int(x) for x in args.hosts.split(",")]
    import tempfile

    work = Path(tempfile.mkdtemp(prefix="patcher-bench-ansible-"))
    fleet = Fleet(work, max(sizes))
    median = lambda f: statistics.median(f() for _ in range(args.repeat))  # noqa: E731
    results: dict = {"cpus": os.cpu_count(), "repeat": args.repeat, "points": []}
    try:
        built = work / "built"
        sh(
            [
                str(BIN / "ansible-galaxy"),
                "collection",
                "build",
                str(ROOT / "remote" / "ansible"),
                "--output-path",
                str(built),
            ]
        )
        sh(
            [
                str(BIN / "ansible-galaxy"),
                "collection",
                "install",
                str(next(built.glob("*.tar.gz"))),
                "-p",
                str(work / "collections"),
            ]
        )
        env = ansible_env(fleet, work / "collections")
        time_runner(fleet, 1, ["--no-ansible-inventory"])  # warms the transform cache
        patched = {rel: site_file(fleet.pythons[0], rel).read_bytes() for rel in TARGETS}
        # one host: the inventory read by the built-in reader, then by ansible-inventory
        one = {
            "builtin_s": median(lambda: time_runner(fleet, 1, ["--no-ansible-inventory"], "status")),
            "ansible_inventory_s": median(lambda: time_runner(fleet, 1, [], "status")),
        }
        results["one_host_status"] = one
        print(json.dumps(one), file=sys.stderr)
        pyinfra = None if args.no_pyinfra else pyinfra_bin()
        for n in sizes:
            point = {"hosts": n, "runner_s": median(lambda n=n: time_runner(fleet, n, ["--no-ansible-inventory"]))}
            fleet.check_patched(n, patched)
            point["collection_s"] = median(lambda n=n: time_collection(fleet, n, env))
            fleet.check_patched(n, patched)
            point["ansible_copy_s"] = median(lambda n=n: time_copy(fleet, n, env, patched))
            fleet.check_patched(n, patched)
            if pyinfra:
                point["pyinfra_s"] = median(lambda n=n: time_pyinfra(fleet, n, pyinfra, patched))
                fleet.check_patched(n, patched)
            results["points"].append(point)
            print(json.dumps(point), file=sys.stderr)
    finally:
        fleet.stop()
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    one = results["one_host_status"]
    print(
        f"\none host, `patcher status -i`: built-in reader {one['builtin_s']:.2f} s, through ansible-inventory "
        f"{one['ansible_inventory_s']:.2f} s (+{one['ansible_inventory_s'] - one['builtin_s']:.2f} s, "
        f"{one['ansible_inventory_s'] / one['builtin_s']:.1f}x)"
    )
    print(
        f"apply on loopback hosts, {results['cpus']} CPUs, forks 8, median of {args.repeat}; ratios against patcher's runner"
    )
    print(
        f"{'hosts':>5} {'runner':>8} {'collection':>11} {'ratio':>6} {'ansible copy':>13} {'ratio':>6} {'pyinfra put':>12} {'ratio':>6}"
    )
    for p in results["points"]:
        line = (
            f"{p['hosts']:>5} {p['runner_s']:>7.2f}s {p['collection_s']:>10.2f}s {p['collection_s'] / p['runner_s']:>5.1f}x "
            f"{p['ansible_copy_s']:>12.2f}s {p['ansible_copy_s'] / p['runner_s']:>5.1f}x"
        )
        if "pyinfra_s" in p:
            line += f" {p['pyinfra_s']:>11.2f}s {p['pyinfra_s'] / p['runner_s']:>5.1f}x"
        print(line)
    load = os.getloadavg()
    print(f"load average at the end: {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")
    record.write("ansible", results, args.json, args.record)


if __name__ == "__main__":
    main()
