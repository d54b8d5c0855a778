"""Transports: how the agent (remote/agent/) reaches a target's Python. interface (the Transport
protocol a run takes, and its errors), process (one agent process and its session, which local, a
subprocess, and ssh, the system OpenSSH client, each compose) and answer_shape (what an agent's
answer must look like). The front ends that carry a run another way (a bundle, the Ansible action)
are patcher/frontends/."""
