"""The suite's sample of scripts/stress_signals.py: signals at random moments of real runs, each checked for what
the README promises (no process left, a documented exit code, status.json, no traceback or C++ abort, W&B holding
every step, a resume bit-identical to an uninterrupted run). One trial of the language model on one process (the
moments are drawn in seconds, so load moves them: each run of the suite hits others); the script's full run (every
cell and signal) gives bench/RESULTS.md's figure."""

from __future__ import annotations

import subprocess
import sys

from conftest import REPO


def test_a_signal_at_a_random_moment_ends_the_run_as_documented():
    seed = 0
    result = subprocess.run([sys.executable, str(REPO / "scripts" / "stress_signals.py"), "--trials", "1",
                             "--cells", "lm-1", "--seed", str(seed)], cwd=REPO, capture_output=True, text=True,
                            timeout=600, check=False)
    assert result.returncode == 0, f"seed {seed}\n{result.stdout[-4000:]}\n{result.stderr[-2000:]}"
    assert result.stdout.splitlines()[-1].split()[1:3] == ["1", "1"], result.stdout[-2000:]
