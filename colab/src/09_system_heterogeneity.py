# %% [markdown]
# # System heterogeneity: FedAvg, over-selection and deadlines vs FedBuff on a device clock
#
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/fedjax-sim/fedjax_sim/blob/main/colab/09_system_heterogeneity.ipynb)
#
# Cross-device FL runs on phones: each device computes at its own speed, uploads over its own
# link, is online only part of the day and may vanish mid-round. Comparing algorithms by
# rounds hides all of that; researchers compare them by **time to accuracy**. fedjax_sim
# gives every client a **device profile** (`fedjax_sim.algorithms.device_model`) and runs a
# **virtual clock** inside the compiled round:
#
# - a synchronous round lasts as long as its slowest reporting client
#   (download + local steps / speed + upload), or its deadline;
# - over-selection (Bonawitz et al. 2019) draws 30 % more clients and keeps the first to
#   finish; a deadline drops the late ones;
# - asynchronous algorithms (FedBuff) fire from the same profiles (`event_model`).
#
# Here: digits split over 64 clients, the bundled 64-device trace (one device per client),
# accuracy against virtual hours.

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
NUM_CLIENTS = 64
STEPS = 10  # local steps per round (FedAvg) or per delivery (FedBuff)
ROUNDS = 16 if SMALL else 200
EVAL_EVERY = 4 if SMALL else 20

# %%
import jax
import matplotlib.pyplot as plt
import numpy as np

import fedjax_sim
from fedjax_sim import CohortSpec, LocalSpec, data, fedavg, models, simulate
from fedjax_sim.algorithms import fedbuff
from fedjax_sim.algorithms.device_model import (
    DeviceModel,
    bundled_trace,
    client_times,
    event_model,
    load_trace,
)
from fedjax_sim.algorithms.events import Aggregation
from fedjax_sim.data.federated import tree_size_bytes

ds = data.load_digits(num_clients=NUM_CLIENTS)
model = models.mlp(ds.feature_shape, ds.num_classes, hidden=(32,))
key = jax.random.key(0)
model_bytes = float(tree_size_bytes(model.init(key)))  # sent down and up each round

# %% [markdown]
# ## The devices
# `load_trace` reads a CSV trace (one row per device: steps/s, uplink and downlink bytes/s,
# a daily online window, a dropout probability); client i gets row i mod 64. A client's time
# for one round is `bytes_down / downlink + steps / speed + bytes_up / uplink`.

# %%
profiles = load_trace(bundled_trace())
p = profiles(np.arange(NUM_CLIENTS))
times = np.asarray(client_times(p, STEPS, model_bytes, model_bytes))
online = np.asarray(p.session / p.period)
print(f"model {model_bytes / 1e3:.0f} kB; round time per client: median {np.median(times):.1f} s, "
      f"90th pct. {np.percentile(times, 90):.1f} s, slowest {times.max():.1f} s")  # fmt: skip
print(f"online {100 * online.mean():.0f} % of the day on average; "
      f"dropout {float(p.dropout.mean()):.3f}")  # fmt: skip

fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3))
ax1.hist(times, bins=20)
ax1.set(xlabel="seconds for one round", ylabel="clients", xscale="log")
ax2.hist(24 * online, bins=12)
ax2.set(xlabel="hours online per day", ylabel="clients")
plt.show()

# %% [markdown]
# ## Synchronous FedAvg on the clock
# `device_model=` is an option of every synchronous preset. Without a deadline a round waits
# for the slowest of its 10 clients; with over-selection 1.3 the server draws 13 and keeps
# the first 10 to finish, and a deadline (here the 70th percentile of the clients' times)
# drops whoever is later. Offline clients and mid-round dropouts report nothing.

# %%
spec = dict(local=LocalSpec(steps=STEPS, batch_size=16), cohort=CohortSpec(size=10))
deadline = float(np.percentile(times, 70))
variants = {
    "FedAvg": DeviceModel(profiles),
    f"FedAvg, over-selection 1.3, deadline {deadline:.0f} s": DeviceModel(
        profiles, deadline=deadline, over_selection=1.3
    ),
}
curves, per_round = {}, {}
for name, device_model in variants.items():
    h = simulate(
        fedavg(model.loss, device_model=device_model, **spec), ds.train, key, model=model,
        num_rounds=ROUNDS, test=ds.test, evaluation=fedjax_sim.EvalSpec(every=EVAL_EVERY),
        progress=False,
    )  # fmt: skip
    curves[name] = h.eval_series("test_accuracy", x="virtual_hours")
    per_round[name] = h.metric("round_time")
    print(f"{name}: {h.num_rounds} rounds in {curves[name][0][-1]:.2f} virtual hours; "
          f"mean round {per_round[name].mean():.1f} s, {h.metric('unavailable').mean():.1f} "
          f"offline, {h.metric('late').mean():.1f} late, {h.metric('dropouts').mean():.2f} "
          "dropouts per round")  # fmt: skip

# %% [markdown]
# ## FedBuff on the same devices
# `event_model` turns the profiles into the event engine's arrivals: client i delivers at rate
# `(1 - dropout_i) / time_i` while it is online; the server applies every 10 deliveries. One
# iteration is `dt` virtual seconds (metric `t`). We run FedBuff for as long as plain
# FedAvg took.

# %%
events = event_model(
    profiles, NUM_CLIENTS, steps=STEPS, bytes_down=model_bytes, bytes_up=model_bytes,
    aggregation=Aggregation.every(10), max_probability=0.5,
)  # fmt: skip
horizon = curves["FedAvg"][0][-1] * 3600.0  # seconds
iterations = max(EVAL_EVERY, int(horizon / events.arrivals.dt))
h = simulate(
    fedbuff(model.loss, events=events, local=LocalSpec(steps=STEPS, batch_size=16)), ds.train,
    key, model=model, num_rounds=iterations, test=ds.test,
    evaluation=fedjax_sim.EvalSpec(every=max(1, iterations // (ROUNDS // EVAL_EVERY))),
    progress=False,
)  # fmt: skip
rounds, acc = h.eval_series("test_accuracy")
clock = dict(zip(h.rounds, np.asarray(h.metric("t")).tolist(), strict=True)) | {0: 0.0}
curves["FedBuff (buffer 10)"] = (np.array([clock[int(r)] / 3600.0 for r in rounds]), acc)
print(f"FedBuff: {iterations} iterations of {events.arrivals.dt:.2f} s")

# %% [markdown]
# ## Accuracy against virtual hours

# %%
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.5))
for name, (hours, acc) in curves.items():
    ax1.plot(hours, acc, "o-", ms=3, label=name)
ax1.set(xlabel="virtual hours", ylabel="test accuracy", ylim=(0, 1))
ax1.legend(fontsize=8)
for name, t in per_round.items():
    ax2.plot(np.arange(1, len(t) + 1), t, lw=1, label=name)
ax2.set(xlabel="round", ylabel="round time (s)", yscale="log")
ax2.legend(fontsize=8)
plt.show()

target = 0.8
for name, (hours, acc) in curves.items():
    reached = hours[acc >= target]
    when = f"{60 * reached[0]:.1f} virtual minutes" if len(reached) else "not reached"
    print(f"{name}: test accuracy {target} after {when}")

# %% [markdown]
# One seed and one trace: an illustration, not a verdict (the experiment with 5 seeds and
# confidence intervals is issue 38's `experiments/`). The same model runs from the command
# line:
#
# ```bash
# fedjax-sim run --device-model bundled --deadline 20 --over-selection 1.3
# ```
#
# (`--device-model` also takes `phones`, `always_on`, `homogeneous` or a CSV trace path; the
# summary prints the total virtual hours and `history.png` gains an accuracy-vs-hours panel.)
