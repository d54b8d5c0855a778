"""The part of patcher a target runs too: standard library only, Python 3.9+, and no module here
imports another (the agent and a bundle send a module's text and import it from memory on its
own): `errors` (error kinds, exit codes, AgentError), `versions` (patcher's one PEP 440 matching), `syntax` (syntax-tree reading the binder and the
agent's verification share)
and `protocol` (the agent protocol's shapes, for the type checker only). Planning, the other
module a bundle runs, is patcher/plan/planning.py."""
