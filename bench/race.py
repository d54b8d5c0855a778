"""Concurrency stress, long form: hundreds of rounds of `apply --no-verify`, `rollback` (with
`--only`/`--skip` mixed in) and `status` started 0-80 ms apart on one environment, locally, over
ssh (a real sshd on 127.0.2.x, loopback only) and both at once; after each round the files, the
reports and `status` are checked (workbench/race_stress.py says what). Not a timing: it prints the
rounds, the bad rounds (each described) and the seed, and exits 1 if any round was bad.

    python bench/race.py [--rounds 300] [--ways local,ssh,mixed] [--seed N] [--max-offset-ms 80]

`--rounds` is per way. The ssh ways need root, /usr/sbin/sshd and the ssh client (skipped with
the reason otherwise). tests/test_race.py runs the short form (a few tens of rounds) in CI.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))  # for workbench/; patcher itself as installed

from workbench.envs import light_env  # noqa: E402
from workbench.race_stress import Stress  # noqa: E402
from workbench.sshd import SshClient, SshServer, why_no_sshd  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=300, help="rounds per way")
    parser.add_argument(
        "--ways", default="local,ssh,mixed", help="local, ssh (every run over ssh), mixed (each run either)"
    )
    parser.add_argument("--seed", type=int, default=int(time.time()) % 100000)
    parser.add_argument("--max-offset-ms", type=float, default=80)
    parser.add_argument("--json", metavar="FILE", help="also write the figures here")
    args = parser.parse_args()
    ways = args.ways.split(",")
    unknown = set(ways) - {"local", "ssh", "mixed"}
    if unknown:
        parser.error(f"unknown way(s): {', '.join(sorted(unknown))}")
    work = Path(tempfile.mkdtemp(prefix="patcher-race-"))
    server = None
    vias: dict[str, list[str]] = {"local": []}
    if {"ssh", "mixed"} & set(ways):
        reason = why_no_sshd()
        if reason:
            print(f"ssh ways skipped: {reason}")
            ways = [w for w in ways if w == "local"]
        else:
            client = SshClient(work / "client")
            server = SshServer(work / "sshd", "127.0.2.2", {"root": client.public_key}).start()
            vias["ssh"] = ["--host", f"root@{server.address}:{server.port}", *client.args()]
    results = {"seed": args.seed, "rounds_per_way": args.rounds, "ways": {}}  # way n uses seed + n
    bad = 0
    try:
        for number, way in enumerate(ways):
            python = light_env(work / way)
            allowed = {"local": ["local"], "ssh": ["ssh"], "mixed": ["local", "ssh"]}[way]
            harness = Stress(python, vias, args.seed + number, args.max_offset_ms / 1000)
            started = time.monotonic()
            for done in range(1, args.rounds + 1):
                if harness.round(allowed):
                    print(harness.bad[-1], flush=True)
                if done % 25 == 0:
                    print(f"{way}: {done} rounds, {len(harness.bad)} bad", flush=True)
            summary = harness.summary()
            summary["seconds"] = round(time.monotonic() - started, 1)
            results["ways"][way] = summary
            bad += len(harness.bad)
            print(f"{way}: {summary}", flush=True)
    finally:
        if server is not None:
            server.remove()
        shutil.rmtree(work, ignore_errors=True)
    total = sum(w["rounds"] for w in results["ways"].values())
    print(f"seed {args.seed}: {total} rounds, {bad} bad")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
