"""Where a benchmark keeps the figures of its last run: bench/results/benchmarks/<name>.json, in the
repository, read by the docs' generated benchmark page (scripts/generate.py). Each script writes it
with --record; what it writes with --json is the same document.

    {"bench": "bench/local.py", "command": "python bench/local.py --repeat 9", "finished": "...Z",
     "cpus": 2, "load_average": [1.0, 0.9, 0.8], "results": <the script's own figures>}
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

FOLDER = Path(__file__).resolve().parent / "results" / "benchmarks"


def document(name: str, results: object) -> dict:
    return {
        "bench": f"bench/{name}.py",
        "command": " ".join(["python", f"bench/{name}.py", *sys.argv[1:]]),
        "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "cpus": os.cpu_count(),
        "load_average": [round(x, 1) for x in os.getloadavg()],
        "results": results,
    }


def write(name: str, results: object, json_file: str | Path | None, record: bool) -> None:
    """The run's figures to --json FILE and, with --record, to its record in the repository."""
    text = json.dumps(document(name, results), indent=1) + "\n"
    if json_file:
        Path(json_file).write_text(text)
    if record:
        FOLDER.mkdir(parents=True, exist_ok=True)
        (FOLDER / f"{name}.json").write_text(text)
        print(f"recorded in {FOLDER / f'{name}.json'}: python scripts/generate.py updates the docs", file=sys.stderr)
