# %% [markdown]
# # Privacy and robustness: DP-FedAvg and robust aggregators under attack
#
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/fedjax-sim/fedjax_sim/blob/main/colab/05_privacy_robustness.ipynb)
#
# Both are **aggregators** (`fedjax_sim.algorithms.aggregators.Aggregator`), so any synchronous
# algorithm takes them through `aggregator=`:
#
# - `dp_mean` is DP-FedAvg (McMahan et al. 2018): clip each client's update, add Gaussian
#   noise to the sum, divide by the expected cohort size; with `AdaptiveClipping` the clip
#   norm tracks a quantile of the update norms (Andrew et al. 2021). `PrivacyAccounting`
#   turns the noise multiplier, the sampling and the number of rounds into epsilon.
# - `median`, `trimmed_mean`, `krum`, `geometric_median` see the stacked `[M, d]` cohort
#   updates; `Attack` makes a fraction of the clients Byzantine (sign flip, ALIE, ...).
#
# Data: digits split over 100 clients, cohorts of 10 per round.

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
NUM_ROUNDS = 4 if SMALL else 200
EVAL_EVERY = 2 if SMALL else 10
NOISE_MULTIPLIERS = [1.0] if SMALL else [0.3, 0.5, 1.0, 2.0]
CLIP_NORM = 0.5

# %%
import jax
import matplotlib.pyplot as plt

from fedjax_sim import CohortSpec, EvalSpec, LocalSpec, fedavg, simulate
from fedjax_sim.algorithms.accounting import PrivacyAccounting
from fedjax_sim.algorithms.aggregators import mean
from fedjax_sim.algorithms.attacks import Attack
from fedjax_sim.algorithms.privacy import AdaptiveClipping, dp_mean, expected_cohort_size
from fedjax_sim.algorithms.robust import geometric_median, krum, median, trimmed_mean
from fedjax_sim.data import load_digits
from fedjax_sim.models import mlp

NUM_CLIENTS = 100
ds = load_digits(num_clients=NUM_CLIENTS)
model = mlp(ds.feature_shape, ds.num_classes, hidden=(64,))
key = jax.random.PRNGKey(0)
# DP needs unit weights (each participant counts once): uniform cohort weighting
cohort = CohortSpec(size=10, weighting="uniform")
local = LocalSpec(steps=10, batch_size=16)


def run(aggregator, attack=None):
    """Test accuracy per evaluated round of FedAvg with `aggregator` (and `attack`)."""
    alg = fedavg(model.loss, aggregator=aggregator, attack=attack, local=local, cohort=cohort)
    h = simulate(
        alg, ds.train, key, model=model, num_rounds=NUM_ROUNDS, test=ds.test,
        evaluation=EvalSpec(every=EVAL_EVERY), progress=False,
    )  # fmt: skip
    return h.eval_series("test_accuracy")


# %% [markdown]
# ## (a) DP-FedAvg: accuracy vs epsilon
# The cohort is M = 10 of C = 100 drawn without replacement each round, so the accountant
# composes `NUM_ROUNDS` subsampled Gaussian mechanisms (RDP, delta = 1e-5). The noise on the
# mean update has std z C_clip / M: with only 10 clients per round the noise is large, which
# is why production DP-FedAvg uses cohorts of hundreds or thousands.

# %%
m = expected_cohort_size(cohort, NUM_CLIENTS)
rounds_nondp, acc_nondp = run(mean())
dp = {"fixed": [], "adaptive": []}
for z in NOISE_MULTIPLIERS:
    accounting = PrivacyAccounting(z, NUM_CLIENTS, "uniform", cohort_size=cohort.size)
    eps = accounting.epsilon(NUM_ROUNDS)
    # the count's noise sigma_b = z (the paper's M / 20 = 0.5 needs z < 1): the update
    # then gets z_Delta = z / sqrt(3/4) and the pair is one mechanism with multiplier z
    for clipping, adaptive in (("fixed", None), ("adaptive", AdaptiveClipping(count_noise=z))):
        _, acc = run(dp_mean(z, CLIP_NORM, m, adaptive=adaptive))
        dp[clipping].append((eps, float(acc[-1])))
        print(f"z={z:4.1f}  epsilon={eps:8.2f}  {clipping:8s} clip: test accuracy {acc[-1]:.3f}")

fig, ax = plt.subplots(figsize=(6, 3.5))
for clipping, points in dp.items():
    eps, acc = zip(*points, strict=True)
    ax.plot(eps, acc, "o-", label=f"DP-FedAvg, {clipping} clipping")
ax.axhline(float(acc_nondp[-1]), color="k", ls="--", label="FedAvg (no DP)")
ax.set(xscale="log", xlabel="epsilon (delta = 1e-5)", ylabel="final test accuracy")
ax.set_title(f"{NUM_ROUNDS} rounds, M = {cohort.size} of C = {NUM_CLIENTS}")
ax.legend()
plt.show()

# %% [markdown]
# ## (b) Robust aggregation under attack
# 20 % of the clients are Byzantine (a fixed set). Under **sign flip** they send
# `-10 Delta_i`; the mean is dragged away, while the median, the trimmed mean (beta = 0.2),
# Krum (f = 2 of 10) and the geometric median ignore the outliers. ALIE (`kind="alie"`)
# hides inside the coordinate-wise spread instead: try it by changing `ATTACK`.

# %%
ATTACK = Attack("sign_flip", fraction=0.2, scale=10.0)
AGGREGATORS = {
    "mean (FedAvg)": mean(),
    "median": median(),
    "Krum (f=2)": krum(2),
}
if not SMALL:  # one compilation each: the small run keeps three
    AGGREGATORS["trimmed mean (0.2)"] = trimmed_mean(0.2)
    AGGREGATORS["geometric median"] = geometric_median()

fig, ax = plt.subplots(figsize=(7, 4))
ax.plot(rounds_nondp, acc_nondp, "k--", label="mean, no attack")
for name, agg in AGGREGATORS.items():
    rounds, acc = run(agg, ATTACK)
    ax.plot(rounds, acc, "o-", label=name)
    print(f"{name:20s} under {ATTACK.kind}: final test accuracy {acc[-1]:.3f}")
ax.set(xlabel="round", ylabel="test accuracy", title="20 % Byzantine clients (sign flip x10)")
ax.legend()
plt.show()
