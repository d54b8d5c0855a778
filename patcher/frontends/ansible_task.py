"""The work of the Ansible action `patcher.fleet.patch` (remote/ansible/), on the controller.

An action plugin, not a module carrying precomputed bytes: the codemods need libcst and
patcher's planning, which live on the controller; the host needs only its Python, and runs the
same standard-library agent `patcher --host` runs. So any file patcher can patch can be patched
through Ansible (a bundle knows only the pristine files it was built from), `--diff` shows the
plan's diffs, `--check` is the plan, and the result holds the same per-host JSON as
`patcher --json`. Each agent round trip (facts, then apply or rollback) is one command over
Ansible's own connection (its ssh, become, pipelining): the agent and its request go on the
command's stdin where the connection pipelines (ssh and local, pipelining on), else in a file
in the task's remote temporary folder that the command reads (pipelining off, and paramiko_ssh,
which cannot feed a command's stdin at all): what Ansible itself does with a module.
"""

from __future__ import annotations

import json
import os
import secrets
import shlex
from collections.abc import Mapping
from typing import Any

from ..core.errors import time_limit_problem
from ..patchset.registry import UnknownPatch, load_patches, resolve_ids, use_folders
from ..patchset.sets import PatchSetError
from ..report import EXIT_OK, EXIT_PENDING
from ..target_run import RunOptions, run_target
from ..transform.transforms import code_fingerprint, shared_transforms
from ..transport.answer_shape import checked_answer
from ..transport.interface import DEFAULT_CALL_TIMEOUT, AgentFailure, TransportError, agent_texts, one_line_bootstrap
from ..transport.ssh import shell_python

COMMANDS = ("status", "apply", "rollback")
# the task's options: remote/ansible/plugins/action/patch.py (_VALID_ARGS) and the module's
# DOCUMENTATION list the same (tests/test_ansible_collection.py)
OPTIONS = ("command", "python", "only", "skip", "verify", "force", "lock_timeout", "patches")

# patcher's messages name its command-line options; a task's result names the task's options
CLI_TO_TASK = (
    ("with --python PATH", "with python: (or ansible_python_interpreter)"),
    ("rerun with --force", "rerun with force: true"),
    ("--lock-timeout raises the wait", "lock_timeout: raises the wait"),
    ("run `patcher rollback --force`", "run the task with command: rollback and force: true"),
)


def task_message(message: str) -> str:
    for cli, task in CLI_TO_TASK:
        message = message.replace(cli, task)
    return message


class AnsibleTransport:
    """patcher's transport over an Ansible action's connection: one agent process per request."""

    def __init__(self, action, python: str, label: str) -> None:
        self.action = action
        self.python = python
        self.label = label
        self.invocations = 0
        self.tmpdir: str | None = None  # the task's remote temporary folder, made for the first unpipelined request

    # Ansible runs each request as one command and stops the task itself; nothing to start or end.
    def start(self) -> None: ...

    def prestart(self) -> None: ...

    def interrupt(self) -> None: ...

    def interrupted_message(self) -> str:
        return "interrupted; Ansible stopped the task (each round trip is one command: see the task's result)"

    def close(self) -> None:
        if self.tmpdir is None:
            return
        tmpdir, self.tmpdir = self.tmpdir, None
        try:
            self.action._remove_tmp_path(tmpdir)
        except Exception as exc:  # noqa: BLE001 - a lost connection must not hide the task's own outcome
            self.action._display.warning(f"patcher.fleet.patch: could not remove {tmpdir} on {self.label}: {exc}")

    def call(self, request: Mapping[str, Any], timeout: float = DEFAULT_CALL_TIMEOUT, limit: str = "") -> Any:
        self.invocations += 1
        # One request per agent process: the agent, its mark and the request on one line. Its
        # answer is the line that starts with the mark, so nothing a login shell prints is
        # taken for it. A writing request's plan is checked under the lock (its "expect").
        mark = "patcher-answer:" + secrets.token_hex(12)
        payload = (json.dumps({**request, "agent": agent_texts(), "mark": mark}) + "\n").encode("utf-8")
        # `~/` is the (become) user's home, as on patcher's command line; one line: a tcsh login reads it too
        command = f"{shell_python(self.python)} -c {shlex.quote(one_line_bootstrap())}"
        # an unreachable host raises Ansible's own connection error here: Ansible reports it
        connection = self.action._connection
        if connection.is_pipelining_enabled():
            done = self.action._low_level_execute_command(command, in_data=payload, sudoable=True)
        else:
            # Pipelining off (the user's choice, e.g. for sudo's requiretty: Ansible then gives
            # the command a tty), or a connection that cannot pipe data to a command
            # (paramiko_ssh): the request goes to a file, as a module would.
            path = self._upload(payload)
            done = self.action._low_level_execute_command(f"{command} < {shlex.quote(path)}", sudoable=True)
        stdout = done.get("stdout") or ""
        for line in stdout.splitlines():
            if line.startswith(mark + " "):
                op = str(request.get("op", ""))
                unknown = (
                    f"; the outcome of this {op} on {self.label} is unknown: every file there is either its old or "
                    "its new bytes (written atomically); run the task with command: status to see which"
                )
                answer = checked_answer(
                    op, line[len(mark) + 1 :], self.label, self.python, unknown if op in ("apply", "forget") else ""
                )
                if not answer["ok"]:
                    raise AgentFailure(answer["error"]["kind"], answer["error"]["message"])
                return answer["result"]
        rc = done.get("rc")
        # with a tty (pipelining off) the command's stderr arrives on its stdout
        said = (done.get("stderr") or "").strip().splitlines() or stdout.strip().splitlines()
        detail = (said or [f"exit status {rc}"])[-1]
        if rc == 127:
            raise TransportError(
                "usage", f"no python at {self.python} on {self.label}; set python: (or ansible_python_interpreter)"
            )
        raise TransportError(
            "usage", f"{self.python} did not answer as a Python 3.9+ interpreter on {self.label} ({detail})"
        )

    def _upload(self, payload: bytes) -> str:
        """The request as a file in the task's remote temporary folder (made once per task, removed
        by close()), readable by the become user (Ansible's _fixup_perms2: ACLs, chown, ...)."""
        action = self.action
        if self.tmpdir is None:
            self.tmpdir = action._make_tmp_path()
        path = action._connection._shell.join_path(self.tmpdir, f"patcher-request-{self.invocations}.json")
        action._transfer_data(path, payload)
        action._fixup_perms2([self.tmpdir, path], execute=False)
        return path


def prepare() -> None:
    """What every host's task reads the same: the patch set, the agent's source and bootstrap, the
    transform cache's code fingerprint. The action plugin calls this when it is loaded, which
    ansible-playbook does in its own process (the strategy looks the action up before it forks
    a worker per host and task): each worker starts with this module imported and these read,
    instead of paying for them once per host (tests/test_ansible_collection.py checks that the
    import happens in ansible-playbook's process; bench/ansible.py measures the difference)."""
    load_patches()
    agent_texts()
    one_line_bootstrap()
    code_fingerprint()


def _python(action, args: dict, task_vars: dict) -> str:
    """The target interpreter: the task's `python`, else the host's ansible_python_interpreter (with
    delegate_to, the delegated host's, as Ansible picks a module's interpreter), templated as
    Ansible does; `auto*` (interpreter discovery, which runs no module here) is python3."""
    if args.get("python"):
        return str(args["python"])
    host_vars = task_vars
    if action._task.delegate_to:
        host_vars = task_vars.get("ansible_delegated_vars", {}).get(action._task.delegate_to, {})
    configured = host_vars.get("ansible_python_interpreter")
    if isinstance(configured, str) and "{" in configured:
        configured = action._templar.template(configured)
    if isinstance(configured, str) and configured.strip() and not configured.strip().startswith("auto"):
        return configured.strip()
    return "python3"


def run_task(action, args: dict, task_vars: dict, check_mode: bool, diff: bool) -> dict:
    """The task's result: Ansible's `changed`, `failed`, `msg`, `diff`, and `patcher` (the host's
    entry of patcher's JSON, schema_version 1)."""
    unknown = set(args) - set(OPTIONS)
    if unknown:
        return {
            "failed": True,
            "msg": f"unknown option(s) {', '.join(sorted(unknown))}; see ansible-doc patcher.fleet.patch",
        }
    shell = action._connection._shell
    if getattr(shell, "_IS_WINDOWS", False) or getattr(shell, "SHELL_FAMILY", "sh") in ("powershell", "cmd"):
        # the agent is started by a POSIX command line (sh quoting, `<` redirection)
        return {
            "failed": True,
            "msg": (
                f"patcher.fleet.patch needs a POSIX shell on the host; this host's is {shell.SHELL_FAMILY} "
                "(a Windows connection, or ansible_shell_type): leave the host out of the play"
            ),
        }
    command = args.get("command", "status")
    if command not in COMMANDS:
        return {"failed": True, "msg": f"command={command!r}: one of {', '.join(COMMANDS)}"}
    lock_problem = time_limit_problem(args.get("lock_timeout", 10), zero_ok=True)
    if lock_problem:
        return {"failed": True, "msg": f"lock_timeout: {lock_problem}"}
    try:
        use_folders([str(folder) for folder in args.get("patches") or []])
    except PatchSetError as exc:
        return {"failed": True, "msg": task_message(str(exc).replace("--patches ", "patches: ", 1))}
    patches = load_patches()
    try:
        only = resolve_ids(patches, list(args.get("only") or []))
        skip = resolve_ids(patches, list(args.get("skip") or []))
    except UnknownPatch as exc:
        return {"failed": True, "msg": f"{exc}; see `patcher list`"}
    force = bool(args.get("force", False))
    options = RunOptions(
        command=command,
        only=only,
        skip=skip,
        # as the command line: apply --force adopts a file changed by hand, rollback --force restores
        # an original pip's RECORD does not vouch for (and never writes over a hand edit)
        force=force and command != "rollback",
        force_restore=force and command == "rollback",
        verify=bool(args.get("verify", True)),
        diff=diff,
        lock_timeout=float(args.get("lock_timeout", 10)),
        check=check_mode and command != "status",
    )
    label = str(task_vars.get("inventory_hostname", "host"))
    if action._task.delegate_to:
        label += f" (delegated to {action._task.delegate_to})"
    transport = AnsibleTransport(action, _python(action, args, task_vars), label)
    persist = None
    if not os.environ.get("PATCHER_NO_TRANSFORM_CACHE"):
        from ..cache import trusted_subfolder

        persist = trusted_subfolder("transforms")
    with shared_transforms(persist=persist):
        report = run_target(transport, patches, options)
    entry = report.as_json()
    written = report.status == "changed" and any(f.get("action") in ("write", "restore") for f in report.files)
    would = options.check and report.exit_code == EXIT_PENDING
    result: dict = {"changed": bool(written or would), "patcher": entry, "msg": task_message(report.message)}
    if report.exit_code not in (EXIT_OK, EXIT_PENDING):
        result["failed"] = True
    if diff:
        result["diff"] = [{"prepared": f["diff"]} for f in report.files if f.get("diff")]
    return result
