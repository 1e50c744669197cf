#!/usr/bin/env bash
# Install what is needed, then run the whole test suite (CPU only; real `accelerate launch` runs).
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
# pytest exits 5 when it collected no tests; set -e turns that into a failure like any other.
python -m ruff check .  # pyproject.toml: pyflakes and pycodestyle, lines of at most 120 characters
python -m pytest -q tests "$@"
