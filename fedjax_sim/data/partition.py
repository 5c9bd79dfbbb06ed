"""Partitioners: pure functions `(labels, num_clients, seed, ...) -> client_ids [N]`.

Every partitioner returns the client of each example, so "every example is assigned exactly
once" holds by construction; `fedjax_sim.data.pack` turns the assignment into padded
`FederatedData`. All are vectorised NumPy (no Python loop over clients; at most a loop over
classes) and deterministic given `seed`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

Seed = int | np.random.Generator


def _rng(seed: Seed) -> np.random.Generator:
    return seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)


def _check(labels: np.ndarray, num_clients: int) -> np.ndarray:
    labels = np.asarray(labels)
    if labels.ndim != 1:
        raise ValueError(f"labels must be 1-D, got shape {labels.shape}")
    if labels.size == 0:
        raise ValueError("cannot partition an empty dataset (0 examples)")
    if num_clients < 1:
        raise ValueError(f"num_clients must be >= 1, got {num_clients}")
    return labels


def _split_evenly(order: np.ndarray, num_clients: int) -> np.ndarray:
    """Example `order[j]` goes to client `floor(j * C / N)` (sizes differ by at most 1)."""
    ids = np.empty(order.size, np.int32)
    ids[order] = (np.arange(order.size, dtype=np.int64) * num_clients // order.size).astype(
        np.int32
    )
    return ids


def iid(labels: np.ndarray, num_clients: int, seed: Seed = 0) -> np.ndarray:
    """Uniformly random, equal-size (+-1) split (needs at least one example per client)."""
    labels = _check(labels, num_clients)
    if num_clients > labels.size:
        raise ValueError(
            f"iid: {num_clients} clients but only {labels.size} examples; an equal split "
            f"cannot leave clients empty (use dirichlet or fewer clients)"
        )
    return _split_evenly(_rng(seed).permutation(labels.size), num_clients)


def sample_dirichlet(rng: np.random.Generator, alpha: float, size: tuple[int, ...]) -> np.ndarray:
    """Dirichlet(alpha * 1) over the last axis, sampled in log space.

    `Gamma(alpha)` underflows to exactly 0 for small alpha (all zeros -> 0/0 = NaN in the
    textbook sampler). With `log G = log Gamma(alpha + 1) + log(U) / alpha` (Marsaglia-Tsang's
    boost) and a softmax, alpha = 1e-3 gives a valid, nearly one-hot vector.
    """
    if not 0 < alpha < np.inf:
        raise ValueError(f"Dirichlet alpha must be finite and > 0, got {alpha}")
    log_g = np.log(rng.gamma(alpha + 1.0, size=size)) + np.log(rng.uniform(size=size)) / alpha
    log_g -= log_g.max(axis=-1, keepdims=True)
    p = np.exp(log_g)
    return p / p.sum(axis=-1, keepdims=True)


def dirichlet(
    labels: np.ndarray, num_clients: int, seed: Seed = 0, *, alpha: float = 0.5
) -> np.ndarray:
    """Label skew: for each class c, proportions `q_c ~ Dir(alpha * 1_C)` over clients.

    Examples of class c are shuffled and cut at `round(cumsum(q_c) * n_c)`, so client i
    receives about `q_{c,i} * n_c` of them (Yurochkin et al. 2019; Hsu et al. 2019 draw the
    transpose). Small alpha -> each class concentrated on few clients; large alpha -> iid.
    Clients may end up empty for small alpha (counts 0 are allowed downstream).
    """
    labels = _check(labels, num_clients)
    rng = _rng(seed)
    classes, inverse = np.unique(labels, return_inverse=True)
    ids = np.empty(labels.size, np.int32)
    props = sample_dirichlet(rng, alpha, (classes.size, num_clients))  # [K, C]
    for c in range(classes.size):  # loop over classes, not clients
        members = rng.permutation(np.flatnonzero(inverse == c))
        cuts = np.round(np.cumsum(props[c]) * members.size).astype(np.int64)
        owner = np.searchsorted(cuts, np.arange(members.size), side="right")
        ids[members] = np.minimum(owner, num_clients - 1)
    return ids


def shards(
    labels: np.ndarray, num_clients: int, seed: Seed = 0, *, per_client: int = 2
) -> np.ndarray:
    """McMahan et al. (2017) pathological non-iid split: sort by label, cut into
    `num_clients * per_client` equal shards, give each client `per_client` random shards."""
    labels = _check(labels, num_clients)
    if per_client < 1:
        raise ValueError(f"per_client must be >= 1, got {per_client}")
    num_shards = num_clients * per_client
    if num_shards > labels.size:
        raise ValueError(
            f"shards: {num_clients} clients x {per_client} shards needs at least {num_shards} "
            f"examples, got {labels.size}"
        )
    rng = _rng(seed)
    shuffled = rng.permutation(labels.size)
    by_label = shuffled[np.argsort(labels[shuffled], kind="stable")]
    shard_of_position = np.arange(labels.size, dtype=np.int64) * num_shards // labels.size
    owner_of_shard = rng.permutation(num_shards) // per_client
    ids = np.empty(labels.size, np.int32)
    ids[by_label] = owner_of_shard[shard_of_position]
    return ids


def quantity_skew(
    labels: np.ndarray,
    num_clients: int,
    seed: Seed = 0,
    *,
    sigma: float = 1.0,
    min_size: int = 1,
) -> np.ndarray:
    """Log-normal client sizes: `n_i = min_size + share_i`, shares proportional to
    `LogNormal(0, sigma)` draws (largest-remainder rounding, so sizes sum to N); examples iid."""
    labels = _check(labels, num_clients)
    if not 0 <= sigma < np.inf:
        raise ValueError(f"sigma must be finite and >= 0, got {sigma}")
    if min_size * num_clients > labels.size:
        raise ValueError(
            f"quantity_skew: min_size={min_size} x {num_clients} clients exceeds "
            f"{labels.size} examples"
        )
    rng = _rng(seed)
    weights = rng.lognormal(0.0, sigma, size=num_clients)
    rest = labels.size - min_size * num_clients
    raw = weights / weights.sum() * rest
    sizes = np.floor(raw).astype(np.int64)
    leftover = rest - sizes.sum()
    sizes[np.argsort(sizes - raw)[:leftover]] += 1  # largest remainders first
    sizes += min_size
    owner = np.repeat(np.arange(num_clients, dtype=np.int32), sizes)
    ids = np.empty(labels.size, np.int32)
    ids[rng.permutation(labels.size)] = owner
    return ids


def natural(groups: np.ndarray) -> tuple[np.ndarray, int]:
    """Natural split: one client per distinct group id (speaker, writer, domain, ...).

    Returns `(client_ids, num_clients)`; clients are numbered in sorted group order.
    """
    groups = np.asarray(groups)
    if groups.ndim != 1 or groups.size == 0:
        raise ValueError(f"groups must be a non-empty 1-D array, got shape {groups.shape}")
    uniq, ids = np.unique(groups, return_inverse=True)
    return ids.astype(np.int32), int(uniq.size)


PARTITIONERS: dict[str, Callable[..., np.ndarray]] = {
    "iid": iid,
    "dirichlet": dirichlet,
    "shards": shards,
    "quantity_skew": quantity_skew,
}


def partition(
    name: str, labels: np.ndarray, num_clients: int, seed: Seed = 0, **kwargs: Any
) -> np.ndarray:
    """Dispatches to a registered partitioner by name."""
    if name not in PARTITIONERS:
        raise ValueError(f"unknown partitioner {name!r}; choose from {sorted(PARTITIONERS)}")
    return PARTITIONERS[name](labels, num_clients, seed, **kwargs)


# ==============================================================================================
# Beikmohammadi, Khirirat, Magnusson (IEEE Trans. Big Data 2024) partitions (issue 6; spec
# docs/specs/stepsizes_no_similarity.md section 4): IID shards, Non-IID2, Non-IID1.
# Each client is one class index, so these need num_clients == number of classes (10 in the
# paper) except `iid_shards`. Apply the same partitioner to the train and the test labels to
# get the paper's per-client test shards.
# ==============================================================================================
def _classes(labels: np.ndarray, num_clients: int, name: str) -> tuple[np.ndarray, np.ndarray]:
    """`(sorted classes, class index of each example)`; checks one client per class."""
    classes, inverse = np.unique(labels, return_inverse=True)
    if classes.size != num_clients:
        raise ValueError(
            f"{name} gives client i the examples of class i: it needs num_clients == number of "
            f"classes ({classes.size}), got num_clients={num_clients}"
        )
    return classes, inverse


def iid_shards(labels: np.ndarray, num_clients: int, seed: Seed = 0) -> np.ndarray:
    """The paper's IID split: a random shuffle cut into `num_clients` contiguous equal shards
    (6000 train / 1000 test each for 10 clients; sizes differ by at most 1 otherwise)."""
    return iid(labels, num_clients, seed)


def one_class(labels: np.ndarray, num_clients: int, seed: Seed = 0) -> np.ndarray:
    """Non-IID1 ("extremely low similarity"): client i holds all examples of class i (the i-th
    smallest label). Deterministic; `seed` is unused."""
    labels = _check(labels, num_clients)
    _, inverse = _classes(labels, num_clients, "one_class")
    return inverse.astype(np.int32)


def class_halves(
    labels: np.ndarray, num_clients: int, seed: Seed = 0, *, pairing: str = "next"
) -> np.ndarray:
    """Non-IID2 ("low similarity"): each class is shuffled and cut into two halves (half 0
    gets `floor(n_c / 2)` examples); `pairing="next"` (the authors' code, default) gives
    client i half 0 of class i and half 1 of class (i + 1) mod C; `pairing="random"` (the
    paper's wording, spec 7.6) deals the 2C chunks out at random, two per client, each chunk
    used once (a client may then get both halves of one class)."""
    labels = _check(labels, num_clients)
    _, inverse = _classes(labels, num_clients, "class_halves")
    if pairing not in ("next", "random"):
        raise ValueError(f"class_halves pairing must be 'next' or 'random', got {pairing!r}")
    rng = _rng(seed)
    owner_of_chunk = (  # chunk 2c + h = half h of class c
        np.stack([np.arange(num_clients), (np.arange(num_clients) - 1) % num_clients], 1)
        .reshape(-1)
        .astype(np.int32)
    )
    if pairing == "random":
        owner_of_chunk = (rng.permutation(2 * num_clients) // 2).astype(np.int32)
    ids = np.empty(labels.size, np.int32)
    for c in range(num_clients):  # loop over classes, not clients
        members = rng.permutation(np.flatnonzero(inverse == c))
        half = members.size // 2
        ids[members[:half]] = owner_of_chunk[2 * c]
        ids[members[half:]] = owner_of_chunk[2 * c + 1]
    return ids


PARTITIONERS.update(
    {"iid_shards": iid_shards, "one_class": one_class, "class_halves": class_halves}
)


# ------------------------------------------------------------------------------ group DRO (issue 7)
# Partitioners for federated group DRO (spec docs/specs/fgdro.md, sections 4 and 7.13).


def natural_groups(
    labels: np.ndarray, num_clients: int, seed: Seed = 0, *, groups: np.ndarray
) -> np.ndarray:
    """Natural split as a registered partitioner ("natural"): one client per distinct value of
    the group-id column `groups [N]` (domain, hospital, speaker, ...), clients numbered in
    sorted group order. `num_clients` must equal the number of distinct groups."""
    del seed
    labels = _check(labels, num_clients)
    groups = np.asarray(groups)
    if groups.shape != labels.shape:
        raise ValueError(
            f"groups must have shape {labels.shape} (one id per example), got {groups.shape}"
        )
    ids, found = natural(groups)
    if found != num_clients:
        raise ValueError(
            f"the group column has {found} distinct groups but num_clients={num_clients}"
        )
    return ids


def imbalanced_dirichlet(
    labels: np.ndarray,
    num_clients: int,
    seed: Seed = 0,
    *,
    alpha: float = 0.3,
    reduced_classes: tuple[int, ...] = (5, 6, 7, 8, 9),
    keep_fraction: float = 0.2,
) -> np.ndarray:
    """Class-imbalanced Dirichlet split (FGDRO paper, App. G; Shen et al. 2021's protocol).

    Keeps a random `keep_fraction` of the examples of each class in `reduced_classes` (the
    paper: 5 classes reduced by 80%), drops the rest (client id -1; `pack`/`federate` skip
    them), then splits the kept examples with `dirichlet(alpha)` over `num_clients`.
    """
    labels = _check(labels, num_clients)
    if not 0.0 < keep_fraction <= 1.0:
        raise ValueError(f"keep_fraction must be in (0, 1], got {keep_fraction}")
    rng = _rng(seed)
    keep = np.ones(labels.size, bool)
    for c in reduced_classes:  # loop over (a few) classes
        members = rng.permutation(np.flatnonzero(labels == c))
        keep[members[int(round(keep_fraction * members.size)) :]] = False
    ids = np.full(labels.size, -1, np.int32)
    ids[keep] = dirichlet(labels[keep], num_clients, rng, alpha=alpha)
    return ids


PARTITIONERS["natural"] = natural_groups
PARTITIONERS["imbalanced_dirichlet"] = imbalanced_dirichlet


# ==============================================================================================
# Hsu et al. (2019) class mix x log-normal client sizes, as used by the FedLPS paper
# (Buttaci & Calafiore; spec docs/specs/fedlps_local_perturbation.md, section 4 and A7).
# ==============================================================================================
def lognormal_sizes(
    num_examples: int, num_clients: int, sigma: float, seed: Seed = 0
) -> np.ndarray:
    """`[C]` client sizes summing to `num_examples`: `s_i = exp(ln(N/C) + sigma z_i)`,
    `z_i ~ N(0, 1)`, rescaled to sum N (largest-remainder rounding). `sigma = 0`: equal (+-1)."""
    if not 0 <= sigma < np.inf:
        raise ValueError(f"data imbalance (log-normal sigma) must be finite and >= 0, got {sigma}")
    if num_clients < 1 or num_examples < 1:
        raise ValueError(
            f"need num_clients >= 1 and num_examples >= 1, got {num_clients}, {num_examples}"
        )
    z = _rng(seed).standard_normal(num_clients) if sigma > 0 else np.zeros(num_clients)
    raw = np.exp(np.log(num_examples / num_clients) + sigma * z)
    raw = raw / raw.sum() * num_examples
    sizes = np.floor(raw).astype(np.int64)
    sizes[np.argsort(sizes - raw, kind="stable")[: num_examples - sizes.sum()]] += 1
    return sizes


def _fit_marginals(demand: np.ndarray, rows: np.ndarray, cols: np.ndarray, iters: int):
    """Iterative proportional fitting (Sinkhorn): rescale rows and columns of `demand`
    `[C, K]` to sums `rows` and `cols` while keeping its cross-ratios (its class skew)."""
    m = demand.copy()
    for _ in range(iters):  # loop over fitting iterations, not clients
        rs = m.sum(axis=1)
        m *= np.where(rs > 0, rows / np.where(rs > 0, rs, 1.0), 0.0)[:, None]
        cs = m.sum(axis=0)
        m *= np.where(cs > 0, cols / np.where(cs > 0, cs, 1.0), 0.0)[None, :]
        if np.abs(m.sum(axis=1) - rows).max() <= 1e-9 * max(rows.max(), 1):
            break
    return m


def _round_columns(m: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """Integer matrix with column sums `cols`: floor, then +1 on the largest remainders."""
    base = np.floor(m).astype(np.int64)
    deficit = cols - base.sum(axis=0)  # [K]
    order = np.argsort(-(m - base), axis=0, kind="stable")  # [C, K] largest remainder first
    rank = np.empty_like(order)
    np.put_along_axis(rank, order, np.arange(m.shape[0])[:, None], axis=0)
    return base + (rank < deficit[None, :])


def hsu(
    labels: np.ndarray,
    num_clients: int,
    seed: Seed = 0,
    *,
    class_imbalance: float = 0.0,
    data_imbalance: float = 0.0,
    fit_iterations: int = 2000,
) -> np.ndarray:
    """FedLPS' partition after Hsu et al. (2019): class mix `q_i ~ Dir((1/a) 1_K)` and size
    `N_i ~ exp(ln(N/C) + b z)` per client; client i gets about `N_i q_ik` examples of class k.

    Args:
      class_imbalance: `a >= 0`; `a = 0` is the exact balanced mix (every client gets the
        class frequencies of the data, i.e. the same number of each class when they divide).
      data_imbalance: `b >= 0`, log-normal sigma of the sizes (`lognormal_sizes`).
      fit_iterations: iterations of the marginal fitting below.

    The demands `N_i q_ik` generally exceed what some classes hold. They are rescaled by
    iterative proportional fitting to row sums `N_i` and class totals `n_k` (every example is
    assigned once; the leftover is spread while the cross-ratios of the demand, i.e. the
    requested class skew, are kept), then rounded per class (largest remainder). Client sizes
    end within about K/2 of `N_i`. Vectorised except a loop over classes.
    """
    labels = _check(labels, num_clients)
    if class_imbalance < 0:
        raise ValueError(f"class imbalance a must be >= 0, got {class_imbalance}")
    rng = _rng(seed)
    classes, inverse = np.unique(labels, return_inverse=True)
    per_class = np.bincount(inverse).astype(np.float64)  # [K]
    sizes = lognormal_sizes(labels.size, num_clients, data_imbalance, rng).astype(np.float64)
    if class_imbalance == 0:
        mix = np.broadcast_to(per_class / per_class.sum(), (num_clients, classes.size))
    else:
        mix = sample_dirichlet(rng, 1.0 / class_imbalance, (num_clients, classes.size))
    demand = sizes[:, None] * np.maximum(mix, 1e-12)  # strictly positive: always fittable
    counts = _round_columns(
        _fit_marginals(demand, sizes, per_class, fit_iterations), per_class.astype(np.int64)
    )  # [C, K]
    ids = np.empty(labels.size, np.int32)
    owners = np.arange(num_clients, dtype=np.int32)
    for c in range(classes.size):  # loop over classes, not clients
        members = rng.permutation(np.flatnonzero(inverse == c))
        ids[members] = np.repeat(owners, counts[:, c])
    return ids


PARTITIONERS["hsu"] = hsu
