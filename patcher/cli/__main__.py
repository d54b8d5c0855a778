"""`python -m patcher.cli`: the click commands, without the console script's fast paths."""

from .fastexit import run_and_exit
from .patcher_command import main

run_and_exit(main)
