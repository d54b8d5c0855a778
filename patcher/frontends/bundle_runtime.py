"""The program inside a `patcher bundle` file: status, plan, apply and rollback on the Python
that runs it, with no controller and nothing installed (standard library only, Python 3.9+).

`patcher bundle` writes this source with two blobs filled in: DATA (the declarations as the
planning core reads them, the pristine files it knows by sha256, and the codemods' result for
every transform the core can ask for on them, keyed by TransformRequest.key()) and MODULES (the
texts of the agent, remote/agent/, and of the modules it shares with the controller:
patcher/core/errors.py and versions.py, patcher/plan/planning.py). Each module is imported
under its own name, from memory, as an agent imports them in a target
(remote/agent/bootstrap.py): the bundle plans with patcher's own planning core and
PEP 440 conditions, not copies, and only the transform results come from DATA instead of libcst.
The agent does every write, exactly as when patcher drives it: same lock, backups, atomic
writes, state record and verification, so patcher and a bundle can take turns on the same
environment.

A bundle applies the whole selected set or rolls all of it back; a file whose bytes it does not
know (another release, a hand edit) is refused, never guessed at.
"""

# No `from __future__` import here: it is a runtime import, and a bundle's first statement must
# drop the bundle's own folder from sys.path (see bundle._render) before anything is imported.
# Annotations the bundle cannot evaluate (names it has only for the type checker) are quoted.
import argparse
import base64
import hashlib
import json
import sys
import zlib

TYPE_CHECKING = False
if TYPE_CHECKING:  # the type checker's view only: a bundle runs this text without typing
    from collections.abc import Mapping

    from ..core.protocol import Facts, TargetFile

DATA = None  # replaced in a bundle file
MODULES = None  # in a bundle: {module name: [is a package, text]} of the agent and the shared modules
DIGESTS = None  # in a bundle: the sha256 of DATA's and MODULES's bytes


# ------------------------------------------------------------------ the shared core


def _unpack(blob: str, sha256: str, what: str) -> bytes:
    """A blob's bytes, re-hashed against the sha256 it is kept under: a bundle damaged in transit
    or with a blob swapped is one line and exit 2 (before anything is read or written), never a
    zlib traceback or another file's bytes. (Integrity, not authenticity: whoever can edit the
    file can edit its digests too; copy bundles as you copy any program you run as root.)"""
    try:
        data = zlib.decompress(base64.b64decode(blob))
    except (ValueError, zlib.error):  # binascii.Error is a ValueError
        data = None
    if data is None or hashlib.sha256(data).hexdigest() != sha256:
        why = "does not decompress" if data is None else "does not match its sha256"
        sys.stderr.write(
            f"error: this bundle is damaged ({what} {why}): make a new one with `patcher bundle` and copy it whole\n"
        )
        sys.exit(2)  # EXIT_USAGE (patcher/core/errors.py), known before the core is loaded
    return data


def _load(name: str) -> bytes:
    blob = globals()[name]
    if blob is None or DIGESTS is None:
        raise RuntimeError("bundle_runtime runs inside a bundle file (patcher bundle writes one)")
    return _unpack(blob, DIGESTS[name], f"its {name} blob")


def _bundle_data() -> dict:
    """DATA, with every patched file's blob checked against its key and decoded once."""
    data = json.loads(_load("DATA"))
    data["blobs"] = {sha: _unpack(blob, sha, f"the patched file {sha[:12]}") for sha, blob in data["blobs"].items()}
    return data


def _modules() -> tuple:
    """(errors, planning, versions, facts, transaction): patcher's own modules. In a bundle their
    texts (MODULES) are made importable from memory first, with the agent's own loader; imported
    inside patcher (tests, `patcher bundle`), they are read from its package: either way the very
    code patcher plans and writes with."""
    if MODULES is not None:
        texts = json.loads(_load("MODULES"))
        loader: dict = {"__name__": "patcher_agent_bootstrap"}
        exec(compile(texts["patcher.remote.agent.bootstrap"][1], "<patcher.remote.agent.bootstrap>", "exec"), loader)  # noqa: S102 - the embedded agent
        loader["install"](texts)
    import importlib

    from patcher.core import errors, versions
    from patcher.plan import planning

    # By name: installed, remote/ is patcher.remote (pyproject maps it), which the type checker,
    # reading the checkout, does not know.
    facts = importlib.import_module("patcher.remote.agent.target_facts")
    transaction = importlib.import_module("patcher.remote.agent.transaction")
    return errors, planning, versions, facts, transaction


ERRORS, CORE_PLANNING, VERSIONS, FACTS, TRANSACTION = _modules()
condition_holds = VERSIONS.condition_holds
EXIT_OK, EXIT_FAILED, EXIT_USAGE = ERRORS.EXIT_OK, ERRORS.EXIT_FAILED, ERRORS.EXIT_USAGE
EXIT_CONFLICT, EXIT_PENDING = ERRORS.EXIT_CONFLICT, ERRORS.EXIT_PENDING


# ------------------------------------------------------------------ the run


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class Refusal(Exception):
    """A run the bundle will not carry out; its exit code is its kind's (core/errors.py)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind, self.message = kind, message


def specs(data: dict) -> list:
    return [CORE_PLANNING.PatchSpec.from_json(p) for p in data["patches"]]


def check_known(data: dict, facts: "Facts", selection: dict) -> None:
    """Refuse a file whose bytes the bundle does not know (another release, a hand edit) where a
    patch would touch it; one no selected patch wants, with no record, is not its business."""
    for target in data["files"]:
        rel = target["path"]
        info = facts["files"].get(rel, {"exists": False})
        if not info.get("exists") or info.get("refused"):  # refused: planning says why
            continue
        current, known = info["sha256"], data["originals"].get(rel, {})
        record: Mapping = facts["state"]["files"].get(rel) or {}
        recorded = {
            record.get("patched_sha256"),
            record.get("original_sha256"),
            (record.get("pending") or {}).get("sha256"),
        }
        if current in known or current in recorded:
            continue
        if not record and not any(selection[p["id"]].selected for p in data["patches"] if p["file"] == rel):
            continue
        raise Refusal(
            "unknown-file",
            f"{info['root']}/{rel} has sha256 {current}, which this bundle does not know (it knows "
            f"{', '.join(sorted(known)) or 'no version of it'}): the file is from another release or was "
            "changed by hand; reinstall the release the bundle was made for, or use patcher itself",
        )


def transform_results(data: dict, draft) -> dict:
    """The codemods' results the draft asks for, from the bytes the bundle carries."""
    results = {}
    for request in draft.requests:
        if request.original_sha256 not in data["originals"].get(request.path, {}):
            raise Refusal(
                "unknown-file",
                f"{request.path} was patched from an original (sha256 {request.original_sha256}) this bundle "
                "does not know; use patcher itself",
            )
        variant = data["variants"].get(request.key())
        if variant is None:
            versions = ", ".join(f"{k} {v}" for k, v in sorted(draft.versions.items()) if v)
            raise Refusal(
                "no-variant",
                f"this bundle holds no patched bytes for what these versions select ({versions}): "
                f"{', '.join(pid for pid, _ in request.steps)}; make a new bundle with `patcher bundle`",
            )
        content = data["blobs"][variant["sha256"]].decode("utf-8") if variant.get("sha256") else ""
        missing = [tuple(m) for m in variant.get("missing", [])]
        results[request.path] = CORE_PLANNING.TransformResult(content, dict(variant["outcomes"]), missing)
    return results


def plan(data: dict, facts: "Facts", mode: str):
    """The core's plan for this environment, the codemods' results taken from the bundle."""
    draft = CORE_PLANNING.draft(facts, specs(data), condition_holds, mode, lines=data.get("lines", ()))
    check_known(data, facts, draft.selection)
    return CORE_PLANNING.finish(draft, transform_results(data, draft))


def _empty_report() -> dict:
    return {
        "target": sys.executable,
        "python": sys.executable,
        "versions": {},
        "distributions": {},
        "status": "ok",
        "exit_code": EXIT_OK,
        "message": "",
        "notes": [],
        "problems": [],
        "state_dir": None,
        "files": [],
        "patches": [],
    }


def _declared(data: dict) -> "list[TargetFile]":
    """The files the agent may read, write and record: the bundle's target files only."""
    return [{"distribution": f["distribution"], "path": f["path"]} for f in data["files"]]


def _read_facts(data: dict, report: dict, command: str, lock_timeout: float) -> "Facts":
    # The agent reads, writes and records the declared files only, as when patcher drives it;
    # as patcher does, a run that writes holds the lock from its facts to its last write.
    declared = _declared(data)
    lock = "exclusive" if command in ("apply", "rollback") else "shared"
    facts: Facts = FACTS.op_facts(
        {"names": data["names"], "files": declared, "declared": declared, "lock": lock, "lock_timeout": lock_timeout}
    )
    report["state_dir"] = facts["state_dir"]
    report["versions"] = {n: d["version"] for n, d in facts["distributions"].items()}
    report["distributions"] = {n: d["name"] for n, d in facts["distributions"].items()}
    state_error = facts.get("state_error")
    if state_error:  # before check_known: a damaged record says so, not "unknown file"
        raise Refusal("corrupt-state", state_error)
    targets = {f["distribution"] for f in data["files"]}
    if not targets & set(facts["distributions"]):
        raise Refusal(
            "usage",
            f"{', '.join(sorted(targets))} is not installed for {sys.executable}; run the bundle with the "
            "environment's Python, e.g. /root/ml-env/bin/python3 patcher-bundle.py status",
        )
    return facts


def _report_plan(report: dict, the_plan, command: str) -> bool:
    """Fill the report from the plan; True when the command is done (nothing to write)."""
    report["patches"] = [p.as_json() for p in the_plan.patches]
    report["notes"] = list(the_plan.notes)
    report["files"] = [
        {
            "path": c.path,
            "action": "restore" if c.new_content is None else "write",
            "patches": c.patches,
            "expected_sha256": c.expected_sha256,
        }
        for c in the_plan.changes
    ]
    if the_plan.conflicts:
        report["status"], report["exit_code"] = ERRORS.outcome(the_plan.conflicts[0].kind)
        report["message"] = the_plan.conflicts[0].message
        report["problems"] = [c.message for c in the_plan.conflicts]
        return True
    count = len(the_plan.changes)
    if command in ("status", "plan"):
        if command == "plan" and count:
            report["exit_code"], report["message"] = EXIT_PENDING, f"{count} file(s) would change"
        else:
            report["message"] = f"{count} file(s) pending" if count else "nothing to do"
        return True
    if not count:
        report["message"] = "nothing to do"
        return True
    return False


def _say_path(report: dict, data: dict, facts: "Facts") -> None:
    """speculators 0.5+ (no source patch serves it): name the path its extraction takes, as patcher does."""
    path = CORE_PLANNING.unpatched_path(facts, data.get("lines", ()), condition_holds)
    if path and not report["files"] and report["exit_code"] == EXIT_OK:
        report["message"] = f"nothing to do: {path}"


def _write(
    data: dict,
    report: dict,
    the_plan,
    mode: str,
    options: dict,
    facts: "Facts",
) -> None:
    """The agent carries the plan out (and verifies it); the report says how it went."""
    verify, lock_timeout = options["verify"], options["lock_timeout"]
    checked = verify and mode == "apply" and the_plan.verify_files
    request = {
        "files": [c.as_request() for c in the_plan.changes],
        "cleanup": the_plan.cleanup,
        "verify": CORE_PLANNING.verify_spec(the_plan.verify_files, facts) if checked else None,
        "expect": facts.get("snapshot"),  # the agent refuses (stale-plan) if the files changed since the facts
        "lock_timeout": lock_timeout,
        "written_by": f"patcher bundle {data['patcher_version']}",
        "declared": _declared(data),
    }
    if options.get("force") and mode == "rollback":
        request["force_restore"] = True  # rollback --force, as patcher's: originals pip's RECORD does not vouch for
    result = TRANSACTION.op_apply(request)
    if result["status"] == "rolled-back":
        report["status"], report["exit_code"] = "rolled-back", EXIT_FAILED
        report["problems"] = result["verification"]["problems"]
        report["message"] = "verification failed, every file restored: " + report["problems"][0]
        return
    report["status"] = "changed"
    after = CORE_PLANNING.after_write(the_plan.patches, the_plan.changes, mode)
    report["patches"] = [p.as_json() for p in after]
    verified = result.get("verification")
    report["message"] = f"{len(the_plan.changes)} file(s) written" + (", verified" if verified else ", not verified")


# The agent's messages name patcher's command line; a bundle's user runs the bundle.
_CLI_TO_BUNDLE = (("run `patcher rollback --force`", "run this bundle with `rollback --force`"),)


def run(command: str, verify: bool, lock_timeout: float, force: bool = False) -> dict:
    """`force`: rollback --force (restore a kept original pip's RECORD does not vouch for)."""
    data = _bundle_data()
    report = _empty_report()
    options = {"verify": verify, "lock_timeout": lock_timeout, "force": force}
    try:
        mode = "rollback" if command == "rollback" else "apply"
        facts = _read_facts(data, report, command, lock_timeout)
        the_plan = plan(data, facts, mode)
        done = _report_plan(report, the_plan, command)
        if done and mode == "apply":
            _say_path(report, data, facts)
        if not done:
            _write(data, report, the_plan, mode, options, facts)
    except Refusal as exc:
        report["status"], report["exit_code"] = ERRORS.outcome(exc.kind)
        report["message"] = exc.message
    except ERRORS.AgentError as exc:
        report["status"], report["exit_code"] = ERRORS.outcome(exc.kind)
        report["message"] = exc.message
        for cli, bundle in _CLI_TO_BUNDLE:
            report["message"] = report["message"].replace(cli, bundle)
    except OSError as exc:
        report["status"], report["exit_code"] = "failed", EXIT_FAILED
        report["message"] = f"{exc.strerror}: {exc.filename}; run as a user who can write there"
    return report


def info() -> None:
    data = _bundle_data()
    print(f"patcher bundle made by patcher {data['patcher_version']} on {data['created']}")
    print("knows these pristine files (sha256):")
    for rel, known in data["originals"].items():
        for sha, about in known.items():
            print(f"  {rel}  {sha}  ({about['release']})")
    print(f"patched variants: {len(data['variants'])}")
    print("release lines (any other release is refused, exit 7):")
    for line in data.get("lines", []):
        how = "patched" if line["patched"] else "no patch needed"
        print(f"  {line['distribution']} {line['spec']}: {how} ({', '.join(line['releases'])})")
    print("supported version ranges:")
    for line in data.get("ranges", []):
        print(f"  {line}")
    print("patches:")
    for p in data["patches"]:
        conditions = "; ".join(f"{k} {v}" for k, v in p["requires"].items())
        print(f"  {p['id']}: {p.get('title', '')} ({conditions})")


def _lock_timeout(text: str) -> float:
    """--lock-timeout's value, by patcher's own rule (finite, 0 to a week): else a usage error, exit 2."""
    problem = ERRORS.time_limit_problem(text, zero_ok=True)
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return float(text)


def main(argv: "list | None" = None) -> int:
    parser = argparse.ArgumentParser(
        prog="patcher-bundle",
        description="patcher, offline: status/plan/apply/rollback for the Python environment that runs this file "
        "(e.g. /root/ml-env/bin/python3 patcher-bundle.py apply). Standard library only.",
    )
    parser.add_argument("command", choices=["status", "plan", "apply", "rollback", "info"])
    parser.add_argument("--no-verify", action="store_true", help="apply: skip verification in a fresh interpreter")
    parser.add_argument("--json", action="store_true", help="print the JSON report (schema_version 1) on stdout")
    parser.add_argument(
        "--force",
        action="store_true",
        help="rollback: restore a kept original even where pip's RECORD gives other bytes and the record does not "
        "say it was adopted with apply --force (as patcher rollback --force)",
    )
    parser.add_argument(
        "--lock-timeout", type=_lock_timeout, default=10.0, metavar="SECONDS", help="wait this long for the lock"
    )
    parser.add_argument("--quiet", "-q", action="store_true")
    args = parser.parse_args(argv)
    if args.force and args.command != "rollback":
        parser.error("--force goes with rollback only")  # exit 2
    if args.command == "info":
        info()
        return 0
    report = run(args.command, not args.no_verify, args.lock_timeout, args.force)
    if args.json:
        doc = {"schema_version": 1, "command": args.command, "exit_code": report["exit_code"], "targets": [report]}
        print(json.dumps(doc, indent=2))
    if not args.quiet or report["exit_code"] not in (0, 6):
        err = sys.stderr
        versions = ", ".join(f"{k} {v}" for k, v in sorted(report["versions"].items()))
        if versions or report["patches"]:  # an unread target has neither: its last line says why
            err.write(f"{report['target']}  {versions}\n")
        if not args.quiet:
            for p in report["patches"]:
                err.write(f"  {p['id']:<28} {p['state']:<18} {p['reason']}\n")
        for problem in report["problems"][1:]:
            err.write(f"  - {problem}\n")
        label = "pending" if report["exit_code"] == 6 else report["status"]  # as patcher/cli/render.py
        err.write(f"{label}: {report['message']}\n")
    return report["exit_code"]
