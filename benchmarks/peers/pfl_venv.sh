#!/usr/bin/env bash
# Creates .venv-pfl: pfl-research 0.6.0 with its PyTorch backend (CPU), apart from the
# project's environment (pfl pins dp-accounting<0.6, packaging<26, wheel<0.46). The bench's
# `pfl` system runs benchmarks/peers/pfl_fedavg.py with this venv's python
# (`fedjax-sim bench --suite baselines --pfl-python .venv-pfl/bin/python`, the default when
# the venv exists). On a CUDA host add --index-url https://download.pytorch.org/whl/cpu to
# the torch install to avoid a CUDA build.
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=${1:-.venv-pfl}
python -m venv "$VENV"
"$VENV/bin/pip" install -q "torch==2.13.0" "pfl[pytorch]==0.6.0"
"$VENV/bin/python" -c "import pfl, torch; print('pfl', pfl.__version__, 'torch', torch.__version__)"
