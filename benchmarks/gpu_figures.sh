#!/usr/bin/env bash
# The accelerator figures of issues 36 and 41 in one device call (a lent GPU, one lease), sized
# for ONE command of at most 9 minutes in a 15-minute lease (the machine takes 1-2 minutes to
# start). What the first lease (benchmarks/results/gpu/, README "One H200 GPU (measured)")
# lacks, most valuable first:
#   1. baselines (issue 41): W1, the engine vs the per-client jitted JAX loop at cohorts
#      10 / 100 / 1000, and the PyTorch loop (on CUDA, one thread: its default measured the
#      same) only up to M = 100: its round grows linearly with the cohort, and at M = 1000 its
#      four rounds would take a third of the budget. 8 measurement processes.
#   2. hypergradient (issue 36): the two T = 1000 variants the first lease's cap cut, with the
#      forward pass they are compared with.
#   3. cohort W1 (issue 41): the W1 curve, 10 -> the largest cohort that fits the budget.
#   4. cohort LR: the LR curve again in the same run, with the time that is left.
# The LoRA figure (issue 39) is complete from the first lease. The first lease's logs give the
# budget: ~12 s per measurement process (start, JAX and CUDA, compile; each system is its own
# process), a skipped peer now costs no process. Each part has its own cap and the script a
# deadline (DEADLINE seconds after its start; a part gets at most what is left), so one slow
# part cannot eat the lease; `fedjax-sim bench` writes each row when measured, so a capped part
# keeps its finished rows.
#
#   run (device tool), timeout_s 560: bash benchmarks/gpu_figures.sh
#   carry: .whl (tyro and its needs, which that image lacks, as wheels; make it once with
#   echo /.whl/ >> .git/info/exclude; python3 -m pip download --no-deps --only-binary=:all: \
#     --python-version 3.12 --implementation cp --platform manylinux2014_x86_64 -d .whl \
#     tyro==1.0.17 docstring-parser==0.18.0 typeguard==4.6.1)
#
# Rows go to $OUT (the device tool brings them back): baselines.jsonl, cohort.jsonl,
# hypergradient_cost.jsonl and log.txt. Keep the first lease's files as they are: copy these
# to benchmarks/results/gpu/<machine>-<lease>_<suite>.jsonl (e.g. h200-2_baselines.jsonl) and
# add them to the README's GPU tables (benchmarks/report.py).
set -u
OUT=${OUT:-/tmp/gpu_figures}
DEADLINE=${DEADLINE:-520}
mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 FEDJAX_SIM_AUTOTUNE=0
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # jax and torch processes share the card
LOG=$OUT/log.txt
part() {  # part SECONDS NAME CMD...: CMD under min(SECONDS, time left), its output and time logged
  local cap=$1 name=$2 left=$((DEADLINE - SECONDS - 5))
  shift 2
  [ "$cap" -gt "$left" ] && cap=$left
  if [ "$cap" -lt 30 ]; then
    echo "=== $name: not run, ${left}s left before the deadline" | tee -a "$LOG"
    return
  fi
  echo "=== $name (cap ${cap}s) $(date +%T)" | tee -a "$LOG"
  local t0=$SECONDS
  timeout -k 5 "$cap" "$@" >>"$LOG" 2>&1
  echo "=== $name: rc $? in $((SECONDS - t0)) s" | tee -a "$LOG"
}
BENCH=(python3 -m fedjax_sim bench --mode vmap --no-flops --memory-budget-gb 60 --out "$OUT")
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv | tee -a "$LOG"
python3 -c "import jax, torch; print(jax.__version__, jax.devices(), torch.__version__)" \
  | tee -a "$LOG"
part 190 baselines "${BENCH[@]}" --suite baselines --workload W1 \
  --baseline-cohorts 10 100 1000 --torch-threads 1 --peer-max-cohort 100
part 60 hypergradient python3 benchmarks/hypergradient_cost.py --rounds 1000 --repeats 3 \
  --variants forward "value_and_grad remat=1" "lr grad forward" \
  --out "$OUT/hypergradient_cost.jsonl"
part 120 cohort-W1 "${BENCH[@]}" --suite cohort --cohort-workloads W1 --max-round-s 20
part 150 cohort-LR "${BENCH[@]}" --suite cohort --cohort-workloads LR --max-round-s 20
rm -f "$OUT"/*.png "$OUT"/*.md  # the tables and plots are regenerated here from the rows
tail -n 60 "$LOG"
