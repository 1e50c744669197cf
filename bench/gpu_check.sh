#!/usr/bin/env bash
# The GPU check, one command: five runs through `accelerate launch` on one GPU and one table of results, in
# under 8 minutes on an H100/H200. The work is in bench/gpu_check.py (options: --dry-run, --smoke,
# --write-results; see --help). Runs from the repository root whatever the current folder, with $PYTHON,
# else the repository's .venv, else the python on PATH: the launches use that same Python's accelerate.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [[ -n "${PYTHON:-}" ]]; then
    python="$PYTHON"
elif [[ -x .venv/bin/python ]]; then
    python=.venv/bin/python
else
    python="$(command -v python || command -v python3)"
fi
exec "$python" bench/gpu_check.py "$@"
