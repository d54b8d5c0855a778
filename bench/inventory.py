"""`--limit` one host on large INI inventories (10k, 30k, 100k hosts), read by the built-in
reader in one process each: the time per host must stay flat (linear in the host count), and
100k hosts under 10 s on the 2-core development machine. The baseline is the 10k inventory of
the same run (per-host cost ratio), since absolute times on a shared machine are noise.

    python bench/inventory.py [--sizes 10000,30000,100000] [--out bench/results/inventory.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

MEASURE = (
    "import sys, time; from patcher.fleet.inventory import load_hosts; t = time.perf_counter(); "
    "hosts = load_hosts([], [sys.argv[1]], sys.argv[2]).hosts; "
    "assert [h.name for h in hosts] == [sys.argv[2]], hosts; print(time.perf_counter() - t)"
)


def write_inventory(path: Path, hosts: int) -> None:
    lines = ["[gpus]"] + [f"gpu{i:06d} ansible_host=127.0.0.{i % 200 + 2}" for i in range(hosts)]
    lines += ["", "[gpus:vars]", "ansible_user=ops", ""]
    path.write_text("\n".join(lines))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10000,30000,100000")
    parser.add_argument("--out", type=Path, default=None, help="also write the figures here (JSON)")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    rows = []
    with tempfile.TemporaryDirectory(prefix="patcher-bench-inventory-") as folder:
        for size in sizes:
            path = Path(folder) / f"hosts-{size}.ini"
            write_inventory(path, size)
            done = subprocess.run(
                [sys.executable, "-c", MEASURE, str(path), f"gpu{size // 2:06d}"],
                capture_output=True, text=True, check=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
            )  # fmt: skip
            seconds = float(done.stdout.strip())
            rows.append({"hosts": size, "seconds": round(seconds, 3), "us_per_host": round(seconds / size * 1e6, 1)})
    base = rows[0]["us_per_host"]
    for row in rows:
        row["per_host_ratio"] = round(row["us_per_host"] / base, 2)
        print(
            f"{row['hosts']:>7} hosts  {row['seconds']:7.2f} s  {row['us_per_host']:6.1f} us/host  x{row['per_host_ratio']}"
        )
    load = os.getloadavg()[0]
    print(f"load average {load:.1f} on {os.cpu_count()} cores")
    if args.out:
        record = {"when": time.strftime("%Y-%m-%d"), "cores": os.cpu_count(), "load": round(load, 1), "rows": rows}
        args.out.write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
