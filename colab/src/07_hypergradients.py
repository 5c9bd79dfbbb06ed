# %% [markdown]
# # Hypergradients: differentiating through federated rounds
#
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/fedjax-sim/fedjax_sim/blob/main/colab/07_hypergradients.ipynb)
#
# A whole federated run is one pure JAX program: `lax.scan` over rounds of a jitted `step`,
# every random draw (cohorts, minibatches) a function of the key. So the validation loss
# after T rounds is a deterministic, differentiable function of every continuous
# hyper-parameter and of the initial model. `differentiable_run` gives its value and
# gradient; `hypergradient_tuner` uses that gradient online to tune the client and server
# learning rates during training.
#
# Here: FedAvg on digits (100 clients, Dirichlet(0.5) label skew). (1) The gradient of the
# validation loss w.r.t. a per-round learning-rate schedule. (2) The tuner started from a
# learning rate 10x too small and 10x too large vs a small grid of fixed learning rates.

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
NUM_ROUNDS = 6 if SMALL else 100
GRID = [0.03, 0.3] if SMALL else [0.01, 0.03, 0.1, 0.3, 1.0, 3.0]
GOOD_LR = 0.1  # the tuners start 10x below and above it
WINDOW = 1 if SMALL else 10  # rounds per hypergradient (longer: less short-horizon bias)

# %%
import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt

from fedjax_sim.algorithms import CohortSpec, LocalSpec, fedavg
from fedjax_sim.data import ArrayData, load_digits
from fedjax_sim.models import mlp
from fedjax_sim.run.differentiate import (
    array_schedule,
    central_loss,
    differentiable_run,
    initial_params,
)
from fedjax_sim.run.simulate import evaluate_central
from fedjax_sim.run.tuner import TunerSpec, hypergradient_tuner

ds = load_digits(num_clients=100)
model = mlp(ds.feature_shape, ds.num_classes, hidden=(64,))
local, cohort = LocalSpec(steps=10, batch_size=16), CohortSpec(size=10)
# the central held-out set split in two: validation (the objective) and test (reported)
val = ArrayData(x=ds.test.x[0::2], y=ds.test.y[0::2])
test = ArrayData(x=ds.test.x[1::2], y=ds.test.y[1::2])
key = jax.random.key(0)
params = initial_params(model, key)  # the initial model `simulate` would use

# %% [markdown]
# ## The gradient w.r.t. a per-round learning-rate schedule
# `make_algorithm(hparams)` is called inside the differentiated function with traced values.
# `array_schedule(lrs)` turns a `[T]` array into the schedule `round -> lrs[round]`; the
# gradient has one entry per round. `remat="sqrt"` checkpoints chunks of sqrt(T) rounds, so
# memory grows like sqrt(T) instead of T.

# %%
def make_scheduled(hp):
    return fedavg(model.loss, client_optimizer=array_schedule(hp["lrs"]), local=local,
                  cohort=cohort)


run = differentiable_run(make_scheduled, central_loss(model, val), num_rounds=NUM_ROUNDS,
                         remat="sqrt")
lrs = jnp.full(NUM_ROUNDS, GOOD_LR)
loss, grads = run.value_and_grad({"lrs": lrs}, params, ds.train, key)
print(f"validation loss after {NUM_ROUNDS} rounds: {float(loss):.4f}")
print("d loss / d lr_t, first rounds:", grads.hparams["lrs"][:5])
print("|d loss / d x_0| (the initial model):",
      float(jnp.sqrt(sum(jnp.sum(g**2) for g in jax.tree.leaves(grads.params)))))

# %% [markdown]
# ## The tuner vs a grid of fixed learning rates
# A grid point is the run with a fixed client learning rate: `run.final_state` is compiled
# once for every value (the learning rate is an input, not a constant). The tuner takes an
# Adam step on the log of the (client, server) learning rates every `WINDOW` rounds, along the
# hypergradient of the validation loss through the last `WINDOW` rounds; two tuners, one 10x
# too small and one 10x too large, run at once (`tuner.sweep`: starts x seeds through the
# sweep engine). A window whose validation loss rises by more than 1 % over its start is
# undone and the learning rates halved (`TunerSpec.tolerance`, a "bold driver" rule): a
# 10x too large learning rate can kill the ReLU network within one window. A one-round
# window is biased toward small learning rates (the short-horizon bias): see
# `experiments/README.md`.

# %%
def make(hp):
    return fedavg(model.loss, client_optimizer=hp["client_lr"],
                  server_optimizer=hp["server_lr"], local=local, cohort=cohort)


def accuracy(p):
    return float(evaluate_central(model, p, test)["test_accuracy"])


fixed = differentiable_run(make, central_loss(model, val), num_rounds=NUM_ROUNDS)
grid_acc = {}
for lr in GRID:
    state = fixed.final_state({"client_lr": lr, "server_lr": 1.0}, params, ds.train, key)
    grid_acc[lr] = accuracy(state.params)
    print(f"grid client_lr={lr:g}: test accuracy {grid_acc[lr]:.4f}")

tuner = hypergradient_tuner(make, central_loss(model, val), num_rounds=NUM_ROUNDS,
                            spec=TunerSpec(step_size=0.3, window=WINDOW))
starts = [GOOD_LR / 10, GOOD_LR * 10]
# seed 0: run key jax.random.key(0) and the initial model `params` above, as the grid's
runs, result = tuner.sweep({"client_lr": starts, "server_lr": [1.0]}, ds.train, seeds=[0],
                           model=model)
for r, start in enumerate(starts):
    final = jax.tree.map(lambda a, r=r: a[r], result.state.params)
    print(f"tuner from client_lr={start:g}: test accuracy {accuracy(final):.4f}, "
          f"final client_lr {float(result.hparams['client_lr'][r]):.3g}, "
          f"server_lr {float(result.hparams['server_lr'][r]):.3g}, "
          f"windows rejected {int(result.trace['rejected'][r].sum())}")
best = max(grid_acc, key=grid_acc.get)
print(f"best grid point: client_lr={best:g} ({grid_acc[best]:.4f}); the grid ran "
      f"{len(GRID)} runs, the tuners one each (plus one backward pass per round)")

# %%
fig, axes = plt.subplots(1, 2, figsize=(12, 4))
axes[0].plot(jnp.arange(NUM_ROUNDS), grads.hparams["lrs"])
axes[0].axhline(0, color="gray", lw=0.5)
axes[0].set(title="d validation loss / d lr_t", xlabel="round t")
effective = result.trace["hparams"]["client_lr"] * result.trace["hparams"]["server_lr"]
for r, start in enumerate(starts):
    axes[1].plot(effective[r], label=f"tuner from {start:g}")
for lr in GRID:
    axes[1].axhline(lr, color="gray", lw=0.5, ls=":")
axes[1].set(yscale="log", title="client lr x server lr (grid dotted)",
            xlabel=f"update (every {WINDOW} rounds)")
axes[1].legend()
plt.tight_layout()
plt.show()
