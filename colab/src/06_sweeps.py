# %% [markdown]
# # Sweeps as one compiled program: step sizes x seeds, with confidence intervals
#
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/fedjax-sim/fedjax_sim/blob/main/colab/06_sweeps.ipynb)
#
# A hyper-parameter study needs many runs: every step size, several seeds each. `sweep`
# stacks all R = (grid points) x (seeds) runs on a leading **runs axis** and runs them as ONE
# compiled program: each round is a `vmap` over runs of the algorithm's pure `step`, inside
# the same `lax.scan` over rounds that `simulate` uses, and evaluations are vmapped too. The
# hyper-parameters are traced `[R]` arrays, so one compilation serves the whole grid. Runs
# are mapped in groups (`lax.map`) when they do not fit the memory budget.
#
# Here: a client step-size grid x 5 seeds for FedAvg and FedProx on digits (100 clients,
# Dirichlet(0.5) label skew), with mean +- 95 % confidence bands over seeds.

# %%
# Install fedjax_sim (skipped when it is already importable, e.g. in a local checkout).
import importlib.util

if importlib.util.find_spec("fedjax_sim") is None:
    %pip install -q "fedjax_sim @ git+https://github.com/fedjax-sim/fedjax_sim"

# %% [markdown]
# ## Parameters
# `SMALL = True` runs a reduced version (CI executes every notebook that way).

# %% tags=["parameters"]
SMALL = False

# %%
NUM_ROUNDS = 6 if SMALL else 150
EVAL_EVERY = 3 if SMALL else 10
SEEDS = 2 if SMALL else 5
STEP_SIZES = [0.03, 0.1] if SMALL else [0.01, 0.03, 0.1, 0.3]

# %%
import matplotlib.pyplot as plt
import optax

from fedjax_sim import EvalSpec
from fedjax_sim.algorithms import CohortSpec, LocalSpec, fedavg, fedprox
from fedjax_sim.data import load_digits
from fedjax_sim.models import mlp
from fedjax_sim.run.sweep import sweep

ds = load_digits(num_clients=100)
model = mlp(ds.feature_shape, ds.num_classes, hidden=(64,))
local, cohort = LocalSpec(steps=10, batch_size=16), CohortSpec(size=10)

# %% [markdown]
# ## The algorithm as a function of its hyper-parameters
# `make_algorithm(hparams)` is called inside the vmap with traced scalars. An optax
# transformation accepts a traced learning rate, so `optax.sgd(lr)` is the client optimizer.

# %%
FACTORIES = {
    "FedAvg": lambda hp: fedavg(
        model.loss, client_optimizer=optax.sgd(hp["client_lr"]), local=local, cohort=cohort
    ),
    "FedProx (mu=0.01)": lambda hp: fedprox(
        model.loss, client_optimizer=optax.sgd(hp["client_lr"]), mu=0.01, local=local,
        cohort=cohort,
    ),
}
results = {}
for name, make in FACTORIES.items():
    results[name] = sweep(
        make, ds.train, seeds=SEEDS, grid={"client_lr": STEP_SIZES}, model=model,
        num_rounds=NUM_ROUNDS, test=ds.test, evaluation=EvalSpec(every=EVAL_EVERY),
    )
    print(f"{name}: {len(results[name].runs)} runs in {results[name].meta['seconds']:.1f} s "
          f"({results[name].meta['runs_per_group']} runs per vmapped group)")

# %% [markdown]
# ## Mean and 95 % confidence interval over seeds
# `summary` gives, per grid point, the mean, standard deviation and Student-t 95 % CI of a
# metric at a round (default: the last evaluation); `best` picks the best grid point.

# %%
for name, res in results.items():
    print(name)
    print(res.table("test_accuracy"))
    best = res.best("test_accuracy")
    print(f"best: {best['config']} (mean {best['mean']:.4f})\n")

# %%
fig, axes = plt.subplots(1, 2, figsize=(12, 4), sharey=True)
for ax, (name, res) in zip(axes, results.items(), strict=True):
    res.plot(metric="test_accuracy", ax=ax)
    ax.set_title(f"{name}: test accuracy, mean and 95% CI over {SEEDS} seeds")
plt.tight_layout()
plt.show()

# %% [markdown]
# ## Per-run histories
# Every run keeps its own `History` (the same as `simulate` with that seed and step size,
# up to float round-off), and `save(out_dir)` writes the summary table, `best.json`, the
# band plot and all histories (`histories.json`, `runs.csv`). From the command line:
#
#     fedjax-sim sweep --seeds 5 --grid client_lr=0.01,0.03,0.1,0.3 --algorithm fedavg

# %%
paths = results["FedAvg"].save("sweep_fedavg")
print(sorted(paths))
print(results["FedAvg"].runs_csv().splitlines()[0])
