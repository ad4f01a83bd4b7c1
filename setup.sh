#!/usr/bin/env bash
# Create .venv with fxparallel and its test extra. Installs torch 2.13.0 first where no torch is
# present, so pip does not pull the newest CUDA build of torch (several GB) on a CPU machine.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  .venv/bin/python -m pip install -q "torch==2.13.0"
fi
.venv/bin/python -m pip install -q -e ".[test]"
