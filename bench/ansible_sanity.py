"""Every `ansible-test sanity` test (the ansible-core pinned by the test extra) on the patcher.fleet
collection, offline but for the package index (see workbench/ansible_test_sanity.py for how), and
how long it took. The suite runs the short form (tests/test_ansible_collection.py); this is the
whole set, which adds pylint, pep8 and import, whose environments take minutes to make the first
time.

    .venv/bin/python bench/ansible_sanity.py [--json bench/results/ansible-sanity.json]

Exit status: 0 when every test passed, 1 when one failed (its errors are printed), 2 when
ansible-core (the test extra) is not installed.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import re
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))

from workbench.ansible_test_sanity import ANSIBLE_TEST, SHORT_FORM, run_sanity  # noqa: E402
from workbench.release_files import cache_dir  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", metavar="FILE", help="write the outcome here")
    args = parser.parse_args()
    if not ANSIBLE_TEST.exists():
        print(f"{ANSIBLE_TEST} is missing: install the test extra (.ci/bootstrap)", file=sys.stderr)
        return 2
    # (not `import ansible`: this folder's ansible.py, the benchmark, comes first on sys.path)
    ansible_core = importlib.metadata.version("ansible-core")
    home = cache_dir() / "ansible-test-home"
    warm = (home / ".ansible" / "test" / "venv").is_dir()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="patcher-ansible-sanity-") as work:
        done = run_sanity(Path(work), home)
    seconds = time.perf_counter() - started
    output = done.stdout + done.stderr
    ran = re.findall(r'^Running sanity test "([^"]+)"', output, re.MULTILINE)
    errors = [line for line in output.splitlines() if line.startswith("ERROR:")]
    outcome = {
        "ansible_core": ansible_core,
        "python": f"{sys.version_info[0]}.{sys.version_info[1]}",
        "tests": ran,
        "short_form": list(SHORT_FORM),
        "passed": done.returncode == 0,
        "errors": errors,
        "seconds": round(seconds, 1),
        "environments": "reused" if warm else "made in this run",
    }
    print(
        f"ansible-test sanity (ansible-core {outcome['ansible_core']}, Python {outcome['python']}): "
        f"{len(ran)} tests, {'all passed' if outcome['passed'] else 'FAILED'}, {seconds:.0f} s "
        f"(environments {outcome['environments']})"
    )
    for line in errors:
        print(line)
    if args.json:
        Path(args.json).write_text(json.dumps(outcome, indent=2) + "\n")
    return 0 if outcome["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
