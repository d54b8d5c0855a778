"""A target whose interpreter changes what patcher's agent answers (a `.pth` file in the
environment runs before the agent, in its process) gets one line saying the target answered
something that is not patcher's protocol, exit 2: never a TypeError or a KeyError from deep in
planning (exit 1, "internal error"), and never taken as an answer it is not (issue 38)."""

from __future__ import annotations

from pathlib import Path

import pytest

from patcher.patchset.registry import load_patches
from tests.support.cli import patcher
from workbench.envs import light_env, site_file

TARGETS = sorted({p.target.path for p in load_patches()})

# What the .pth makes of each answer `o` the agent prints (a Python expression): valid JSON each time.
CHANGES = {
    "a list": ("[o]", "answer is a list, not an object"),
    "no result": ('{"ok": True}', "answer has no 'result'"),
    "an error that is text": ('{"ok": False, "error": "no"}', "answer.error is text, not an object"),
    "python that is text": (
        '{**o, "result": {**o["result"], "python": "3.11"}} if "python" in (o.get("result") or {}) else o',
        "answer.result.python is text, not an object",
    ),
    "a sha256 that is a number": (
        (
            '{**o, "result": {**o["result"], "files": {k: {**v, "sha256": 5} for k, v in o["result"]["files"].items()}}}'
            ' if "files" in (o.get("result") or {}) else o'
        ),
        ".sha256 is a number, not text",
    ),
}


def answers_changed(python: Path, expression: str) -> None:
    """A .pth in the environment: every answer the agent prints becomes `expression` of it."""
    site = next((python.parent.parent / "lib").glob("python3.*/site-packages"))
    (site / "zz-answers.pth").write_text(
        "import json; json.dumps = (lambda dumps: lambda o, *a, **k: dumps("
        f'(lambda o: {expression})(o) if isinstance(o, dict) and "ok" in o else o, *a, **k))(json.dumps)\n'
    )


def files(python: Path) -> dict[str, bytes]:
    return {rel: site_file(python, rel).read_bytes() for rel in TARGETS}


@pytest.mark.parametrize("change", list(CHANGES))
def test_an_answer_of_another_shape_is_one_line_and_exit_2(tmp_path: Path, change: str):
    python = light_env(tmp_path)
    pristine = files(python)
    expression, why = CHANGES[change]
    answers_changed(python, expression)
    for command in ("status", "apply"):
        code, _, err = patcher(command, "--no-verify" if command == "apply" else "-q", "--python", str(python))
        assert code == 2, err
        last = err.strip().splitlines()[-1]
        assert "the target answered something that is not patcher's protocol (to the facts request: " in last, err
        assert why in last and "a .pth file or sitecustomize" in last, err
        assert "Traceback" not in err and "internal error" not in err
    assert files(python) == pristine


def test_an_apply_answer_of_another_shape_says_the_outcome_is_unknown(tmp_path: Path):
    """The agent wrote and recorded, but its answer says a status patcher does not know: exit 2,
    and the line says every file is its old or its new bytes and how to see which."""
    python = light_env(tmp_path)
    answers_changed(
        python, '{**o, "result": {**o["result"], "status": "done"}} if "status" in (o.get("result") or {}) else o'
    )
    code, _, err = patcher("apply", "--no-verify", "--python", str(python))
    assert code == 2, err
    last = err.strip().splitlines()[-1]
    assert "not patcher's protocol (to the apply request: answer.result.status is 'done', not one of" in last, err
    assert "the outcome of this apply" in last and "is unknown" in last and "run `patcher status" in last, err
    next((python.parent.parent / "lib").glob("python3.*/site-packages/zz-answers.pth")).unlink()
    code, doc, err = patcher("status", "--python", str(python), "--json")
    assert code == 0, err
    assert doc is not None and {p["state"] for p in doc["targets"][0]["patches"]} <= {"applied", "not-selected"}
