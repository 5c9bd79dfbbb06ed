"""Clustered federated learning: IFCA (Ghosh, Chung, Yin, Ramchandran, "An Efficient
Framework for Clustered Federated Learning", NeurIPS 2020), the model-averaging variant of
its Algorithm 2 ("option II"), as a preset of the composable layer (issue 37).

The server keeps `clusters` = K models, stacked on a leading axis: `state.params` has
leaves `[K, ...]` (the server optimizer's state too). Round t, with theta_j the K models,
S_t the cohort and w_i its aggregation weights (the cohort's weighting: counts by default):

    every client i of S_t receives all K models and estimates its cluster
        j_i = argmin_j F_i(theta_j)                   (F_i: the loss on its full local data)
    it trains theta_{j_i} locally (the usual client work: E local steps of the client
        optimizer, its sampling, weight decay, stragglers) and sends Delta_i and j_i
    per cluster: Delta^j = sum_{i in S_t, j_i = j} w_i Delta_i / W_j,   W_j = sum of those w_i
    theta_j <- the server optimizer's step on the pseudo-gradient -Delta^j   (W_j > 0)
    theta_j unchanged                                                        (W_j = 0)

How it is composed (`ifca`): `ClusteredWork` is `ClientWork` whose `train` first computes
the K losses on the client's data (one vmapped forward pass per model), trains the chosen
model with the inherited client work, and sends its update in slot j_i of a `[K, ...]` tree
(zeros elsewhere) with j_i as the output of the `ifca` hook. The aggregator's weighted mean
of these trees is `W_j / W` times the cluster means, W the round's total weight; the hook's
`finalize` rescales each cluster's slot by `W / W_j` (W the sum of the W_j), calls the
server optimizer once on the stacked tree (elementwise optimizers, SGD / momentum / Adam,
step each cluster as if alone) and keeps the models of clusters nobody chose. Vectorized
over clients (the client map) and clusters (the leading axis); keys as every composed
algorithm's (round, purpose, client).

Options: every common option (stragglers dropped by default, as FedAvg's) but `partition`
(a label tree of one model, not of K) and `attack` (its hooks see the stacked models).
Aggregators: the mean and the wrappers that transform each client's update (compression,
error feedback with a `[K, ...]` memory per client, clipping, secure aggregation of a
mean). Refused up front: robust aggregators (they see every client's `[K, ...]` tree,
zeros at the clusters it did not choose, so a coordinate-wise median is not a per-cluster
one) and DP (`privacy.dp_mean`: its noised sum is divided by a fixed expected cohort, while
IFCA's cluster means divide by the number of clients that chose each cluster, a count the
mechanism does not privatize). `bytes_up` counts one model's update and the index j_i (the
wire format), not the stacked tree; `bytes_down` all K models (the paper broadcasts them).

Initialisation (the paper's random initialisation, K models from K keys): cluster 0 is the
given initial model (so K = 1 is FedAvg exactly); cluster j >= 1 is `cluster_init(key_j)`
with `key_j = fold_in(fold_in(key, CLUSTER_INIT), j)` (key: the run key `init` receives),
e.g. `cluster_init=model.init` (what the CLI passes); without `cluster_init`, each leaf of
the initial model with its entries shuffled by `key_j` (for the usual i.i.d. initialisers a
draw of the same distribution; constant leaves such as zero biases stay equal, so give
`cluster_init` for a model initialised to a constant, e.g. zeros).

Models of the clients (`personalize`): each client's cluster estimate on its training data,
`theta_{j_i}` with `j_i = argmin_j F_i(theta_j)`. The global model (`Algorithm.model`, what
central evaluation evaluates): the model of the cluster with the largest weight W_j in the
latest round (ties: the lowest index; cluster 0 before the first round). Metrics:
`cluster_sizes` `[K]`, the clients of the round's cohort (weight > 0) that chose each cluster.

Deviation: the server optimizer's state of a cluster nobody chose sees a zero pseudo-gradient
(momentum decays) although its model is kept.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from fedjax_sim.algorithms.aggregators import Aggregator, mean
from fedjax_sim.algorithms.client_work import ClientResult, ClientWork
from fedjax_sim.algorithms.compose import Options, preset, synchronous
from fedjax_sim.algorithms.core import Algorithm, LossFn, Params, Stragglers, minibatch
from fedjax_sim.algorithms.local_hook import LocalHook, RoundSummary, ServerStep
from fedjax_sim.data.federated import ClientData, FederatedData, tree_size_bytes

NAME = "ifca"  # the hook: server state = last round's cluster weights W_j [K]; output j_i
CLUSTER_INIT = 8  # purpose folded into the run key for the clusters' initial models


def num_clusters(models: Params) -> int:
    """K, the leading axis of the stacked cluster models."""
    return jax.tree.leaves(models)[0].shape[0]


def cluster_of(loss_fn: LossFn, models: Params, client: ClientData) -> jax.Array:
    """`[] int32`: `argmin_j F_i(theta_j)` on the client's full (padded, masked) data; a
    client without data chooses cluster 0."""
    batch = minibatch(client, None, 0, 0, "full")
    losses = jax.vmap(lambda m: loss_fn(m, batch))(models)
    return jnp.where(client.count > 0, jnp.argmin(losses), 0).astype(jnp.int32)


def _take(models: Params, j: jax.Array) -> Params:
    return jax.tree.map(lambda a: a[j], models)


def _per_cluster(values: jax.Array, leaf: jax.Array) -> jax.Array:
    """`values [K]` shaped to broadcast against a stacked leaf `[K, ...]`."""
    return values.reshape(-1, *([1] * (leaf.ndim - 1)))


class ClusteredWork(ClientWork):
    """`ClientWork` on K stacked models: the client trains its cluster estimate's model and
    sends its update in that cluster's slot (see the module docstring)."""

    def train(self, params: Params, data: FederatedData, client: jax.Array, key, **kwargs):
        j = cluster_of(self.loss_fn, params, data.client(client))
        res: ClientResult = super().train(_take(params, j), data, client, key, **kwargs)
        slot = jnp.arange(num_clusters(params)) == j

        def place(tree: Params, rest: Params | None) -> Params:
            """`tree` (one model's shapes) in slot j of the stack, `rest` (zeros) elsewhere."""
            return jax.tree.map(
                lambda v, a: jnp.where(
                    _per_cluster(slot, a), v[None], 0 if rest is None else a
                ).astype(a.dtype),
                tree,
                params if rest is None else rest,
            )

        return res._replace(
            params=place(res.params, params),
            delta=place(res.delta, None),
            update=place(res.update, None),
            outputs={**res.outputs, NAME: j},
        )


def cluster_means() -> LocalHook:
    """IFCA's server step: the aggregated `[K, ...]` update rescaled per cluster to the
    weighted mean over the clients that chose it, the server optimizer on the stack, the
    models of clusters nobody chose kept. Server state: the round's cluster weights W_j."""

    def init_server(models: Params) -> jax.Array:
        return jnp.zeros((num_clusters(models),), jnp.float32)

    def finalize(server: jax.Array, summary: RoundSummary, server_step: ServerStep):
        k = server.shape[0]
        weights = summary.cohort.weights
        chose = summary.outputs[:, None] == jnp.arange(k)  # [M, K]
        per = jnp.sum(jnp.where(chose, weights[:, None], 0.0), axis=0)  # W_j
        total = jnp.sum(per)
        scale = jnp.where(per > 0, total / jnp.where(per > 0, per, 1.0), 0.0)
        update = jax.tree.map(
            lambda u: (u * _per_cluster(scale, u)).astype(u.dtype), summary.update
        )
        stepped = server_step(update)
        kept = jax.tree.map(
            lambda n, x: jnp.where(_per_cluster(per > 0, n), n, x), stepped, summary.params
        )
        sizes = jnp.sum(chose & (weights[:, None] > 0), axis=0)
        return per.astype(server.dtype), kept, {"cluster_sizes": sizes}

    return LocalHook(NAME, init_server=init_server, finalize=finalize)


def largest_cluster(state: Any) -> Params:
    """The global model of an IFCA state: the model of the cluster with the largest weight in
    the latest round (ties and before the first round: the lowest index)."""
    return _take(state.params, jnp.argmax(state.hooks[NAME]))


def _check_aggregator(aggregator: Aggregator | None) -> Aggregator:
    aggregator = aggregator or mean()
    if aggregator.stacked:
        raise ValueError(
            "IFCA refuses robust aggregators: they see each client's [K, ...] update with zeros "
            "at the clusters it did not choose, so their rule is not a per-cluster one"
        )
    if aggregator.private:
        raise ValueError(
            "IFCA refuses DP aggregation: dp_mean divides by a fixed expected cohort, IFCA's "
            "cluster means by how many clients chose each cluster, a count DP does not protect"
        )
    one = lambda models: _take(models, 0)
    payload = aggregator.payload or tree_size_bytes
    # what a client sends on the wire: one model's update (the index is the hook's output)
    return aggregator._replace(payload=lambda models: float(payload(one(models))))


def _check_clusters(clusters: Any) -> None:
    if isinstance(clusters, bool) or not isinstance(clusters, int) or clusters < 1:
        raise ValueError(f"IFCA clusters must be an int >= 1, got {clusters!r}")


def initial_models(
    params: Params, key: jax.Array, clusters: int, cluster_init: Any = None
) -> Params:
    """The K stacked initial models (see the module docstring): `params`, then
    `cluster_init(key_j)` (or `params` shuffled leafwise by `key_j`) for j = 1..K-1."""

    def other(j: int) -> Params:
        key_j = jax.random.fold_in(jax.random.fold_in(key, CLUSTER_INIT), j)
        if cluster_init is not None:
            return cluster_init(key_j)
        leaves, treedef = jax.tree.flatten(params)
        keys = jax.random.split(key_j, len(leaves))
        return treedef.unflatten(
            [
                jax.random.permutation(k, jnp.ravel(a)).reshape(jnp.shape(a))
                for k, a in zip(keys, leaves, strict=True)
            ]
        )

    models = [params] + [other(j) for j in range(1, clusters)]
    return jax.tree.map(lambda *leaves: jnp.stack(leaves), *models)


@preset(fixed=("partition", "attack"), stragglers=Stragglers(policy="drop"))
def ifca(
    loss_fn: LossFn, *, clusters: int = 2, cluster_init: Any = None, options: Options
) -> Algorithm:
    """IFCA (Ghosh, Chung, Yin, Ramchandran, "An Efficient Framework for Clustered Federated
    Learning", NeurIPS 2020; model averaging): K = `clusters` models; each cohort client
    trains the model of lowest loss on its data, the server averages each cluster's updates
    over the clients that chose it. `cluster_init(key)`: cluster j >= 1's initial model
    (None: the initial model's entries shuffled); personal models: each client's cluster."""
    _check_clusters(clusters)
    if cluster_init is not None and not callable(cluster_init):
        raise ValueError(
            f"IFCA cluster_init must be a function key -> params, got {cluster_init!r}"
        )
    options = dataclasses.replace(options, aggregator=_check_aggregator(options.aggregator))
    base = synchronous(loss_fn, options, cluster_means(), work=ClusteredWork)

    def init(params: Params, key: jax.Array):
        return base.init(initial_models(params, key, clusters, cluster_init), key)

    def personalize(state, data: FederatedData, ids: jax.Array, key: jax.Array) -> Params:
        del key
        models = state.params
        return jax.vmap(lambda cid: _take(models, cluster_of(loss_fn, models, data.client(cid))))(
            ids
        )

    return base._replace(init=init, personalize=personalize, model=largest_cluster)
