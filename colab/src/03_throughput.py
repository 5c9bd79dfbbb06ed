# %% [markdown]
# # Throughput: the benchmark suite on your runtime
#
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/fedjax-sim/fedjax_sim/blob/main/colab/03_throughput.ipynb)
#
# How fast is a federated round when clients are an array axis? This notebook runs
# `fedjax_sim.app.bench` -- the suites behind `fedjax-sim bench` -- on whatever accelerator the
# runtime has (in Colab: *Runtime > Change runtime type > GPU or TPU*; the code is the same on
# CPU). It sweeps the cohort size M for two workloads and compares one round against the
# per-client Python loop that simulators built on a deep-learning framework run.
#
# Each measurement reports compile time, seconds per round (median of `repeats` rounds after
# the compiling one), client-steps per second, peak memory and, with FLOP counting, the
# fraction of the measured matmul peak (roofline ratio). Configurations that would not fit
# the memory budget, or that are predicted to take longer than `max_round_s` per round, are
# skipped with the reason.

# %%
# Install fedjax_sim (skipped when it is already importable, e.g. in a local checkout).
import importlib.util

if importlib.util.find_spec("fedjax_sim") is None:
    %pip install -q "fedjax_sim @ git+https://github.com/fedjax-sim/fedjax_sim"

# %% [markdown]
# ## Parameters
# `SMALL = True` runs tiny workloads in this process (CI executes every notebook that way);
# the full version takes several minutes on a GPU runtime and longer on CPU.

# %% tags=["parameters"]
SMALL = False

# %%
if SMALL:
    WORKLOADS = ("tiny-mlp",)  # presets of fedjax_sim.app.bench.workloads.PRESETS
    COHORTS = (2, 8)
    OPTIONS = dict(mode="map", isolate=False, flops=False, peak_n=256, torch_threads=1)
else:
    WORKLOADS = ("LR", "W1")  # logistic regression; MLP 784-200-200-10, 10 steps x batch 32
    COHORTS = (10, 100, 1_000, 10_000, 100_000, 1_000_000)
    # isolate: every measurement in its own process (its own peak memory); mode "preset"
    # fits the client map (vmap, or lax.map chunks) to the memory budget per cohort size
    OPTIONS = dict(mode="preset", isolate=True, flops=True, max_round_s=30.0)

# %%
import tempfile

import matplotlib.pyplot as plt
from IPython.display import Markdown, display

from fedjax_sim.app.bench import BenchConfig, machine_info, suites
from fedjax_sim.app.bench.report import markdown

info = machine_info()
print(f"{info['device_kind']} ({info['backend']}) x {info['device_count']}, jax {info['jax']}")
OUT = tempfile.mkdtemp(prefix="fedjax_bench_")  # <suite>.jsonl / .md / .png land here

# %% [markdown]
# ## Cohort-size sweep
# Full participation, M clients per round, each running the workload's local steps. The
# sweep stops at the first cohort that does not fit the memory budget or is predicted to
# exceed `max_round_s`.

# %%
cfg = BenchConfig(
    suite=("cohort",), cohorts=COHORTS, cohort_workloads=WORKLOADS, plots=False, out=OUT, **OPTIONS
)
cohort_rows = suites.run(cfg, log=lambda line: None)["cohort"]
display(Markdown(markdown(cohort_rows)))

# %%
measured = [r for r in cohort_rows if r["kind"] == "round"]
assert measured, "no cohort size could be measured"
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4))
for name in WORKLOADS:
    rows = [r for r in measured if r["workload"]["name"] == name]
    m = [r["clients"] for r in rows]
    ax1.loglog(m, [r["round_s_median"] for r in rows], "o-", label=name)
    ax2.loglog(m, [r["client_steps_per_s"] for r in rows], "o-", label=name)
ax1.set(xlabel="cohort size M (clients per round)", ylabel="seconds per round (median)")
ax2.set(xlabel="cohort size M (clients per round)", ylabel="client-steps per second")
for ax in (ax1, ax2):
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
fig.suptitle(f"FedAvg round throughput on {info['device_kind']}")
plt.show()

# %% [markdown]
# Seconds per round grow sub-linearly in M while the device is not saturated (small cohorts
# are latency-bound: the cost is per step, not per client), then linearly; client-steps per
# second level off at the device's throughput.
#
# ## Against a per-client loop
# The `baselines` suite runs the same round as (i) our compiled round, (ii) a Python loop
# over clients calling a jitted per-client update with a running weighted sum, and (iii) a
# PyTorch per-client loop when `torch` is installed (skipped otherwise).

# %%
main_workload = WORKLOADS[-1]
cfg = BenchConfig(
    suite=("baselines",),
    workload=main_workload,
    clients=None if SMALL else 100,
    plots=False,
    out=OUT,
    **OPTIONS,
)
baseline_rows = suites.run(cfg, log=lambda line: None)["baselines"]
display(Markdown(markdown(baseline_rows)))
rounds = [r for r in baseline_rows if r["kind"] == "round"]
fig, ax = plt.subplots(figsize=(9, 0.5 * len(rounds) + 1.5))
ax.barh([r["label"] for r in rounds], [r["round_s_median"] for r in rounds])
ax.invert_yaxis()
ax.set(xscale="log", xlabel="seconds per round (median, log scale)")
ax.set_title(f"one round of {main_workload}, {rounds[0]['clients']} clients")
plt.show()

# %% [markdown]
# `fedjax-sim bench --suite cohort baselines modes steps width algorithms memory` runs these
# and more suites from the command line (`--help` lists the options); `benchmarks/README.md`
# records the numbers measured on the project's machines.
