"""`python -m patcher`: the console script."""

from .cli.entry import main

main()
