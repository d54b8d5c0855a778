"""Fleet benchmark: `patcher apply --no-verify` on 1, 8 and 32 loopback hosts, against the manual
procedure (copy a script with scp, run it over ssh, one host at a time) and, with --ansible,
against Ansible copying the same patched files with backup=yes on the same hosts.

Each host is its own sshd on 127.0.1.x (loopback only) with its own light target environment
(speculators 0.3.0 from its wheel, vLLM as metadata). Verification is left out (--no-verify):
it imports vLLM and torch, seconds of CPU per host, the same on every path. Each timed run
starts from pristine files and no state. ssh invocations are counted by an `ssh` wrapper put
first on PATH for patcher.

    sudo python bench/fleet.py [--hosts 1,8,32] [--forks 8] [--repeat 3] [--ansible]

Needs root (sshd), /usr/sbin/sshd and the ssh client; --ansible installs ansible-core into a
private venv (from the package index) the first time.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))  # for workbench/; patcher itself as installed

import record  # noqa: E402  (bench/record.py, beside this script)

from patcher.patchset.registry import load_patches  # noqa: E402
from workbench.envs import light_env, site_file  # noqa: E402
from workbench.sshd import SshClient, SshServer, why_no_sshd  # noqa: E402

TARGETS = sorted({p.target.path for p in load_patches()})
# What users run: the console script installed beside this interpreter.
SCRIPT = Path(sys.executable).parent / "patcher"
PATCHER = [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "patcher.cli.entry"]


def address(i: int) -> str:
    return f"127.0.1.{i + 2}"  # loopback; apart from the tests' 127.0.0.x


def ansible_base_env(fleet: Fleet) -> dict:
    """Ansible's settings for a loopback fleet (its ssh config, pipelining, no agent), shared
    with bench/ansible.py."""
    env = {
        **os.environ,
        "ANSIBLE_SSH_ARGS": f"-F {fleet.client.config} -o ControlMaster=auto -o ControlPersist=60s",
        "ANSIBLE_PIPELINING": "True",
        "ANSIBLE_HOST_KEY_CHECKING": "True",
        "ANSIBLE_RETRY_FILES_ENABLED": "False",
        "ANSIBLE_LOCAL_TEMP": str(fleet.work / "ansible-tmp"),
        "ANSIBLE_NOCOLOR": "1",
    }
    env.pop("SSH_AUTH_SOCK", None)
    return env


def sh(command: list[str], env: dict | None = None, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if check and done.returncode != 0:
        raise SystemExit(f"{' '.join(command[:6])} ... exited {done.returncode}:\n{done.stderr[-3000:]}")
    return done


class Fleet:
    def __init__(self, work: Path, size: int) -> None:
        self.work = work
        self.client = SshClient(work / "client")
        self.servers = [SshServer(work / f"sshd{i}", address(i), {"root": self.client.public_key}) for i in range(size)]
        for server in self.servers:
            server.start()
        self.pythons = [light_env(work / f"host{i}") for i in range(size)]
        self.pristine = {rel: site_file(self.pythons[0], rel).read_bytes() for rel in TARGETS}
        # every host's key into known_hosts once, so no run pays for accept-new
        for server in self.servers:
            sh(
                [
                    "ssh",
                    "-F",
                    str(self.client.config),
                    "-o",
                    "StrictHostKeyChecking=accept-new",
                    "-p",
                    str(server.port),
                    f"root@{server.address}",
                    "true",
                ]
            )
        bin_dir = work / "bin"
        bin_dir.mkdir()
        self.counter = work / "ssh-calls"
        self.last_cpu = 0.0  # machine CPU seconds of the last timed patcher run
        real_ssh = shutil.which("ssh")
        (bin_dir / "ssh").write_text(
            "#!/bin/sh\n"
            f'case " $* " in *" -O exit "*) echo control >> {self.counter};; *) echo session >> {self.counter};; esac\n'
            f'exec {real_ssh} "$@"\n'
        )
        (bin_dir / "ssh").chmod(0o755)
        self.env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
        self.env.pop("SSH_AUTH_SOCK", None)

    def reset(self, n: int) -> None:
        for python in self.pythons[:n]:
            for rel, data in self.pristine.items():
                site_file(python, rel).write_bytes(data)
                for pyc in site_file(python, rel).parent.glob(f"__pycache__/{Path(rel).stem}.*"):
                    pyc.unlink()
            shutil.rmtree(python.parent.parent / "share" / "patcher", ignore_errors=True)
        self.counter.unlink(missing_ok=True)

    def check_patched(self, n: int, reference: dict[str, bytes]) -> None:
        """Every host carries the reference bytes (taken from host 0 after the first run)."""
        for python in self.pythons[:n]:
            for rel in TARGETS:
                if site_file(python, rel).read_bytes() != reference[rel]:
                    raise SystemExit(f"{python}: {rel} is not the patched bytes")

    def inventory(self, n: int) -> Path:
        path = self.work / f"hosts-{n}"
        path.write_text(
            "".join(
                f"root@{s.address}:{s.port} ansible_python_interpreter={p}\n"
                for s, p in zip(self.servers[:n], self.pythons[:n])
            )
        )
        return path

    def stop(self) -> None:
        for server in self.servers:
            server.remove()


def time_patcher(fleet: Fleet, n: int, forks: int, cache: Path) -> tuple[float, int, int]:
    """One `patcher apply`; `cache` is $PATCHER_CACHE (an empty folder: a cold run, whose codemods
    run; a used one: a warm run, whose transforms come from the cache)."""
    fleet.reset(n)
    command = [
        *PATCHER,
        "apply",
        "--no-verify",
        "-q",
        "--no-retry-file",
        "-i",
        str(fleet.inventory(n)),
        "--no-ansible-inventory",
        "--forks",
        str(forks),
        "--ssh-config",
        str(fleet.client.config),
    ]
    cpu, started = machine_cpu_seconds(), time.perf_counter()
    done = subprocess.run(
        command, capture_output=True, text=True, env={**fleet.env, "PATCHER_CACHE": str(cache)}, cwd=fleet.work
    )
    elapsed = time.perf_counter() - started
    fleet.last_cpu = machine_cpu_seconds() - cpu
    if done.returncode != 0:
        raise SystemExit(f"patcher apply on {n} hosts exited {done.returncode}:\n{done.stderr[-3000:]}")
    calls = fleet.counter.read_text().splitlines()
    control = calls.count("control")
    return elapsed, len(calls) - control, control


def machine_cpu_seconds() -> float:
    """CPU time used by every process on the machine so far (/proc/stat: user, nice, system, irq...)."""
    with open("/proc/stat") as fh:
        ticks = fh.readline().split()[1:]
    return sum(int(x) for x in ticks[:3] + ticks[5:8]) / os.sysconf("SC_CLK_TCK")


def time_ssh_only(fleet: Fleet, n: int, forks: int) -> tuple[float, float]:
    """n bare logins (`ssh HOST true`), `forks` at a time: the connection work any run over ssh
    pays (client and sshd: key exchange, authentication, session), with nothing of patcher's.
    (wall seconds, machine CPU seconds)."""
    from concurrent.futures import ThreadPoolExecutor

    config = str(fleet.client.config)

    def login(server) -> None:
        sh(["ssh", "-F", config, "-p", str(server.port), f"root@{server.address}", "true"], env=fleet.env)

    cpu, started = machine_cpu_seconds(), time.perf_counter()
    with ThreadPoolExecutor(forks) as pool:
        list(pool.map(login, fleet.servers[:n]))
    return time.perf_counter() - started, machine_cpu_seconds() - cpu


def time_manual(fleet: Fleet, n: int, script: Path) -> float:
    """The procedure the issue starts from: for each host, scp the script, run it over ssh."""
    fleet.reset(n)
    config = str(fleet.client.config)
    started = time.perf_counter()
    for server, python in zip(fleet.servers[:n], fleet.pythons[:n]):
        sh(
            [
                "scp",
                "-q",
                "-F",
                config,
                "-P",
                str(server.port),
                str(script),
                f"root@{server.address}:/tmp/patch-bench.py",
            ]
        )
        sh(
            [
                "ssh",
                "-F",
                config,
                "-p",
                str(server.port),
                f"root@{server.address}",
                f"{python} /tmp/patch-bench.py apply --no-verify -q",
            ]
        )
    return time.perf_counter() - started


def ansible_venv(work: Path) -> Path:
    cache = Path(os.environ.get("PATCHER_CACHE", "~/.cache/patcher")).expanduser() / "bench-ansible"
    playbook = cache / "bin" / "ansible-playbook"
    if not playbook.exists():
        print("installing ansible-core into", cache, file=sys.stderr)
        sh([sys.executable, "-m", "venv", str(cache)])
        sh([str(cache / "bin" / "pip"), "install", "-q", "--disable-pip-version-check", "ansible-core"])
    return playbook


def time_ansible(fleet: Fleet, n: int, forks: int, playbook_bin: Path, patched: dict[str, bytes]) -> float:
    fleet.reset(n)
    files = fleet.work / "ansible-files"
    files.mkdir(exist_ok=True)
    for rel, data in patched.items():
        (files / Path(rel).name).write_bytes(data)
    site = lambda python: str(site_file(python, ""))  # noqa: E731
    inventory = fleet.work / f"ansible-{n}.ini"
    inventory.write_text(
        "[gpus]\n"
        + "".join(
            f"h{i} ansible_host={s.address} ansible_port={s.port} ansible_user=root ansible_python_interpreter={p} "
            f"site={site(p)}\n"
            for i, (s, p) in enumerate(zip(fleet.servers[:n], fleet.pythons[:n]))
        )
    )
    tasks = "".join(
        f'    - copy:\n        src: {files / Path(rel).name}\n        dest: "{{{{ site }}}}/{rel}"\n        backup: yes\n'
        for rel in TARGETS
    )
    play = fleet.work / "play.yml"
    play.write_text(f"- hosts: gpus\n  gather_facts: false\n  tasks:\n{tasks}")
    env = ansible_base_env(fleet)
    started = time.perf_counter()
    sh([str(playbook_bin), "-i", str(inventory), "-f", str(forks), str(play)], env=env)
    elapsed = time.perf_counter() - started
    fleet.check_patched(n, patched)
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hosts", default="1,8,32")
    parser.add_argument("--forks", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=3, help="timed runs per point; the median is reported")
    parser.add_argument("--ansible", action="store_true", help="also time Ansible (ansible-core) doing the copy")
    parser.add_argument("--json", metavar="FILE", help="also write the figures here")
    parser.add_argument("--record", action="store_true", help="also record them: bench/results/benchmarks/fleet.json")
    args = parser.parse_args()
    reason = why_no_sshd()
    if reason:
        raise SystemExit(reason)
    sizes = [int(x) for x in args.hosts.split(",")]
    work = Path(tempfile.mkdtemp(prefix="patcher-bench-"))
    fleet = Fleet(work, max(sizes))
    results: dict = {"forks": args.forks, "cpus": os.cpu_count(), "points": []}
    try:
        script = work / "patcher-bundle.py"  # the script the manual procedure copies around
        sh([sys.executable, "-m", "patcher.cli", "bundle", "-q", "-o", str(script)])
        playbook = ansible_venv(work) if args.ansible else None
        patched = None
        warm = work / "cache-warm"
        for n in sizes:
            point: dict = {"hosts": n}
            cold = [time_patcher(fleet, n, args.forks, Path(tempfile.mkdtemp(dir=work))) for _ in range(args.repeat)]
            point["patcher_cold_s"] = statistics.median(r[0] for r in cold)
            if patched is None:
                patched = {rel: site_file(fleet.pythons[0], rel).read_bytes() for rel in TARGETS}
            fleet.check_patched(n, patched)
            runs, cpus = [], []
            for _ in range(args.repeat):
                runs.append(time_patcher(fleet, n, args.forks, warm))
                cpus.append(fleet.last_cpu)
            point["patcher_s"] = statistics.median(r[0] for r in runs)
            point["patcher_cpu_s"] = statistics.median(cpus)
            logins = [time_ssh_only(fleet, n, args.forks) for _ in range(args.repeat)]
            point["ssh_only_s"] = statistics.median(w for w, _ in logins)
            point["ssh_only_cpu_s"] = statistics.median(c for _, c in logins)
            point["ssh_sessions_per_host"] = runs[-1][1] / n
            point["ssh_control_per_host"] = runs[-1][2] / n
            fleet.check_patched(n, patched)
            point["forks_n_s"] = statistics.median(time_patcher(fleet, n, n, warm)[0] for _ in range(args.repeat))
            point["manual_s"] = statistics.median(
                time_manual(fleet, n, script) for _ in range(max(1, args.repeat // 2))
            )
            fleet.check_patched(n, patched)
            if playbook is not None:
                point["ansible_s"] = statistics.median(
                    time_ansible(fleet, n, args.forks, playbook, patched) for _ in range(max(1, args.repeat // 2))
                )
            results["points"].append(point)
            print(json.dumps(point), file=sys.stderr)
    finally:
        fleet.stop()
        shutil.rmtree(work, ignore_errors=True)
    first = results["points"][0]
    print(
        f"\npatcher apply --no-verify on loopback hosts, {results['cpus']} CPUs, --forks {args.forks}, "
        f"median of {args.repeat}; ratios against 1 host in the same run"
    )
    header = (
        f"{'hosts':>5} {'cold':>7} {'ratio':>6} {'warm':>7} {'ratio':>6} {'forks=N':>8} {'ssh/host':>9} "
        f"{'ssh-only':>9} {'warm/ssh-only':>14} {'cpu/host':>9} {'ssh cpu/host':>13} "
        f"{'manual':>8} {'manual/warm':>12}"
    )
    if args.ansible:
        header += f" {'ansible':>8} {'ansible/warm':>13} {'ansible/cold':>13}"
    print(header)
    for p in results["points"]:
        line = (
            f"{p['hosts']:>5} {p['patcher_cold_s']:>6.2f}s {p['patcher_cold_s'] / first['patcher_cold_s']:>5.2f}x "
            f"{p['patcher_s']:>6.2f}s {p['patcher_s'] / first['patcher_s']:>5.2f}x {p['forks_n_s']:>7.2f}s "
            f"{p['ssh_sessions_per_host']:>4.0f}+{p['ssh_control_per_host']:.0f}ctl "
            f"{p['ssh_only_s']:>8.2f}s {p['patcher_s'] / p['ssh_only_s']:>13.2f}x "
            f"{p['patcher_cpu_s'] / p['hosts'] * 1000:>6.0f} ms {p['ssh_only_cpu_s'] / p['hosts'] * 1000:>10.0f} ms "
            f"{p['manual_s']:>7.2f}s "
            f"{p['manual_s'] / p['patcher_s']:>11.1f}x"
        )
        if args.ansible:
            line += f" {p['ansible_s']:>7.2f}s {p['ansible_s'] / p['patcher_s']:>12.1f}x {p['ansible_s'] / p['patcher_cold_s']:>12.1f}x"
        print(line)
    load = os.getloadavg()
    print(f"load average at the end: {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")
    record.write("fleet", results, args.json, args.record)


if __name__ == "__main__":
    main()
