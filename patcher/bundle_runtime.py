"""The program inside a `patcher bundle` file: status, plan, apply and rollback on the Python
that runs it, with no controller and nothing installed (standard library only, Python 3.9+).

`patcher bundle` writes this source, then the data (DATA: what patcher knows, the patched bytes
for every pristine file it knows by sha256 and every patch selection the supported version
ranges lead to) and the agent (AGENT), then a call to main(). The agent does every write,
exactly as when patcher drives it: same lock, backups, atomic writes, state record and
verification, so patcher and a bundle can take turns on the same environment.

A bundle applies the whole selected set or rolls all of it back; a file whose bytes it does not
know (another release, a hand edit) is refused, never guessed at.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import re
import sys
import zlib

DATA = None  # replaced in a bundle file
AGENT = None

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_CONFLICT, EXIT_UNREACHABLE, EXIT_LOCKED, EXIT_PENDING = 0, 1, 2, 3, 4, 5, 6
AGENT_ERRORS = {
    "locked": EXIT_LOCKED,
    "conflict": EXIT_CONFLICT,
    "corrupt-state": EXIT_CONFLICT,
    "backup-missing": EXIT_CONFLICT,
    "hostile-path": EXIT_CONFLICT,
    "python-too-old": EXIT_USAGE,
    "usage": EXIT_USAGE,
}


# ------------------------------------------------------------------ PEP 440, the part patches use
# (checked against `packaging` for every condition and many versions around each boundary when
# the bundle is made: see patcher/bundle.py)

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
    if pre is None and post is None and dev is not None:
        pre_key = (0,)
    elif pre is None:
        pre_key = (2,)
    else:
        pre_key = (1,) + tuple(pre)
    post_key = (0,) if post is None else (1, post)
    dev_key = (1,) if dev is None else (0, dev)
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
            self.post = int(m.group("post_n1") or m.group("post_n2") or 0)
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


def condition_holds(spec: str, version: str | None) -> bool:
    """As patcher.selection.condition_holds: PEP 440, pre-releases allowed."""
    if version is None:
        return False
    try:
        parsed = Version(version)
        return all(specifier_holds(item, parsed) for item in spec.split(",") if item.strip())
    except ValueError:
        return False


# ------------------------------------------------------------------ selection (as patcher.selection)


def failed_conditions(conditions: dict, versions: dict) -> list:
    out = []
    for name, spec in conditions.items():
        have = versions.get(name)
        if have is None:
            out.append(f"{name} is not installed (needs {spec})")
        elif not condition_holds(spec, have):
            out.append(f"{name} {have} does not satisfy {spec}")
    return out


def select(patches: list, versions: dict) -> dict:
    """patch id -> (selected, reason, edit names)."""
    out: dict = {}
    for patch in patches:
        failed = failed_conditions(patch["requires"], versions)
        if failed:
            out[patch["id"]] = (False, "; ".join(failed), [])
            continue
        edits = [e["name"] for e in patch["edits"] if not failed_conditions(e["when"], versions)]
        if not edits:
            reasons = sorted({r for e in patch["edits"] for r in failed_conditions(e["when"], versions)})
            out[patch["id"]] = (False, "no edit applies: " + "; ".join(reasons), [])
            continue
        missing = [n for n in patch.get("needs", []) if not (n in out and out[n][0])]
        if missing:
            out[patch["id"]] = (False, f"needs {', '.join(missing)}, which is not selected", [])
            continue
        out[patch["id"]] = (True, "conditions hold", edits)
    return out


def signature(selection: dict) -> list:
    """What selects the bytes: every selected patch with its edits, in canonical order."""
    return [[pid, list(edits)] for pid, (chosen, _, edits) in selection.items() if chosen]


# ------------------------------------------------------------------ the run


def _load(blob: str) -> bytes:
    return zlib.decompress(base64.b64decode(blob))


def _agent() -> dict:
    source = _load(AGENT).decode("utf-8")
    ns = {"__name__": "patcher_agent", "AGENT_SOURCE": source}
    exec(compile(source, "<patcher-agent>", "exec"), ns)
    return ns


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class Refusal(Exception):
    def __init__(self, kind: str, message: str, code: int) -> None:
        super().__init__(message)
        self.kind, self.message, self.code = kind, message, code


def plan(data: dict, facts: dict, mode: str) -> tuple:
    """(items for the agent, verify spec, per-patch states, versions). Raises Refusal."""
    dists = facts["distributions"]
    versions = {name: (dists[name]["version"] if name in dists else None) for name in data["names"]}
    selection = select(data["patches"], versions)
    key = signature(selection)
    entry = next((e for e in data["selections"] if e["selected"] == key), None)
    if mode == "apply" and key and entry is None:
        raise Refusal(
            "no-variant",
            "this bundle holds no patched bytes for what these versions select "
            f"({', '.join(f'{k} {v}' for k, v in sorted(versions.items()) if v)}): "
            f"{', '.join(pid for pid, _ in key)}; make a new bundle with `patcher bundle`",
            EXIT_USAGE,
        )
    needs = {p["id"]: p.get("needs", []) for p in data["patches"]}
    items, verify_files, states = [], [], {}
    state_files = facts["state"]["files"]
    for target in data["files"]:
        rel = target["path"]
        info = facts["files"].get(rel, {"exists": False})
        file_patches = [p for p in data["patches"] if p["file"] == rel]
        if not info.get("exists"):
            for p in file_patches:
                states[p["id"]] = ("not-selected", f"{rel} is not installed", rel)
            continue
        current = info["sha256"]
        record = state_files.get(rel)
        known = data["originals"].get(rel, {})
        pending = (record or {}).get("pending") or {}
        if record and current == record.get("patched_sha256"):
            original, carried = record["original_sha256"], record.get("patches", [])
        elif record and pending and current == pending.get("sha256"):
            original, carried = record["original_sha256"], pending.get("patches", [])
        elif current in known or (record and current == record.get("original_sha256")):
            original, carried = current, []
        elif not record and not any(selection[p["id"]][0] for p in file_patches):
            for p in file_patches:  # another release, and no patch wants it: not our business
                states[p["id"]] = ("not-selected", selection[p["id"]][1], rel)
            continue
        else:
            raise Refusal(
                "unknown-file",
                f"{info['root']}/{rel} has sha256 {current}, which this bundle does not know (it knows "
                f"{', '.join(sorted(known)) or 'no version of it'}): the file is from another release or was "
                "changed by hand; reinstall the release the bundle was made for, or use patcher itself",
                EXIT_CONFLICT,
            )
        if original not in known:
            raise Refusal(
                "unknown-file",
                f"{rel} was patched from an original (sha256 {original}) this bundle does not know; use patcher itself",
                EXIT_CONFLICT,
            )
        variant = None
        if mode == "apply" and entry is not None:
            index = entry["files"].get(rel, {}).get(original)
            variant = data["variants"][index] if index is not None else None
        if variant is not None and variant.get("anchor_missing"):
            raise Refusal("anchor-missing", variant["anchor_missing"], EXIT_CONFLICT)
        desired = variant["patches"] if variant else []
        if variant is not None:
            new = _load(data["blobs"][variant["sha256"]])
            outcomes = variant["outcomes"]
            verify_files.append({"module": target["module"], "attribute_calls": variant["attribute_calls"]})
        else:
            new, outcomes = None, {}
        for p in file_patches:
            pid = p["id"]
            chosen, reason, _ = selection[pid]
            if pid in desired:
                if outcomes.get(pid) == "already-satisfied":
                    states[pid] = ("already-satisfied", "the file already has this change", rel)
                elif new is not None and _sha(new) == current and pid in carried:
                    states[pid] = ("applied", reason, rel)
                else:
                    states[pid] = ("pending", reason, rel)
            elif pid in carried:
                if mode == "rollback":
                    states[pid] = ("pending", "rolled back by this run", rel)
                else:
                    states[pid] = ("stale", f"no longer selected: {reason}; apply removes it", rel)
            elif chosen and mode == "apply":
                missing = [n for n in needs[pid] if n not in desired]
                why = f"needs {', '.join(missing)}, which is not part of this run" if missing else "left out"
                states[pid] = ("not-selected", why, rel)
            else:
                states[pid] = ("not-selected", reason if not chosen else "rollback takes every patch out", rel)
        if new is not None and _sha(new) == current:
            continue
        if new is None and current == original:
            continue
        items.append(
            {
                "path": rel,
                "root": info["root"],
                "distribution": target["distribution"],
                "distribution_version": dists[target["distribution"]]["version"],
                "expected_sha256": current,
                "original_sha256": original,
                "new_content": None if new is None else new.decode("utf-8"),
                "restore_original": new is None,
                "patches": desired,
                "edits": variant["edits"] if variant else {},
                "outcomes": outcomes,
                "versions": {k: v for k, v in versions.items() if v is not None},
            }
        )
    ordered = [(p["id"],) + states[p["id"]] for p in data["patches"] if p["id"] in states]
    return items, verify_files, ordered, versions


def run(command: str, verify: bool, lock_timeout: float) -> dict:
    data = json.loads(_load(DATA))
    ns = _agent()
    report = {
        "target": sys.executable, "python": sys.executable, "versions": {}, "distributions": {},
        "status": "ok", "exit_code": EXIT_OK, "message": "", "notes": [], "problems": [],
        "state_dir": None, "files": [], "patches": [],
    }  # fmt: skip
    try:
        # The agent reads, writes and records the declared files only, as when patcher drives it;
        # as patcher does, a run that writes holds the lock from its facts to its last write.
        declared = [{"distribution": f["distribution"], "path": f["path"]} for f in data["files"]]
        lock = "exclusive" if command in ("apply", "rollback") else "shared"
        facts = ns["op_facts"](
            {"names": data["names"], "files": declared, "declared": declared, "lock": lock, "lock_timeout": lock_timeout}
        )
        report["state_dir"] = facts["state_dir"]
        report["versions"] = {n: d["version"] for n, d in facts["distributions"].items()}
        report["distributions"] = {n: d["name"] for n, d in facts["distributions"].items()}
        if facts.get("state_error"):
            raise Refusal("corrupt-state", facts["state_error"], EXIT_CONFLICT)
        targets = {f["distribution"] for f in data["files"]}
        if not targets & set(facts["distributions"]):
            raise Refusal(
                "usage",
                f"{', '.join(sorted(targets))} is not installed for {sys.executable}; run the bundle with the "
                "environment's Python, e.g. /root/ml-env/bin/python3 patcher-bundle.py status",
                EXIT_USAGE,
            )
        mode = "rollback" if command == "rollback" else "apply"
        items, verify_files, states, versions = plan(data, facts, mode)
        report["patches"] = [{"id": i, "state": s, "reason": r, "file": f} for i, s, r, f in states]
        report["files"] = [
            {"path": it["path"], "action": "restore" if it["restore_original"] else "write",
             "patches": it["patches"], "expected_sha256": it["expected_sha256"]}
            for it in items
        ]  # fmt: skip
        if command in ("status", "plan"):
            if command == "plan" and items:
                report["exit_code"] = EXIT_PENDING
                report["message"] = f"{len(items)} file(s) would change"
            else:
                report["message"] = f"{len(items)} file(s) pending" if items else "nothing to do"
            return report
        if not items:
            report["message"] = "nothing to do"
            return report
        request = {
            "files": items,
            "verify": {"files": verify_files, "import_prefixes": ["vllm"]} if verify and mode == "apply" and verify_files else None,
            "expect": facts.get("snapshot"),
            "lock_timeout": lock_timeout,
            "written_by": f"patcher bundle {data['patcher_version']}",
            "declared": declared,
        }
        result = ns["op_apply"](request)
        if result["status"] == "rolled-back":
            report["status"], report["exit_code"] = "rolled-back", EXIT_FAILED
            report["problems"] = result["verification"]["problems"]
            report["message"] = "verification failed, every file restored: " + report["problems"][0]
            return report
        report["status"] = "changed"
        for p in report["patches"]:
            if p["state"] == "pending" and mode == "apply":
                p["state"] = "applied"
            elif p["state"] == "stale":
                p["state"] = "not-selected"
        verified = result.get("verification")
        report["message"] = f"{len(items)} file(s) written" + (", verified" if verified else ", not verified")
        return report
    except Refusal as exc:
        report["status"], report["exit_code"], report["message"] = "failed", exc.code, exc.message
        return report
    except ns["AgentError"] as exc:
        report["status"], report["exit_code"] = "failed", AGENT_ERRORS.get(exc.kind, EXIT_FAILED)
        report["message"] = exc.message
        return report
    except OSError as exc:
        report["status"], report["exit_code"] = "failed", EXIT_FAILED
        report["message"] = f"{exc.strerror}: {exc.filename}; run as a user who can write there"
        return report


def info() -> None:
    data = json.loads(_load(DATA))
    print(f"patcher bundle made by patcher {data['patcher_version']} on {data['created']}")
    print("knows these pristine files (sha256):")
    for rel, known in data["originals"].items():
        for sha, about in known.items():
            print(f"  {rel}  {sha}  ({about['release']})")
    print(f"patched variants: {len(data['variants'])}, for {len(data['selections'])} patch selection(s)")
    print("supported version ranges:")
    for line in data.get("ranges", []):
        print(f"  {line}")
    print("patches:")
    for p in data["patches"]:
        conditions = "; ".join(f"{k} {v}" for k, v in p["requires"].items())
        print(f"  {p['id']}: {p['title']} ({conditions})")


def main(argv: list | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="patcher-bundle",
        description="patcher, offline: status/plan/apply/rollback for the Python environment that runs this file "
        "(e.g. /root/ml-env/bin/python3 patcher-bundle.py apply). Standard library only.",
    )
    parser.add_argument("command", choices=["status", "plan", "apply", "rollback", "info"])
    parser.add_argument("--no-verify", action="store_true", help="apply: skip verification in a fresh interpreter")
    parser.add_argument("--json", action="store_true", help="print the JSON report (schema_version 1) on stdout")
    parser.add_argument("--lock-timeout", type=float, default=10.0, metavar="SECONDS")
    parser.add_argument("--quiet", "-q", action="store_true")
    args = parser.parse_args(argv)
    if args.command == "info":
        info()
        return 0
    report = run(args.command, not args.no_verify, args.lock_timeout)
    if args.json:
        doc = {"schema_version": 1, "command": args.command, "exit_code": report["exit_code"], "targets": [report]}
        print(json.dumps(doc, indent=2))
    if not args.quiet or report["exit_code"] not in (0, 6):
        err = sys.stderr
        versions = ", ".join(f"{k} {v}" for k, v in sorted(report["versions"].items()))
        err.write(f"{report['target']}  {versions}\n")
        if not args.quiet:
            for p in report["patches"]:
                err.write(f"  {p['id']:<28} {p['state']:<18} {p['reason']}\n")
        for problem in report["problems"][1:]:
            err.write(f"  - {problem}\n")
        prefix = "error: " if report["exit_code"] not in (0, 6) else ""
        err.write(f"{report['status']}: {prefix}{report['message']}\n")
    return report["exit_code"]
