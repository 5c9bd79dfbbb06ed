# %% [markdown]
# # Personalized FL: each client's own model, evaluated on its own test split
#
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/fedjax-sim/fedjax_sim/blob/main/colab/08_personalization.ipynb)
#
# Under strong label skew one global model fits no client well. Personalized algorithms
# keep a model per client as a per-client row `[C, ...]` of the state, trained in the same
# vmapped round: **FedPer** keeps each client's last layer (the head) at home and averages
# the body; **Ditto** trains a full personal model `v_i` pulled towards the global one by
# `lam/2 ||v_i - x||^2`. `EvalSpec(personal=True)` evaluates every client's own model
# (`Algorithm.personalize`) on its own test split, beside the global model, and
# `simulate(unseen=...)` adapts clients never trained on by k local steps from the global
# model before testing them.
#
# Here: FedAvg vs FedPer vs Ditto vs IFCA on scikit-learn digits split over 50 clients with
# Dirichlet(0.1) label skew (most clients see two or three digits), 5 of them held out as
# unseen clients.

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
NUM_CLIENTS = 12 if SMALL else 50
UNSEEN = 2 if SMALL else 5
NUM_ROUNDS = 4 if SMALL else 100
EVAL_EVERY = 2 if SMALL else 10

# %%
import jax
import matplotlib.pyplot as plt
import numpy as np

from fedjax_sim import EvalSpec, simulate
from fedjax_sim.algorithms import CohortSpec, LocalSpec, ditto, fedavg, fedper, ifca
from fedjax_sim.data import load_digits
from fedjax_sim.data.unseen import held_out
from fedjax_sim.models import mlp

ds = load_digits(num_clients=NUM_CLIENTS, alpha=0.1)
train, unseen = held_out(ds.train, UNSEEN)  # unseen clients: never in a cohort
model = mlp(ds.feature_shape, ds.num_classes, hidden=(32,))
common = dict(
    client_optimizer=0.1, local=LocalSpec(steps=10, batch_size=16), cohort=CohortSpec(size=10)
)
y, counts = np.asarray(train.y), np.asarray(train.counts)
classes = [len(np.unique(y[i, : counts[i]])) for i in range(train.num_clients)]
print(f"{train.num_clients} trained clients, {unseen.num_clients} unseen; classes per client:",
      classes)

# %% [markdown]
# ## Four runs, each evaluated per client
# `personal=True` adds `personal_accuracy_mean / _p10 / _worst` (each client's own model) to
# the evaluation rows, beside `client_accuracy_*` (the global model on the same test
# splits) and `unseen_accuracy_*` (unseen clients after `unseen_steps` local steps).
# FedAvg has no `personalize`: its personal models are the global one. IFCA (Ghosh et al.
# 2020) keeps K = 2 cluster models; each client trains and keeps the one that fits its data
# best, and the "global" model is the cluster most clients chose in the latest round.

# %%
ALGORITHMS = {
    "FedAvg": fedavg(model.loss, **common),
    "FedPer": fedper(model.loss, num_clients=train.num_clients, **common),
    "Ditto": ditto(model.loss, num_clients=train.num_clients, lam=0.1, **common),
    "IFCA": ifca(model.loss, clusters=2, cluster_init=model.init, **common),
}
evaluation = EvalSpec(every=EVAL_EVERY, personal=True, unseen_steps=5, unseen_lr=0.1)
histories = {
    name: simulate(
        alg, train, jax.random.key(0), model=model, num_rounds=NUM_ROUNDS, test=ds.test,
        evaluation=evaluation, unseen=unseen, progress=False,
    )
    for name, alg in ALGORITHMS.items()
}
print(f"{'':8s} {'global mean':>12s} {'personal mean':>14s} {'p10':>6s} {'worst':>6s} "
      f"{'unseen':>7s}")
for name, h in histories.items():
    f = h.final()
    print(f"{name:8s} {f['client_accuracy_mean']:12.3f} {f['personal_accuracy_mean']:14.3f} "
          f"{f['personal_accuracy_p10']:6.3f} {f['personal_accuracy_worst']:6.3f} "
          f"{f['unseen_accuracy_mean']:7.3f}")

# %% [markdown]
# ## Personal vs global accuracy over rounds, and per client
# The per-client accuracies of every evaluation are in `History.client_evals`
# (`client_series(name)` -> rounds, `[E, C]` values; NaN for a client without test data).

# %%
fig, axes = plt.subplots(1, 2, figsize=(12, 4))
for name, h in histories.items():
    r, personal = h.eval_series("personal_accuracy_mean")
    line, = axes[0].plot(r, personal, "o-", ms=3, label=f"{name} personal")
    axes[0].plot(*h.eval_series("client_accuracy_mean"), "--", color=line.get_color(),
                 label=f"{name} global")
    _, per_client = h.client_series("personal_accuracy")
    axes[1].hist(per_client[-1][~np.isnan(per_client[-1])], bins=10, range=(0, 1),
                 alpha=0.5, label=name)
axes[0].set(xlabel="round", ylabel="mean client test accuracy", ylim=(0, 1),
            title="each client's own model (solid) vs the global model (dashed)")
axes[0].legend(fontsize=8)
axes[1].set(xlabel="client test accuracy (personal model)", ylabel="clients",
            title="per-client distribution at the last evaluation")
axes[1].legend()
plt.tight_layout()
plt.show()

# %% [markdown]
# From the command line the same evaluation is `--personal-eval` (and `--unseen-clients N
# --unseen-steps k`); the summary line then reports the personal models' mean, 10th
# percentile and worst accuracy:
#
#     fedjax-sim run --algorithm ditto --partition dirichlet --alpha 0.1 --personal-eval --unseen-clients 5
