"""The program inside a `patcher bundle` file: status, plan, apply and rollback on the Python
that runs it, with no controller and nothing installed (standard library only, Python 3.9+).

`patcher bundle` writes this source with three blobs filled in: DATA (the declarations as the
planning core reads them, the pristine files it knows by sha256, and the codemods' result for
every transform the core can ask for on them, keyed by TransformRequest.key()), AGENT (the agent)
and CORE (the texts of patcher/core/errors.py and patcher/plan/planning.py). It plans with
patcher's own planning core, not a copy: only PEP 440 matching is its own (below, checked against packaging
when the bundle is made) and the transform results come from DATA instead of libcst. The agent
does every write, exactly as when patcher drives it: same lock, backups, atomic writes, state
record and verification, so patcher and a bundle can take turns on the same environment.

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
import re
import sys
import zlib

TYPE_CHECKING = False
if TYPE_CHECKING:  # the type checker's view only: a bundle runs this text without typing
    from collections.abc import Mapping

    from ..core.protocol import Facts, TargetFile

DATA = None  # replaced in a bundle file
AGENT = None
DIGESTS = None  # in a bundle: the sha256 of DATA's, AGENT's and CORE's bytes

CORE = None  # the texts of core/errors.py and plan/planning.py, in a bundle


# ------------------------------------------------------------------ PEP 440, the part patches use
# (checked against `packaging` for every condition and many versions around each boundary when
# the bundle is made: see patcher/transport/bundle.py, check_runtime_versions)

_PEP440 = re.compile(
    r"""^\s*v?
    (?:(?P<epoch>[0-9]+)!)?
    (?P<release>[0-9]+(?:\.[0-9]+)*)
    (?P<pre>[-_.]?(?P<pre_l>alpha|a|beta|b|preview|pre|c|rc)[-_.]?(?P<pre_n>[0-9]+)?)?
    (?P<post>(?:-(?P<post_n1>[0-9]+))|(?:[-_.]?(?P<post_l>post|rev|r)[-_.]?(?P<post_n2>[0-9]+)?))?
    (?P<dev>[-_.]?(?P<dev_l>dev)[-_.]?(?P<dev_n>[0-9]+)?)?
    (?:\+(?P<local>[a-z0-9]+(?:[-_.][a-z0-9]+)*))?
    \s*$""",
    re.VERBOSE | re.IGNORECASE,
)
_PRE_ORDER = {"a": 0, "alpha": 0, "b": 1, "beta": 1, "c": 2, "rc": 2, "pre": 2, "preview": 2}


def _key(epoch: int, release: tuple, pre, post, dev, local=None) -> tuple:
    """PEP 440 order: as packaging's Version._key (trailing zeros do not count; a dev release
    of a final sorts before its pre-releases; a local label sorts after the same public version)."""
    trimmed = list(release)
    while len(trimmed) > 1 and trimmed[-1] == 0:
        trimmed.pop()
    pre_key: tuple
    if pre is None and post is None and dev is not None:
        pre_key = (0,)
    elif pre is None:
        pre_key = (2,)
    else:
        pre_key = (1,) + tuple(pre)
    post_key = (0,) if post is None else (1, post)
    dev_key = (1,) if dev is None else (0, dev)
    local_key: tuple
    if local is None:
        local_key = (0,)
    else:
        local_key = (1,) + tuple((1, int(p), "") if p.isdigit() else (0, 0, p) for p in local.split("."))
    return (epoch, tuple(trimmed), pre_key, post_key, dev_key, local_key)


class Version:
    def __init__(self, text: str) -> None:
        m = _PEP440.match(text)
        if not m:
            raise ValueError(f"not a PEP 440 version: {text!r}")
        self.text = text
        self.epoch = int(m.group("epoch") or 0)
        self.release = tuple(int(p) for p in m.group("release").split("."))
        self.pre = (_PRE_ORDER[m.group("pre_l").lower()], int(m.group("pre_n") or 0)) if m.group("pre") else None
        if m.group("post"):
            self.post: int | None = int(m.group("post_n1") or m.group("post_n2") or 0)
        else:
            self.post = None
        self.dev = int(m.group("dev_n") or 0) if m.group("dev") else None
        self.local = m.group("local").lower().replace("-", ".").replace("_", ".") if m.group("local") else None
        self.key = _key(self.epoch, self.release, self.pre, self.post, self.dev, self.local)
        self.public = self.key[:5]

    @property
    def is_prerelease(self) -> bool:
        return self.pre is not None or self.dev is not None


_SPEC = re.compile(r"^\s*(===|~=|==|!=|<=|>=|<|>)\s*(\S+)\s*$")


def _next_prefix_dev0(epoch: int, release: tuple) -> tuple:
    """1.2 -> the key of 1.3.dev0, the smallest version past the 1.2 prefix."""
    return _key(epoch, release[:-1] + (release[-1] + 1,), None, None, 0)


def specifier_holds(item: str, version: Version) -> bool:
    """One specifier, pre-releases allowed, with the ranges packaging (26) gives each operator."""
    m = _SPEC.match(item)
    if not m:
        raise ValueError(f"unsupported version condition {item!r}")
    op, text = m.groups()
    v = version
    if op == "===":
        return v.text.strip().lower() == text.lower()
    if op in ("==", "!=") and text.endswith(".*"):
        base = Version(text[:-2])
        inside = _key(base.epoch, base.release, None, None, 0) <= v.key < _next_prefix_dev0(base.epoch, base.release)
        return inside if op == "==" else not inside
    s = Version(text)
    if op == "~=":
        if len(s.release) < 2:
            raise ValueError(f"~= needs two release numbers: {item!r}")
        return s.key <= v.key < _next_prefix_dev0(s.epoch, s.release[:-1])
    if op in ("==", "!="):
        equal = v.key == s.key if s.local is not None else v.public == s.public  # ==1.4 takes 1.4+anything
        return equal if op == "==" else not equal
    if op == ">=":
        return v.key >= s.key
    if op == "<=":
        return v.public <= s.public  # and every local label of it
    if op == "<":
        if s.is_prerelease:
            return v.key < s.key
        return v.key < _key(s.epoch, s.release, s.pre, s.post, 0)  # not V's own dev/pre-releases
    if op == ">":
        if s.dev is not None:
            return v.key >= _key(s.epoch, s.release, s.pre, s.post, s.dev + 1)
        if s.post is not None:
            return v.key >= _key(s.epoch, s.release, s.pre, s.post + 1, 0)
        return v.key[:3] > s.key[:3]  # above V, V+local and every V.postN
    raise ValueError(f"unsupported operator in {item!r}")


def condition_holds(spec: str, version: "str | None") -> bool:
    """As patcher.plan.selection.condition_holds: PEP 440, pre-releases allowed."""
    if version is None:
        return False
    try:
        parsed = Version(version)
        return all(specifier_holds(item, parsed) for item in spec.split(",") if item.strip())
    except ValueError:
        return False


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


def _core() -> tuple:
    """(errors, planning): patcher/core/errors.py and patcher/plan/planning.py. In a bundle their
    text is in CORE and runs here as their own modules; imported inside patcher (tests, `patcher bundle`), they are
    patcher's own: either way the very code patcher plans with."""
    if CORE is None:
        from patcher.core import errors
        from patcher.plan import planning

        return errors, planning
    sources = json.loads(_load("CORE"))
    loaded = []
    for name in ("errors", "planning"):
        module = type(sys)(f"patcher_core_{name}")
        sys.modules[module.__name__] = module  # dataclasses look their module up there
        exec(compile(sources[name], f"<patcher-core-{name}>", "exec"), module.__dict__)  # noqa: S102 - the embedded core
        loaded.append(module)
    return tuple(loaded)


ERRORS, CORE_PLANNING = _core()
EXIT_OK, EXIT_FAILED, EXIT_USAGE = ERRORS.EXIT_OK, ERRORS.EXIT_FAILED, ERRORS.EXIT_USAGE
EXIT_CONFLICT, EXIT_PENDING = ERRORS.EXIT_CONFLICT, ERRORS.EXIT_PENDING


# ------------------------------------------------------------------ the run


def _agent() -> dict:
    source = _load("AGENT").decode("utf-8")
    ns = {"__name__": "patcher_agent", "AGENT_SOURCE": source}
    exec(compile(source, "<patcher-agent>", "exec"), ns)  # noqa: S102 - the embedded agent
    return ns


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
        if not info.get("exists"):
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


def _read_facts(ns: dict, data: dict, report: dict, command: str, lock_timeout: float) -> "Facts":
    # The agent reads, writes and records the declared files only, as when patcher drives it;
    # as patcher does, a run that writes holds the lock from its facts to its last write.
    declared = _declared(data)
    lock = "exclusive" if command in ("apply", "rollback") else "shared"
    facts: Facts = ns["op_facts"](
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
    ns: dict,
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
    result = ns["op_apply"](request)
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
    ns = _agent()
    report = _empty_report()
    options = {"verify": verify, "lock_timeout": lock_timeout, "force": force}
    try:
        mode = "rollback" if command == "rollback" else "apply"
        facts = _read_facts(ns, data, report, command, lock_timeout)
        the_plan = plan(data, facts, mode)
        done = _report_plan(report, the_plan, command)
        if done and mode == "apply":
            _say_path(report, data, facts)
        if not done:
            _write(ns, data, report, the_plan, mode, options, facts)
    except Refusal as exc:
        report["status"], report["exit_code"] = ERRORS.outcome(exc.kind)
        report["message"] = exc.message
    except ns["AgentError"] as exc:
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
    parser.add_argument("--lock-timeout", type=float, default=10.0, metavar="SECONDS")
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
