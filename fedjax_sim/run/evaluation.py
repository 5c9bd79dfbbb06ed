"""The evaluations of a run: the global model on the central test set and on each client's
test split, each client's own (personal) model on its test split, and unseen clients after k
local steps from the global model (issue 37).

Per-client summaries (`client_summary`) are over the clients with test examples: mean, worst
(min accuracy / max loss), 10th percentile of accuracy (numpy.percentile's `method="lower"`:
the sorted accuracies' entry `floor(0.1 (n - 1))`, an accuracy some client has) and the
pooled (example-weighted) loss; `distribution` adds the `[C]` accuracies and losses (NaN for
clients without test examples), which `History` keeps per evaluation (`client_evals`).

Personal models come from `Algorithm.personalize(state, data, ids, key)` in blocks of
clients (the client map's chunk: one block in vmap mode), a `lax.map` over the blocks, so
`[C, ...]` personal models are never built at once in map mode; the key is
`round_key(run key, state.round, PERSONALIZE)`. Unseen clients (`data/unseen.py`: clients
never trained on) adapt by `personal_models.fine_tuned` on their training rows and are
evaluated on their test split.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from fedjax_sim.algorithms.core import PERSONALIZE, LocalSpec, Personalize, round_key
from fedjax_sim.algorithms.personal_models import fine_tuned
from fedjax_sim.data.federated import ArrayData, Batch, FederatedData
from fedjax_sim.models.base import Model
from fedjax_sim.runtime.parallel import ClientMap


def evaluate_central(model: Model, params: Any, test: ArrayData, batch_size: int = 1024):
    """Loss and accuracy of `params` on a central dataset, in batches of `batch_size`."""
    n = test.x.shape[0]
    bs = max(1, min(batch_size, n))
    nb = -(-n // bs)
    pad = nb * bs - n

    def padded(a):
        a = jnp.asarray(a)
        return jnp.concatenate([a, jnp.zeros((pad, *a.shape[1:]), a.dtype)]).reshape(
            nb, bs, *a.shape[1:]
        )

    mask = padded(jnp.ones((n,), jnp.float32))
    stats = lax.map(
        lambda b: model.evaluate(params, Batch(*b)), (padded(test.x), padded(test.y), mask)
    )
    stats = jax.tree.map(jnp.sum, stats)
    count = jnp.maximum(stats["count"], 1.0)
    return {"test_loss": stats["loss"] / count, "test_accuracy": stats["correct"] / count}


def client_stats(
    model: Model,
    params: Any,
    x: jax.Array,
    y: jax.Array,
    counts: jax.Array,
    client_map: ClientMap = ClientMap(),
    rows: int | None = None,
) -> dict[str, jax.Array]:
    """`[C]` sums over each client's valid rows of the global model's `loss`, `correct` and
    `count` (`Model.evaluate` per client, in blocks of `rows` rows: `evaluate_client`)."""
    one = lambda xc, yc, n: evaluate_client(model, params, xc, yc, n, rows)
    return client_map.map(one, x, y, counts)


def evaluate_client(
    model: Model,
    params: Any,
    x: jax.Array,
    y: jax.Array,
    count: jax.Array,
    rows: int | None = None,
) -> dict[str, jax.Array]:
    """`Model.evaluate` sums of `params` on one client's first `count` rows of its padded
    `x [N_max, ...]`, `y [N_max]`; with `rows < N_max`, in blocks of `rows` rows summed in a
    `lax.map` (the same sums up to the last bits): the activations of a vmapped cohort are
    then `[C, rows, ...]`, not `[C, N_max, ...]`."""
    n = x.shape[0]
    mask = (jnp.arange(n) < count).astype(jnp.float32)
    if rows is None or rows >= n:
        return model.evaluate(params, Batch(x, y, mask))
    blocks = -(-n // rows)
    pad = lambda a: jnp.pad(a, [(0, blocks * rows - n)] + [(0, 0)] * (a.ndim - 1))
    split = lambda a: pad(a).reshape(blocks, rows, *a.shape[1:])
    sums = lax.map(lambda b: model.evaluate(params, Batch(*b)), (split(x), split(y), split(mask)))
    return jax.tree.map(lambda a: jnp.sum(a, 0), sums)


def client_summary(
    stats: dict[str, jax.Array], counts: jax.Array, prefix: str, distribution: bool = False
) -> dict[str, jax.Array]:
    """Summaries over the clients with data of `[C]` sums (`client_stats`): `{prefix}_`
    `accuracy_mean`, `accuracy_worst`, `accuracy_p10`, `loss_mean`, `loss_worst`,
    `loss_pooled`; `distribution`: also `{prefix}_accuracy` and `{prefix}_loss` `[C]` (NaN
    where a client has no data)."""
    has = counts > 0
    cnt = jnp.maximum(stats["count"], 1.0)
    acc, loss = stats["correct"] / cnt, stats["loss"] / cnt
    n_has = jnp.maximum(jnp.sum(has), 1)
    acc_sorted = jnp.sort(jnp.where(has, acc, jnp.inf))
    p10 = acc_sorted[jnp.floor(0.1 * (n_has - 1)).astype(jnp.int32)]
    out = {
        f"{prefix}_accuracy_mean": jnp.sum(jnp.where(has, acc, 0)) / n_has,
        f"{prefix}_accuracy_worst": jnp.min(jnp.where(has, acc, jnp.inf)),
        f"{prefix}_accuracy_p10": p10,
        f"{prefix}_loss_mean": jnp.sum(jnp.where(has, loss, 0)) / n_has,
        f"{prefix}_loss_worst": jnp.max(jnp.where(has, loss, -jnp.inf)),
        f"{prefix}_loss_pooled": jnp.sum(stats["loss"]) / jnp.maximum(jnp.sum(stats["count"]), 1),
    }
    if distribution:
        out[f"{prefix}_accuracy"] = jnp.where(has, acc, jnp.nan)
        out[f"{prefix}_loss"] = jnp.where(has, loss, jnp.nan)
    return out


def evaluate_clients(
    model: Model,
    params: Any,
    x: jax.Array,
    y: jax.Array,
    counts: jax.Array,
    client_map: ClientMap = ClientMap(),
    prefix: str = "client",
    distribution: bool = False,
    rows: int | None = None,
) -> dict[str, jax.Array]:
    """Per-client loss/accuracy of the global model (in blocks of `rows` rows), summarised by
    `client_summary`."""
    stats = client_stats(model, params, x, y, counts, client_map, rows)
    return client_summary(stats, counts, prefix, distribution)


def personal_stats(
    model: Model,
    personalize: Personalize | None,
    state: Any,
    data: FederatedData,
    key: jax.Array,
    client_map: ClientMap = ClientMap(),
) -> dict[str, jax.Array]:
    """`[C]` sums (as `client_stats`) of each client's own model `personalize(state, data,
    ids, key)` on its test split; None: the global model `state.params` (`client_stats`)."""
    x, y, counts = data.x_test, data.y_test, data.test_counts
    if personalize is None:
        return client_stats(model, state.params, x, y, counts, client_map)
    c = data.num_clients
    _, chunk = client_map.resolve(c)
    blocks = -(-c // chunk)
    ids = (jnp.arange(blocks * chunk) % c).reshape(blocks, chunk)  # padding: dropped below

    def block(ids):
        params = personalize(state, data, ids, key)

        one = lambda p, i: evaluate_client(model, p, x[i], y[i], counts[i])
        return jax.vmap(one)(params, ids)

    stats = lax.map(block, ids)
    return jax.tree.map(lambda a: a.reshape(-1)[:c], stats)


def evaluate_personal(
    model: Model,
    personalize: Personalize | None,
    state: Any,
    data: FederatedData,
    key: jax.Array,
    client_map: ClientMap = ClientMap(),
) -> dict[str, jax.Array]:
    """`personal_*` summaries and `[C]` distribution of each client's own model on its test
    split (`key`: the run key)."""
    k = round_key(key, state.round, PERSONALIZE)
    stats = personal_stats(model, personalize, state, data, k, client_map)
    return client_summary(stats, data.test_counts, "personal", distribution=True)


def evaluate_unseen(
    model: Model,
    state: Any,
    unseen: FederatedData,
    key: jax.Array,
    *,
    steps: int,
    lr: float,
    batch_size: int,
    client_map: ClientMap = ClientMap(),
) -> dict[str, jax.Array]:
    """`unseen_*` summaries and `[U]` distribution of unseen clients' models after `steps`
    local SGD steps of size `lr` (minibatches of `batch_size` drawn with replacement) from
    the global model on their training rows (`personal_models.fine_tuned`), evaluated on their
    test split."""
    adapt = fine_tuned(model.loss, steps, lr, LocalSpec(batch_size=batch_size))
    k = round_key(key, state.round, PERSONALIZE)
    stats = personal_stats(model, adapt, state, unseen, k, client_map)
    return client_summary(stats, unseen.test_counts, "unseen", distribution=True)
