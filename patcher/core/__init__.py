"""The part of patcher the target runs too: standard library only, Python 3.9+, sent as module
texts with the agent (patcher/agent/bootstrap.py) and in a bundle: `errors` (error kinds, exit
codes, AgentError), `planning` (select, classify, desired set, states, changes), `versions`
(PEP 440 conditions) and `protocol` (the agent protocol's shapes, for the type checker only)."""
