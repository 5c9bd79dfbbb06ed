# %% [markdown]
# # Asynchronous federated learning: AREA vs FedBuff vs AS-FedAvg
#
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/fedjax-sim/fedjax_sim/blob/main/colab/02_async.ipynb)
#
# In asynchronous FL each client works at its own speed and the server updates whenever
# results arrive. fedjax_sim simulates this with an **event engine** (`fedjax_sim.algorithms.events`):
# clients have random clocks, one `step` of an asynchronous algorithm is one event iteration
# (who fires, does the server aggregate, how much simulated time passed), and a run is a
# `lax.scan` over iterations -- still one compiled program, with cost proportional to the
# clients that fire, not to all clients.
#
# The test bed is the AREA paper's heterogeneous quadratic: client i holds
# `f_i(x) = (1/2)(i x - 1)^2`, i = 1..50, so every client has a different optimum `1/i`,
# and the clients' clock rates are drawn from N(10, 3). Fast clients deliver more often, so
# methods that apply every delivery as it comes (AS-FedAvg, FedBuff) drift towards the fast
# clients' optima; AREA keeps one stored contribution per client and averages them exactly.

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
NUM_CLIENTS = 50
HORIZON = 1.5 if SMALL else 8.0  # simulated time
SEEDS = 2 if SMALL else 16  # independent event sequences, run side by side (vmap)

# %%
import jax

jax.config.update("jax_enable_x64", True)  # errors go down to 1e-30: use float64

# %%
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
import optax

from fedjax_sim.algorithms import area, as_fedavg, fedbuff
from fedjax_sim.algorithms.core import LocalSpec
from fedjax_sim.algorithms.events import Aggregation, Arrivals, Events, normal_rates, staleness_bins
from fedjax_sim.data import toy_quadratic
from fedjax_sim.models import linear_regression

problem = toy_quadratic(NUM_CLIENTS)  # one example per client: feature i, target 1
x_star = float(problem.optimum()[0])  # minimiser of the average of the f_i
rates = normal_rates(NUM_CLIENTS, 10.0, 3.0, minimum=0.1, seed=0)  # lambda_i, events / time
x_fast = float(problem.optimum(weights=rates / rates.sum())[0])  # minimiser of sum lambda_i f_i
print(f"x* = {x_star:.6f}; rate-weighted minimiser {x_fast:.6f}")

fig, ax = plt.subplots(figsize=(7, 3))
ax.bar(np.arange(1, NUM_CLIENTS + 1), rates)
ax.set(xlabel="client i (its optimum is 1/i)", ylabel="clock rate lambda_i")
plt.show()

# %% [markdown]
# ## The event engine on its own
# `Events(arrivals, aggregation)` is a pure state machine. `Arrivals.categorical(rates)`
# simulates independent Poisson clocks exactly (one event per iteration, exponential time
# steps); `Aggregation.every(4)` lets the server aggregate after every 4 deliveries. Other
# choices: `Arrivals.bernoulli(p)` / `Arrivals.poisson(rates, dt=...)` (many clients per
# iteration), availability windows, a timer or random server events.

# %%
events = Events(Arrivals.categorical(rates), Aggregation.every(4))
key = jax.random.key(0)
es = events.init(key)
for k in range(8):
    tick = events.draw(es, jax.random.fold_in(key, k))
    fired = [int(i) for i in tick.ids[tick.active]]
    print(f"t = {float(tick.t):.4f}: client {fired} delivers; aggregate: {bool(tick.aggregate)}")
    es = events.advance(es, tick)

# %% [markdown]
# ## AREA vs FedBuff vs AS-FedAvg
# Each algorithm is a factory like any other (`area(loss, events=..., client_optimizer=...)`);
# one step is one event. We scan `steps` events for `SEEDS` event sequences at once and record
# the normalised error `|x - x*|^2 / |x*|^2` and the simulated time. Step sizes: the best of
# the grid 1e-6..1e-3 for each method (`experiments/area_quadratic.py`).

# %%
loss = linear_regression(1).loss
exact = LocalSpec(steps=1, sampling="full")  # one exact gradient step per event
methods = {
    "AREA": area(loss, events=events, client_optimizer=optax.sgd(1e-3), local=exact),
    "FedBuff": fedbuff(loss, events=events, client_optimizer=optax.sgd(1e-4), local=exact),
    "AS-FedAvg": as_fedavg(loss, events=events, client_optimizer=optax.sgd(1e-5), local=exact),
}
steps = int(1.3 * HORIZON * rates.sum()) + 100  # enough events to cover HORIZON


def run(alg, keys):
    """`(error [S, steps], time [S, steps], staleness histogram [S, steps, bins])`."""

    def one(key):
        state = alg.init({"w": jnp.zeros(1)}, key)

        def body(s, _):
            s, m = alg.step(s, problem.data, key)
            err = (s.params["w"][0] - x_star) ** 2 / x_star**2
            return s, (err, m["t"], m["tau_hist"])

        return jax.lax.scan(body, state, None, length=steps)[1]

    return jax.jit(jax.vmap(one))(keys)


keys = jax.random.split(jax.random.key(1), SEEDS)
grid = np.linspace(0.0, HORIZON, 300)
curves, hists = {}, {}
for name, alg in methods.items():
    err, t, hist = (np.asarray(a) for a in run(alg, keys))
    idx = np.stack([np.searchsorted(t[s], grid, side="right") - 1 for s in range(SEEDS)])
    curves[name] = np.where(idx >= 0, np.take_along_axis(err, np.maximum(idx, 0), 1), 1.0)
    hists[name] = hist.sum(axis=(0, 1))
    print(f"{name:10s} final error (median over seeds): {np.median(curves[name][:, -1]):.3g}")

# %%
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4))
for name, c in curves.items():
    (line,) = ax1.semilogy(grid, np.median(c, 0), label=name)
    ax1.fill_between(grid, c.min(0), c.max(0), color=line.get_color(), alpha=0.15)
ax1.axhline((x_fast - x_star) ** 2 / x_star**2, color="gray", ls=":", label="rate-weighted optimum")
ax1.set(xlabel="simulated time", ylabel="|x - x*|^2 / |x*|^2", ylim=(1e-30, 10))
ax1.set_title(f"median and range over {SEEDS} event sequences")
ax1.legend()
h = hists["AREA"]  # the same for all three: same event sequences, same aggregation rule
assert all(np.array_equal(h, other) for other in hists.values())
ax2.bar(np.arange(len(h)), h / h.sum())
ax2.set_xticks(np.arange(len(h)), staleness_bins(len(h)))
ax2.set(xlabel="staleness of a delivery (server versions)", ylabel="fraction of deliveries")
ax2.set_title("staleness (identical for the three methods)")
plt.show()

# %% [markdown]
# AREA converges to the exact optimum (its error keeps falling to round-off), while FedBuff
# and AS-FedAvg stall near the optimum of the frequency-weighted objective `sum_i lambda_i
# f_i` (the dotted line): clients that fire more often pull the model towards their own
# optimum. All three see the same event sequences (same keys), so the difference is the
# aggregation rule alone. More: `fedjax_sim.algorithms.mifa`, `s_fedavg` (synchronous rounds
# that last as long as the slowest client), `fedasync`; `experiments/area_quadratic.py`
# reproduces the paper's figure with 200 runs and a step-size grid.
