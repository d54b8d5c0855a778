"""The tiny checkpoints made on the spot, kept under <cache>/demo-model/<key>: made by running
patcher/run_check/tiny_model.py (or a checkout's workbench/tiny_moe.py) as a script in the demo
environment's python, into a temporary folder renamed into place when complete (make_in_place),
and reused after. Runs in patcher's interpreter, standard library only."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

from ..run_check import tiny_model
from ..run_check.tiny_model import PARAMS

COMPLETE_MARKER = ".patcher-demo-complete"


def model_key(params: dict = PARAMS) -> str:
    return hashlib.sha256(json.dumps(params, sort_keys=True).encode()).hexdigest()[:12]


def make_in_place(final: Path, marker: str, make: Callable[[Path], None]) -> None:
    """Make the folder `final`: `make` fills a temporary folder beside it, renamed into place only
    once complete (with `marker` in it), so a half-made one is never used; where another process
    put a complete one there first, that one stands."""
    shutil.rmtree(final, ignore_errors=True)  # not complete: the caller reuses a complete one
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-build-", dir=final.parent))
    try:
        make(tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / marker).is_file():
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def ensure_tiny_model(
    python: Path | str,
    cache_root: Path | None = None,
    progress: Callable[[str], None] = print,
    params: dict = PARAMS,
) -> Path:
    """Make (or reuse) the tiny model with the demo environment's `python`; return its directory."""
    from .environment import resolve_cache

    base = resolve_cache(cache_root) / "demo-model"
    final = base / model_key(params)
    if (final / COMPLETE_MARKER).is_file():
        progress(f"tiny model: reusing {final}")
        return final
    base.mkdir(parents=True, exist_ok=True)
    progress(
        f"tiny model: making {final} (Llama, {params['num_hidden_layers']} layers, "
        f"{params['num_attention_heads']} heads, random weights)"
    )

    def make(folder: Path) -> None:
        proc = subprocess.run(
            [str(python), str(Path(tiny_model.__file__).resolve()), str(folder), json.dumps(params)],
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"making the tiny model failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
        (folder / COMPLETE_MARKER).write_text(json.dumps(params, sort_keys=True) + "\n")

    make_in_place(final, COMPLETE_MARKER, make)
    progress(f"tiny model: ready at {final}")
    return final
