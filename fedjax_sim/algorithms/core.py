"""Shared machinery of every algorithm: the `Algorithm` pattern, local training, cohorts,
aggregation and server updates. Written once here and reused by all algorithm modules.

An algorithm is a pair of pure functions, optax-style::

    algorithm = fedavg(model.loss, client_optimizer=0.1, local=LocalSpec(steps=10))
    state = algorithm.init(params, key)
    state, metrics = algorithm.step(state, data, key)   # one round (or one async event)

Every `State` is a `flax.struct.dataclass` with at least `params` (the global model) and
`round` (int32 counter); per-client parts are stacked on axis 0 for all C clients and
declared as `core.rows.Rows`.

Randomness: `step` derives everything from `(key, state.round)`; the key of client `i` is
`fold_in(fold_in(fold_in(key, round), LOCAL), i)`, so results do not depend on cohort order,
on the client-map mode or its batch size, and a run can be resumed from `(state, key)` alone.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from fedjax_sim.algorithms import cohorts
from fedjax_sim.data.federated import Batch, ClientData, FederatedData, tree_size_bytes
from fedjax_sim.runtime.parallel import ClientMap, to_varying

Params = Any
State = Any
Metrics = dict[str, jax.Array]
PRNGKey = jax.Array
LossFn = Callable[[Params, Batch], jax.Array]
ValueAndGrad = Callable[[Params, Batch], tuple[jax.Array, Params]]
# grad_fn(value_and_grad, params, batch, aux) -> (loss, direction, aux): the local-step hook.
GradFn = Callable[[ValueAndGrad, Params, Batch, Any], tuple[jax.Array, Params, Any]]
# personalize(state, data, ids [K], key) -> the clients' personal models, leaves [K, ...]
Personalize = Callable[[State, FederatedData, jax.Array, PRNGKey], Params]


class Algorithm(NamedTuple):
    """A federated algorithm as a pure state transition (the optax pattern).

    Per-client state `[C, ...]` is declared by its type: the state holds it as
    `core.rows.Rows`. `simulate(mesh=...)` shards exactly those leaves over the clients axis
    (everything else is replicated); `simulate_streamed(state_rows="host")` keeps them on the
    host and sends the device only the rows a chunk touches.

    `personalize(state, data, ids, key) -> params [K, ...]` gives the personal models of the
    clients `ids [K]` (their rows of a personalized algorithm, or k local steps from the
    global model); None: every client's model is the global one, `state.params`.

    `model(state) -> params`: the global model central evaluation evaluates, where
    `state.params` is not one model (IFCA's K cluster models); None: `state.params`
    (`global_model`)."""

    init: Callable[[Params, PRNGKey], State]
    step: Callable[[State, FederatedData, PRNGKey], tuple[State, Metrics]]
    personalize: Personalize | None = None
    model: Callable[[State], Params] | None = None


def global_model(algorithm: Algorithm, state: State) -> Params:
    """The global model of `state` (`Algorithm.model`; `state.params` without one)."""
    return state.params if algorithm.model is None else algorithm.model(state)


def float_dtype() -> jnp.dtype:
    """The default float dtype (float64 under `jax.enable_x64`, else float32)."""
    return jax.dtypes.canonicalize_dtype(jnp.float64)


# ------------------------------------------------------------------------------ keys
# Purposes folded into the round key, so different uses never share random bits.
COHORT, LOCAL, STRAGGLERS, EXTRA, UPLINK, DEVICES, PERSONALIZE = 0, 1, 2, 3, 4, 5, 6


def round_key(key: PRNGKey, round_: jax.Array, purpose: int) -> PRNGKey:
    """`fold_in(fold_in(key, round), purpose)`."""
    return jax.random.fold_in(jax.random.fold_in(key, round_), purpose)


def client_key(key: PRNGKey, client_id: jax.Array) -> PRNGKey:
    return jax.random.fold_in(key, client_id)


# ------------------------------------------------------------------------------ specs
Sampling = Literal["replacement", "epoch", "full", "fixed"]
SAMPLINGS = ("replacement", "epoch", "full", "fixed")


@dataclasses.dataclass(frozen=True)
class LocalSpec:
    """How much local work each client does per round, and how minibatches are drawn.

    Attributes:
      steps: local steps per round (used when `epochs` is None).
      epochs: if set, client i runs `ceil(epochs * n_i / batch_size)` steps ("E epochs of
        local data"; unequal across clients, extra steps masked out exactly).
      batch_size: minibatch size B (ignored by `sampling="full"`).
      sampling: "replacement" (B uniform draws from the client's n_i examples),
        "epoch" (a fresh permutation per epoch, last batch partial),
        "full" (each step uses all n_i examples: deterministic full-batch GD),
        "fixed" (one minibatch of distinct examples reused by every step, e.g. an inexact
        proximal solver on one sample).
    """

    steps: int = 10
    epochs: float | None = None
    batch_size: int = 32
    sampling: Sampling = "replacement"

    def __post_init__(self):
        if self.sampling not in SAMPLINGS:
            raise ValueError(f"local sampling must be one of {SAMPLINGS}, got {self.sampling!r}")
        if self.epochs is None and self.steps < 1:
            raise ValueError(f"local steps must be >= 1, got {self.steps}")
        if self.epochs is not None and self.epochs <= 0:
            raise ValueError(f"local epochs must be > 0, got {self.epochs}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")

    def steps_per_epoch(self, count: jax.Array) -> jax.Array:
        if self.sampling == "full":
            return jnp.ones_like(count)
        return (count + self.batch_size - 1) // self.batch_size

    def max_steps(self, max_count: int) -> int:
        """Static length of the local scan for clients with up to `max_count` examples."""
        if self.epochs is None:
            return self.steps
        per_epoch = 1 if self.sampling == "full" else math.ceil(max_count / self.batch_size)
        return max(1, math.ceil(self.epochs * per_epoch))

    def num_steps(self, counts: jax.Array) -> jax.Array:
        """`[M]` int32 local steps of each client (0 for clients without data)."""
        if self.epochs is None:
            steps = jnp.full(counts.shape, self.steps, jnp.int32)
        else:
            steps = jnp.ceil(self.epochs * self.steps_per_epoch(counts)).astype(jnp.int32)
        return jnp.where(counts > 0, steps, 0)


@dataclasses.dataclass(frozen=True)
class CohortSpec:
    """Who participates in a round and how their updates are weighted.

    Attributes:
      size: clients per round M (None: full participation). For "bernoulli" sampling: the
        static capacity of the cohort buffer (None: all C clients, exact).
      sampling: "uniform" (M without replacement), "proportional" (M with replacement,
        P ~ n_i) or "bernoulli" (each client independently with `probability`; padding
        slots and empty rounds get weight 0, so an empty round leaves the model unchanged).
      weighting: "counts" (n_i), "uniform", or "auto" (counts, except uniform for
        proportional sampling, which is then unbiased).
      probability: participation probability p of "bernoulli" sampling.
      client_weights: optional fixed `[C]` aggregation weights (e.g. FedLPS' graph degrees
        p_i, `similarity.SimilarityGraph.degrees`); when given they replace `weighting`
        (clients without data still get 0). Stored as a tuple of floats.
    """

    size: int | None = None
    sampling: str = "uniform"
    weighting: Literal["auto", "counts", "uniform"] = "auto"
    probability: float | None = None
    client_weights: tuple[float, ...] | None = None

    def __post_init__(self):
        if self.client_weights is not None:
            w = np.asarray(self.client_weights, np.float64)
            if w.ndim != 1 or w.size == 0:
                raise ValueError(f"client_weights must be a non-empty [C] vector, got {w.shape}")
            if not np.isfinite(w).all() or w.min() < 0:
                raise ValueError("client_weights must be finite and >= 0")
            object.__setattr__(self, "client_weights", tuple(float(v) for v in w))
        if self.size is not None and self.size < 1:
            raise ValueError(f"cohort size must be >= 1, got {self.size}")
        if self.sampling not in ("uniform", "proportional", "bernoulli"):
            raise ValueError(
                f"cohort sampling must be uniform|proportional|bernoulli, got {self.sampling!r}"
            )
        if self.weighting not in ("auto", "counts", "uniform"):
            raise ValueError(f"weighting must be auto|counts|uniform, got {self.weighting!r}")
        if self.sampling == "bernoulli":
            if self.probability is None or not 0.0 < self.probability <= 1.0:
                raise ValueError(
                    f"bernoulli sampling needs a probability in (0, 1], got {self.probability}"
                )
        elif self.probability is not None:
            raise ValueError("probability is only used by sampling='bernoulli'")

    def check(self, num_clients: int) -> None:
        if self.client_weights is not None and len(self.client_weights) != num_clients:
            raise ValueError(
                f"client_weights has {len(self.client_weights)} entries for {num_clients} clients"
            )
        if self.size is not None and self.size > num_clients and self.sampling != "proportional":
            raise ValueError(
                f"cohort size {self.size} exceeds the number of clients ({num_clients})"
            )

    def sample(self, key: PRNGKey, counts: jax.Array) -> tuple[jax.Array, jax.Array]:
        """`(client ids [M], aggregation weights [M])`; empty clients get weight 0."""
        self.check(counts.shape[0])
        idx, selected = cohorts.sample(
            key,
            counts.shape[0],
            self.size,
            self.sampling,
            counts=counts,
            probability=self.probability,
        )
        n = counts[idx].astype(float_dtype())
        if self.client_weights is not None:
            fixed = jnp.asarray(self.client_weights, float_dtype())[idx]
            weights = jnp.where(n > 0, fixed, 0.0)
        else:
            weighting = self.weighting
            if weighting == "auto":
                weighting = "uniform" if self.sampling == "proportional" else "counts"
            weights = n if weighting == "counts" else (n > 0).astype(n.dtype)
        if selected is not None:
            weights = jnp.where(selected, weights, 0.0)
        return idx, weights

    def downloads(self, idx: jax.Array, weights: jax.Array) -> jax.Array:
        """Clients that receive the model in a round: the whole cohort, except for Bernoulli
        sampling, whose unselected padding slots are not clients of the round."""
        if self.sampling == "bernoulli":
            return jnp.sum(weights > 0)
        return jnp.int32(idx.shape[0])


@dataclasses.dataclass(frozen=True)
class Stragglers:
    """FedProx's systems heterogeneity (Li et al. 2020, Section 5.2).

    Exactly `round(fraction * M)` cohort clients (chosen by a per-client random rank, so the
    choice does not depend on cohort order) are stragglers. With `policy="partial"` (FedProx)
    a straggler runs a uniformly random amount of work in [1, E] epochs (or [1, steps]
    steps); with `policy="drop"` (FedAvg in that paper) its update is discarded.
    """

    fraction: float = 0.0
    policy: Literal["partial", "drop"] = "partial"

    def __post_init__(self):
        if not 0.0 <= self.fraction <= 1.0:
            raise ValueError(f"straggler fraction must be in [0, 1], got {self.fraction}")
        if self.policy not in ("partial", "drop"):
            raise ValueError(f"straggler policy must be partial|drop, got {self.policy!r}")

    def apply(
        self,
        key: PRNGKey,
        idx: jax.Array,
        counts: jax.Array,
        num_steps: jax.Array,
        weights: jax.Array,
        local: LocalSpec,
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Returns `(num_steps, weights, is_straggler)` for the cohort `idx`."""
        if self.fraction == 0.0:
            return num_steps, weights, jnp.zeros(idx.shape, bool)
        keys = jax.vmap(lambda i: client_key(key, i))(idx)
        rank_u = jax.vmap(lambda k: jax.random.uniform(jax.random.fold_in(k, 0)))(keys)
        num = round(self.fraction * idx.shape[0])
        ranks = jnp.argsort(jnp.argsort(rank_u))
        is_straggler = (ranks < num) & (counts > 0)
        if self.policy == "drop":
            return num_steps, jnp.where(is_straggler, 0.0, weights), is_straggler
        work_u = jax.vmap(lambda k: jax.random.uniform(jax.random.fold_in(k, 1)))(keys)
        if local.epochs is None:
            partial = 1 + jnp.floor(work_u * local.steps).astype(jnp.int32)
        else:
            max_epochs = max(1, int(math.ceil(local.epochs)))
            epochs = 1 + jnp.floor(work_u * max_epochs).astype(jnp.int32)
            partial = epochs * local.steps_per_epoch(counts)
        return (
            jnp.where(is_straggler, jnp.minimum(partial, num_steps), num_steps),
            weights,
            (is_straggler),
        )


# ------------------------------------------------------------------------------ local training
class LocalResult(NamedTuple):
    params: Params  # final local model
    opt_state: Any  # final client optimizer state
    aux: Any  # final hook state
    loss: jax.Array  # mean minibatch loss over the executed steps (at pre-step params)
    steps: jax.Array  # executed steps


# Local training draws at most this many with-replacement minibatch indices per client before
# its scan (one threefry call instead of one per step; on XLA:CPU each is a rolled loop whose
# per-step overhead dominated small rounds); longer local runs draw per step. Same values.
PREDRAW_LIMIT = 4096


def replacement_indices(
    key: PRNGKey, step: jax.Array, count: jax.Array, batch_size: int
) -> jax.Array:
    """Local step `step`'s minibatch indices `[batch_size]`, uniform with replacement over
    the client's `count` examples."""
    step_key = jax.random.fold_in(jax.random.fold_in(key, 0), step)
    return jax.random.randint(step_key, (batch_size,), 0, jnp.maximum(count, 1))


def minibatch(
    client: ClientData,
    key: PRNGKey,
    step: jax.Array,
    batch_size: int,
    sampling: Sampling,
    indices: jax.Array | None = None,
) -> Batch:
    """The minibatch of local step `step` of one client (padding rows masked out);
    `indices` `[batch_size]`: the step's `replacement_indices`, if already drawn."""
    n_max, n = client.x.shape[0], client.count
    if sampling == "full":
        return Batch(client.x, client.y, (jnp.arange(n_max) < n).astype(jnp.float32))
    if sampling == "replacement":
        idx = replacement_indices(key, step, n, batch_size) if indices is None else indices
        mask = jnp.full((batch_size,), n > 0, jnp.float32)
    else:
        if sampling == "epoch":
            per_epoch = jnp.maximum((n + batch_size - 1) // batch_size, 1)
            epoch, pos0 = step // per_epoch, (step % per_epoch) * batch_size
        else:  # "fixed": the first minibatch of one permutation, every step
            epoch, pos0 = jnp.int32(0), jnp.int32(0)
        u = jax.random.uniform(jax.random.fold_in(jax.random.fold_in(key, 1), epoch), (n_max,))
        perm = jnp.argsort(jnp.where(jnp.arange(n_max) < n, u, 2.0))
        pos = pos0 + jnp.arange(batch_size)
        idx = perm[jnp.minimum(pos, n_max - 1)]
        mask = (pos < n).astype(jnp.float32)
    return Batch(client.x[idx], client.y[idx], mask)


def default_grad_fn(value_and_grad: ValueAndGrad, params: Params, batch: Batch, aux: Any):
    loss, grads = value_and_grad(params, batch)
    return loss, grads, aux


def local_train(
    params: Params,
    client: ClientData,
    key: PRNGKey,
    *,
    loss_fn: LossFn,
    optimizer: optax.GradientTransformation,
    max_steps: int,
    num_steps: jax.Array | None = None,
    batch_size: int = 32,
    sampling: Sampling = "replacement",
    grad_fn: GradFn | None = None,
    aux: Any = None,
    opt_state: Any = None,
) -> LocalResult:
    """Runs one client's local optimisation: a `lax.scan` over `max_steps` steps.

    Step k draws a minibatch from the client's own `count` examples, computes
    `(loss, direction, aux) = grad_fn(value_and_grad(loss_fn), params, batch, aux)` (the
    default is the plain gradient) and applies `optimizer`. Steps `k >= num_steps` (unequal
    local work, stragglers, empty clients) leave params, optimizer state and aux unchanged,
    so a client with `num_steps = s` gives exactly the result of an `s`-step run.

    Args:
      params: starting model (the broadcast global model).
      client: the client's padded data (`data.client(i)`).
      key: the client's key (`client_key(...)`).
      loss_fn: `loss_fn(params, batch) -> scalar`, masked mean over the batch.
      optimizer: optax client optimizer; its state starts at `opt_state` (or a fresh init).
      max_steps: static scan length. num_steps: traced number of active steps (None: all).
      grad_fn: hook that customises the local direction (FedProx' proximal term, SCAFFOLD's
        control variates, SAM, momentum...). `aux` is threaded through it across steps.
    """
    grad_fn = grad_fn or default_grad_fn
    value_and_grad = jax.value_and_grad(loss_fn)
    # inside a sharded client map, replicated inputs become per-device values first (so that
    # gradients and optimizer states are local); a no-op otherwise
    params, aux = to_varying((params, aux))
    opt_state = optimizer.init(params) if opt_state is None else to_varying(opt_state)
    masked = num_steps is not None

    steps = jnp.arange(max_steps)
    draws = None  # [max_steps, batch_size] when drawn before the scan
    if sampling == "replacement" and max_steps * batch_size <= PREDRAW_LIMIT:
        draws = jax.vmap(lambda k: replacement_indices(key, k, client.count, batch_size))(steps)

    def body(carry, step):
        p, s, a, loss_sum = carry
        indices = None if draws is None else draws[step]
        batch = minibatch(client, key, step, batch_size, sampling, indices)
        loss, direction, new_a = grad_fn(value_and_grad, p, batch, a)
        updates, new_s = optimizer.update(direction, s, p)
        new_p = optax.apply_updates(p, updates)
        if masked:
            active = step < num_steps
            keep = lambda new, old: jnp.where(active, new, old)
            new_p, new_s, new_a = (
                jax.tree.map(keep, *t) for t in ((new_p, p), (new_s, s), (new_a, a))
            )
            loss = jnp.where(active, loss, 0.0)
        return (new_p, new_s, new_a, loss_sum + loss.astype(loss_sum.dtype)), None

    init = (params, opt_state, aux, to_varying(jnp.zeros(())))
    (params, opt_state, aux, loss_sum), _ = lax.scan(body, init, steps)
    executed = jnp.asarray(max_steps, jnp.int32) if num_steps is None else num_steps
    return LocalResult(params, opt_state, aux, loss_sum / jnp.maximum(executed, 1), executed)


# ------------------------------------------------------------------------------ aggregation
def tree_sub(a: Params, b: Params) -> Params:
    return jax.tree.map(jnp.subtract, a, b)


def tree_add(a: Params, b: Params) -> Params:
    return jax.tree.map(jnp.add, a, b)


def tree_scale(a: Params, s: jax.Array) -> Params:
    return jax.tree.map(lambda x: x * s, a)


def tree_norm(tree: Params) -> jax.Array:
    return jnp.sqrt(sum(jnp.sum(jnp.square(x)) for x in jax.tree.leaves(tree)))


def tree_sq_norm(tree: Params) -> jax.Array:
    return sum(jnp.sum(jnp.square(x)) for x in jax.tree.leaves(tree))


def consistency(mean_sq_norm: jax.Array, mean_delta: Params) -> jax.Array:
    """The FedMIM paper's local consistency `C_t = sum_i w_i ||x_i - xbar||^2 / sum_i w_i`
    (dispersion of the cohort's local models x_i around their weighted mean xbar), from the
    weighted means of `||Delta_i||^2` and of `Delta_i = x_i - x_t`:
    `C_t = mean ||Delta_i||^2 - ||mean Delta_i||^2` (clipped at 0 against round-off)."""
    return jnp.maximum(mean_sq_norm - tree_sq_norm(mean_delta), 0.0)


def tree_all_finite(tree: Params) -> jax.Array:
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))


def weighted_mean(stacked: Params, weights: jax.Array) -> Params:
    """`sum_i w_i x_i / sum_i w_i` over axis 0 (zeros when all weights are 0)."""
    total = jnp.sum(weights)
    scale = jnp.where(total > 0, 1.0 / jnp.where(total > 0, total, 1.0), 0.0)
    return jax.tree.map(lambda x: jnp.tensordot(weights * scale, x, axes=1), stacked)


class Cohort(NamedTuple):
    """A round's cohort, as the hooks' `prepare` and the aggregator's `reduce` see it."""

    ids: jax.Array  # [M] client ids
    weights: jax.Array  # [M] aggregation weights (0: does not contribute)
    round: jax.Array  # []
    num_clients: int  # C


class CohortResult(NamedTuple):
    mean: Any  # weighted mean over the cohort of the summands
    outputs: Any  # stacked per-client outputs [M, ...]
    total_weight: jax.Array


def map_weighted_sum(
    client_fn: Callable[..., tuple[Any, Any]],
    ids: jax.Array,
    weights: jax.Array,
    *inputs: Any,
    client_map: ClientMap = ClientMap(),
) -> tuple[Any, jax.Array, Any]:
    """Runs `client_fn(client_id, *inputs_i) -> (summand, output)` over the cohort and returns
    `(sum_i w_i summand_i, sum_i w_i, stacked outputs)`; the sum is accumulated without
    materialising `[M, d]` in `map` mode."""

    def weighted(cid, w, *xs):
        summand, out = client_fn(cid, *xs)
        return (jax.tree.map(lambda s: s * w, summand), w), out

    (total, total_w), outs = client_map.map_sum(weighted, ids, weights, *inputs)
    return total, total_w, outs


def mean_of_total(total: Any, total_weight: jax.Array) -> Any:
    """`total / total_weight` (zeros when the weight is 0)."""
    scale = jnp.where(total_weight > 0, 1.0 / jnp.where(total_weight > 0, total_weight, 1.0), 0.0)
    return jax.tree.map(lambda s: s * scale, total)


def map_cohort(
    client_fn: Callable[..., tuple[Any, Any]],
    ids: jax.Array,
    weights: jax.Array,
    *inputs: Any,
    client_map: ClientMap = ClientMap(),
) -> CohortResult:
    """Runs `client_fn(client_id, *inputs_i) -> (summand, output)` over the cohort and returns
    the `weights`-weighted mean of the summands (accumulated without materialising `[M, d]`
    in `map` mode) and the stacked outputs."""
    total, total_w, outs = map_weighted_sum(client_fn, ids, weights, *inputs, client_map=client_map)
    return CohortResult(mean_of_total(total, total_w), outs, total_w)


def server_update(
    params: Params,
    mean_delta: Params,
    optimizer: optax.GradientTransformation,
    opt_state: Any,
    apply: jax.Array | bool = True,
) -> tuple[Params, Any]:
    """Applies the server optimizer to the pseudo-gradient `-mean_delta` (Reddi et al. 2021):
    `optax.sgd(1)` is plain averaging, `sgd(lr, momentum)` FedAvgM, `adam` FedAdam, ...
    With `apply=False` (e.g. nobody contributed) params and optimizer state are unchanged."""
    pseudo_grad = jax.tree.map(jnp.negative, mean_delta)
    updates, new_state = optimizer.update(pseudo_grad, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    keep = lambda new, old: jnp.where(apply, new, old)
    return jax.tree.map(keep, new_params, params), jax.tree.map(keep, new_state, opt_state)


def payload_metrics(
    params: Params,
    uploads: jax.Array,
    downloads: jax.Array,
    up_models: float = 1.0,
    down_models: float = 1.0,
) -> Metrics:
    """`bytes_up`/`bytes_down` of a round: `uploads` clients each send `up_models` model-sized
    vectors, `downloads` clients each receive `down_models` of them."""
    size = float(tree_size_bytes(params))
    return {
        "bytes_up": uploads.astype(jnp.float32) * size * up_models,
        "bytes_down": downloads.astype(jnp.float32) * size * down_models,
    }
