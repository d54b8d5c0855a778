# SPDX-License-Identifier: Apache-2.0
# Documentation only (ansible-doc, ansible-test): the task is the action plugin of the same name,
# plugins/action/patch.py, which runs on the controller; nothing of this file runs on a host.

from __future__ import annotations

DOCUMENTATION = r"""
module: patch
short_description: patcher's status, apply and rollback on a host's Python environment
description:
  - Runs patcher (installed on the controller) against the target environment of each host. The
    speculators/vLLM patch set is planned on the controller with libcst, and the host runs only
    patcher's standard-library agent, with the environment's Python, over the host's connection.
  - Check mode shows the plan and writes nothing; diff mode shows the plan's unified diffs.
    C(changed) is true only when file bytes changed (in check mode, when they would).
  - A conflict (a file changed by hand), a failed verification (every file restored) or a missing
    interpreter fails the host with patcher's message; unreachable hosts are Ansible's own.
version_added: 0.1.0
requirements:
  - patcher in the Python that runs Ansible on the controller (C(pip install patcher ansible-core)).
  - On each host, the target environment's Python (3.9 or newer) and a POSIX shell; nothing else.
notes:
  - This is an action plugin; this file only documents it. Nothing of the collection runs on a host.
  - Tested connections (ansible-core 2.19) are C(local), C(ssh) and C(paramiko_ssh), each with and
    without O(ignore:become) (sudo), pipelining on and off. With pipelining on (C(ssh), C(local)), the agent
    and its request go on the command's standard input; with pipelining off, and over C(paramiko_ssh)
    (which cannot feed a command's input), they go in a file in the task's remote temporary
    folder, made readable for the become user as Ansible does for modules, and removed afterwards.
  - Each host costs one command for C(status), check mode and an C(apply) with nothing left to do
    (the facts), and two for an C(apply) or C(rollback) that writes (the facts, then the write);
    the plan is made on the controller from the facts, between the two.
  - Windows hosts (C(winrm), C(psrp), a PowerShell or cmd shell) are refused with a message.
options:
  command:
    description:
      - V(status) reports each patch's state; V(apply) applies the selected patches; V(rollback)
        restores the original bytes of every file patcher wrote.
    choices: [status, apply, rollback]
    default: status
    type: str
  python:
    description:
      - The target environment's interpreter on the host.
      - Default, the host's C(ansible_python_interpreter) (the delegated host's with C(delegate_to))
        unless it is C(auto*) or a template, else C(python3).
    type: str
  only:
    description: Only these patches (their V(vN) short form or full id); see C(patcher list).
    type: list
    elements: str
  skip:
    description: Leave these patches out.
    type: list
    elements: str
  verify:
    description:
      - After an O(command=apply) that writes, verify the patched modules in a fresh target interpreter
        (every patched vLLM call binds); on failure every file is restored and the host fails.
    type: bool
    default: true
  force:
    description:
      - With O(command=apply), adopt a file changed by hand as the new original (C(patcher apply --force)).
      - With O(command=rollback), restore a kept original even where pip's RECORD gives other bytes and
        patcher's record does not say it was adopted with O(force) (C(patcher rollback --force)); a file
        changed by hand is still refused.
    type: bool
    default: false
  lock_timeout:
    description: Seconds to wait for another patcher run's lock on the environment.
    type: float
    default: 10
  patches:
    description:
      - Folders of patch sets on the controller to use beside the installed ones (C(patcher --patches DIR));
        a folder another user can write is refused. Installed sets (entry point C(patcher.patch_sets)) are
        always used.
    type: list
    elements: str
extends_documentation_fragment:
  - ansible.builtin.action_common_attributes
  - ansible.builtin.action_common_attributes.conn
  - ansible.builtin.action_common_attributes.flow
attributes:
  action:
    support: full
  async:
    support: none
  become:
    support: full
  bypass_host_loop:
    support: none
  check_mode:
    support: full
  connection:
    support: full
  delegation:
    support: full
  diff_mode:
    support: full
  platform:
    platforms: posix
author:
  - patcher maintainers (!UNKNOWN)
"""

EXAMPLES = r"""
- name: Speculators patches on vLLM
  hosts: gpus
  gather_facts: false
  tasks:
    - name: Apply (with --check --diff, the plan and its diffs; nothing written)
      patcher.fleet.patch:
        command: apply
        python: /root/ml-env/bin/python3
      register: patched

    - name: Each patch's state
      ansible.builtin.debug:
        msg: "{{ patched.patcher.patches }}"

- name: Roll back, on the machine that runs Ansible
  hosts: localhost
  gather_facts: false
  tasks:
    - name: Restore the original bytes
      patcher.fleet.patch:
        command: rollback
        python: /opt/vllm-env/bin/python3
"""

RETURN = r"""
msg:
  description: patcher's one-line summary of the host's outcome, or what went wrong and what to do.
  returned: always
  type: str
  sample: 2 file(s) written, verified
patcher:
  description:
    - The host's entry of patcher's JSON report (schema_version 1), as C(patcher --json) prints it
      under C(targets).
  returned: when patcher ran on the host
  type: dict
  contains:
    status:
      description: ok, changed, failed or rolled-back.
      type: str
      returned: always
    exit_code:
      description: patcher's exit code for the host (0 done, 6 check mode would change, 3 conflict, ...).
      type: int
      returned: always
    versions:
      description: The installed versions of the distributions the patches target.
      type: dict
      returned: always
      sample: {"speculators": "0.3.0", "vllm": "0.16.0"}
    patches:
      description: Each patch's id, state and reason.
      type: list
      elements: dict
      returned: always
    files:
      description: Each file written or restored (or, in check mode, that would be), with its diff in diff mode.
      type: list
      elements: dict
      returned: always
"""
