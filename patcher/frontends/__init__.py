"""Front ends: the ways into a run other than the command line. bundle (one standard-library file
for hosts patcher cannot reach, and bundle_runtime, the program inside it) and ansible_task (the
controller side of the Ansible action in remote/ansible/). Each plans here and carries the agent
(remote/agent/) through patcher/transport/ or its own file."""
