# SPDX-License-Identifier: Apache-2.0
"""The action of `patcher.fleet.patch`. It runs on the controller: the work is patcher's own
(patcher.frontends.ansible_task), which plans with libcst here and starts patcher's standard-library agent
on the host over Ansible's connection. Nothing of this file runs on a host."""

from __future__ import annotations

from ansible.plugins.action import ActionBase

# Imported when ansible-playbook loads this plugin, in its own process, before it forks a worker
# per host: every worker inherits patcher imported and its patch set read (prepare()), instead of
# paying for both once per host.
MISSING = ""
try:
    from patcher.frontends.ansible_task import prepare, run_task
except ImportError as exc:
    run_task = None  # type: ignore[assignment]  # the task then fails with MISSING
    MISSING = str(exc)
else:
    prepare()


class ActionModule(ActionBase):
    TRANSFERS_FILES = False
    _VALID_ARGS = frozenset(("command", "python", "only", "skip", "verify", "force", "lock_timeout", "patches"))

    def run(self, tmp=None, task_vars=None):
        result = super().run(tmp, task_vars)
        if run_task is None:
            result.update(
                failed=True, msg=f"patcher is not installed in the controller's Python ({MISSING}): pip install patcher"
            )
            return result
        result.update(
            run_task(self, dict(self._task.args), task_vars or {}, bool(self._task.check_mode), bool(self._task.diff))
        )
        return result
