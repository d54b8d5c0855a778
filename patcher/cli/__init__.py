"""The command line, kept thin: the console script (entry, with its fast --version and
--help), the `patcher` click group and the commands on targets (patcher_command; `demo` and
`check-upstream` are their packages' demo_command and check_upstream_command, loaded when they
run), terminal rendering (render, fleetview) and the early exit (fastexit). `python -m
patcher.cli` runs the click group (__main__)."""
