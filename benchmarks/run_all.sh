#!/usr/bin/env bash
# Every benchmark of benchmarks/README.md at full size, on a QUIET machine (nothing else
# running: timings on a shared machine are inflated and noisy). Rows (stamped with commit,
# machine, load and command) go to $OUT/<suite>.jsonl (default benchmarks/results, where each
# suite's rows replace those it measures again; then `python benchmarks/report.py` regenerates
# the README tables). Each measurement runs
# in its own process under a memory budget (default min(8 GiB, half the available memory),
# override with BUDGET_GB=...), so the cohort sweep stops at the largest cohort that fits.
#
#   pip install -e ".[peers]"           # PyTorch CPU for the peer baseline (torch==2.13.0)
#   bash benchmarks/run_all.sh          # ~1-2 h on 2 CPU cores; minutes on a GPU
set -euo pipefail
cd "$(dirname "$0")/.."

OUT=${OUT:-benchmarks/results}
BUDGET=()
[ -n "${BUDGET_GB:-}" ] && BUDGET=(--memory-budget-gb "$BUDGET_GB")
BENCH=(python -m fedjax_sim bench --out "$OUT" "${BUDGET[@]}")

echo "load before: $(uptime)"
# 1 + 4: W1 (FedAvg, 1000 clients x 10 steps x batch 32, MLP 784-200-200-10): our round
# (preset map(batch_size=5) and the memory-fitted mode) vs the per-client jitted loop and the
# PyTorch per-client loop (1 thread and default threads)
"${BENCH[@]}" --suite round baselines --workload W1
# 2: vmap vs map(batch_size) vs the memory-fitted choice on W1
"${BENCH[@]}" --suite modes --workload W1 --map-batches 1 2 5 8 16 32
# 2: cohort size 10 -> 10^6, logistic regression (60 features) and the W1 MLP, fitted mode
"${BENCH[@]}" --suite cohort --cohort-workloads LR W1 \
  --cohorts 10 100 1000 10000 100000 1000000 --max-round-s 300
# 2: local steps 1 -> 100 and MLP width 50 -> 800 on W1
"${BENCH[@]}" --suite steps --workload W1 --steps-list 1 3 10 30 100 --max-round-s 300
"${BENCH[@]}" --suite width --workload W1 --widths 50 100 200 400 800 --max-round-s 300
# 3: every registered algorithm on W1-100 (100 clients), round time as a ratio to FedAvg
"${BENCH[@]}" --suite algorithms --workload W1-100
# peak memory of 20 vs 200 rounds under one lax.scan (target: within 10 %)
"${BENCH[@]}" --suite memory --workload W1-100 --memory-rounds 20 200
echo "load after: $(uptime)"
