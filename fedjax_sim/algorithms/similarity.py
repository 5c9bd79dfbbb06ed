"""The one-off similarity graph of FedLPS: client messages and graph weights.

Buttaci & Calafiore, "Aiding Global Convergence in Federated Learning via Local Perturbation
and Mutual Similarity Information" (spec: docs/specs/fedlps_local_perturbation.md,
section 2.2 and resolutions A4, A5).

Before round 0 every client sends one unit-norm *message* `m_i`, the first principal
component of its local features **without centering or scaling** (the top right singular
vector of `X_i`, `[N_i, d]`). The server builds a complete graph with weights
`A_in = -ln(mis(i, n))`, `mis(i, n) = (1 - m_i.m_n) / 2 = ||m_i - m_n||^2 / 4`, clipped to
`[eps, 1]`, and normalises them into pair weights `p_in = A_in / 1'A1` and degrees
`p_i = sum_n p_in` (the aggregation weights of the paper's "Adjacency" scheme).

`client_messages` runs on device for all clients at once (batched over the padded
`[C, N_max, ...]` array, rows `>= counts[i]` masked to zero, which leaves `X_i'X_i` and the
mean unchanged): an exact batched `eigh` of `X_i'X_i` for small `d`, or a block power
(subspace) iteration with a Rayleigh-Ritz step, which only needs products with `X_i` and
`X_i'`, for large `d` (a batched `d x d` eigh of 100 Fashion-MNIST clients takes ~80 s on two
CPU cores, the subspace iteration ~1 s). The graph itself is a small `C x C` computation done
on the host in float64.

Deviations / resolutions:
- Messages are computed in the default float dtype (float64 only under `jax.enable_x64`; the
  spec recommends float64). The misalignment uses the form `||m_i - m_n||^2 / 4`, which does
  not cancel catastrophically for nearly equal messages, in float64.
- Sign (A4): `m_i' mean(X_i) >= 0`; when that product is zero up to round-off
  (`|m_i' sum_n x_n| <= 8 eps sqrt(d) sum_n ||x_n||`), `sum(m_i) >= 0`.
- Clients without data (A5) have no message: their rows and columns of A are 0, so `p_i = 0`.
  A client *with* data whose features are all zero has no defined message: `ValueError`.
"""

from __future__ import annotations

import functools
import math
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from fedjax_sim.algorithms.core import float_dtype
from fedjax_sim.data.federated import FederatedData

MessageMethod = Literal["auto", "eigh", "subspace"]
EIGH_MAX_DIM = 256  # "auto" uses the exact eigh up to this feature dimension
DEFAULT_EPS = 1e-12


# ------------------------------------------------------------------------------ messages
def client_messages(
    x: jax.Array,
    counts: jax.Array,
    *,
    method: MessageMethod = "auto",
    rank: int = 8,
    iterations: int = 60,
) -> jax.Array:
    """`[C, d]` first principal components (uncentred, unscaled) of every client's features.

    Args:
      x: `[C, N_max, *feature_shape]` padded features (rows `>= counts[i]` are ignored).
      counts: `[C]` number of valid rows of each client.
      method: "eigh" (exact, `O(C d^3)`), "subspace" (block power iteration of width `rank`
        for `iterations` steps, then Rayleigh-Ritz; error `~(s_{rank+1}/s_1)^(2 iterations)`),
        or "auto" (eigh for `d <= 256`, else subspace).

    Returns:
      Unit rows `m_i` oriented with `m_i' mean(X_i) >= 0`; all-zero rows for clients whose
      `X_i` is zero (no data, or all-zero features).
    """
    x = jnp.asarray(x)
    counts = jnp.asarray(counts)
    if x.ndim < 3:
        raise ValueError(f"x must have shape [C, N_max, *features], got {x.shape}")
    if counts.shape != x.shape[:1]:
        raise ValueError(f"counts must have shape [{x.shape[0]}], got {counts.shape}")
    if method not in ("auto", "eigh", "subspace"):
        raise ValueError(f"method must be auto|eigh|subspace, got {method!r}")
    if rank < 1 or iterations < 1:
        raise ValueError(f"rank and iterations must be >= 1, got {rank}, {iterations}")
    dim = math.prod(x.shape[2:])
    if method == "auto":
        method = "eigh" if dim <= EIGH_MAX_DIM else "subspace"
    return _messages(x, counts, method, min(rank, dim), iterations)


@functools.partial(jax.jit, static_argnums=(2, 3, 4))
def _messages(x, counts, method, rank, iterations):
    dtype = float_dtype()
    num, n_max = x.shape[:2]
    rows = jnp.arange(n_max)[None, :] < counts[:, None]  # [C, N_max]
    xf = jnp.where(rows[..., None], x.reshape(num, n_max, -1).astype(dtype), 0.0)  # [C, N, d]
    if method == "eigh":
        gram = jnp.einsum("cnd,cne->cde", xf, xf, precision=lax.Precision.HIGHEST)
        evals, evecs = jnp.linalg.eigh(gram)
        top, scale = evecs[..., -1], evals[..., -1]  # [C, d], [C]
    else:
        top, scale = jax.vmap(lambda xc: _top_subspace(xc, rank, iterations))(xf)
    total = jnp.sum(xf, axis=1)  # [C, d], N_i * mean(X_i)
    dot = jnp.sum(top * total, axis=-1)
    eps = jnp.finfo(dtype).eps
    scale_sum = jnp.sum(jnp.linalg.norm(xf, axis=-1), axis=1)  # [C] sum_n ||x_n||
    tol = 8 * eps * math.sqrt(top.shape[-1]) * scale_sum  # round-off level of m' sum_n x_n
    fallback = jnp.where(jnp.sum(top, axis=-1) < 0, -1.0, 1.0)
    sign = jnp.where(jnp.abs(dot) > tol, jnp.sign(dot), fallback)
    defined = scale > 0  # X_i' X_i != 0
    return jnp.where(defined[:, None], top * sign[:, None], 0.0)


def _top_subspace(xc: jax.Array, rank: int, iterations: int) -> tuple[jax.Array, jax.Array]:
    """Top eigenvector (and eigenvalue) of `xc' xc`, `xc` `[N, d]`, by block power iteration."""
    d = xc.shape[1]
    hp = lax.Precision.HIGHEST
    # fixed start: deterministic, shared by every client (no key needed for a one-off step)
    v0 = jax.random.normal(jax.random.key(0), (d, rank), xc.dtype)
    v0 = v0 + jnp.sum(xc, axis=0)[:, None] / jnp.maximum(xc.shape[0], 1)

    def body(_, v):
        v, _ = jnp.linalg.qr(jnp.matmul(xc.T, jnp.matmul(xc, v, precision=hp), precision=hp))
        return v

    v = lax.fori_loop(0, iterations, body, jnp.linalg.qr(v0)[0])
    xv = jnp.matmul(xc, v, precision=hp)  # [N, rank]
    evals, evecs = jnp.linalg.eigh(jnp.matmul(xv.T, xv, precision=hp))  # Rayleigh-Ritz
    return jnp.matmul(v, evecs[:, -1], precision=hp), evals[-1]


# ------------------------------------------------------------------------------ graph
class SimilarityGraph(NamedTuple):
    """The FedLPS similarity graph (host numpy arrays, float64).

    Attributes:
      messages: `[C, d]` unit messages (zero rows for clients without one).
      misalignment: `[C, C]` `mis(i, n)` clipped to `[eps, 1]` (diagonal 0).
      adjacency: `[C, C]` `A_in = -ln mis(i, n)`, symmetric, zero diagonal.
      pair_weights: `[C, C]` `p_in = A_in / 1'A1` (sums to 1).
      degrees: `[C]` `p_i = sum_n p_in` (sums to 1): the aggregation weights.
    """

    messages: np.ndarray
    misalignment: np.ndarray
    adjacency: np.ndarray
    pair_weights: np.ndarray
    degrees: np.ndarray

    @property
    def num_clients(self) -> int:
        return int(self.degrees.shape[0])

    @property
    def row_normalised(self) -> np.ndarray:
        """`[C, C]` `p_in / p_i` (rows sum to 1); all-zero rows where `p_i = 0`."""
        p = self.degrees[:, None]
        return np.where(p > 0, self.pair_weights / np.where(p > 0, p, 1.0), 0.0)

    @property
    def laplacian(self) -> np.ndarray:
        """`[C, C]` `diag(A 1) - A` (used in the paper's graph analysis, Appendix C.6)."""
        return np.diag(self.adjacency.sum(axis=1)) - self.adjacency


def similarity_graph(
    messages: np.ndarray | jax.Array,
    *,
    valid: np.ndarray | jax.Array | None = None,
    eps: float = DEFAULT_EPS,
) -> SimilarityGraph:
    """Builds the graph from `[C, d]` messages (normalised to unit norm).

    Args:
      messages: one message per client; rows with `valid=False` are ignored (row/column of A
        set to 0, so `p_i = 0`), e.g. clients without data.
      valid: `[C]` bool (default: all clients).
      eps: lower clip of the misalignment (A5); identical messages get `A = -ln(eps)`.

    Raises:
      ValueError: bad shapes, non-finite or zero-norm messages of valid clients, eps outside
        (0, 1), or a graph without any positive edge (e.g. fewer than two valid clients).
    """
    m = np.asarray(messages, np.float64)
    if m.ndim != 2:
        raise ValueError(f"messages must have shape [C, d], got {m.shape}")
    num = m.shape[0]
    valid = np.ones(num, bool) if valid is None else np.asarray(valid, bool)
    if valid.shape != (num,):
        raise ValueError(f"valid must have shape [{num}], got {valid.shape}")
    if not 0 < eps < 1:
        raise ValueError(f"eps must be in (0, 1), got {eps}")
    if not np.isfinite(m[valid]).all():
        raise ValueError("messages contain NaN/Inf")
    norms = np.linalg.norm(m, axis=1)
    zero = valid & (norms == 0)
    if zero.any():
        raise ValueError(
            f"messages of clients {np.flatnonzero(zero).tolist()} have zero norm: their first "
            "principal component is undefined (all-zero features?); mark them invalid"
        )
    unit = np.where(valid[:, None], m / np.where(norms > 0, norms, 1.0)[:, None], 0.0)
    diff = unit[:, None, :] - unit[None, :, :]
    mis = np.clip(np.sum(diff * diff, axis=-1) / 4.0, eps, 1.0)  # (1 - m_i.m_n) / 2
    pair = valid[:, None] & valid[None, :] & ~np.eye(num, dtype=bool)
    mis = np.where(np.eye(num, dtype=bool), 0.0, mis)
    adjacency = np.where(pair, -np.log(np.where(pair, mis, 1.0)), 0.0)
    adjacency = 0.5 * (adjacency + adjacency.T)  # exact symmetry
    total = adjacency.sum()
    if not total > 0:
        raise ValueError(
            "the similarity graph has no positive edge (fewer than two valid clients, or all "
            "messages pairwise opposite); FedLPS weights are undefined"
        )
    pair_weights = adjacency / total
    return SimilarityGraph(
        messages=unit,
        misalignment=mis,
        adjacency=adjacency,
        pair_weights=pair_weights,
        degrees=pair_weights.sum(axis=1),
    )


def graph_from_data(
    data: FederatedData,
    *,
    method: MessageMethod = "auto",
    rank: int = 8,
    iterations: int = 60,
    eps: float = DEFAULT_EPS,
) -> SimilarityGraph:
    """Messages of every client of `data` (on device, batched) and their graph.

    Clients without data are excluded (`p_i = 0`); a client with data but all-zero features
    raises `ValueError` (its message is undefined)."""
    messages = client_messages(data.x, data.counts, method=method, rank=rank, iterations=iterations)
    valid = np.asarray(data.counts) > 0
    return similarity_graph(np.asarray(messages), valid=valid, eps=eps)
