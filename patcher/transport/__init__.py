"""Transports: how the agent (remote/agent/) reaches a target's Python. interface (the Transport
protocol a run takes, and its errors), process (one agent process and its session, which local, a
subprocess, and ssh, the system OpenSSH client, each compose), bundle (one standard-library file
for hosts patcher cannot reach, and bundle_runtime, the program inside it) and ansible_task (the
controller side of the Ansible action in remote/ansible/)."""
