#!/usr/bin/env bash
# The accelerator figures of issues 36, 39 and 41 in one device call (a lent GPU, one lease):
# W1 engine vs the per-client JAX loop vs the PyTorch loop (on CUDA) at cohorts 10 / 100 /
# 1000; the cohort sweep (LR, W1: 10 -> 10^6 clients, to the largest that fits); the cost of
# gradients through T = 10 / 100 / 1000 rounds; LoRA vs full fine-tuning cohorts (+ PyTorch
# LoRA loop on CUDA). Each part has its own time cap, so one slow part cannot eat the lease.
#
#   run (device tool): bash benchmarks/gpu_figures.sh      carry: .whl (tyro and its needs,
#   which that image lacks; see benchmarks/README.md "On a GPU")
#
# Rows go to $OUT (the device tool brings them back); copy them into benchmarks/results/.
set -u
OUT=${OUT:-/tmp/gpu_figures}
mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 FEDJAX_SIM_AUTOTUNE=0
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # jax and torch processes share the card
LOG=$OUT/log.txt
part() {  # part SECONDS NAME CMD...: run CMD under a cap, log its output and its wall time
  local cap=$1 name=$2
  shift 2
  echo "=== $name (cap ${cap}s) $(date +%T)" | tee -a "$LOG"
  local t0=$SECONDS
  timeout "$cap" "$@" >>"$LOG" 2>&1
  echo "=== $name: rc $? in $((SECONDS - t0)) s" | tee -a "$LOG"
}
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv | tee -a "$LOG"
python3 -c "import jax, torch; print(jax.__version__, jax.devices(), torch.__version__)" \
  | tee -a "$LOG"
part 170 baselines python3 -m fedjax_sim bench --suite baselines --workload W1 --mode vmap \
  --baseline-cohorts 10 100 1000 --no-flops --memory-budget-gb 60 --out "$OUT"
part 150 hypergradient python3 benchmarks/hypergradient_cost.py --rounds 10 100 1000 \
  --repeats 3 --out "$OUT/hypergradient_cost.jsonl"
part 90 lora python3 benchmarks/lora_cohort.py --cohorts 4 16 64 --out "$OUT/lora_cohort.jsonl"
part 100 cohort python3 -m fedjax_sim bench --suite cohort --mode vmap --no-flops \
  --memory-budget-gb 60 --max-round-s 20 --out "$OUT"
rm -f "$OUT"/*.png "$OUT"/*.md  # the tables and plots are regenerated here from the rows
tail -n 60 "$LOG"
