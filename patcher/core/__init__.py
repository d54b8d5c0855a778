"""Standard library only, Python 3.9+, and no module here imports another (a bundle embeds a
module's text and runs it on its own, as it does the agent's): `errors` (error kinds and exit
codes; embedded in a bundle) and `protocol` (the agent protocol as TypedDicts, for the type
checker). Planning, the other module a bundle embeds, is patcher/plan/planning.py."""
