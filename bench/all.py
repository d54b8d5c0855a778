"""Every benchmark, one command: local (apply, no-op apply, --version/--help, verification),
check-upstream (warm, full matrix) and the fleet (1/8/32 loopback hosts; root and sshd needed,
skipped with the reason otherwise; with --ansible also bench/ansible.py: the collection, Ansible's
copy and pyinfra on 8 and 32 hosts). Each prints its figures as ratios against a baseline measured
in the same run; nothing here asserts a time. With --record each also keeps its figures in
bench/results/benchmarks/ (bench/record.py), which the docs' figures page is generated from.

    python bench/all.py [--ansible] [--record]
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def run(title: str, args: list[str]) -> int:
    args = [*args, *(["--record"] if "--record" in sys.argv[1:] else [])]
    print(f"\n== {title}: {' '.join(args)}", flush=True)
    return subprocess.run([sys.executable, *args], cwd=HERE.parent).returncode


def main() -> int:
    codes = [
        run("local", [str(HERE / "local.py")]),
        run("check-upstream", [str(HERE / "check_upstream.py")]),
    ]
    if os.geteuid() == 0 and (shutil.which("sshd") or Path("/usr/sbin/sshd").exists()):
        fleet = [str(HERE / "fleet.py"), "--hosts", "1,8,32", "--repeat", "3"]
        codes.append(run("fleet", fleet + (["--ansible"] if "--ansible" in sys.argv else [])))
        if "--ansible" in sys.argv:
            codes.append(run("fleets through Ansible", [str(HERE / "ansible.py"), "--hosts", "8,32"]))
    else:
        print("\n== fleet: skipped (needs root and /usr/sbin/sshd; `.ci/bootstrap` installs it as root)")
    return max(codes)


if __name__ == "__main__":
    sys.exit(main())
