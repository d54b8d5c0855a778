"""`python -m patcher`: the console script."""

from .entry import main

main()
