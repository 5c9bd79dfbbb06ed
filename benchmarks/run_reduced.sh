#!/usr/bin/env bash
# The reduced-size CPU run whose tables are in benchmarks/README.md ("Reduced CPU run"):
# the same suites as run_all.sh at sizes that finish in ~30-40 min on a 2-core machine
# shared with other jobs. Every row records the 1-minute load average at measurement time;
# this file also logs `uptime` before and after each command (stdout).
#
#   PYTHONPATH=$PWD nice -n 10 bash benchmarks/run_reduced.sh
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
BENCH=(python -m fedjax_sim bench --out "$OUT" --memory-budget-gb "${BUDGET_GB:-3}")
log() { echo "$(date -u +%H:%M:%S) $* | $(uptime)"; }

# W1 at 100 clients (full W1 = 1000 clients): engine modes vs the per-client jitted loop
log "start round_throughput M=100"
python benchmarks/round_throughput.py --clients 100 --map-batch 5 10 \
  --out "$OUT/round_throughput.jsonl"
# kernel table: every registered algorithm, MLP 784-200-200-10, 20 clients x 10 steps x 32
log "start algorithms"
"${BENCH[@]}" --suite algorithms --workload W1-100 --clients 20 --repeats 5 --no-flops
# baselines (engine, memory-fitted engine, per-client jitted loop, PyTorch loop) at M=100
log "start baselines"
"${BENCH[@]}" --suite baselines --workload W1-100
# peak memory of 20 vs 200 rounds under one lax.scan
log "start memory"
"${BENCH[@]}" --suite memory --workload W1-100 --clients 20 --memory-rounds 20 200
# cohort sweep, logistic regression 10 -> 10^6 (stops at the memory budget)
log "start cohort"
"${BENCH[@]}" --suite cohort --cohort-workloads LR \
  --cohorts 10 100 1000 10000 100000 1000000 --max-round-s 30
# local steps 1 -> 100 and MLP widths at 20 clients
log "start steps"
"${BENCH[@]}" --suite steps --workload W1-100 --clients 20 --steps-list 1 3 10 30 100 \
  --max-round-s 30
log "start width"
"${BENCH[@]}" --suite width --workload W1-100 --clients 20 --widths 50 100 200 400 800 \
  --max-round-s 30
log "done"
