# Sourced by demo.sh and test.sh: make .venv (once) and install requirements-dev.txt into it
# (what the templates need, plus the tests, the search tools and ruff).
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv}"
if [ ! -x "$VENV/bin/python" ]; then
  "${PYTHON:-python3}" -m venv "$VENV"
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"
if ! python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    pip install torch
  else
    # No GPU: the CPU build. A plain `pip install torch` on Linux downloads the multi-GB CUDA build.
    pip install torch --index-url https://download.pytorch.org/whl/cpu
  fi
fi
pip install --quiet --disable-pip-version-check -r "$ROOT/requirements-dev.txt"
cd "$ROOT"
