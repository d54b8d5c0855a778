"""The release matrix's last result per vLLM release, shown beside check-upstream's verdict.

check-upstream sees only what the sources say; what a release does when it runs (the KV cache
layout resolved at start-up, the CPU block size, silently wrong rows) is seen only by running
it: the release matrix (bench/releases.py) builds each release's environment, applies and runs
the run check there, and writes one file per run:

    $PATCHER_CACHE/releases/<anything>.json      (default ~/.cache/patcher/releases)
    {"schema_version": 1, "vllm": "0.32.0", "ok": true, "finished": "2026-11-30T22:04:00Z",
     "summary": "one line: what passed or the first failure", "patcher": "commit or version"}

The newest `finished` per `vllm` wins; a file that does not read as that is skipped.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class RunResult:
    vllm: str
    ok: bool
    finished: str  # ISO 8601, UTC
    summary: str = ""
    patcher: str = ""
    file: str = ""

    def to_json(self) -> dict:
        return {"ok": self.ok, "finished": self.finished, "summary": self.summary, "patcher": self.patcher, "file": self.file}


def default_folder() -> Path:
    base = os.environ.get("PATCHER_CACHE")
    return (Path(base).expanduser() if base else Path.home() / ".cache" / "patcher") / "releases"


def load_runs(folder: Path | None = None) -> dict[str, RunResult]:
    folder = folder or default_folder()
    out: dict[str, RunResult] = {}
    try:
        files = sorted(folder.glob("*.json"))
    except OSError:
        return out
    for file in files:
        try:
            data = json.loads(file.read_text())
            result = RunResult(
                str(data["vllm"]), bool(data["ok"]), str(data["finished"]), str(data.get("summary", "")),
                str(data.get("patcher", "")), str(file),
            )  # fmt: skip
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if result.vllm not in out or result.finished > out[result.vllm].finished:
            out[result.vllm] = result
    return out
