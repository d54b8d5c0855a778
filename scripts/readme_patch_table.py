"""Write README.md's patch table (section "The patches") from the patch declarations: each row is
a Patch's id, target file, `readme` (or `without_it`) and `since` (or its vLLM conditions).
tests/test_declarations.py fails while README.md differs from what this writes.

    .venv/bin/python scripts/readme_patch_table.py          # rewrite README.md
    .venv/bin/python scripts/readme_patch_table.py --check  # exit 1 if it is out of date
"""

from __future__ import annotations

import sys
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"
HEADER = "| id | file | without it, on vLLM 0.16 (CPU build, tiny Llama: `tests/test_e2e_vllm.py`) | since vLLM |"


def table() -> str:
    from patcher.patchset.registry import import_patches

    lines = [HEADER, "|---|---|---|---|"]
    for patch in import_patches():
        # the two data_generation files by their short names ("generator", "worker"), others by path
        short = Path(patch.target.path).stem.rsplit("_", 1)[-1]
        file = short if short in ("generator", "worker") else f"`{patch.target.path}`"
        if not patch.readme_cell:
            raise SystemExit(f"{patch.id} declares neither without_it= nor readme=: say what breaks without it")
        cell = patch.readme_cell.replace("|", "\\|").replace("\n", " ")
        lines.append(f"| {patch.id} | {file} | {cell} | {patch.since_cell} |")
    return "\n".join(lines) + "\n"


def rewritten(text: str) -> str:
    """README's text with the table (from HEADER to the first blank line) replaced."""
    start = text.index(HEADER)
    end = text.index("\n\n", start) + 1
    return text[:start] + table() + text[end:]


if __name__ == "__main__":
    current = README.read_text(encoding="utf-8")
    wanted = rewritten(current)
    if "--check" in sys.argv[1:]:
        sys.exit(0 if wanted == current else 1)
    README.write_text(wanted, encoding="utf-8")
    print(f"wrote the patch table of {README}")
