"""Test helper, launched in place of a template: run the template unchanged, but after each evaluation
it logs, wait until the local search has reported that evaluation to its study.

    PACE_JOURNAL=<study folder>/journal.log python tests/paced_trial.py templates/x.py --opt ...

A tiny trial makes all its evaluations within one poll of the runner, which then sees them at once,
counts the trial as having reached its end and never asks the pruner: whether a test's trial is
pruned would depend on the machine's speed. Waiting for the study's record of evaluation k (the
journal's intermediate value at step k, written before the runner asks the pruner) makes every
trial meet the pruner at each evaluation, on any machine. At most PACE_TIMEOUT_S (60) per evaluation.
Without PACE_JOURNAL (a rerun outside the search, e.g. search.seeds) the template runs unpaced.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
from pathlib import Path

template_path = Path(sys.argv[1]).resolve()
sys.argv = [str(template_path), *sys.argv[2:]]
sys.path.insert(0, str(template_path.parent.parent))  # common/ of the repository under test

from common import tracking  # noqa: E402

JOURNAL = Path(os.environ["PACE_JOURNAL"]) if os.environ.get("PACE_JOURNAL") else None
TIMEOUT_S = float(os.environ.get("PACE_TIMEOUT_S", "60"))
evaluations = [0]


def reported(step: int) -> bool:
    """Whether the journal holds an intermediate value at `step` for the newest trial that has any."""
    try:
        lines = JOURNAL.read_text().splitlines()
    except FileNotFoundError:
        return False
    for line in reversed(lines):
        try:
            op = json.loads(line)
        except ValueError:
            continue  # a line being written
        if "intermediate_value" in op:
            return op.get("step") == step
    return False


original_log = tracking.Tracker.log


def paced_log(self, metrics: dict[str, float], step: int) -> None:
    original_log(self, metrics, step)
    if JOURNAL is None or not any(key.startswith("val/") for key in metrics):
        return
    evaluations[0] += 1
    deadline = time.monotonic() + TIMEOUT_S
    while not reported(evaluations[0]) and time.monotonic() < deadline:
        time.sleep(0.05)


tracking.Tracker.log = paced_log

spec = importlib.util.spec_from_file_location("__main__", template_path)
template = importlib.util.module_from_spec(spec)
sys.modules["__main__"] = template  # dataclasses look their module up while the file runs
spec.loader.exec_module(template)
