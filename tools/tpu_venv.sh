#!/usr/bin/env bash
# Build the training venv on a machine whose python3 is too old for the pins (a stock TPU VM image ships Python 3.10;
# google-tunix 0.1.7 needs >= 3.11). uv fetches a managed CPython (python-build-standalone), so neither root nor
# deadsnakes is needed. Usage: tools/tpu_venv.sh [VENV] [REQUIREMENTS]   (defaults: .venv requirements-tpu.txt)
# GEMMA_TPU_PYTHON picks the Python (default 3.12, Colab's version); tests/fast/test_requirements.py checks that the pins
# resolve for it.
set -euo pipefail
VENV=${1:-.venv}
REQ=${2:-requirements-tpu.txt}
PYVER=${GEMMA_TPU_PYTHON:-3.12}
UV_VERSION=0.13.9
cd "$(dirname "$0")/.."

if ! command -v uv >/dev/null; then
  export PATH="$HOME/.local/bin:$PATH"
fi
if ! command -v uv >/dev/null; then
  echo "installing uv $UV_VERSION into ~/.local/bin" >&2
  python3 -m pip install -q --user "uv==$UV_VERSION" 2>/dev/null \
    || curl -LsSf "https://astral.sh/uv/$UV_VERSION/install.sh" | sh
fi

uv venv --seed --allow-existing --python "$PYVER" "$VENV"
uv pip install --python "$VENV/bin/python" -r "$REQ"
uv pip install --python "$VENV/bin/python" --no-deps -e .
"$VENV/bin/python" -c "import sys, gemma_tpu_helpers; print('ok:', sys.version.split()[0], '$VENV')"
