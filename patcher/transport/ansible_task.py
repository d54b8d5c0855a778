"""The work of the Ansible action `patcher.fleet.patch` (remote/ansible/), on the controller.

An action plugin, not a module carrying precomputed bytes: the codemods need libcst and
patcher's planning, which live on the controller; the host needs only its Python, and runs the
same standard-library agent `patcher --host` runs. So any file patcher can patch can be patched
through Ansible (a bundle knows only the pristine files it was built from), `--diff` shows the
plan's diffs, `--check` is the plan, and the result holds the same per-host JSON as
`patcher --json`. Each agent round trip (facts, then apply or rollback) is one command over
Ansible's own connection (its ssh, become, pipelining), the agent and its request on stdin.
"""

from __future__ import annotations

import json
import os
import secrets
import shlex
from collections.abc import Mapping
from typing import Any

from ..report import EXIT_OK, EXIT_PENDING
from .local import AgentFailure, TransportError, agent_source, bootstrap

COMMANDS = ("status", "apply", "rollback")


class AnsibleTransport:
    """patcher's transport over an Ansible action's connection: one agent process per request."""

    def __init__(self, action, python: str, label: str) -> None:
        self.action = action
        self.python = python
        self.label = label
        self.invocations = 0

    def start(self) -> None: ...

    def prestart(self) -> None: ...

    def close(self) -> None: ...

    def call(self, request: Mapping[str, Any], timeout: float = 900, limit: str = "") -> Any:
        self.invocations += 1
        # One request per agent process: the agent, its mark and the request on one line. Its
        # answer is the line that starts with the mark, so nothing a login shell prints is
        # taken for it. A writing request's plan is checked under the lock (its "expect").
        mark = "patcher-answer:" + secrets.token_hex(12)
        stdin = json.dumps({**request, "agent": agent_source(), "mark": mark}) + "\n"
        command = f"{shlex.quote(self.python)} -c {shlex.quote(bootstrap())}"
        # an unreachable host raises Ansible's own connection error here: Ansible reports it
        done = self.action._low_level_execute_command(command, in_data=stdin, sudoable=True)
        for line in (done.get("stdout") or "").splitlines():
            if line.startswith(mark + " "):
                answer = json.loads(line[len(mark) + 1 :])
                if not answer.get("ok"):
                    error = answer.get("error", {})
                    raise AgentFailure(error.get("kind", "unknown"), error.get("message", "agent failed"))
                return answer["result"]
        rc = done.get("rc")
        detail = ((done.get("stderr") or "").strip().splitlines() or [f"exit status {rc}"])[-1]
        if rc == 127:
            raise TransportError(
                "usage", f"no python at {self.python} on {self.label}; set python: (or ansible_python_interpreter)"
            )
        raise TransportError(
            "usage", f"{self.python} did not answer as a Python 3.9+ interpreter on {self.label} ({detail})"
        )


def _python(args: dict, task_vars: dict) -> str:
    if args.get("python"):
        return str(args["python"])
    configured = task_vars.get("ansible_python_interpreter")
    if isinstance(configured, str) and configured and not configured.startswith("auto") and "{" not in configured:
        return configured
    return "python3"


def run_task(action, args: dict, task_vars: dict, check_mode: bool, diff: bool) -> dict:
    """The task's result: Ansible's `changed`, `failed`, `msg`, `diff`, and `patcher` (the host's
    entry of patcher's JSON, schema_version 1)."""
    from ..patchset.registry import UnknownPatch, load_patches, resolve_ids
    from ..run import RunOptions, run_target
    from ..transform.transforms import shared_transforms

    unknown = set(args) - {"command", "python", "only", "skip", "verify", "force", "lock_timeout"}
    if unknown:
        return {
            "failed": True,
            "msg": f"unknown option(s) {', '.join(sorted(unknown))}; see ansible-doc patcher.fleet.patch",
        }
    command = args.get("command", "status")
    if command not in COMMANDS:
        return {"failed": True, "msg": f"command={command!r}: one of {', '.join(COMMANDS)}"}
    patches = load_patches()
    try:
        only = resolve_ids(patches, list(args.get("only") or []))
        skip = resolve_ids(patches, list(args.get("skip") or []))
    except UnknownPatch as exc:
        return {"failed": True, "msg": f"{exc}; see `patcher list`"}
    options = RunOptions(
        command=command,
        only=only,
        skip=skip,
        force=bool(args.get("force", False)),
        verify=bool(args.get("verify", True)),
        diff=diff,
        lock_timeout=float(args.get("lock_timeout", 10)),
        check=check_mode and command != "status",
    )
    label = str(task_vars.get("inventory_hostname", "host"))
    transport = AnsibleTransport(action, _python(args, task_vars), label)
    persist = None
    if not os.environ.get("PATCHER_NO_TRANSFORM_CACHE"):
        from ..cache import trusted_subfolder

        persist = trusted_subfolder("transforms")
    with shared_transforms(persist=persist):
        report = run_target(transport, patches, options)
    entry = report.as_json()
    written = report.status == "changed" and any(f.get("action") in ("write", "restore") for f in report.files)
    would = options.check and report.exit_code == EXIT_PENDING
    result: dict = {"changed": bool(written or would), "patcher": entry, "msg": report.message}
    if report.exit_code not in (EXIT_OK, EXIT_PENDING):
        result["failed"] = True
    if diff:
        result["diff"] = [{"prepared": f["diff"]} for f in report.files if f.get("diff")]
    return result
