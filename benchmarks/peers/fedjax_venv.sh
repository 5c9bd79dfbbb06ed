#!/usr/bin/env bash
# Creates .venv-fedjax: Google's fedjax 0.0.17 (its last release) on CPU, apart from the
# project's environment. The bench's `fedjax` system runs benchmarks/peers/fedjax_fedavg.py
# with this venv's python (`fedjax-sim bench --suite baselines --fedjax-python
# .venv-fedjax/bin/python`, the default when the venv exists).
# Why jax 0.5.3: fedjax 0.0.17 calls `jax.tree_map` (fedjax/core/tree_util.py, used by
# FedAvg's server sum every round), which jax removed in 0.6.0 (AttributeError there, e.g.
# with the project's jax 0.10.2); 0.5.3 is the newest jax that still has it (a deprecation
# warning only). dm-haiku 0.0.17 and optax 0.2.8 are what pip resolves beside it and were
# checked to work (a FedAvg round, tests/bench/test_baselines.py's comparison). No
# TensorFlow: the bench gives fedjax in-memory data (fedjax.InMemoryFederatedData).
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=${1:-.venv-fedjax}
python -m venv "$VENV"
"$VENV/bin/pip" install -q "fedjax==0.0.17" "jax==0.5.3" "jaxlib==0.5.3" "dm-haiku==0.0.17" \
    "optax==0.2.8"
# the check: fedjax imports and runs two FedAvg rounds of a tiny MLP
"$VENV/bin/python" benchmarks/peers/fedjax_fedavg.py '{"model": "mlp", "widths": [4, 3, 2],
    "image": [], "num_classes": 2, "clients": 2, "per_client": 3, "local_steps": 2,
    "batch_size": 2, "lr": 0.1, "rounds": 2, "threads": null, "seed": 0}'
