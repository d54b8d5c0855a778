"""The part of patcher a bundle carries too: standard library only, Python 3.9+, and no module
here imports another (a bundle embeds each module's text and runs it on its own, as it does the
agent's): `errors` (error kinds and exit codes) and `planning` (select, classify, desired set,
states, changes)."""
