"""`python -m patcher.cli`: the click commands, without the console script's fast paths."""

from .commands import main
from .fastexit import run_and_exit

run_and_exit(main)
