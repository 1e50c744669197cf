"""Local hyperparameter search over the W&B sweep files in sweeps/, with Optuna: no account, no network.

    python -m search --sweep sweeps/image_classification.yaml --n_trials 30 [-- options for every trial]
    python -m search.seeds --results runs/search/image_classification/results.json --seeds 0,1,2

- runner.py: the search (`python -m search` runs it; see its docstring)
- seeds.py: one set of parameters re-run with several seeds, reported as mean ± std
- sweep.py: a sweep file read and checked, its parameters drawn with Optuna, a trial's command built
- trial.py: one trial as a subprocess (process group), its metrics followed as they are logged

Not needed to train (the templates import only common/); a project that wants the local search copies
search/ beside its common/, as nothing else of this repository is used: from common/ it takes config and
errors. Nothing here imports torch or accelerate (the trials do, in their own processes).
"""
