# %% [markdown]
# # The papers' algorithms against their baselines
#
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/fedjax-sim/fedjax_sim/blob/main/colab/04_paper_algorithms.ipynb)
#
# One short run of each paper's algorithm implemented in fedjax_sim against the baselines the
# paper compares with, on small offline data (scikit-learn's digits and a synthetic
# shifted-minority problem):
#
# 1. **FedMIM** (multi-step inertial momentum) vs FedAvg, FedCM, SCAFFOLD, FedDyn, FedSAM;
# 2. **AREA** (asynchronous exact averaging) vs FedBuff and MIFA on the event engine;
# 3. **EF-FedAvg** (top-k compression with error feedback, step-size schedules) vs
#    full-precision FedAvg;
# 4. **FGDRO** (federated group DRO, CVaR and KL) vs FedAvg on the worst client;
# 5. **FedLPS** (label-similarity graph, local perturbation) vs FedAvg on unseen clients.
#
# These are short demonstrations at toy scale, not reproductions: `experiments/` holds the
# scripts that compare with the papers' tables. Every algorithm is an `Algorithm(init, step)`
# from the registry (`fedjax-sim list`), and every run below is one compiled `lax.scan`.

# %%
# Install fedjax_sim (skipped when it is already importable, e.g. in a local checkout).
import importlib.util

if importlib.util.find_spec("fedjax_sim") is None:
    %pip install -q "fedjax_sim @ git+https://github.com/fedjax-sim/fedjax_sim"

# %% [markdown]
# ## Parameters
# `SMALL = True` runs a few rounds of each (CI executes every notebook that way).

# %% tags=["parameters"]
SMALL = False

# %%
ROUNDS = 4 if SMALL else 150  # synchronous rounds (sections 1, 3, 5)
EVENTS = 40 if SMALL else 3000  # asynchronous event iterations (section 2)
DRO_ROUNDS = 4 if SMALL else 60  # section 4

# %%
import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np

from fedjax_sim import ClientMap, CohortSpec, LocalSpec, data, models
from fedjax_sim.algorithms import (
    area,
    ef_fedavg,
    fedavg,
    fedbuff,
    fedcm,
    feddyn,
    fedlps,
    fedmim,
    fedsam,
    fgdro_cvar,
    fgdro_kl,
    fp_fedavg,
    mifa,
    scaffold,
)

KEY = jax.random.key(0)
# small cohorts: the whole cohort as one batched computation (ClientMap("map", 8) for big ones)
VMAP = ClientMap("vmap")


def run(alg, train, params, steps, measure):
    """`steps` steps of `alg` from `params` under one compiled `lax.scan`; returns the stacked
    `measure(state, metrics)` of every step as NumPy arrays."""

    @jax.jit
    def go(params):
        def body(state, _):
            state, metrics = alg.step(state, train, KEY)
            return state, measure(state, metrics)

        return jax.lax.scan(body, alg.init(params, KEY), None, length=steps)[1]

    return jax.tree.map(np.asarray, go(params))


def accuracy_on(model, test):
    """Accuracy of the global model on a central test set, as a `measure` for `run`."""
    return lambda state, metrics: jnp.mean(
        jnp.argmax(model.apply(state.params, test.x), -1) == test.y
    )


# %% [markdown]
# ## 1. FedMIM vs momentum and drift-correction baselines
# Digits over 50 clients with Dirichlet(0.3) label skew, 10 clients per round, 10 local SGD
# steps of minibatch 16, an MLP with one hidden layer of 64 units. FedMIM's inertial weights
# are the paper's best, alpha = (0.6, 0.3), beta = (0.9, 0.1).

# %%
ds = data.load_digits(num_clients=50, alpha=0.3)
mlp = models.mlp(ds.feature_shape, ds.num_classes, hidden=(64,))
C = ds.train.num_clients
sync = dict(local=LocalSpec(steps=10, batch_size=16), cohort=CohortSpec(size=10), client_map=VMAP)
algorithms = {
    "FedMIM": fedmim(mlp.loss, client_optimizer=0.1, **sync),
    "FedAvg": fedavg(mlp.loss, client_optimizer=0.1, **sync),
    "FedCM": fedcm(mlp.loss, client_optimizer=0.1, **sync),
    "SCAFFOLD": scaffold(mlp.loss, num_clients=C, client_optimizer=0.1, **sync),
    "FedDyn": feddyn(mlp.loss, num_clients=C, client_optimizer=0.1, **sync),
    "FedSAM": fedsam(mlp.loss, client_optimizer=0.1, **sync),
}
params0 = mlp.init(KEY)
fig, ax = plt.subplots(figsize=(7, 4))
for name, alg in algorithms.items():
    acc = run(alg, ds.train, params0, ROUNDS, accuracy_on(mlp, ds.test))
    ax.plot(np.arange(1, ROUNDS + 1), acc, label=f"{name} ({acc[-1]:.3f})")
ax.set(xlabel="round", ylabel="test accuracy", title="FedMIM and its baselines (digits)")
ax.legend()
plt.show()

# %% [markdown]
# ## 2. AREA vs FedBuff and MIFA (asynchronous)
# The same digits clients with Poisson clocks of rates N(10, 3); at each event the firing
# client delivers 5 local steps computed from the model it last read; the server aggregates
# every 4 deliveries. Logistic regression, the same client learning rate 0.5 for all three.

# %%
from fedjax_sim.algorithms.events import Aggregation, Arrivals, Events, normal_rates

logistic = models.logistic_regression(ds.feature_shape, ds.num_classes)
rates = normal_rates(C, 10.0, 3.0, minimum=0.1, seed=0)
events = Events(Arrivals.categorical(rates), Aggregation.every(4))
async_kw = dict(events=events, client_optimizer=0.5, local=LocalSpec(steps=5, batch_size=16))
algorithms = {
    "AREA": area(logistic.loss, **async_kw),
    "FedBuff": fedbuff(logistic.loss, **async_kw),
    "MIFA": mifa(logistic.loss, **async_kw),
}
acc_of = accuracy_on(logistic, ds.test)
fig, ax = plt.subplots(figsize=(7, 4))
for name, alg in algorithms.items():
    acc, t = run(alg, ds.train, logistic.init(KEY), EVENTS, lambda s, m: (acc_of(s, m), m["t"]))
    ax.plot(t, acc, label=f"{name} ({acc[-1]:.3f})")
ax.set(xlabel="simulated time", ylabel="test accuracy", title="asynchronous methods (digits)")
ax.legend()
plt.show()

# %% [markdown]
# AREA's server model is the average of every client's latest contribution, so one delivery
# moves it by 1/n of that client's progress: with the same step size it advances more slowly
# in time than FedBuff and MIFA on this easy problem. Its point is exactness when clients run
# at different speeds (`02_async.ipynb`: the error of FedBuff and AS-FedAvg stalls at the
# frequency-weighted optimum, AREA's keeps falling); `experiments/area_logistic.py` tunes
# each method's step size on a grid, as the paper does.

# %% [markdown]
# ## 3. Compressed uploads with error feedback
# Beikmohammadi et al.: FedAvg as a fixed-point iteration with step size `s_k` (here a
# constant 1.0 split over T = 10 local steps), full participation; EF-FedAvg uploads only
# the largest 1% (or 10%) of each update's entries and keeps the rest in a per-client error
# memory that is added to the next update. Accuracy against the bytes the clients uploaded:

# %%
fp_kw = dict(client_optimizer=1.0, local=LocalSpec(steps=10, batch_size=16), client_map=VMAP)
algorithms = {
    "FedAvg (full precision)": fp_fedavg(mlp.loss, **fp_kw),
    "EF-FedAvg top-10%": ef_fedavg(mlp.loss, num_clients=C, compression_fraction=0.1, **fp_kw),
    "EF-FedAvg top-1%": ef_fedavg(mlp.loss, num_clients=C, compression_fraction=0.01, **fp_kw),
}
acc_of = accuracy_on(mlp, ds.test)
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4))
for name, alg in algorithms.items():
    acc, up = run(alg, ds.train, params0, ROUNDS, lambda s, m: (acc_of(s, m), m["bytes_up"]))
    ax1.plot(np.arange(1, ROUNDS + 1), acc, label=f"{name} ({acc[-1]:.3f})")
    ax2.plot(np.cumsum(up) / 2**20, acc, label=name)
ax1.set(xlabel="round", ylabel="test accuracy")
ax2.set(xlabel="uploaded MiB (all clients)", ylabel="test accuracy", xscale="log")
ax1.legend()
fig.suptitle("error feedback: top-k uploads (digits, MLP)")
plt.show()

# %% [markdown]
# ## 4. Federated group DRO: the worst client
# Ten clients: nine share one linear rule, the last one is shifted and rotated, so no single
# linear model fits all. FedAvg minimises the average loss and leaves the minority client
# behind; FGDRO-CVaR minimises the mean of the K = 2 largest client losses, FGDRO-KL the
# soft maximum `lambda log mean exp(l_i / lambda)` (lambda = 0.5). 32 local steps per round.

# %%
from fedjax_sim.data.builtin import load_shifted_minority
from fedjax_sim.run.simulate import client_stats

shifted = load_shifted_minority(num_clients=10, examples_per_client=100)
lr_model = models.logistic_regression(shifted.feature_shape, shifted.num_classes)
dro_local = LocalSpec(steps=32, batch_size=32)
dro_kw = dict(
    num_clients=10, client_optimizer=0.1, local=dro_local, client_map=VMAP, client_metrics=False
)
algorithms = {
    "FedAvg": fedavg(
        lr_model.loss,
        client_optimizer=0.1,
        local=dro_local,
        cohort=CohortSpec(weighting="uniform"),
        client_map=VMAP,
    ),
    "FGDRO-CVaR (K=2)": fgdro_cvar(lr_model.loss, k=2, **dro_kw),
    "FGDRO-KL (lambda=0.5)": fgdro_kl(lr_model.loss, temperature=0.5, **dro_kw),
}
train = shifted.train


def client_losses(state, metrics):
    s = client_stats(lr_model, state.params, train.x, train.y, train.counts, VMAP)
    return s["loss"] / jnp.maximum(s["count"], 1)  # [10] training loss of each client


fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4))
for name, alg in algorithms.items():
    losses = run(alg, train, lr_model.init(KEY), DRO_ROUNDS, client_losses)  # [rounds, 10]
    (line,) = ax1.plot(losses.max(1), label=f"{name} ({losses[-1].max():.3f})")
    ax2.plot(losses.mean(1), color=line.get_color(), label=name)
ax1.set(xlabel="round", ylabel="worst client's training loss", title="worst client")
ax2.set(xlabel="round", ylabel="mean client training loss", title="average client")
ax1.legend()
plt.show()

# %% [markdown]
# ## 5. FedLPS on unseen clients
# Buttaci & Calafiore's protocol: the digits pool is split 80:20, and the training and the
# test part are each partitioned into 20 clients by the Hsu et al. procedure with class
# imbalance a = 10 and size imbalance b = 1; the test clients are never trained on. FedLPS
# computes a label-similarity graph between the training clients once, then each client's
# local gradients are taken at `beta w + (1 - beta) u_i`, a mix of its model and its graph
# neighbours'. FedAvg aggregates with the same graph weights. Metrics of the paper: pooled
# accuracy over the unseen test clients, and the number of rounds to reach a target accuracy.

# %%
from sklearn.datasets import load_digits

from fedjax_sim.algorithms.similarity import graph_from_data
from fedjax_sim.data.unseen import federate_unseen, split_pool
from fedjax_sim.run.convergence import rounds_to_target

bunch = load_digits()
pool = split_pool(bunch.data.astype(np.float32) / 16.0, bunch.target.astype(np.int32), seed=0)
unseen = federate_unseen(
    *pool, num_clients=20, partitioner="hsu", num_classes=10, class_imbalance=10.0,
    data_imbalance=1.0,
)  # fmt: skip
graph = graph_from_data(unseen.train)
lps_model = models.logistic_regression(unseen.feature_shape, unseen.num_classes)
lps_local = LocalSpec(epochs=2, batch_size=16, sampling="epoch")
lps_kw = dict(client_optimizer=5e-3, local=lps_local, client_map=VMAP)
algorithms = {
    "FedAvg": fedavg(lps_model.loss, cohort=CohortSpec(client_weights=graph.degrees), **lps_kw),
    "FedLPS beta=0.5": fedlps(lps_model.loss, beta=0.5, graph=graph, **lps_kw),
    "FedLPS beta=0.1": fedlps(lps_model.loss, beta=0.1, graph=graph, **lps_kw),
}
TARGET = 0.85
fig, ax = plt.subplots(figsize=(7, 4))
for name, alg in algorithms.items():
    acc = run(alg, unseen.train, lps_model.init(KEY), ROUNDS, accuracy_on(lps_model, unseen.test))
    reached = rounds_to_target(np.arange(1, ROUNDS + 1), acc, TARGET)
    print(f"{name:16s} final accuracy {acc[-1]:.3f}, rounds to {TARGET}: {reached}")
    ax.plot(np.arange(1, ROUNDS + 1), acc, label=f"{name} ({acc[-1]:.3f})")
ax.set(xlabel="round", ylabel="pooled accuracy, unseen clients", title="FedLPS (digits)")
ax.legend()
plt.show()
