DOCUMENTATION = r"""
module: patch
short_description: patcher's status, apply and rollback on a host's Python environment
description:
  - Runs patcher (installed on the controller) against the target environment of each host. The
    patches are planned on the controller with libcst; the host runs patcher's standard-library
    agent with the environment's Python. Check mode shows the plan and writes nothing; diff mode
    shows unified diffs. C(changed) is true only when file bytes changed (or would, in check mode).
  - This is an action plugin; this file only documents it.
options:
  command:
    description: What to do.
    choices: [status, apply, rollback]
    default: status
    type: str
  python:
    description: The target environment's interpreter. Default, the host's ansible_python_interpreter, else python3.
    type: str
  only:
    description: Only these patches (vN or full id).
    type: list
    elements: str
  skip:
    description: Leave these patches out.
    type: list
    elements: str
  verify:
    description: Verify the patched modules in a fresh target interpreter (apply).
    type: bool
    default: true
  force:
    description: Adopt a file changed by hand as the new original (apply).
    type: bool
    default: false
  lock_timeout:
    description: Seconds to wait for another run's lock.
    type: float
    default: 10
author: [patcher maintainers]
"""

EXAMPLES = r"""
- hosts: gpus
  gather_facts: false
  tasks:
    - patcher.fleet.patch:
        command: apply
        python: /root/ml-env/bin/python3
"""

RETURN = r"""
patcher:
  description: The host's entry of patcher's JSON report (schema_version 1), as `patcher --json` prints it.
  returned: always
  type: dict
"""

if __name__ == "__main__":
    import json
    import sys

    print(json.dumps({"failed": True, "msg": "patcher.fleet.patch is an action plugin: run it from a playbook"}))
    sys.exit(1)
