"""patcher.shapes is libcst.matchers' API for what the patches use (see its docstring): every
patch's examples and already-satisfied sources, run with the patch modules matching through
shapes and through libcst.matchers itself, must give the same code and the same outcomes."""

from __future__ import annotations

import json
import subprocess
import sys

RUN_EXAMPLES = """
import json, sys
if sys.argv[1] == "libcst":
    import libcst.matchers
    import patcher
    sys.modules["patcher.shapes"] = libcst.matchers  # what `from patcher import shapes as m` finds
    patcher.shapes = libcst.matchers
from patcher.patchset.registry import import_patches
from patcher.transform.transforms import transform_source
out = {}
for patch in import_patches():
    module = sys.modules[patch.edits[0].codemod.__module__]
    assert sys.argv[1] != "libcst" or getattr(module, "m", sys.modules["patcher.shapes"]).__name__ == "libcst.matchers"
    sources = [e.before for e in patch.examples] + [e.after for e in patch.examples] + list(patch.satisfied)
    for i, source in enumerate(sources):
        result = transform_source(source, [(patch, patch.edits)], filename=patch.target.path)
        out[f"{patch.id}/{i}"] = [result.result, [(o.outcome, o.edits) for o in result.outcomes]]
print(json.dumps(out))
"""


def examples_through(matcher: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", RUN_EXAMPLES, matcher],
        capture_output=True,
        text=True,
        timeout=600,
        env={"PATCHER_NO_TRANSFORM_CACHE": "1", "PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def test_every_example_gives_the_same_code_through_shapes_and_libcst_matchers():
    ours, theirs = examples_through("shapes"), examples_through("libcst")
    assert ours.keys() == theirs.keys() and len(ours) > 30
    different = [key for key in ours if ours[key] != theirs[key]]
    assert not different, different
