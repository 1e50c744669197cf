"""python -m search --sweep sweeps/<template>.yaml --n_trials 30 [-- options for every trial]; see runner.py."""

from search.runner import main

main()
