"""patcher's agent: the only code that runs inside a target interpreter and the only code that
writes to a target. Standard library only, Python 3.9+; it never imports libcst, packaging or
anything of patcher's outside this package and the shared `patcher.core.errors`, so a host needs
nothing but its Python. The controller imports these modules too (their types, the bootstrap);
the target gets them as module texts in the first line of the agent's input and imports them
from memory under the same names (bootstrap.py): nothing is written to the target to run it.

It is started as `python -c BOOTSTRAP` with one JSON request, or as a session (`"session":
true`): then it answers one request per line until its input ends. Each answer is one line on
stdout, `MARK JSON`, where MARK is chosen by the controller for this run and sent with the
agent: whatever else reaches stdout (a login banner, a shell's rc file, a module that prints)
cannot be taken for an answer. Operations (session.py's OPERATIONS):

- facts:      interpreter, distributions that provide the named import packages, the target
              files (bytes as text, sha256, the sha256 pip recorded), the state record (facts.py).
- apply:      one transaction per environment: lock, pristine backups taken once, each file
              written atomically, stale bytecode removed, state record, optional verification
              in a fresh interpreter, automatic restore of the previous bytes on failure
              (transaction.py).
- verify:     the check apply runs, on its own: in a fresh interpreter (verify-here, the check
              itself, is what that interpreter is asked; verification.py).
- forget:     drop record entries (and backups) of files pip has since replaced (transaction.py).
- run-check:  run remote/run_check_driver.py (sent as text with the scripts it drives) in a temporary
              folder: a tiny model through speculators and vLLM, compared with transformers.
              No lock is taken (verification.py).

The modules, each importing only those above it: faults (crash-test pauses and kills), writes
(flags, digests, a failed write in words), answers (answer lines, time limits), detect
(distributions from their metadata), state (patcher's own folder and its lock), record
(state.json), targets (the declared files, reached by folder descriptors), facts, transaction,
verification, session (the entry), bootstrap (how all of it reaches a target).

State lives under <sys.prefix>/share/patcher/: state.json, backups/<sha256>.py, lock.

Time limits: a request may carry `time_limit` (facts: the whole request; apply and forget: the
writes once the lock is held, `lock_timeout` bounding the wait before) and the verification its
own `timeout`. When one passes, the agent answers `timeout` and exits (a kill at any point is
safe: see tests/test_crash.py). A session whose input ends while a request is being served (the
controller gave up, was interrupted, or the connection dropped) stops at once the same way.
"""
