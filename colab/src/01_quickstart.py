# %% [markdown]
# # fedjax_sim quickstart: FedAvg in a minute
#
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/fedjax-sim/fedjax_sim/blob/main/colab/01_quickstart.ipynb)
#
# fedjax_sim simulates federated learning with **clients as an array axis**: every client's
# data is stacked on a leading axis, a cohort's local training is one `vmap`-ed (or
# `lax.map`-ed) compiled computation, and rounds run under `lax.scan`. This notebook trains
# FedAvg on scikit-learn's digits split over 100 clients (no download; under a minute on a
# free CPU runtime), shows the `Algorithm(init, step)` pattern, and writes a new algorithm in
# twenty lines.

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
NUM_CLIENTS = 100
NUM_ROUNDS = 30 if SMALL else 200
EVAL_EVERY = 10 if SMALL else 20
CLIPS = (0.3,) if SMALL else (0.1, 0.3)  # clipping norms compared at the end

# %% [markdown]
# ## Federated data
# `load_digits` partitions the 1797 digits over `NUM_CLIENTS` clients with Dirichlet(0.5)
# label skew and holds out 20% of each client's examples. The result is one padded array per
# field: `x [C, N_max, 64]`, `y [C, N_max]`, and the true `counts [C]` (padding rows are masked
# out of every loss).

# %%
import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np

import fedjax_sim
from fedjax_sim import CohortSpec, LocalSpec, data, fedavg, models, simulate

print("fedjax_sim", fedjax_sim.__version__, "| jax", jax.__version__, "|", jax.devices())
ds = data.load_digits(num_clients=NUM_CLIENTS)
train = ds.train
print("x", train.x.shape, "y", train.y.shape, "counts", train.counts.shape)

labels = np.zeros((NUM_CLIENTS, ds.num_classes))
for c in range(NUM_CLIENTS):
    n = int(train.counts[c])
    labels[c] = np.bincount(np.asarray(train.y[c, :n]), minlength=ds.num_classes)
fig, ax = plt.subplots(figsize=(10, 2.8))
bottom = np.zeros(NUM_CLIENTS)
for k in range(ds.num_classes):
    ax.bar(np.arange(NUM_CLIENTS), labels[:, k], bottom=bottom, width=1.0, label=str(k))
    bottom += labels[:, k]
ax.set(xlabel="client", ylabel="examples", title="Dirichlet(0.5) label skew: classes per client")
ax.legend(ncol=10, fontsize=7, loc="upper right")
plt.show()

# %% [markdown]
# ## The `Algorithm(init, step)` pattern
# An algorithm is a pair of pure functions, like an optax optimizer:
# `state = alg.init(params, key)` and `state, metrics = alg.step(state, data, key)` (one
# round). Every random draw derives from `(key, state.round)`, so a step is bit-reproducible,
# with or without `jit`.

# %%
model = models.mlp(ds.feature_shape, ds.num_classes)  # flax MLP + masked cross-entropy
alg = fedavg(
    model.loss,
    client_optimizer=0.1,  # SGD learning rate (or any optax optimizer)
    local=LocalSpec(steps=10, batch_size=16),  # 10 local steps of minibatch 16
    cohort=CohortSpec(size=10),  # 10 clients per round, uniformly
)
key = jax.random.key(0)
state = alg.init(model.init(key), key)
step = jax.jit(alg.step)
state1, metrics = step(state, train, key)
print({k: float(v) for k, v in metrics.items()})

again, _ = step(state, train, key)  # the same inputs give the same round, bit for bit
same = jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), state1.params, again.params)
assert all(jax.tree.leaves(same))

# %% [markdown]
# ## A full run
# `simulate` runs the rounds as compiled `lax.scan` chunks between evaluations, evaluating the
# global model on the central test set and on every client's held-out split.

# %%
history = simulate(
    alg,
    train,
    key,
    model=model,
    num_rounds=NUM_ROUNDS,
    test=ds.test,
    evaluation=fedjax_sim.EvalSpec(every=EVAL_EVERY),
    progress=False,
)
final = history.final()
print(f"after {history.num_rounds} rounds: test accuracy {final['test_accuracy']:.3f}")

rounds, acc = history.eval_series("test_accuracy")
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.2))
ax1.plot(history.metric("train_loss"))
ax1.set(xlabel="round", ylabel="train loss (cohort mean)", yscale="log")
ax2.plot(rounds, acc, "o-")
ax2.set(xlabel="round", ylabel="test accuracy")
plt.show()

# %% [markdown]
# ## A new algorithm from parts
# An algorithm is composed from parts (`fedjax_sim.algorithms.compose`): local-step hooks,
# client work, an aggregator, an optax server optimizer and a cohort; every named algorithm
# takes all of them. FedAvg whose client updates are clipped to norm `clip` before averaging
# (the core of differentially private FedAvg) is FedAvg with the `clipped` aggregator; the
# same line clips SCAFFOLD, FedProx or FedMIM.

# %%
from fedjax_sim.algorithms.aggregators import clipped


def clipped_fedavg(loss_fn, *, clip=1.0, **options):
    """FedAvg with client updates clipped to norm `clip` before averaging."""
    return fedjax_sim.fedavg(loss_fn, aggregator=clipped(clip), **options)


# %% [markdown]
# With a huge `clip` nothing is clipped and the new algorithm must be FedAvg exactly (same
# keys, same cohorts, same minibatches) -- a quick check that it is right. Then compare a few
# clipping norms.

# %%
spec = dict(local=LocalSpec(steps=10, batch_size=16), cohort=CohortSpec(size=10))
unclipped = clipped_fedavg(model.loss, clip=1e9, **spec)
s_new, _ = jax.jit(unclipped.step)(unclipped.init(model.init(key), key), train, key)
gap = jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))), s_new.params, state1.params)
print("largest difference to FedAvg after one round:", max(jax.tree.leaves(gap)))
assert max(jax.tree.leaves(gap)) < 1e-6

fig, ax = plt.subplots(figsize=(6, 3.5))
ax.plot(rounds, acc, "k--", label="FedAvg")
for clip in CLIPS:
    h = simulate(
        clipped_fedavg(model.loss, clip=clip, **spec), train, key, model=model,
        num_rounds=NUM_ROUNDS, test=ds.test, evaluation=fedjax_sim.EvalSpec(every=EVAL_EVERY),
        progress=False,
    )  # fmt: skip
    r, a = h.eval_series("test_accuracy")
    ax.plot(r, a, "o-", label=f"clip={clip}")
ax.set(xlabel="round", ylabel="test accuracy")
ax.legend()
plt.show()

# %% [markdown]
# ## Next
# - Register your algorithm with `fedjax_sim.algorithms.register("name", factory)` to run it
#   from the command line (`fedjax-sim run --algorithm name --hparams clip=0.3`); see the
#   guide *Write your own algorithm* in the documentation (`docs/`) for new hooks and
#   presets.
# - [02_async](https://colab.research.google.com/github/fedjax-sim/fedjax_sim/blob/main/colab/02_async.ipynb):
#   the asynchronous event engine (AREA vs FedBuff vs AS-FedAvg).
# - [03_throughput](https://colab.research.google.com/github/fedjax-sim/fedjax_sim/blob/main/colab/03_throughput.ipynb):
#   the benchmark suite on your runtime's accelerator.
# - [04_paper_algorithms](https://colab.research.google.com/github/fedjax-sim/fedjax_sim/blob/main/colab/04_paper_algorithms.ipynb):
#   FedMIM, AREA, EF-FedAvg, FGDRO and FedLPS against their baselines.
