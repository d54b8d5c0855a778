"""The command line, kept thin: the console script (entry, with its fast --version and
--help), the click commands (commands), terminal rendering (render, fleetview) and the early
exit (fastexit). `python -m patcher.cli` runs the commands (__main__)."""
