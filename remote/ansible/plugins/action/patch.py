# SPDX-License-Identifier: Apache-2.0
"""The action of `patcher.fleet.patch`. It runs on the controller: the work is patcher's own
(patcher.transport.ansible_task), which plans with libcst here and starts patcher's standard-library agent
on the host over Ansible's connection. Nothing of this file runs on a host."""

from __future__ import annotations

from ansible.plugins.action import ActionBase


class ActionModule(ActionBase):
    TRANSFERS_FILES = False
    _VALID_ARGS = frozenset(("command", "python", "only", "skip", "verify", "force", "lock_timeout"))

    def run(self, tmp=None, task_vars=None):
        result = super().run(tmp, task_vars)
        try:
            from patcher.transport.ansible_task import run_task
        except ImportError as exc:
            result.update(
                failed=True, msg=f"patcher is not installed in the controller's Python ({exc}): pip install patcher"
            )
            return result
        result.update(
            run_task(self, dict(self._task.args), task_vars or {}, bool(self._task.check_mode), bool(self._task.diff))
        )
        return result
