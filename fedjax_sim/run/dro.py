"""Group-DRO evaluation: per-group loss and accuracy of the global model, worst-group and
average summaries, the CVaR and KL objective values, and worst-vs-average plots.

A "group" is a client (per-client train or test split: the FGDRO objective's `l_i`) or a
label class of the central test set (the worst-class accuracy used for the imbalanced
CIFAR-10 protocol, spec `docs/specs/fgdro.md` section 7.13). Use with `simulate`::

    extra = dro_evaluator(model, groups="train", k=2, temperature=1.0)
    evaluation = EvalSpec(every=10, extra=extra)

The learned client weights (softmax(u/temperature), CVaR top-K, DRFA's lambda) are per-round
metrics of the algorithms themselves (`client_weights`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, Literal

import jax
import jax.numpy as jnp
from jax import lax

from fedjax_sim.algorithms.fgdro import kl_objective, topk_mean
from fedjax_sim.core.checks import positive
from fedjax_sim.data.federated import ArrayData, Batch, FederatedData
from fedjax_sim.models.base import Model
from fedjax_sim.run.evaluation import client_stats
from fedjax_sim.run.history import History
from fedjax_sim.runtime.parallel import ClientMap

GROUPINGS = ("train", "test", "classes")


def group_stats(
    model: Model,
    params: Any,
    x: jax.Array,
    y: jax.Array,
    groups: jax.Array,
    num_groups: int,
    batch_size: int = 1024,
) -> dict[str, jax.Array]:
    """`[G]` mean loss, accuracy and example count per group of a central dataset
    (`groups [N]` int in [0, G); e.g. `groups = y` gives per-class metrics)."""
    n = x.shape[0]
    bs = max(1, min(batch_size, n))
    nb = -(-n // bs)
    pad = nb * bs - n

    def padded(a, fill=0):
        a = jnp.asarray(a)
        filler = jnp.full((pad, *a.shape[1:]), fill, a.dtype)
        return jnp.concatenate([a, filler]).reshape(nb, bs, *a.shape[1:])

    def per_example(xb, yb):  # Model.evaluate on batches of one example, vectorised
        one = lambda xi, yi: model.evaluate(params, Batch(xi[None], yi[None], jnp.ones(1)))
        return jax.vmap(one)(xb, yb)

    stats = lax.map(lambda b: per_example(*b), (padded(x), padded(y)))
    gid = padded(groups, num_groups).reshape(-1)  # padding rows land in a dropped segment
    sums = {
        k: jax.ops.segment_sum(v.reshape(-1), gid, num_segments=num_groups + 1)[:num_groups]
        for k, v in stats.items()
    }
    cnt = jnp.maximum(sums["count"], 1.0)
    return {"loss": sums["loss"] / cnt, "accuracy": sums["correct"] / cnt, "count": sums["count"]}


def summarize(
    loss: jax.Array,
    accuracy: jax.Array,
    count: jax.Array,
    *,
    prefix: str,
    k: int | None = None,
    temperature: float | None = None,
    per_group: bool = False,
) -> dict[str, jax.Array]:
    """Worst/average summaries over the groups with examples (`count > 0`): `{prefix}_`
    `loss_mean`, `loss_worst` (max), `accuracy_mean`, `accuracy_worst` (min), and if given
    `cvar` (mean of the k largest group losses; k must not exceed the non-empty groups) and
    `kl` (`t log mean exp(loss/t)`, t = `temperature`). `per_group` adds `{prefix}_loss_{g}` and
    `{prefix}_accuracy_{g}` for every group g (for a handful of groups)."""
    has = count > 0
    n_has = jnp.maximum(jnp.sum(has), 1)
    out = {
        f"{prefix}_loss_mean": jnp.sum(jnp.where(has, loss, 0.0)) / n_has,
        f"{prefix}_loss_worst": jnp.max(jnp.where(has, loss, -jnp.inf)),
        f"{prefix}_accuracy_mean": jnp.sum(jnp.where(has, accuracy, 0.0)) / n_has,
        f"{prefix}_accuracy_worst": jnp.min(jnp.where(has, accuracy, jnp.inf)),
    }
    if k is not None:
        out[f"{prefix}_cvar"] = topk_mean(jnp.where(has, loss, -jnp.inf), k)
    if temperature is not None:
        # groups without examples drop out: t (logsumexp over valid - log #valid)
        masked = jnp.where(has, loss, -jnp.inf)
        out[f"{prefix}_kl"] = kl_objective(masked, temperature) + temperature * (
            math.log(loss.shape[0]) - jnp.log(n_has)
        )
    if per_group:
        for g in range(loss.shape[0]):
            out[f"{prefix}_loss_{g}"] = loss[g]
            out[f"{prefix}_accuracy_{g}"] = accuracy[g]
    return out


def dro_evaluator(
    model: Model,
    *,
    groups: Literal["train", "test", "classes"] = "train",
    k: int | None = None,
    temperature: float | None = None,
    per_group: bool = False,
    client_map: ClientMap = ClientMap(),
    batch_size: int = 1024,
) -> Callable[[Any, FederatedData, ArrayData | None], dict[str, jax.Array]]:
    """An `EvalSpec.extra` function: worst/average group metrics of the global model.

    groups: "train" (each client's training data: the quantity FGDRO optimises; prefix
      `train_clients`), "test" (each client's test split; `test_clients`), or "classes"
      (each label class of the central test set; `test_classes`).
    k, temperature: also report the CVaR (top-k mean) and KL objective over the groups.
    """
    if groups not in GROUPINGS:
        raise ValueError(f"groups must be one of {GROUPINGS}, got {groups!r}")
    if k is not None and k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if temperature is not None:
        positive("temperature", temperature)

    def evaluate(params, data: FederatedData, test: ArrayData | None):
        if groups == "classes":
            if test is None or not data.num_classes:
                raise ValueError("groups='classes' needs a central test set and num_classes")
            s = group_stats(model, params, test.x, test.y, test.y, data.num_classes, batch_size)
            loss, acc, cnt, prefix = s["loss"], s["accuracy"], s["count"], "test_classes"
        else:
            if groups == "test":
                if not data.has_client_test:
                    raise ValueError("groups='test' needs per-client test splits")
                x, y, counts, prefix = data.x_test, data.y_test, data.test_counts, "test_clients"
            else:
                x, y, counts, prefix = data.x, data.y, data.counts, "train_clients"
            s = client_stats(model, params, x, y, counts, client_map)
            cnt = s["count"]
            loss = s["loss"] / jnp.maximum(cnt, 1.0)
            acc = s["correct"] / jnp.maximum(cnt, 1.0)
        return summarize(
            loss, acc, cnt, prefix=prefix, k=k, temperature=temperature, per_group=per_group
        )

    return evaluate


def plot_worst_vs_average(
    histories: Mapping[str, History],
    path: str,
    *,
    worst: str = "test_classes_accuracy_worst",
    mean: str = "test_accuracy",
    title: str | None = None,
) -> None:
    """Two panels (worst-group and average metric over rounds), one line per algorithm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharex=True)
    for name, hist in histories.items():
        for ax, key in zip(axes, (worst, mean), strict=True):
            r, v = hist.eval_series(key)
            if len(r):
                ax.plot(r, v, "o-", ms=2.5, lw=1.2, label=name)
    axes[0].set(xlabel="round", ylabel=worst, title="worst group")
    axes[1].set(xlabel="round", ylabel=mean, title="average")
    axes[1].legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
