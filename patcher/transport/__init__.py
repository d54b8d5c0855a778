"""Transports: how the agent (remote/agent.py) reaches a target's Python. local (a
subprocess; the bootstrap every transport sends), ssh (the system OpenSSH client), bundle (one
standard-library file for hosts patcher cannot reach, and bundle_runtime, the program inside it)
and ansible_task (the controller side of the Ansible action in remote/ansible/)."""
