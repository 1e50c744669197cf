"""python -m search --sweep sweeps/<template>.yaml --n_trials 30 [-- options for every trial]; see runner.py."""

import sys

from search.runner import main

sys.argv[0] = "python -m search"  # what --help's usage line names, rather than __main__.py
main()
