"""Standard library only, Python 3.9+, and no module here imports another (the agent and a bundle
send a module's text and import it from memory on its own): `errors` (error kinds and exit codes),
`versions` (patcher's one PEP 440 matching) and `protocol` (the agent protocol as TypedDicts, for
the type checker). Planning, the other module a bundle runs, is patcher/plan/planning.py."""
