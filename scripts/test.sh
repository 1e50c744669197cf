#!/usr/bin/env bash
# Install what is needed, then run the whole test suite (CPU only; real `accelerate launch` runs).
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
# pytest exits 5 when it collected no tests; set -e turns that into a failure like any other.
python -m ruff check .  # pyproject.toml: pyflakes and pycodestyle, lines of at most 120 characters
# Two test files at a time (pytest-xdist): most of a test is a launched process starting up, so 2 cores take
# both; --dist loadfile keeps each file on one worker, with its module fixtures built once.
python -m pytest -q -n 2 --dist loadfile tests "$@"
